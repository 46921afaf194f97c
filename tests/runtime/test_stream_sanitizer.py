"""Each rule of the Stream protocol (device.py), removed in turn, is caught on the emulated device: by
the sanitizer naming the rule, or by poison reaching the gradients. Without a mutation the same runs
are exact and the sanitizer silent (test_emulation.py).

Rule by rule, what removing it does here:
 1 (D2H waits for compute)  - the sanitizer names rule 1 at the first swap.
 2 (pinned host memory)      - the sanitizer names rule 2 at the first swap.
 3 (keep the source alive)   - the worker finds the source gone: rule 3 at the host's next call.
 4 (the host reads a D2H buffer only after its event) - the verifier reads poison instead of
   forward's bytes and its check fails (exact recomputes demoted), or the copy back of those bytes
   is not ordered after their copy-out and the sanitizer names rule 6. The rule's other half (a
   buffer not handed to another copy before the event) cannot be broken by the runtime: copy-outs
   share one D2H stream, whose order already puts a second copy into the same buffer after the
   first (not needed, so not tested).
 5 (H2D waits for compute)   - the sanitizer names rule 5 at the first prefetch.
 6 (H2D waits for its copy-out) - the sanitizer names rule 6, and the copy back reads poison.
 7 (compute waits before reading a prefetch) - the sanitizer names rule 7 where the executor hands
   the tensor to backward; with that check gone too, backward reads poison: NaN or wrong gradients.
 8 (the pinned source of an H2D is not recycled before its event) - the sanitizer names rule 8 when
   the pool hands that buffer to a copy-out.
"""

import pytest
import torch

from slackswap_ds.plan import Decision, Plan
from slackswap_ds.runtime.device import CopyHandle, Device
from slackswap_ds.runtime.host_pool import HostPool
from slackswap_ds.runtime.stream_sanitizer import RULES, StreamProtocolError

from exactness import apply_on, assert_exact, emulated, profile, random_plan, run, swap_all, without_caches

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)


@pytest.fixture(scope="module")
def llama():
    transformers.logging.set_verbosity_error()
    model, batch = zoo.ZOO["llama"].build(torch.float32)
    without_caches(model)
    return model, batch, profile(model, zoo.step, batch), run(model, zoo.step, batch)


def swapped(prof):
    """Every saved tensor swapped, on a budget no copy-out has to be waited for (residency.py)."""
    return swap_all(prof, prof.total_bytes)


def step_under(llama, plan, device):
    model, batch, prof, _ = llama
    ex = apply_on(device, model, plan, prof)
    return ex, run(model, zoo.step, batch, ex)


def assert_rule(rule: int, llama, plan, device):
    with pytest.raises(StreamProtocolError, match=rf"Stream protocol rule {rule} broken") as caught:
        step_under(llama, plan, device)
    assert caught.value.rule == rule and RULES[rule] in str(caught.value)


def assert_goes_wrong(llama, plan, device):
    """The step fails on poison (NaN floats, -1 token ids) or gives other gradients."""
    reference = llama[3]
    try:
        _, (loss, grads) = step_under(llama, plan, device)
    except (IndexError, RuntimeError) as e:
        assert not isinstance(e, StreamProtocolError), e
        return
    assert not (torch.equal(loss, reference[0]) and all(torch.equal(grads[k], reference[1][k]) for k in grads))


def test_unmutated_the_same_runs_are_exact_and_silent(llama):
    for plan in (swapped(llama[2]), random_plan(llama[2], 4)):
        device = emulated("2ms")
        ex, result = step_under(llama, plan, device)
        assert_exact(result, llama[3])
        assert device.accelerator.sanitizer.violations == []


def test_rule_1_a_copy_out_that_does_not_wait_for_compute(llama):
    device = emulated("2ms")
    device.d2h_stream.wait_stream = lambda other: None
    assert_rule(1, llama, swapped(llama[2]), device)


def test_rule_2_a_copy_into_pageable_memory(llama, monkeypatch):
    monkeypatch.setattr(Device, "empty_pinned", lambda self, n: torch.empty(n, dtype=torch.uint8))
    assert_rule(2, llama, swapped(llama[2]), emulated("2ms"))


def test_rule_3_a_source_let_go_before_its_copy_lands(llama, monkeypatch):
    monkeypatch.setattr(Device, "_hold", lambda self, direction, event, src: None)
    assert_rule(3, llama, swapped(llama[2]), emulated("2ms"))


def test_rule_4_the_host_reading_a_copy_out_before_its_event(llama, monkeypatch):
    """The verifier compares a replay's bytes with forward's copy on the host: read before the copy
    lands, forward's bytes are poison and the check fails; the restore's copy back of those bytes is
    then named by rule 6 if the host had not yet seen their copy-out end."""
    model, batch, prof, reference = llama
    wait, unwaited = CopyHandle.wait, []

    def no_wait(self):  # returns at once; the handle (and the source it holds, rule 3) lives on
        if self.direction == "d2h":
            unwaited.append(self)
            return self.tensor
        return wait(self)

    recompute = Plan.build(prof, {a.key: Decision.RECOMPUTE if a.recomputable else Decision.KEEP
                                  for a in prof.activations}, budget_bytes=prof.total_bytes,
                           hardware_digest="any", planner="test")
    ex, result = step_under(llama, recompute, emulated("20ms"))
    assert_exact(result, reference)
    assert ex.stats.last_step.verified is True       # unmutated: the checks pass
    monkeypatch.setattr(CopyHandle, "wait", no_wait)
    device = emulated("20ms")
    try:
        ex, result = step_under(llama, recompute, device)
    except StreamProtocolError as e:  # the restore's copy back ran before the host saw forward's copy-out end
        assert e.rule == 6
    else:                             # it had seen it end: the step is exact, the checks failed on poison
        assert_exact(result, reference)
        assert ex.stats.last_step.verified is False and ex.stats.demotions
    assert unwaited


def test_rule_5_a_prefetch_that_does_not_wait_for_compute(llama):
    device = emulated("2ms")
    device.h2d_stream.wait_stream = lambda other: None
    assert_rule(5, llama, swapped(llama[2]), device)


def test_rule_6_a_copy_back_not_ordered_after_its_copy_out():
    device = emulated("20ms")
    pool = HostPool(None, device)
    src = torch.arange(1000, dtype=torch.float32)
    buf = pool.acquire(src.nbytes).view(torch.float32, (1000,))
    device.copy_out(src, buf)
    with pytest.raises(StreamProtocolError, match="rule 6 broken"):
        device.copy_in(buf)                        # after= left out
    # with it, the copy back waits for the copy-out and brings forward's values
    device2 = emulated("20ms")
    buf2 = HostPool(None, device2).acquire(src.nbytes).view(torch.float32, (1000,))
    out = device2.copy_out(src, buf2)
    assert torch.equal(device2.copy_in(buf2, after=out).wait_on_current(), src)


def test_rule_6_through_the_executor(llama, monkeypatch):
    copy_in = Device.copy_in
    monkeypatch.setattr(Device, "copy_in", lambda self, src, dst=None, *, after=None: copy_in(self, src, dst))
    device = emulated("20ms")
    with pytest.raises(StreamProtocolError, match="rule 6 broken"):
        model, batch, prof, _ = llama
        ex = apply_on(device, model, swapped(prof), prof)
        with ex:                                     # a forward, then backward at once: copy-outs still in flight
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            zoo.step(model, batch)


def test_rule_7_backward_reading_a_prefetch_before_its_copy_lands(llama, monkeypatch):
    monkeypatch.setattr(CopyHandle, "wait_on_current", lambda self: self.tensor)
    assert_rule(7, llama, swapped(llama[2]), emulated("5ms"))
    # a read nobody announces (the check gone as well) computes with the poison the copy has not replaced
    monkeypatch.setattr(CopyHandle, "check_read", lambda self: None)
    assert_goes_wrong(llama, swapped(llama[2]), emulated("5ms"))


def test_rule_8_a_copy_backs_source_recycled_before_its_event(monkeypatch):
    device = emulated("20ms")
    pool = HostPool(None, device)
    src = torch.arange(1000, dtype=torch.float32)
    raw = pool.acquire(src.nbytes)
    buf = raw.view(torch.float32, (1000,))
    device.copy_out(src, buf).wait()
    back = device.copy_in(buf)
    release = HostPool.release
    monkeypatch.setattr(HostPool, "release", lambda self, b, after=None: release(self, b))  # `after` ignored
    pool.release(raw, after=back)
    again = pool.acquire(src.nbytes)                 # the same buffer, while the copy back still reads it
    assert again.view(torch.uint8, (src.nbytes,)).data_ptr() == buf.data_ptr()
    with pytest.raises(StreamProtocolError, match="rule 8 broken"):
        device.copy_out(torch.zeros(1000), again.view(torch.float32, (1000,)))
    monkeypatch.setattr(HostPool, "release", release)
    # unmutated, the pool holds the buffer until the copy back's event: another buffer is handed out
    device2 = emulated("20ms")
    pool2 = HostPool(None, device2)
    raw2 = pool2.acquire(src.nbytes)
    b2 = raw2.view(torch.float32, (1000,))
    device2.copy_out(src, b2).wait()
    back2 = device2.copy_in(b2)
    pool2.release(raw2, after=back2)
    other = pool2.acquire(src.nbytes)
    assert other.view(torch.uint8, (src.nbytes,)).data_ptr() != b2.data_ptr()
    device2.copy_out(torch.zeros(1000), other.view(torch.float32, (1000,))).wait()
    assert torch.equal(back2.wait(), src) and device2.accelerator.sanitizer.violations == []

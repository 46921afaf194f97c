"""The executor's Stream protocol under an accelerator whose copies land late (late_accelerator.py):
steps that swap are exact only if every read of a prefetch waits for it and every copy's source
is kept until the copy lands. The fake itself is checked to catch an executor that forgets."""

import threading

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.runtime.device import CopyHandle, Device
from slackswap_ds.runtime.host_pool import HostPool

from exactness import assert_exact, profile, random_plan, run, without_caches
from late_accelerator import LateAccelerator

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)


@pytest.fixture(scope="module")
def setup():
    transformers.logging.set_verbosity_error()
    model, batch = zoo.ZOO["llama"].build(torch.float32)
    without_caches(model)
    return model, batch, profile(model, zoo.step, batch), run(model, zoo.step, batch)


def late_apply(model, plan, prof, **kw):
    device = Device(LateAccelerator())
    assert device.has_streams
    return ss.apply(model, plan, prof, device=device, pool=HostPool(None, device), **kw), device


def swap_all(prof):
    return Plan.build(prof, {a.key: Decision.SWAP for a in prof.activations}, budget_bytes=0,
                      hardware_digest="any", planner="test")


def test_swaps_and_replays_with_late_copies_are_exact(setup):
    model, batch, prof, reference = setup
    for plan in [swap_all(prof), ss.plan(prof, "a100-80g-pcie4", 0.5)] + [random_plan(prof, s) for s in range(6)]:
        ex, device = late_apply(model, plan, prof)
        assert_exact(run(model, zoo.step, batch, ex), reference)
        assert_exact(run(model, zoo.step, batch, ex), reference)
        swapped = len(plan.keys(Decision.SWAP))
        assert device._acc.issued >= 2 * swapped  # every swap went out and came back through the fake
        assert ex.stats.last_step.fallbacks == {}


def assert_goes_wrong(model, batch, ex, reference):
    """The step fails on junk (NaN floats, -1 token ids) or gives other gradients."""
    try:
        loss, grads = run(model, zoo.step, batch, ex)
    except (IndexError, RuntimeError):
        return
    assert not all(torch.equal(grads[k], reference[1][k]) for k in grads)


def test_the_fake_catches_a_read_that_does_not_wait(setup, monkeypatch):
    """Without the compute stream waiting on a prefetch, backward reads junk: the fake works."""
    model, batch, prof, reference = setup
    monkeypatch.setattr(CopyHandle, "wait_on_current", lambda self: self.tensor)
    ex, _ = late_apply(model, swap_all(prof), prof)
    assert_goes_wrong(model, batch, ex, reference)


def test_the_fake_catches_a_source_dropped_before_its_copy_lands(setup, monkeypatch):
    model, batch, prof, reference = setup
    issue = LateAccelerator.issue_copy

    def forgetful(self, dst, src, stream):  # a copy that does not keep its source alive
        issue(self, dst, src.clone(), stream)

    monkeypatch.setattr(LateAccelerator, "issue_copy", forgetful)
    ex, _ = late_apply(model, swap_all(prof), prof)
    assert_goes_wrong(model, batch, ex, reference)


def test_backward_on_another_thread_waits_on_its_own_current_stream(setup):
    """Autograd may run backward on another thread than forward: each thread has its current
    stream, and the consumer waits on the one current where it reads."""
    model, batch, prof, reference = setup
    ex, _ = late_apply(model, random_plan(prof, 11), prof)
    result = {}

    def step_with_backward_elsewhere(m, b):
        out = m(**b)
        worker = threading.Thread(target=lambda: result.setdefault("done", out.loss.backward()))
        worker.start()
        worker.join()
        return out.loss

    for _ in range(2):
        assert_exact(run(model, step_with_backward_elsewhere, batch, ex), reference)
    assert "done" in result

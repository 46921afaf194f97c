"""The emulated asynchronous device (SLACKSWAP_ASYNC_EMULATION=1): its streams, events and copies keep
their CUDA meaning on worker threads; destinations hold poison until their copy lands; the zoo under
seeded random plans and the real loops stay exact through it, with the Stream protocol's sanitizer
silent. (The mutations that break each rule: test_stream_sanitizer.py.)"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds.plan import Decision
from slackswap_ds.runtime import emulation
from slackswap_ds.runtime.emulation import Delays, EmulationError, emulation_requested
from slackswap_ds.runtime.host_pool import HostPool

from exactness import LOOPS, apply_on, assert_exact, emulated, profile, random_plan, run, swap_all, without_caches

POISON_F32 = torch.tensor([0xFF] * 4, dtype=torch.uint8).view(torch.float32)


def emulated_apply(model, plan, prof, delays=None, **kw):
    device = emulated(delays)
    return apply_on(device, model, plan, prof, **kw), device


# -- the switch and the delays ------------------------------------------------------------------

@pytest.mark.parametrize("value, on", [(None, False), ("1", True), (" Yes ", True), ("on", True), ("true", True),
                                       ("0", False), ("off", False), ("NO", False), ("false", False)])
def test_the_switch_takes_its_documented_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(emulation.ENV, raising=False)
    else:
        monkeypatch.setenv(emulation.ENV, value)
    assert emulation_requested() is on


def test_the_switch_has_the_start_up_hooks_vocabulary():
    """One vocabulary for SlackSwap's on/off variables (autoroute.py may import nothing of the package
    at start-up, so it keeps its own copy)."""
    from slackswap_ds import autoroute

    assert (emulation.ON, emulation.OFF) == (autoroute.ON, autoroute.OFF)


@pytest.mark.parametrize("value", ["", "2", "enable", "emulate", "0x1"])
def test_any_other_value_of_the_switch_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(emulation.ENV, value)
    with pytest.raises(EmulationError, match=rf"SLACKSWAP_ASYNC_EMULATION='{value}' is not one of its values.*1, true"):
        emulation_requested()


def test_delays_read_as_documented():
    assert Delays.parse(None) == Delays(jitter_s=1e-3)
    assert Delays.parse("random:5ms", seed=3) == Delays(jitter_s=5e-3, seed=3)
    assert Delays.parse("0") == Delays() and Delays.parse("250us").latency_s == pytest.approx(250e-6)
    d = Delays.parse("12GB/s+10us")
    assert d.bytes_per_s == 12e9 and d.latency_s == pytest.approx(10e-6)
    assert d.of(12_000_000, None) == pytest.approx(1e-3 + 10e-6)
    for bad in ("fast", "5", "-1ms", "12GB", "random:", "0GB/s"):
        with pytest.raises(EmulationError, match="is not a delay; write one of"):
            Delays.parse(bad)


def test_the_variable_selects_the_emulated_device_and_the_log_says_so_once():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from slackswap_ds.runtime.device import Device\n"
            "d = Device.current(); assert d is Device.current() and d.has_streams, d\n"
            "print(type(d.accelerator).__name__)")
    env = dict(os.environ, SLACKSWAP_ASYNC_EMULATION="1", SLACKSWAP_EMULATION_DELAY="2ms", DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "EmulatedAccelerator"
    lines = [line for line in out.stderr.splitlines() if "the device is emulated" in line]
    assert len(lines) == 1 and "delays of 2 ms" in lines[0], out.stderr


# -- streams, events, copies ------------------------------------------------------------------

def test_a_copy_lands_after_its_delay_and_its_destination_holds_poison_until_then():
    device = emulated("30ms")
    pool = HostPool(None, device)
    src = torch.arange(256, dtype=torch.float32)
    buf = pool.acquire(src.nbytes)
    host = buf.view(torch.float32, (256,))
    out = device.copy_out(src, host)
    assert not out.done()                                       # polls, never blocks
    assert torch.isnan(host).all()                              # poison until it lands
    t0 = time.perf_counter()
    assert torch.equal(out.wait(), src) and time.perf_counter() - t0 > 0.01
    assert out.done() and device.stats().host_waits == 1

    back = device.copy_in(host, after=out)
    assert torch.isnan(back.tensor).all()
    assert torch.equal(back.wait_on_current(), src)             # compute is the host: it waits


def test_events_complete_in_stream_order_and_a_side_stream_waits_on_another():
    device = emulated("10ms")
    acc = device.accelerator
    d2h, h2d = device.d2h_stream, device.h2d_stream
    a, b = torch.ones(1000), torch.full((1000,), 2.0)
    host = acc.pin_empty(1000, dtype=torch.float32)
    first = device.copy_out(a, host)
    late = acc.Event()
    late.record(d2h)
    assert not late.query() and not first.done()
    d2h.synchronize()
    assert late.query() and first.done() and torch.equal(host, a)
    # the H2D stream made to wait on a D2H event does not copy before that event completes
    host2 = acc.pin_empty(1000, dtype=torch.float32)
    out = device.copy_out(b, host2)
    back = device.copy_in(host2, after=out)
    assert torch.equal(back.wait(), b) and out.done()
    assert late.when <= out._event.when <= back._event.when
    assert all(t.name.startswith("slackswap-emulated-") for t in threading.enumerate()
               if t.name.startswith("slackswap-emulated"))
    h2d.synchronize()


def test_poison_marks_every_dtype():
    for t in (torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(3, 2)[:, 0]):
        emulation.poison(t)
        assert torch.isnan(t.float()).all()
    for t, want in ((torch.zeros(4, dtype=torch.int64), -1), (torch.zeros(4, dtype=torch.uint8), 255),
                    (torch.zeros(4, 2, dtype=torch.int32)[:, 1], -1), (torch.zeros(4, 2, dtype=torch.bool)[:, 0], True)):
        emulation.poison(t)
        assert (t == want).all()


def test_an_idle_worker_ends_and_the_next_copy_starts_another(monkeypatch):
    monkeypatch.setattr(emulation, "IDLE_EXIT_S", 0.05)
    device = emulated("0")
    host = device.accelerator.pin_empty(8, dtype=torch.float32)
    device.copy_out(torch.ones(8), host).wait()
    stream = device.d2h_stream
    deadline = time.time() + 5
    while stream._worker is not None and time.time() < deadline:
        time.sleep(0.01)
    assert stream._worker is None
    assert torch.equal(device.copy_out(torch.full((8,), 3.0), host).wait(), torch.full((8,), 3.0))


# -- the runtime through it: the zoo under random plans, the real loops ---------------------------

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)

ARCHITECTURES = ["llama", "gpt2-eager", "t5", "mixtral", "bert"]


@pytest.fixture(autouse=True, scope="module")
def quiet_transformers():
    transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_zoo_under_random_plans_is_exact_through_the_emulated_device(name):
    model, batch = zoo.ZOO[name].build(torch.float32)
    without_caches(model)
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    plans = [swap_all(prof), ss.plan(prof, "a100-80g-pcie4", 0.5)] + [random_plan(prof, seed) for seed in range(3)]
    for i, plan in enumerate(plans):
        ex, device = emulated_apply(model, plan, prof, delays="random:1ms" if i % 2 else "0")
        for _ in range(2):
            assert_exact(run(model, zoo.step, batch, ex), reference)
        last = ex.stats.last_step
        assert last.fallbacks == {} and ex.stats.demotions == []
        assert device.accelerator.sanitizer.violations == []
        if plan.keys(Decision.SWAP):
            assert device.stats().copies_d2h > 0 and device.stats().copies_h2d > 0


@pytest.mark.parametrize("loop", LOOPS, ids=lambda f: f.__name__)
def test_real_loops_are_exact_through_the_emulated_device(loop):
    model, batch = zoo.ZOO["gpt2-eager"].build(torch.float32)
    without_caches(model)
    reference = run(model, loop, batch)
    prof = profile(model, loop, batch)
    for seed in range(2):
        ex, device = emulated_apply(model, random_plan(prof, seed), prof)
        assert_exact(run(model, loop, batch, ex), reference)
        assert_exact(run(model, loop, batch, ex), reference)
        assert device.accelerator.sanitizer.violations == []


def test_a_step_without_backward_leaves_no_copy_behind():
    """A forward whose backward never runs (an evaluation with grad): its swaps' copies end, their
    buffers go back to the pool, and the next step is exact."""
    model, batch = zoo.ZOO["llama"].build(torch.float32)
    without_caches(model)
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    ex, device = emulated_apply(model, swap_all(prof), prof, delays="2ms")
    with ex:
        model(**batch)
    assert_exact(run(model, zoo.step, batch, ex), reference)
    device.synchronize()
    pool = ex.pool
    pool.trim()
    assert pool.stats().bytes_in_use == 0 and device.accelerator.sanitizer.violations == []


# -- the budget when copies are slower than the plan timed them -----------------------------------

def test_copies_slower_than_planned_cost_waits_never_the_budget(monkeypatch):
    """A plan timed for an A100's link, run where every copy takes 2 ms: copy-outs still in flight
    hold device bytes, so a save that would pass the budget first waits for the oldest of them
    (counted in `budget_waits`). Without that wait the same step goes over its budget."""
    from slackswap_ds.runtime.residency import Residency

    model, batch = zoo.ZOO["llama"].build(torch.float32)
    without_caches(model)
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    plan = ss.plan(prof, "a100-80g-pcie4", 0.5)
    ex, _ = emulated_apply(model, plan, prof, delays="2ms")
    for _ in range(2):
        assert_exact(run(model, zoo.step, batch, ex), reference)
        last = ex.stats.last_step
        assert last.peak_device_bytes <= plan.budget_bytes and last.budget_waits > 0
    monkeypatch.setattr(Residency, "_make_room", lambda self, entry: None)
    ex, _ = emulated_apply(model, plan, prof, delays="2ms")
    assert_exact(run(model, zoo.step, batch, ex), reference)
    assert ex.stats.last_step.peak_device_bytes > plan.budget_bytes


@pytest.mark.slow  # two 20-step launches of 2 ranks (about 2 min)
def test_the_readme_job_trains_to_the_same_losses_under_emulation(tmp_path):
    from jobs import cpu_env, deepspeed_line, run_launch

    runs = {}
    for emulate in ("0", "1"):
        losses = tmp_path / f"losses_{emulate}.json"
        out = run_launch(deepspeed_line(2, "launch/train.py", "--deepspeed_config", "configs/slackswap.json",
                                        "--losses", str(losses)), cpu_env(SLACKSWAP_ASYNC_EMULATION=emulate), timeout=900)
        runs[emulate] = (json.loads(losses.read_text()), out)
    (plain, _), (emulated_losses, out) = runs["0"], runs["1"]
    assert len(plain) == 20 and emulated_losses == plain
    assert out.count("the device is emulated") == 1 and "every planned step within its plan's budget" in out


def test_backward_on_another_thread_waits_on_its_own_current_stream():
    """Autograd may run backward on another thread than forward: each thread has its current stream
    (the compute stream unless it entered another), and the consumer waits where it reads."""
    model, batch = zoo.ZOO["llama"].build(torch.float32)
    without_caches(model)
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    ex, device = emulated_apply(model, random_plan(prof, 11), prof, delays="1ms")
    threads = []

    def step_with_backward_elsewhere(m, b):
        out = m(**b)
        worker = threading.Thread(target=out.loss.backward)
        worker.start()
        worker.join()
        threads.append(worker)
        return out.loss

    for _ in range(2):
        assert_exact(run(model, step_with_backward_elsewhere, batch, ex), reference)
    assert len(threads) == 2 and device.accelerator.sanitizer.violations == []
    assert device.stats().copies_h2d > 0


@pytest.mark.slow  # the runtime's tests, ZeRO's and the pipeline stages' again, on the emulated device
def test_the_runtime_suite_passes_on_the_emulated_device():
    """Every test of tests/runtime (slow ones included), the ZeRO 0-3 plans and the pipeline stages'
    jobs with SLACKSWAP_ASYNC_EMULATION=1 (their ranks inherit it): the same code on the asynchronous
    path. (Under the variable, this test itself is skipped.)"""
    from jobs import ROOT

    if emulation_requested():
        pytest.skip("already on the emulated device")
    targets = ["tests/runtime", "tests/test_zero_plans.py", "tests/test_stages.py::test_training_is_exact",
               "tests/test_stages.py::test_each_stage_stays_within_its_budget_with_its_micro_batches_in_flight"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                           *targets], cwd=ROOT, env=dict(os.environ, SLACKSWAP_ASYNC_EMULATION="1"),
                          capture_output=True, text=True, timeout=5400)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, "\n".join([line for line in lines if line.startswith(("FAILED", "ERROR"))] + lines[-3:])

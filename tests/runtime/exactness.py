"""What the runtime tests share: one step from a fixed RNG state, bit-exact comparison, profiles
whose op times come from a fake clock (so the plans a test gets never depend on how fast this
machine ran an op), seeded random plans (and swap-all ones), the emulated asynchronous device, soak
sampling (live tensors, RSS), and real training loops."""

from __future__ import annotations

import gc
import itertools
import random
import warnings
from typing import Any, Callable

import torch
from torch import nn

import slackswap_ds as ss
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.step_profile import StepProfile

Result = tuple[torch.Tensor, dict[str, torch.Tensor]]


def run(model: nn.Module, step_fn: Callable, batch: Any, ctx=None, seed: int = 1) -> Result:
    """One step (forward + backward) from RNG state `seed`, under `ctx` if given: the loss and
    every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if ctx is None:
        loss = step_fn(model, batch)
    else:
        with ctx:
            loss = step_fn(model, batch)
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_exact(got: Result, want: Result) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = got, want
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    differ = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not differ, f"gradients differ: {differ[:5]}"


def assert_peak_as_predicted(peak: int, prof: StepProfile, plan: Plan, exact: bool = False) -> None:
    """A step's measured peak against the simulator on `Hardware.instant_copies()`, the executor's
    model when copies are synchronous (CPU): never above it (`exact`: equal), which is within the
    budget. On an asynchronous device (SLACKSWAP_ASYNC_EMULATION=1) copy-outs in flight hold bytes
    that Schedule does not have: there the peak is held to the budget only (residency.py waits)."""
    from slackswap_ds.hardware import Hardware
    from slackswap_ds.plan import lower
    from slackswap_ds.runtime.device import Device
    from slackswap_ds.simulator import simulate

    predicted = simulate(lower(prof, plan), Hardware.instant_copies()).peak_bytes
    assert predicted <= plan.budget_bytes
    if Device.current().has_streams:
        assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)
    elif exact:
        assert peak == predicted
    else:
        assert peak <= predicted, (peak, predicted)


def swap_all(profile: StepProfile, budget_bytes: int = 0) -> Plan:
    """Every saved tensor swapped (each prefetched from the end of forward), within `budget_bytes`."""
    return Plan.build(profile, {a.key: Decision.SWAP for a in profile.activations}, budget_bytes=budget_bytes,
                      hardware_digest="any", planner="test")


def emulated(delays: str | None = None):
    """A Device on a fresh emulated asynchronous accelerator whose copies take `delays`
    (SLACKSWAP_EMULATION_DELAY's forms; None: its default)."""
    from slackswap_ds.runtime.device import Device
    from slackswap_ds.runtime.emulation import Delays, EmulatedAccelerator

    return Device(EmulatedAccelerator(Delays.parse(delays)))


def apply_on(device, model: nn.Module, plan: Plan, prof: StepProfile, **kw):
    """ss.apply on `device`, with a host pool of that device."""
    from slackswap_ds.runtime.host_pool import HostPool

    return ss.apply(model, plan, prof, device=device, pool=HostPool(None, device), **kw)


def fake_clock(step: float = 1e-6) -> Callable[[], float]:
    """Every op takes `step` seconds: plans made from such a profile are the same on every run."""
    ticks = itertools.count()
    return lambda: next(ticks) * step


def profile(model: nn.Module, step_fn: Callable, batch: Any, seed: int = 1, **kw) -> StepProfile:
    """A profile of one step from RNG state `seed` (the state `run` uses, so that data-dependent
    shapes, e.g. mixture-of-experts routing after dropout, match the runs)."""
    torch.manual_seed(seed)
    return ss.profile_step(model, step_fn, batch, warmup=0, timer=fake_clock(), **kw)


def loss_step(model: nn.Module, x: Any) -> torch.Tensor:
    """A step of a model whose forward returns its loss: forward, backward, the loss."""
    loss = model(x)
    loss.backward()
    return loss


def measured(model: nn.Module, x: Any, step_fn: Callable = loss_step) -> tuple:
    """(model, x, the reference step's loss and gradients, the step's profile), from RNG state 1."""
    return model, x, run(model, step_fn, x), profile(model, step_fn, x)


def random_plan(profile: StepProfile, seed: int, budget_bytes: int | None = None) -> Plan:
    """Seeded random fates, and about two thirds of the packable kept or swapped tensors packed (PACK)."""
    rng = random.Random(seed)
    decisions = {a.key: rng.choice([Decision.KEEP, Decision.SWAP] + [Decision.RECOMPUTE] * a.recomputable)
                 for a in profile.activations}
    packed = [k for k in profile.packable if decisions[k] is not Decision.RECOMPUTE and rng.random() < 2 / 3]
    return Plan.build(profile, decisions, budget_bytes=profile.total_bytes if budget_bytes is None else budget_bytes,
                      hardware_digest="any", planner="random", packed=packed)


def without_caches(model: nn.Module) -> nn.Module:
    """use_cache off in every config of the model (SlackSwap does that while it runs: a reference
    run must do the same to be comparable bit for bit; see test_takeover for caches left on)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False
    return model


def rss() -> int:
    """This process's resident set size, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def live_tensors() -> int:
    """Tensors the garbage collector can see, after a collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch.distributed objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def soak(step: Callable[[], Any], steps: int, sample_at: tuple[int, int], also: Callable[[], Any] = lambda: None):
    """`step()` run `steps` times; at each step index of `sample_at` (after the allocators settled),
    (live tensors, RSS, `also()`). Returns the two samples."""
    samples = []
    for i in range(steps):
        step()
        if i in sample_at:
            samples.append((live_tensors(), rss(), also()))
    return samples


# -- real training loops (test_loops.py; under the emulated device, test_emulation.py) --------------

def two_forwards(model, batch):
    """R-Drop: the same batch twice (two dropout masks), one loss, one backward."""
    a, b = model(**batch), model(**batch)
    loss = a.loss + b.loss + (a.logits - b.logits).pow(2).mean()
    loss.backward()
    return loss


def no_grad_forward_between(model, batch):
    out = model(**batch)
    with torch.no_grad():
        model(**batch)  # e.g. an EMA teacher or a metric
    out.loss.backward()
    return out.loss


def eval_forward_between(model, batch):
    out = model(**batch)
    model.eval()
    probe = model(**batch)  # with grad, in eval mode: not planned, left to autograd
    model.train()
    (out.loss + 0 * probe.loss).backward()
    return out.loss


def accumulate(model, batch, micro=3):
    total = 0
    for _ in range(micro):
        out = model(**batch)
        (out.loss / micro).backward()
        total = total + out.loss.detach()
    return total


LOOPS = (two_forwards, no_grad_forward_between, eval_forward_between, accumulate)

"""Which tensors the default planner packs (PACK, runtime/packing.py): those the budget needs packed.

Packing a kept or swapped tensor frees (bytes - packed_bytes) of device memory, and of copy time
when swapped, for a kernel after its save and one before its first read (`Activation.pack_s` each).
It pays where the memory it frees saves more recompute or stall than the kernels cost: a budget
that would otherwise recompute dropout outputs or swap beyond the slack.

1. The packed view: the profile with every packable tensor at its packed bytes and both kernels
   added to the ops that would run them (`packed_view`). The planner plans on it as on any profile;
   whatever it keeps or swaps of the packable tensors is packed.
2. Unpack what the budget does not need: packed tensors, the most kernel time per freed byte first,
   go back to their whole bytes while the region model's peak (their stored bytes) stays within the
   budget less what the simulator saw above the model (transients); then, in the same order, while
   the simulated plan keeps its budget and is no slower.
3. The plans (all packed, trimmed) are lowered and simulated on the real profile; the caller
   (slackswap.plan_slackswap) compares the fastest feasible one with its plan without packing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..errors import BudgetInfeasibleError
from ..hardware import Hardware
from ..plan import Decision
from ..shares import Share
from ..step_profile import StepProfile
from .common import MAX_REPAIRS, Planned, RegionModel, best_triggers, peak_of, region_bytes, simulated

__all__ = ["packed_view", "with_packing"]

SIMULATED_TRIES = 64  # simulations step 2 may spend after the region model's pass


def packed_view(profile: StepProfile) -> StepProfile:
    """`profile` with every packable tensor at its packed bytes and no longer packable, and each
    packing (unpacking) kernel's time added to the forward (backward) of the op that saves (first
    reads) it."""
    fwd = [o.fwd_s for o in profile.ops]
    bwd = [o.bwd_s for o in profile.ops]
    acts = []
    for a in profile.activations:
        if a.packable:
            fwd[a.saved_at] += a.pack_s
            bwd[a.first_read] += a.pack_s
            a = dataclasses.replace(a, bytes=a.packed_bytes, packed_bytes=None, pack_s=0.0)
        acts.append(a)
    ops = tuple(dataclasses.replace(o, fwd_s=f, bwd_s=b) for o, f, b in zip(profile.ops, fwd, bwd))
    meta = (*profile.meta, ("view", "packed"))
    return StepProfile(profile.name, ops, tuple(acts), meta)


def with_packing(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share, holds: int,
                 plan_view: Callable[[StepProfile, int], Planned], *, planner: str, version: str) -> Planned | None:
    """The fastest feasible packing plan (steps 1-3 of the module docstring), `plan_view(view, budget)`
    planning on the packed view; None where nothing is packable or no such plan keeps the budget."""
    if not profile.packable:
        return None

    def finalized(decisions: dict[str, Decision], keys: list[str]) -> tuple[Planned | None, int]:
        return best_triggers(profile, decisions, hw=hw, budget_bytes=budget_bytes, share=share, planner=planner,
                             version=version, holds=holds, packed=tuple(keys))

    view, target = packed_view(profile), budget_bytes
    for _ in range(MAX_REPAIRS):  # the view does not see the unpacked bytes in backward: repaired as common.repair does
        try:
            on_view = plan_view(view, target)
        except BudgetInfeasibleError:
            return None
        decisions = dict(on_view.plan.decision)
        packed = [k for k in profile.packable if decisions[k] is not Decision.RECOMPUTE]
        if not packed:
            return None
        everything, overshoot = finalized(decisions, packed)
        if everything is not None:
            break
        target -= overshoot
    else:
        return None
    trimmed = _trimmed(profile, hw, share, holds, decisions, packed, budget_bytes, everything)
    candidates = [p for p in (everything, finalized(decisions, trimmed)[0] if trimmed != packed else None)
                  if p is not None]
    best = _unpacked_while_it_fits(profile, hw, share, holds, min(candidates, key=lambda p: p.result.step_s))
    return dataclasses.replace(best, search=on_view.search, found=on_view.found)


def _unpacked_while_it_fits(profile: StepProfile, hw: Hardware, share: Share, holds: int, planned: Planned,
                            tries: int = SIMULATED_TRIES) -> Planned:
    """Step 2 in the simulator, after the region model (which puts a region's bytes on the device
    whole, and so leaves packed what the step has room for): each packed tensor, in the same order,
    unpacked where the simulated plan still keeps its budget and is no slower; at most `tries` simulations."""
    plan = planned.plan
    for key in _by_cost(profile, plan.packed)[:tries]:
        fewer = plan.rebuilt(profile, packed=tuple(k for k in plan.packed if k != key))
        tried = simulated(profile, fewer, hw, share, holds)
        if tried.result.feasible and tried.result.step_s <= planned.result.step_s:
            plan, planned = fewer, tried
    return planned


def _by_cost(profile: StepProfile, keys) -> list[str]:
    """The most kernel time per freed byte first."""
    def cost(k: str) -> tuple[float, str]:
        a = profile.by_key[k]
        return -a.pack_s / max(1, a.bytes - a.packed_bytes), k
    return sorted(keys, key=cost)


def _trimmed(profile: StepProfile, hw: Hardware, share: Share, holds: int, decisions: dict[str, Decision],
             packed: list[str], budget_bytes: int, everything: Planned) -> list[str]:
    """`packed` less the tensors whose whole bytes the region model's peak has room for (step 2)."""
    model = RegionModel(profile, hw, share, holds)
    total, kept, swapped = region_bytes(model, decisions, {k: profile.by_key[k].packed_bytes for k in packed})
    unseen = max(0, everything.peak_bytes - peak_of(total, kept, swapped, holds))  # (transients: the simulator's peak above the model's)
    target = budget_bytes - unseen
    out = list(packed)
    for k in _by_cost(profile, packed):
        a = profile.by_key[k]
        r, grow = model.region_of[k], a.bytes - a.packed_bytes
        side = kept if decisions[k] is Decision.KEEP else swapped
        total[r] += grow
        side[r] += grow
        if peak_of(total, kept, swapped, holds) <= target:
            out.remove(k)
        else:
            total[r] -= grow
            side[r] -= grow
    return out

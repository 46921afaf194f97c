"""What every planner shares: the region memory model, prefetch triggers, and the final check that a
plan is feasible in the simulator, whose result travels with the plan (`Planned`: nobody lowers or
simulates the chosen plan again). A rank's share of its node is shares.py's `Share`.

Region memory model (used by the planners to reason fast; the simulator has the last word).
Backward visits regions in reverse. When region r's backward starts, every byte of r is resident
(kept, swapped back in, or recomputed), plus the kept bytes of all earlier regions, plus what is
being prefetched for the region before it:

    M(r) = kept(<r) + bytes(r) + swapped(r-1)        peak ~= max_r M(r)

A pipeline stage under 1F1B runs `holds` micro-batches at once: while one is in backward, the others
have finished their forward and hold their kept bytes, so its peak is (holds - 1) * kept + max_r M(r).
Then dropping any tensor helps, the last region's too.

Dropping (swapping or recomputing) an activation of region r' lowers M(r) for every r > r', and
leaves M(r') unchanged; that is why dropping in the last region to run forward never helps.
Swaps must also fit their copy windows: a region's D2H copies under that region's own forward,
its H2D copies under the backward of the region after it (which runs just before it).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..errors import BudgetInfeasibleError
from ..hardware import Hardware
from ..plan import END_OF_FORWARD, Decision, Plan, Schedule, lower, retrigger
from ..shares import PRIVATE, Share
from ..simulator import SimResult, simulate
from ..step_profile import StepProfile


def keep_all(profile: StepProfile) -> dict[str, Decision]:
    return {a.key: Decision.KEEP for a in profile.activations}


@dataclass(frozen=True)
class Planned:
    """A planner's answer: the plan, its one lowering and its one simulation, on the hardware it
    was planned for at the planner's link share (`share.limit(hw)`), with `held_bytes` (what the
    other micro-batches a pipeline stage holds keep) counted against the budget. Whoever installs,
    reports or compares the plan takes these from here: a plan is lowered and simulated once."""

    plan: Plan
    schedule: Schedule
    result: SimResult
    held_bytes: int = 0
    search: str = ""  # how the planner found it, where the plan line should say (planners/refine.py)
    found: str = ""  # the same in one word of refine.FOUND, for tables that count them ("" where `search` is)

    @property
    def peak_bytes(self) -> int:
        """The simulated peak of device-resident saved bytes, the held micro-batches' included."""
        return self.result.peak_bytes + self.held_bytes


_KEEP_ALL_CACHE: "OrderedDict[tuple[str, str], SimResult]" = OrderedDict()
_KEEP_ALL_CACHE_SIZE = 64
_KEEP_ALL_LOCK = threading.Lock()  # (the default planner's two searches run in two threads: refine.py)


def keep_all_result(profile: StepProfile, hw: Hardware) -> SimResult:
    """The ideal step: everything kept, no memory limit. Simulated once per (profile, hardware):
    the result is remembered for the last few profiles (a pure function of both digests)."""
    key = (profile.digest, hw.digest)
    with _KEEP_ALL_LOCK:
        found = _KEEP_ALL_CACHE.get(key)
        if found is not None:
            _KEEP_ALL_CACHE.move_to_end(key)
            return found
    plan = Plan.build(profile, keep_all(profile), budget_bytes=0, hardware_digest=hw.digest, planner="keep-all")
    res = simulate(lower(profile, plan), hw, record=False)
    found = SimResult(**{**res.__dict__, "ideal_s": res.step_s})
    with _KEEP_ALL_LOCK:
        _KEEP_ALL_CACHE[key] = found
        if len(_KEEP_ALL_CACHE) > _KEEP_ALL_CACHE_SIZE:
            _KEEP_ALL_CACHE.popitem(last=False)
    return found


def refusal(planner: str, error: Exception) -> str:
    """Why `planner` refused, without its name in front (planners start their messages with it;
    callers put it where their own format wants it)."""
    text = str(error)
    return text[len(planner) + 2:] if text.startswith(f"{planner}: ") else text


class RegionModel:
    """Per-region bytes and times of a profile, for fast planning (see the module docstring)."""

    def __init__(self, profile: StepProfile, hw: Hardware, share: Share = PRIVATE, holds: int = 1,
                 replays_at_first_read: bool = False):
        if isinstance(holds, bool) or not isinstance(holds, int) or holds < 1:
            raise ValueError(f"holds must be a positive number of micro-batches, got {holds!r}")
        self.profile, self.hw, self.share, self.holds = profile, hw, share, holds
        # a what-if for benchmarks/pack_bound.py: each recomputed tensor made again at its own first read
        # in backward (one replay per tensor, which the runtime does not do: it replays a layer once, as
        # backward enters it), so a region's memory rows count it from there (milp.py)
        self.replays_at_first_read = replays_at_first_read
        self.regions = list(profile.regions)
        self.index = {r: i for i, r in enumerate(self.regions)}
        n = len(self.regions)
        self.fwd_s = [0.0] * n
        self.bwd_s = [0.0] * n
        self.ops: list[list[int]] = [[] for _ in range(n)]  # each region's op indices, in order
        for i, o in enumerate(profile.ops):
            self.fwd_s[self.index[o.region]] += o.fwd_s
            self.bwd_s[self.index[o.region]] += o.bwd_s
            self.ops[self.index[o.region]].append(i)
        self.bytes = [0] * n
        self.region_of = {}
        for a in profile.activations:
            r = self.index[profile.region_of(a)]
            self.region_of[a.key] = r
            self.bytes[r] += a.bytes
        self.d2h_bps, self.h2d_bps = share.d2h(hw), share.h2d(hw)

    def copy_s(self, nbytes: int, bps: float) -> float:
        return self.hw.copy_latency_s + nbytes / bps


def draft_schedule(profile: StepProfile, decisions: dict[str, Decision], replay: tuple[str, ...] = (),
                   packed: tuple[str, ...] = ()) -> Schedule:
    """The schedule of `decisions` with every prefetch at the end of forward: its compute stream is
    the plan's whatever the triggers (they only change copy-in waits; see plan.retrigger)."""
    return lower(profile, Plan.build(profile, decisions, budget_bytes=0, hardware_digest="", planner="draft",
                                     replay=replay, packed=packed))


def alap_triggers(profile: StepProfile, decisions: dict[str, Decision], hw: Hardware, share: Share,
                  lead: int = 0, draft: Schedule | None = None) -> dict[str, str]:
    """Prefetch triggers as late as possible: the H2D queue, run backwards from each swapped
    tensor's need time on the stall-free compute timeline, gives each copy its latest start; the
    trigger is the last backward op that ends by then. `lead` moves every trigger that many
    backward ops earlier (a safety margin the repair loop can add). `draft`: the decisions'
    schedule, if the caller has lowered it already (triggers do not change the compute stream)."""
    if not any(d is Decision.SWAP for d in decisions.values()):
        return {}
    if draft is None:
        draft = draft_schedule(profile, decisions)
    sch = draft
    # Stall-free compute timeline: start/end of each compute instruction.
    t, start, bwd_end = 0.0, {}, []  # bwd_end: (end time, op index) in backward order
    op_index = {o.key: i for i, o in enumerate(profile.ops)}
    for i, ins in enumerate(sch.instrs):
        if ins.stream != "compute":
            continue
        start[i] = t
        t += ins.seconds
        if ins.kind.value == "bwd":
            bwd_end.append((t, op_index[ins.name]))
    fwd_end = sum(o.fwd_s for o in profile.ops)
    need_time = {}
    for i, ins in enumerate(sch.instrs):
        if ins.stream == "h2d":
            need_time[ins.name] = math.inf
    for i, ins in enumerate(sch.instrs):
        if ins.stream == "compute":
            for w in ins.waits:
                k = sch.instrs[w].name
                need_time[k] = min(need_time[k], start[i])
    # Walk the H2D queue from its end, in exactly the lowering's order (copies run FIFO).
    order = [(sch.instrs[i].name, sch.instrs[i].nbytes) for i in reversed(sch.stream("h2d"))]
    rate = share.h2d(hw)
    triggers, next_start = {}, math.inf
    ends = [e for e, _ in bwd_end]
    for k, nbytes in order:
        finish = min(need_time[k], next_start)
        begin = finish - (hw.copy_latency_s + nbytes / rate)
        next_start = begin
        j = bisect.bisect_right(ends, begin + 1e-15) - 1 - lead  # last backward op ending by `begin`
        need = need_time[k]
        # the trigger must end strictly before the tensor's need
        while j >= 0 and ends[j] > need:
            j -= 1
        triggers[k] = END_OF_FORWARD if j < 0 or begin <= fwd_end else profile.ops[bwd_end[j][1]].key
    return triggers


def model_peak(model: RegionModel, decisions: dict[str, Decision]) -> int:
    """The region model's peak max_r M(r) of `decisions` (see the module docstring)."""
    return peak_of(*region_bytes(model, decisions), model.holds)


def region_bytes(model: RegionModel, decisions: Mapping[str, Decision],
                 sizes: Mapping[str, int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(all, kept, swapped) bytes per region; `sizes`: the bytes of the activations stored in other
    than their own (packed ones, planners/packing.py)."""
    n = len(model.regions)
    total, kept, swapped = (np.zeros(n, dtype=np.int64) for _ in range(3))
    sizes = sizes or {}
    for a in model.profile.activations:
        r, nbytes, d = model.region_of[a.key], sizes.get(a.key, a.bytes), decisions[a.key]
        total[r] += nbytes
        if d is Decision.KEEP:
            kept[r] += nbytes
        elif d is Decision.SWAP:
            swapped[r] += nbytes
    return total, kept, swapped


def region_peaks(total: np.ndarray, kept: np.ndarray, swapped: np.ndarray) -> np.ndarray:
    """M(r) = kept(<r) + bytes(r) + swapped(r-1) for every region r (one micro-batch)."""
    m = total.copy()
    m[1:] += np.cumsum(kept)[:-1] + swapped[:-1]
    return m


def peak_of(total: np.ndarray, kept: np.ndarray, swapped: np.ndarray, holds: int = 1) -> int:
    """max_r M(r), plus the kept bytes of the other micro-batches in flight (`holds` - 1)."""
    m = region_peaks(total, kept, swapped)
    return (int(m.max()) if len(m) else 0) + (holds - 1) * int(kept.sum())


def release(model: RegionModel, decisions: dict[str, Decision], target: int,
            packed: tuple[str, ...] = ()) -> dict[str, Decision]:
    """`decisions` with every drop the model peak does not need turned back into KEEP: recomputes
    first, the most expensive first (each saves its re-run time), then swaps, the latest region
    first (each saves pinned bytes and link time another rank or ZeRO could use). A greedy
    planner overshoots (it drops before it knows what later drops will do); an exact one may
    leave free swaps in (they cost nothing in its objective). Keeping one is allowed only while
    the model peak stays within `target`. `packed`: tensors stored packed (kept or swapped): a swap of
    one kept again is kept packed."""
    p = model.profile
    dec = dict(decisions)
    sizes = {k: p.by_key[k].packed_bytes for k in packed}
    total, kept, swapped = region_bytes(model, dec, sizes)  # (packed until read: milp.py's memory rows)
    if peak_of(total, kept, swapped, model.holds) > target:
        return dec  # nothing to give back (the caller's decisions do not meet the target)
    rec = [a for a in p.activations if dec[a.key] is Decision.RECOMPUTE and a.bytes > 0]
    rec.sort(key=lambda a: (-sum(p.ops[o].fwd_s for o in a.producers), a.key))
    for a in rec:
        r = model.region_of[a.key]
        kept[r] += a.bytes
        if peak_of(total, kept, swapped, model.holds) <= target:
            dec[a.key] = Decision.KEEP
        else:
            kept[r] -= a.bytes
    swaps = [a for a in p.activations if dec[a.key] is Decision.SWAP and a.bytes > 0]
    swaps.sort(key=lambda a: (-model.region_of[a.key], -a.bytes, a.key))
    for a in swaps:
        r, nbytes = model.region_of[a.key], sizes.get(a.key, a.bytes)
        kept[r] += nbytes
        swapped[r] -= nbytes
        if peak_of(total, kept, swapped, model.holds) <= target:
            dec[a.key] = Decision.KEEP
        else:
            kept[r] -= nbytes
            swapped[r] += nbytes
    return dec


MAX_REPAIRS = 8


def repair(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share, planner: str,
           decide: Callable[[int], dict[str, Decision] | tuple[dict[str, Decision], tuple[str, ...]]],
           version: str = "1", holds: int = 1) -> Planned:
    """The repair loop every model-based planner runs: `decide(target)` gives decisions whose region
    model peak meets `target` (or raises BudgetInfeasibleError), with the tensors it packs where it
    packs any ((decisions, packed)); the simulator has the last word.
    When it finds the best-triggered plan over budget (copy latency, transients the model does not
    see), the target is lowered by the overshoot and `decide` asked again, up to MAX_REPAIRS times."""
    target = budget_bytes
    for _ in range(MAX_REPAIRS):
        decided = decide(target)
        decisions, packed = decided if isinstance(decided, tuple) else (decided, ())
        planned, overshoot = best_triggers(profile, decisions, hw=hw, budget_bytes=budget_bytes, share=share,
                                           planner=planner, version=version, holds=holds, packed=packed)
        if planned is not None:
            return planned
        target -= overshoot
    raise BudgetInfeasibleError(f"{planner}: no plan within {budget_bytes:,} B after {MAX_REPAIRS} repairs")


LEADS = (0, 1, 2, 4)  # prefetch trigger margins (backward ops) tried when prefetches stall compute


def best_triggers(profile: StepProfile, decisions: dict[str, Decision], *, hw: Hardware, budget_bytes: int,
                  share: Share, planner: str, version: str = "1",
                  replay: tuple[str, ...] = (), holds: int = 1,
                  packed: tuple[str, ...] = ()) -> tuple[Planned | None, int]:
    """The fastest feasible plan over the prefetch margins in LEADS (stopping at the first that
    does not stall compute), or (None, overshoot in bytes of the latest margin tried). With
    `holds` > 1 the other micro-batches' kept bytes count against the budget too."""
    best: Planned | None = None
    overshoot = 0
    held = held_bytes(profile, decisions, holds, packed)
    rank_hw = share.limit(hw)
    draft = None
    if any(d is Decision.SWAP for d in decisions.values()):
        draft = draft_schedule(profile, decisions, replay, packed)
    for lead in LEADS if draft is not None else (0,):
        triggers = alap_triggers(profile, decisions, hw, share, lead=lead, draft=draft)
        plan = Plan.build(profile, decisions, budget_bytes=budget_bytes, hardware_digest=hw.digest, planner=planner,
                          planner_version=version, prefetch=triggers, replay=replay, packed=packed)
        schedule = retrigger(draft, profile, plan) if draft is not None else lower(profile, plan)
        res = simulate(schedule, rank_hw, budget_bytes=plan.budget_bytes - held, record=False)
        if not res.feasible:
            overshoot = overshoot or res.peak_bytes + held - budget_bytes
            continue
        if best is None or res.step_s < best.result.step_s:
            best = Planned(plan, schedule, res, held)
        if res.stall_s["compute"] <= 1e-9 * res.step_s:
            break
    return (best, 0) if best else (None, overshoot)


def finalize(profile: StepProfile, decisions: dict[str, Decision], *, hw: Hardware, budget_bytes: int,
             share: Share, planner: str, version: str = "1", replay: tuple[str, ...] = (),
             holds: int = 1) -> Planned:
    """The best-triggered plan for fixed decisions; BudgetInfeasibleError if the simulator finds it
    over budget."""
    planned, overshoot = best_triggers(profile, decisions, hw=hw, budget_bytes=budget_bytes, share=share,
                                       planner=planner, version=version, replay=replay, holds=holds)
    if planned is None:
        raise BudgetInfeasibleError(
            f"{planner}: its plan peaks at {budget_bytes + overshoot:,} B, over the budget of {budget_bytes:,} B"
        )
    return planned


def held_bytes(profile: StepProfile, decisions: Mapping[str, Decision], holds: int,
               packed: tuple[str, ...] = ()) -> int:
    """What the other `holds` - 1 micro-batches a pipeline stage holds keep on the device while one
    runs its backward: their kept bytes (module docstring; packed ones packed)."""
    if holds == 1:
        return 0
    return (holds - 1) * sum(a.packed_bytes if a.key in packed else a.bytes for a in profile.activations
                             if decisions[a.key] is Decision.KEEP)


def simulated(profile: StepProfile, plan: Plan, hw: Hardware, share: Share = PRIVATE, holds: int = 1) -> Planned:
    """A plan no planner made here (read from a plan file, written by hand) lowered and simulated
    once, as a planner's plan is: whoever installs it takes the lowering and the simulation from here,
    and `result.feasible` says whether it keeps its budget."""
    held = held_bytes(profile, plan.decision, holds, plan.is_packed)
    schedule = lower(profile, plan)
    return Planned(plan, schedule, simulate(schedule, share.limit(hw), budget_bytes=plan.budget_bytes - held,
                                            record=False), held)


def fit_triggers(profile: StepProfile, planned: Planned, hw: Hardware, device: Hardware, share: Share = PRIVATE,
                 holds: int = 1) -> Planned:
    """`planned` as it should run on `device`, another device than the `hw` it was planned for:
    if its prefetches, timed for `hw`, push the peak on `device` over the budget, they are timed
    for `device` instead (same decisions; on `Hardware.instant_copies()`, the synchronous CPU path,
    each copy-in then starts just before backward needs it), and the retimed plan is simulated on
    `hw` like any plan. Returns `planned` itself if it fits. With `holds` micro-batches in flight,
    the others' kept bytes count against the budget too."""
    plan = planned.plan
    if not plan.prefetch:
        return planned
    budget_left = plan.budget_bytes - planned.held_bytes
    if simulate(planned.schedule, share.limit(device), budget_bytes=budget_left, record=False).feasible:
        return planned
    decisions = dict(plan.decision)
    draft = draft_schedule(profile, decisions, plan.replay, plan.packed)
    fitted = plan.rebuilt(profile, prefetch=alap_triggers(profile, decisions, device, share, draft=draft))
    schedule = retrigger(draft, profile, fitted)
    return Planned(fitted, schedule, simulate(schedule, share.limit(hw), budget_bytes=budget_left, record=False),
                   planned.held_bytes)

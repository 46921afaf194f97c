"""The SlackSwap planner: spend the hideable transfer time on the tensors most expensive to
recompute, recompute the cheapest others, keep the rest; then check and improve in the simulator.

1. Slack. A region's swaps are free when their D2H copies finish before forward ends (copies queue
   in save order, so for every op k the copies of tensors saved from op k on must fit under the
   forward of the ops after k) and their H2D copies fit under the backward of the region after it (which runs just before), at
   the rank's share of the link (`Share`). These windows are the slack.
2. Swap. Candidates in order of recompute cost per byte, most expensive first; tensors that cannot
   be recomputed at all (layer inputs) come last: keeping them is free, and slack spent on them is
   slack a large, costly tensor could have used. Each is swapped if its copies fit the remaining
   slack and the host pool, and while the memory model still runs over budget.
3. Recompute. While the region memory model's peak M(r*) is over budget, recompute the tensor with
   the lowest marginal recompute time per byte (producers already re-run in its region are free)
   among the regions before r*.
3b. Trade. A swapped tensor whose producers re-run anyway is recomputed instead, for free (an
   attention-dropout mask once its dropout output is recomputed), and the link time and pinned bytes
   it held go to the recomputes that cost the most re-run time per byte (the producers no other
   recompute of the region needs), swapped instead while their copies fit and the model peak
   stays within the target: the greedy's plan then does what the MILP's optimum does on a fast link.
4. Give back. Drops the model peak does not need after all are kept again (`common.release`):
   recomputes first (time), then swaps (pinned bytes and link time for other ranks and ZeRO).
5. Check and improve. Simulate; if the simulator's peak overshoots (copy latency, transients the
   model does not see), tighten the model budget by the overshoot and continue from step 3; if
   prefetches stall compute, try earlier triggers; keep the fastest feasible plan.
6. Refine (refine.py). The region model's MILP within a wall-clock budget, identical layers tied
   first (ties.py), then the full MILP from the better plan (with two CPUs, also the full MILP from
   nothing beside them); the faster simulated plan is kept.
   Where the profile has packable tensors the MILP may pack them (PACK, milp.py's sp / kp).
   Steps 1-5 alone are the `slackswap-greedy` planner.
7. Pack (packing.py). Where steps 1-5 on the profile's packed view beat them on the profile (the
   greedy's own view of packing), steps 1-5 run again on that view and the plan packs what the
   budget needs; the faster simulated plan of it and step 6's is kept.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import replace

import numpy as np

from ..errors import BudgetInfeasibleError
from ..hardware import Hardware
from ..plan import Decision
from ..shares import PRIVATE, Share
from ..step_profile import StepProfile
from .common import Planned, RegionModel, keep_all, keep_all_result, region_peaks, release, repair
from .packing import packed_view, with_packing
from .refine import refined

NAME, VERSION = "slackswap", "9"
GREEDY = "slackswap-greedy"


def plan_slackswap(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                   holds: int = 1) -> Planned:
    """Steps 1-5, then the exact refinement (refine.py): the region model's optimum where the MILP
    finds it within REFINE_BUDGET_S, else the better of its best plan so far and steps 1-5's."""
    model = RegionModel(profile, hw, share, holds)
    greedy = _greedy_or_none(model, budget_bytes)
    pack = bool(profile.packable)  # (the exact search packs where that pays: milp.py's PACK variables)
    try:
        exact, refused = refined(greedy, model, budget_bytes, planner=NAME, version=VERSION, allow_pack=pack), None
    except BudgetInfeasibleError as e:
        exact, refused = None, e  # (steps 1-5 on the packed view may fit where nothing else was found)
    if not pack or not _packing_may_pay(profile, hw, budget_bytes, share, holds, greedy):
        if exact is None:
            raise refused
        return exact
    # where steps 1-5 on the packed view beat them on the profile, their own packing plan (packing.py,
    # tens of ms: the exact search already had its time) is kept if it simulates faster (ties: the
    # exact search's)
    packed = with_packing(profile, hw, budget_bytes, share, holds,
                          lambda view, target: _greedy(RegionModel(view, hw, share, holds), target, NAME),
                          planner=NAME, version=VERSION)
    if packed is None:
        if exact is None:
            raise BudgetInfeasibleError(f"{NAME}: no plan within {budget_bytes:,} B, with or without packing")
        return exact
    if exact is not None and exact.result.step_s <= packed.result.step_s:
        return exact
    than = "the exact search found no plan" if exact is None else "faster in the simulator than the exact search's plan"
    return replace(packed, search=f"greedy on the packed view (planners/packing.py), {than}", found="greedy-packed")


def _greedy_or_none(model: RegionModel, budget_bytes: int) -> Planned | None:
    try:
        return _greedy(model, budget_bytes, NAME)
    except BudgetInfeasibleError:
        return None


def _packing_may_pay(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share, holds: int,
                     greedy: Planned | None) -> bool:
    """Whether a plan that packs may be faster than one that does not, by steps 1-5 on both: on the
    packed view (every packable tensor packed, its kernels in the ops) against the profile. The view
    does not count the unpacked bytes a packed tensor takes in backward, so it flatters packing: where
    even it is no faster, the whole exact search goes to the plan without packing (the presets' dropout
    masks, whose kernels cost more than the memory they free at most budgets: docs/packing.md)."""
    if greedy is None:
        return True  # (nothing fits without packing: it may)
    if greedy.result.step_s <= keep_all_result(profile, hw).step_s * (1 + 1e-12):
        return False  # as fast as keeping everything: packing cannot gain
    on_view = _greedy_or_none(RegionModel(packed_view(profile), hw, share, holds), budget_bytes)
    return on_view is not None and on_view.result.step_s < greedy.result.step_s


def plan_slackswap_greedy(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                          holds: int = 1) -> Planned:
    """Steps 1-5 alone: tens of milliseconds where the refinement may take seconds."""
    return _greedy(RegionModel(profile, hw, share, holds), budget_bytes, GREEDY)


def _greedy(model: RegionModel, budget_bytes: int, planner: str) -> Planned:
    state = _State(model)  # (the model itself is read, never changed: the refinement reads it after)

    def decide(target: int) -> dict[str, Decision]:
        state.swap_within_slack(target)
        state.recompute_until(target)
        state.trade(target)
        return release(model, state.dec, target)

    return repair(model.profile, model.hw, budget_bytes, model.share, planner, decide, version=VERSION,
                  holds=model.holds)


class _State:
    """Decisions plus the incremental bookkeeping of the region model."""

    def __init__(self, model: RegionModel):
        self.m = model
        p = model.profile
        self.dec = keep_all(p)
        n = len(model.regions)
        self.bytes_np = np.array(model.bytes, dtype=np.int64)
        self.kept = self.bytes_np.copy()
        self.swapped = np.zeros(n, dtype=np.int64)
        # D2H copies queue in save order and must drain before forward ends. A tensor saved by op i
        # can copy under the forward of ops i+1..; for every k, copies released at or after op k
        # must fit under the forward of ops k.. (suffix windows at op granularity).
        fwd = np.array([o.fwd_s for o in p.ops] + [0.0])
        self.d2h_slack = np.cumsum(fwd[::-1])[::-1].copy()
        # H2D of region r runs under region r+1's backward; the last region has no window.
        self.h2d_left = [model.bwd_s[r + 1] if r + 1 < n else 0.0 for r in range(n)]
        pool = model.share.host_pool_bytes  # every micro-batch in flight pins its own swaps
        self.pool_left = None if pool is None else pool // model.holds
        self.rerun: list[set[int]] = [set() for _ in range(n)]
        self.swap_tried = False

    def peak(self) -> tuple[int, int]:
        """(estimated peak M, region where it occurs): M(r) = kept(<r) + bytes(r) + swapped(r-1)."""
        m = region_peaks(self.bytes_np, self.kept, self.swapped)
        where = int(np.argmax(m))
        return int(m[where]) + (self.m.holds - 1) * int(self.kept.sum()), where

    def _rec_cost(self, a) -> float:
        r = self.m.region_of[a.key]
        return sum(self.m.profile.ops[p].fwd_s for p in a.producers if p not in self.rerun[r])

    def swap_within_slack(self, target: int) -> None:
        if self.swap_tried:
            return
        self.swap_tried = True
        m = self.m
        cands = [a for a in m.profile.activations if a.bytes > 0]
        cands.sort(key=lambda a: (-(self._rec_cost(a) / a.bytes if a.recomputable else 0.0),
                                  m.region_of[a.key], a.key))
        for a in cands:
            if self.peak()[0] <= target:
                break
            fits = self._fits_swap(a)
            if fits is None:
                continue
            # (a swap never raises the model peak: M(r+1) trades kept bytes for prefetched ones)
            self.kept[m.region_of[a.key]] -= a.bytes
            self._swap(a, fits)

    def _fits_swap(self, a) -> tuple[float, float] | None:
        """(D2H s, H2D s) of swapping `a` if its copies fit the slack left and its bytes the pool."""
        m, r = self.m, self.m.region_of[a.key]
        out, back = m.copy_s(a.bytes, m.d2h_bps), m.copy_s(a.bytes, m.h2d_bps)
        if back > self.h2d_left[r] or out > self.d2h_slack[: a.saved_at + 2].min():
            return None
        if self.pool_left is not None and a.bytes > self.pool_left:
            return None
        return out, back

    def _swap(self, a, fits: tuple[float, float]) -> None:
        """`a` swapped: its copies (`_fits_swap`'s) taken from the slack, its bytes from the pool."""
        r = self.m.region_of[a.key]
        self.swapped[r] += a.bytes
        self.dec[a.key] = Decision.SWAP
        self.d2h_slack[: a.saved_at + 2] -= fits[0]
        self.h2d_left[r] -= fits[1]
        if self.pool_left is not None:
            self.pool_left -= a.bytes

    def trade(self, target: int) -> None:
        """Step 3b (module docstring): free riders recomputed, then the dearest recomputes swapped."""
        m = self.m
        for a in m.profile.activations:
            if self.dec[a.key] is Decision.SWAP and a.recomputable and self._rec_cost(a) == 0:
                self._recompute(a, m.region_of[a.key])
        uses = [collections.Counter() for _ in m.regions]  # re-runs of each producer a region's recomputes need
        recomputed = [a for a in m.profile.activations if self.dec[a.key] is Decision.RECOMPUTE]
        for a in recomputed:
            uses[m.region_of[a.key]].update(a.producers)

        def saving(a) -> float:  # re-run time no other recompute of its region needs
            r = m.region_of[a.key]
            return sum(m.profile.ops[p].fwd_s for p in a.producers if uses[r][p] == 1)

        for a in sorted((a for a in recomputed if a.bytes > 0), key=lambda a: (-saving(a) / a.bytes, a.key)):
            fits = self._fits_swap(a) if saving(a) > 0 else None
            r = m.region_of[a.key]
            if fits is None:
                continue
            self.swapped[r] += a.bytes  # (the prefetch term of M(r + 1), tried)
            over = self.peak()[0] > target
            self.swapped[r] -= a.bytes
            if over:
                continue
            self._swap(a, fits)
            uses[r].subtract(a.producers)
            self.rerun[r] = {p for p, n in uses[r].items() if n > 0}

    def recompute_until(self, target: int) -> None:
        """Recompute the cheapest tensors per byte until the model peak M(r*) meets `target`.

        A kept tensor of region r lowers M(r*) when r < r*, and with micro-batches in flight
        (holds > 1) wherever it is; a swapped one only lowers the prefetch term of M(r+1), so it
        is a candidate when r* = r + 1."""
        m = self.m
        candidates = (Decision.KEEP, Decision.SWAP)
        heap = [(self._rec_cost(a) / a.bytes, m.region_of[a.key], a.key) for a in m.profile.activations
                if a.recomputable and a.bytes > 0 and self.dec[a.key] in candidates]
        heapq.heapify(heap)
        deferred = []
        while True:
            peak, where = self.peak()
            if peak <= target:
                return
            while heap:
                cost, r, key = heapq.heappop(heap)
                a = m.profile.by_key[key]
                d = self.dec[key]
                if d not in candidates:
                    continue
                # a kept tensor lowers M(where) if its region ran before; with micro-batches in
                # flight it lowers what they hold wherever it is
                useless_keep = d is Decision.KEEP and r >= where and self.m.holds == 1
                if useless_keep or (d is Decision.SWAP and r != where - 1):
                    deferred.append((cost, r, key))  # would not lower the peak
                    continue
                now = self._rec_cost(a) / a.bytes
                if abs(now - cost) > 1e-18:  # stale: region-mates made it cheaper since
                    heapq.heappush(heap, (now, r, key))
                    continue
                self._recompute(a, r)
                # producers now re-run make its region-mates cheaper
                for b in m.profile.region_acts[m.regions[r]]:
                    if self.dec[b.key] in candidates and b.recomputable and b.bytes > 0:
                        heapq.heappush(heap, (self._rec_cost(b) / b.bytes, r, b.key))
                break
            else:
                raise BudgetInfeasibleError(
                    f"{NAME}: even recomputing everything possible leaves an estimated peak of {peak:,} B "
                    f"in region {m.regions[where]!r}, over the target of {target:,} B"
                )
            for item in deferred:
                heapq.heappush(heap, item)
            deferred.clear()

    def _recompute(self, a, r: int) -> None:
        if self.dec[a.key] is Decision.SWAP:  # give its slack and pool bytes back
            m = self.m
            self.swapped[r] -= a.bytes
            self.d2h_slack[: a.saved_at + 2] += m.copy_s(a.bytes, m.d2h_bps)
            self.h2d_left[r] += m.copy_s(a.bytes, m.h2d_bps)
            if self.pool_left is not None:
                self.pool_left += a.bytes
        else:
            self.kept[r] -= a.bytes
        self.dec[a.key] = Decision.RECOMPUTE
        self.rerun[r].update(a.producers)

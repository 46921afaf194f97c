"""The exact refinement of a fast plan: the region model's MILP (planners/milp.py) within a wall-clock
budget, the better plan of the two kept, and how it was found said (`Planned.search`).

A greedy planner is fast (tens of ms) but stops short of the optimum where its order of choices is
wrong for the model (q, k and v re-made by one projection, swap slack spent on small tensors):
0.05-0.3 points of throughput on the paper's workloads. The MILP finds the optimum in about a second
on this machine for the paper's workloads (bytes and seconds scaled to units HiGHS's tolerances suit),
but its time grows with the model: planning runs once per input shape, so the search gets at most
`REFINE_BUDGET_S` of wall-clock time ($SLACKSWAP_PLAN_SEARCH_S sets another; 0 turns it off), and
when that runs out the better of HiGHS's best plan so far and the greedy plan is kept, and the plan
line says so. Both plans are simulated on the rank's share; the faster simulated step wins (ties:
the greedy plan, which needs no solver).

Identical layers make the MILP slow to search (planners/ties.py): HiGHS meets each choice once per
layer. So the search first solves the MILP with every 8 identical layers tied (for up to TIED_SHARE of
its time), then the full MILP from the faster of that plan and the greedy's: on the anchor table's hard
cells (GH200's GPT-2 XL at 0.3-0.6, the 7B models at 0.2) it reaches or nears the optimum where 2 s of
the full MILP alone stopped 0.1-0.6 points short (docs/benchmarks.md, "Identical layers tied").
Where the process may use two CPUs or more (`usable_cpus`: its share among the node's ranks), the full
MILP is also searched from nothing in a thread beside that sequence, for the same time (HiGHS releases
the GIL while it solves): on some cells (Mixtral-8x7B at 0.2) the full MILP alone proves its optimum in
1.3-1.6 s, while the sequence spends its first second on a tied MILP that cannot reach it; on others
the tied plan is the way in. The faster simulated plan of the two wins (docs/benchmarks.md, "Two
searches at once")."""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import replace
from typing import Callable

from ..errors import BudgetInfeasibleError, PlanError
from .common import Planned, RegionModel, keep_all_result
from .milp import MilpOptions, MilpResult, OutOfTime, solve_region_milp
from .ties import layer_ties

REFINE_BUDGET_S = 2.0  # wall-clock seconds of exact search per plan (a job plans once per input shape)
# how close to the region model's optimum a plan must be proven, relative to the step it predicts
# (the keep-all step plus recompute): 1e-4 is 0.01 points of throughput
STEP_GAP = 1e-4
# The search with identical layers tied (planners/ties.py) first, then the full MILP from the faster plan: how
# many layers a group ties, and the share of the search's time the tied search may take. Chosen on the anchor
# table's 173 cells below 99.995% of ideal (scratch sweeps, 2026-12-04, docs/benchmarks.md "Identical layers
# tied"): groups of 8 with 0.4-0.55 of the time were best; of 6 worse; 8 then 4, or all layers as one group first,
# worse still (each level's time taken from the full search). The share is of REFINE_BUDGET_S at most: the tied
# search is for a good plan fast, and a longer search has the time to find it in the full MILP (the tied MILP's
# proof alone took Llama-7B's whole 30 s on a loaded machine). With the full search beside it (two CPUs), 0.6
# (later sweeps of 2026-12-04: GH200's GPT-2 XL at 0.3 proves its tied optimum in 1.05 s, which 0.5 cut off).
TIE_GROUP = 8
TIED_SHARE = 0.6
BUDGET_ENV = "SLACKSWAP_PLAN_SEARCH_S"  # another budget in seconds (0: the greedy plan alone)
# `Planned.found`: which plan was kept and why, in one word each
FOUND = {
    "exact-proven": "the exact search's plan, proven within its gap",
    "exact-stopped": "the exact search's plan when its time ran out",
    "exact-tied": "the exact search's plan with identical layers tied, the full search finding none faster in its time",
    "greedy-ideal": "the greedy plan, as fast as keeping everything",
    "greedy-tie": "the greedy plan, as fast as the exact search's",
    "greedy-faster": "the greedy plan, faster in the simulator than the exact search's",
    "greedy-alone": "the greedy plan, the exact search off or without a plan",
    "greedy-packed": "the greedy plan on the packed view (packing.py), faster than the exact search's or the only one",
}


def _tied_search(greedy: Planned | None, model: RegionModel, budget_bytes: int, options: MilpOptions,
                 deadline: float, *, planner: str, version: str) -> Planned | None:
    """The faster, by simulated step, of `greedy` (None: it found no plan) and the MILP's plan with
    every TIE_GROUP identical layers tied (planners/ties.py), found by `deadline`. The tied search
    starts from nothing: the greedy plan cannot start it (its layers do not decide alike), and its
    recompute time as a cutoff (HiGHS's `objective_bound`) made HiGHS slower, not faster (Mistral-7B
    on the h100 preset at 0.3: its optimum in 0.39 s without, 2.0 s with). It has no PACK variables:
    it is for a good start fast, and they slowed it (GH200's GPT-2 XL at 0.3: its tied optimum in
    1.05 s without, not found in 2 s with); the full searches decide what is packed."""
    ties = layer_ties(model, TIE_GROUP)
    if not ties.groups:
        return greedy
    try:
        tied = solve_region_milp(model, budget_bytes, allow_swap=True, planner=planner, version=version,
                                 options=options, deadline=deadline, ties=ties)
    except (OutOfTime, BudgetInfeasibleError):
        return greedy
    return greedy if greedy is not None and greedy.result.step_s <= tied.planned.result.step_s else tied.planned


class _Beside:
    """`search` run in a thread of its own while the caller searches too (HiGHS releases the GIL
    while it solves). `result()` waits for it: its MilpResult, or None where it found no plan in its
    time or none exists; any other error is raised there, in the caller's thread."""

    def __init__(self, search: Callable[[], MilpResult]):
        self._result: MilpResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(search,), name="slackswap-plan-search", daemon=True)
        self._thread.start()

    def _run(self, search: Callable[[], MilpResult]) -> None:
        try:
            self._result = search()
        except (OutOfTime, BudgetInfeasibleError):
            pass
        except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
            self._error = e

    def result(self) -> MilpResult | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


# how launchers tell a process how many ranks they started on its node (torchrun, DeepSpeed, Open MPI, MPICH)
LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def usable_cpus() -> int:
    """CPUs this process may plan on: those it may run on (its affinity where the platform says),
    shared among the ranks its launcher started on this node (each may plan at the same time)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        cpus = os.cpu_count() or 1
    for name in LOCAL_RANKS_ENV:
        text = os.environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return max(1, cpus // int(text))
    return cpus


def search_budget_s() -> float:
    """The exact search's seconds per plan: $SLACKSWAP_PLAN_SEARCH_S, else REFINE_BUDGET_S."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return REFINE_BUDGET_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0 or math.isinf(seconds):
        raise PlanError(f"{BUDGET_ENV}={text!r} is not a number of seconds >= 0 (the exact search's time per plan; "
                         f"unset it for the default {REFINE_BUDGET_S:g} s, 0 for the greedy plan alone)")
    return seconds


def _searched(greedy: Planned | None, model: RegionModel, budget_bytes: int, options: MilpOptions, start: float,
              budget_s: float, *, planner: str, version: str, allow_pack: bool
              ) -> tuple[Planned | None, MilpResult | None]:
    """The exact search from `start` for `budget_s` seconds: the tied search's plan where faster
    than `greedy` (else `greedy`), and the faster MILP result of the full search started from it and,
    with two CPUs or more, the full search from nothing beside both (None: neither found a plan in
    its time). BudgetInfeasibleError where no plan exists and there is neither."""
    deadline = start + budget_s
    beside = _Beside(lambda: solve_region_milp(model, budget_bytes, allow_swap=True, planner=planner,
                                               version=version, options=options, deadline=deadline,
                                               allow_pack=allow_pack)) if usable_cpus() >= 2 else None
    seed = _tied_search(greedy, model, budget_bytes, options, start + TIED_SHARE * min(budget_s, REFINE_BUDGET_S),
                        planner=planner, version=version)
    exact = infeasible = None
    try:
        exact = solve_region_milp(model, budget_bytes, allow_swap=True, planner=planner, version=version,
                                  options=options, deadline=deadline,
                                  start=None if seed is None else seed.plan.decision, allow_pack=allow_pack,
                                  start_packed=() if seed is None else seed.plan.packed)
    except OutOfTime:
        pass
    except BudgetInfeasibleError as e:
        infeasible = e
    other = None if beside is None else beside.result()
    if other is not None and (exact is None or other.planned.result.step_s < exact.planned.result.step_s):
        exact = other
    if exact is None and seed is None and infeasible is not None:
        raise infeasible
    return seed, exact


def refined(greedy: Planned | None, model: RegionModel, budget_bytes: int, *, planner: str, version: str,
            budget_s: float | None = None, allow_pack: bool = False) -> Planned:
    """The faster (simulated) of `greedy` (None: the greedy planner found no plan) and the MILP's
    plan found within `budget_s` seconds (default: `search_budget_s()`), with `search` saying which
    and how sure it is. BudgetInfeasibleError if neither has a plan. `allow_pack`: the MILP may pack
    the profile's packable tensors (PACK, milp.py). The MILP's plan is the faster of the tied-then-full
    sequence's and, with two CPUs or more, the full search's from nothing beside it (module docstring)."""
    budget_s = search_budget_s() if budget_s is None else budget_s
    ideal_s = keep_all_result(model.profile, model.hw).step_s
    if greedy is not None and greedy.result.step_s <= ideal_s * (1 + 1e-12):
        return replace(greedy, search="greedy, as fast as keeping everything (nothing for the exact search to gain)",
                       found="greedy-ideal")
    if budget_s > 0:
        import highspy  # noqa: F401  (its import, once a process, is not search time)
    start = time.perf_counter()
    seed, exact = greedy, None
    if budget_s > 0:
        options = MilpOptions(time_limit_s=budget_s, mip_abs_gap_s=STEP_GAP * ideal_s)
        seed, exact = _searched(greedy, model, budget_bytes, options, start, budget_s, planner=planner,
                                version=version, allow_pack=allow_pack)
    took = time.perf_counter() - start
    if exact is None or (seed is not greedy and seed.result.step_s < exact.planned.result.step_s):
        none = f"is off (${BUDGET_ENV}=0)" if budget_s <= 0 else f"found no plan in its {budget_s:g} s"
        if seed is None:
            raise BudgetInfeasibleError(f"{planner}: the greedy search found no plan within {budget_bytes:,} B "
                                        f"and the exact search {none}")
        if seed is not greedy:  # (the full search found none faster, or none at all, in its time)
            return replace(seed, search=f"exact search with identical layers tied (not proven optimal; {took:.2f} s)",
                           found="exact-tied")
        return replace(greedy, search=f"greedy; the exact search {none}", found="greedy-alone")
    last = exact.last
    proven = not last.stopped_early
    # the gap in points of throughput: ideal / (ideal + bound) - ideal / (ideal + incumbent)
    points = 100 * ideal_s * (1 / (ideal_s + last.bound_s) - 1 / (ideal_s + last.objective_s))
    sure = (f"optimal in the region model within {100 * STEP_GAP:g}% of the step or "
            f"{100 * MilpOptions().mip_rel_gap:g}% of recompute time" if proven
            else f"not proven optimal: up to {points:.2f} points of throughput when its {budget_s:g} s ran out")
    if greedy is not None and greedy.result.step_s <= exact.planned.result.step_s:
        tie = greedy.result.step_s >= exact.planned.result.step_s * (1 - 1e-12)  # (sums in another order)
        how = "greedy, as fast as the exact search's plan" if tie else "greedy, faster than the exact search's plan"
        return replace(greedy, search=f"{how} ({sure}; {took:.2f} s)", found="greedy-tie" if tie else "greedy-faster")
    return replace(exact.planned, search=f"exact search ({sure}; {took:.2f} s)",
                   found="exact-proven" if proven else "exact-stopped")

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
the greedy plan, which needs no solver)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace

from ..errors import BudgetInfeasibleError, PlanError
from .common import Planned, RegionModel, keep_all_result
from .milp import MilpOptions, OutOfTime, solve_region_milp

REFINE_BUDGET_S = 2.0  # wall-clock seconds of exact search per plan (a job plans once per input shape)
# how close to the region model's optimum a plan must be proven, relative to the step it predicts
# (the keep-all step plus recompute): 1e-4 is 0.01 points of throughput
STEP_GAP = 1e-4
BUDGET_ENV = "SLACKSWAP_PLAN_SEARCH_S"  # another budget in seconds (0: the greedy plan alone)
# `Planned.found`: which plan was kept and why, in one word each
FOUND = {
    "exact-proven": "the exact search's plan, proven within its gap",
    "exact-stopped": "the exact search's plan when its time ran out",
    "greedy-ideal": "the greedy plan, as fast as keeping everything",
    "greedy-tie": "the greedy plan, as fast as the exact search's",
    "greedy-faster": "the greedy plan, faster in the simulator than the exact search's",
    "greedy-alone": "the greedy plan, the exact search off or without a plan",
}


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


def refined(greedy: Planned | None, model: RegionModel, budget_bytes: int, *, planner: str, version: str,
            budget_s: float | None = None) -> Planned:
    """The faster (simulated) of `greedy` (None: the greedy planner found no plan) and the MILP's
    plan found within `budget_s` seconds (default: `search_budget_s()`), with `search` saying which
    and how sure it is. BudgetInfeasibleError if neither has a plan."""
    budget_s = search_budget_s() if budget_s is None else budget_s
    ideal_s = keep_all_result(model.profile, model.hw).step_s
    if greedy is not None and greedy.result.step_s <= ideal_s * (1 + 1e-12):
        return replace(greedy, search="greedy, as fast as keeping everything (nothing for the exact search to gain)",
                       found="greedy-ideal")
    exact = None
    if budget_s > 0:
        import highspy  # noqa: F401  (its import, once a process, is not search time)
    start = time.perf_counter()
    if budget_s > 0:
        options = MilpOptions(time_limit_s=budget_s, mip_abs_gap_s=STEP_GAP * ideal_s)
        try:
            exact = solve_region_milp(model, budget_bytes, allow_swap=True, planner=planner, version=version,
                                      options=options, deadline=start + budget_s,
                                      start=None if greedy is None else greedy.plan.decision)
        except OutOfTime:
            pass
        except BudgetInfeasibleError:
            if greedy is None:
                raise
    took = time.perf_counter() - start
    if exact is None:
        none = f"is off (${BUDGET_ENV}=0)" if budget_s <= 0 else f"found no plan in its {budget_s:g} s"
        if greedy is None:
            raise BudgetInfeasibleError(f"{planner}: the greedy search found no plan within {budget_bytes:,} B "
                                        f"and the exact search {none}")
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

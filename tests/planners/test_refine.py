"""The default planner's exact refinement (planners/refine.py): never slower than its greedy steps
alone, the MILP's optimum where the search has the time, the greedy plan (and the plan line saying
so) where it has not."""

import pytest

from slackswap_ds.budget import resolve_budget
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.planners import get_planner
from slackswap_ds.planners.common import RegionModel
from slackswap_ds.planners.milp import MilpOptions, OutOfTime, solve_region_milp
from slackswap_ds.planners.refine import refined
from slackswap_ds.workloads import workload


@pytest.fixture(scope="module")
def gpt2(a100):
    return workload("gpt2-xl", a100, layers=6, micro_batch=2)


@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_the_default_plan_is_the_optimum_where_the_search_has_the_time(a100, gpt2, fraction):
    budget = resolve_budget(fraction, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    default = get_planner("slackswap")(gpt2, a100, budget)
    optimal = get_planner("optimal")(gpt2, a100, budget)
    assert (default.plan.planner, greedy.plan.planner) == ("slackswap", "slackswap-greedy")
    assert default.peak_bytes <= budget and default.result.feasible
    assert "optimal in the region model" in default.search and default.found in ("exact-proven", "greedy-tie")
    # the same MILP as the optimal planner's (proven within its gap; another plan of equal cost may
    # sum its times in another order), or the greedy plan where that is faster
    assert default.result.step_s <= min(greedy.result.step_s, optimal.result.step_s) * (1 + 1e-12)


def test_the_refinement_matters_where_the_greedy_order_is_wrong(a100, gpt2):
    """q, k and v are re-made by one projection: the greedy prices each alone and swaps them where
    the optimum swaps fc1's output; the refinement finds the faster plan."""
    budget = resolve_budget(0.5, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    default = get_planner("slackswap")(gpt2, a100, budget)
    assert default.result.step_s < greedy.result.step_s
    assert default.search.startswith("exact search (optimal")


def test_out_of_time_the_greedy_plan_is_kept_and_said(a100, gpt2):
    budget = resolve_budget(0.5, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    kept = refined(greedy, RegionModel(gpt2, a100), budget, planner="slackswap-greedy", version="3", budget_s=0.0)
    assert kept.plan == greedy.plan and kept.result == greedy.result
    assert kept.search == "greedy; the exact search is off ($SLACKSWAP_PLAN_SEARCH_S=0)" and kept.found == "greedy-alone"
    with pytest.raises(BudgetInfeasibleError, match="the greedy search found no plan .* and the exact search is off"):
        refined(None, RegionModel(gpt2, a100), budget, planner="slackswap", version="3", budget_s=0.0)
    late = refined(greedy, RegionModel(gpt2, a100), budget, planner="slackswap-greedy", version="3", budget_s=1e-9)
    assert late.plan == greedy.plan and late.search == "greedy; the exact search found no plan in its 1e-09 s"


def test_the_search_budget_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    from slackswap_ds.errors import PlanError
    from slackswap_ds.planners.refine import REFINE_BUDGET_S, search_budget_s

    monkeypatch.delenv("SLACKSWAP_PLAN_SEARCH_S", raising=False)
    assert search_budget_s() == REFINE_BUDGET_S == 2.0
    monkeypatch.setenv("SLACKSWAP_PLAN_SEARCH_S", " 0.5 ")
    assert search_budget_s() == 0.5
    for bad in ("-1", "nan", "inf", "two"):
        monkeypatch.setenv("SLACKSWAP_PLAN_SEARCH_S", bad)
        with pytest.raises(PlanError, match=f"SLACKSWAP_PLAN_SEARCH_S='{bad}' is not a number of seconds >= 0"):
            search_budget_s()


def test_a_solve_stopped_before_any_plan_is_out_of_time_not_infeasible(a100):
    p = workload("llama-7b", a100)
    budget = resolve_budget(0.2, p)
    with pytest.raises(OutOfTime):
        solve_region_milp(RegionModel(p, a100), budget, allow_swap=True, planner="optimal",
                          options=MilpOptions(time_limit_s=1e-3))


def test_a_budget_nothing_meets_is_refused_by_both_searches(a100, gpt2):
    with pytest.raises(BudgetInfeasibleError, match="^slackswap: even recomputing everything possible|^slackswap: "):
        get_planner("slackswap")(gpt2, a100, 1)


def test_a_greedy_plan_as_fast_as_keeping_everything_is_not_searched_further(a100, gpt2):
    budget = resolve_budget(0.95, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    from slackswap_ds.planners import keep_all_result

    assert greedy.result.step_s <= keep_all_result(gpt2, a100).step_s  # (swaps hidden, nothing recomputed)
    default = get_planner("slackswap")(gpt2, a100, budget)
    assert default.plan.decision == greedy.plan.decision
    assert default.search == "greedy, as fast as keeping everything (nothing for the exact search to gain)"
    assert default.found == "greedy-ideal"


def test_a_solve_started_from_a_plan_begins_at_that_plan(a100, gpt2):
    """HiGHS takes the greedy plan's decisions as its first incumbent: however early its time limit
    stops it, the MILP's plan is never slower than the one it started from (from nothing, a short
    solve can return a worse plan, or none: the test above)."""
    from slackswap_ds.planners.milp import _MilpModel

    budget = resolve_budget(0.5, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    model = RegionModel(gpt2, a100)
    milp_model = _MilpModel(model, allow_swap=True)
    milp_model.decision_variables()
    x = milp_model.binaries(greedy.plan.decision)
    assert milp_model.decode(list(x) + [0] * (len(milp_model.col) - len(x))) == (greedy.plan.decision, ())
    first_plan = MilpOptions(more=(("mip_max_improving_sols", 1),))  # stop at the first incumbent: no timing
    started = solve_region_milp(model, budget, allow_swap=True, planner="optimal", start=greedy.plan.decision,
                                options=first_plan)
    assert started.planned.result.step_s <= greedy.result.step_s * (1 + 1e-12), (started.last, greedy.result.step_s)
    cold = solve_region_milp(model, budget, allow_swap=True, planner="optimal", options=first_plan)
    assert cold.planned.result.step_s > greedy.result.step_s, (cold.last, cold.planned.result.step_s)  # a rough one


def test_the_tied_search_plan_is_kept_where_the_full_search_finds_none(a100, gpt2, monkeypatch):
    """Identical layers tied first (planners/ties.py): where the full MILP finds no plan in its time,
    the tied MILP's plan is kept if it is faster than the greedy's, and the plan line says so."""
    import slackswap_ds.planners.refine as refine

    real = refine.solve_region_milp

    def full_search_out_of_time(*args, ties=None, **kwargs):
        if ties is None:
            raise OutOfTime("the full search, out of time (this test)")
        return real(*args, ties=ties, **kwargs)

    monkeypatch.setattr(refine, "solve_region_milp", full_search_out_of_time)
    budget = resolve_budget(0.5, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    kept = refined(greedy, RegionModel(gpt2, a100), budget, planner="slackswap", version="7", budget_s=30.0)
    assert kept.found == "exact-tied" and kept.search.startswith("exact search with identical layers tied")
    assert kept.result.step_s < greedy.result.step_s and kept.result.feasible and kept.peak_bytes <= budget


@pytest.mark.parametrize("cpus", [1, 2])
def test_the_full_search_from_nothing_runs_beside_the_sequence_where_two_cpus_are_free(a100, gpt2, monkeypatch, cpus):
    """With two CPUs or more, the full MILP from nothing is searched in a thread beside the tied-then-full
    sequence: where the sequence finds nothing (here: both its solves out of time), that search's plan
    is kept; on one CPU only the sequence runs (the greedy plan is kept, and said)."""
    import threading

    import slackswap_ds.planners.refine as refine

    real, threads = refine.solve_region_milp, []

    def only_the_search_from_nothing(*args, ties=None, start=None, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        if ties is not None or start is not None:
            raise OutOfTime("the sequence, out of time (this test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(refine, "solve_region_milp", only_the_search_from_nothing)
    monkeypatch.setattr(refine, "usable_cpus", lambda: cpus)
    budget = resolve_budget(0.5, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    kept = refined(greedy, RegionModel(gpt2, a100), budget, planner="slackswap", version="9", budget_s=30.0)
    if cpus == 1:
        assert kept.found == "greedy-alone" and threads == [True, True]
    else:
        assert kept.found == "exact-proven" and kept.search.startswith("exact search (optimal")
        assert kept.result.step_s < greedy.result.step_s and kept.peak_bytes <= budget
        assert sorted(threads) == [False, True, True]  # (the search beside, in a thread of its own)


def test_an_error_in_the_search_beside_is_raised_in_the_planners_thread(a100, gpt2, monkeypatch):
    import slackswap_ds.planners.refine as refine

    real = refine.solve_region_milp

    def beside_breaks(*args, ties=None, start=None, **kwargs):
        if ties is None and start is None:
            raise RuntimeError("a bug in the search beside (this test)")
        return real(*args, **kwargs, **({} if ties is None else {"ties": ties}), start=start)

    monkeypatch.setattr(refine, "solve_region_milp", beside_breaks)
    monkeypatch.setattr(refine, "usable_cpus", lambda: 2)
    budget = resolve_budget(0.5, gpt2)
    greedy = get_planner("slackswap-greedy")(gpt2, a100, budget)
    with pytest.raises(RuntimeError, match="a bug in the search beside"):
        refined(greedy, RegionModel(gpt2, a100), budget, planner="slackswap", version="9", budget_s=30.0)


def test_the_cpus_a_search_may_use_are_shared_among_the_ranks_on_the_node(monkeypatch):
    import os

    from slackswap_ds.planners.refine import LOCAL_RANKS_ENV, usable_cpus

    for name in LOCAL_RANKS_ENV:
        monkeypatch.delenv(name, raising=False)
    alone = usable_cpus()
    assert alone == len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_SIZE", "2")  # (DeepSpeed's launcher)
    assert usable_cpus() == max(1, alone // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * alone))  # (torchrun's, read first): more ranks than CPUs
    assert usable_cpus() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert usable_cpus() == max(1, alone // 2)

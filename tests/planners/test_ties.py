"""Identical layers tied together (planners/ties.py): which regions are the same layer, which are
tied, and that a tied MILP's plan is one of the full MILP's, its tied layers deciding alike."""

import dataclasses

import pytest

from slackswap_ds.budget import resolve_budget
from slackswap_ds.plan import Decision
from slackswap_ds.planners.common import RegionModel
from slackswap_ds.planners.milp import MilpOptions, solve_region_milp
from slackswap_ds.planners.ties import EDGE, NO_TIES, identical_runs, layer_ties
from slackswap_ds.step_profile import layer_class
from slackswap_ds.workloads import workload


@pytest.fixture(scope="module")
def gpt2(a100):
    return workload("gpt2-xl", a100, layers=8, micro_batch=2)


def test_the_layers_of_a_preset_are_one_run(a100, gpt2):
    model = RegionModel(gpt2, a100)
    assert model.regions[0] == "embed" and model.regions[-1] == "head"
    assert identical_runs(model) == [list(range(1, 9))]  # layers.0 .. layers.7; never the embedding or the head


def test_groups_tie_to_their_first_layer_and_leave_the_run_edges_free(a100, gpt2):
    model = RegionModel(gpt2, a100)
    ties = layer_ties(model, 3)
    # the run is layers 0..7: layer 0 and the last EDGE (6, 7) stay free; 1..5 in groups of 3: (1, 2, 3), (4, 5)
    assert EDGE == 2 and ties.groups == 2
    tied_layers = {k.split(".")[1] for k in ties.acts}
    assert tied_layers == {"2", "3", "5"}
    for member, rep in ties.acts.items():
        assert layer_class(member) == layer_class(rep)
        assert rep.startswith("layers.1.") if member.split(".")[1] in "23" else rep.startswith("layers.4.")
    for member, rep in ties.ops.items():
        assert layer_class(gpt2.ops[member].key) == layer_class(gpt2.ops[rep].key)
    assert layer_ties(model, 1) is NO_TIES
    assert layer_ties(RegionModel(workload("gpt2-xl", a100, layers=3, micro_batch=2), a100), 8) is NO_TIES


def test_a_layer_unlike_its_neighbours_breaks_the_run(a100, gpt2):
    acts = [dataclasses.replace(a, bytes=a.bytes + 2) if a.key == "layers.4.mlp:fc1.out" else a
            for a in gpt2.activations]
    odd = dataclasses.replace(gpt2, activations=tuple(acts))
    assert identical_runs(RegionModel(odd, a100)) == [[1, 2, 3, 4], [6, 7, 8]]


@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_a_tied_plan_is_a_plan_of_the_full_milp_whose_tied_layers_decide_alike(a100, gpt2, fraction):
    model = RegionModel(gpt2, a100)
    budget = resolve_budget(fraction, gpt2)
    ties = layer_ties(model, 2)
    tied = solve_region_milp(model, budget, allow_swap=True, planner="optimal", ties=ties)
    full = solve_region_milp(model, budget, allow_swap=True, planner="optimal")
    for member, rep in ties.acts.items():
        assert tied.decisions[member] is tied.decisions[rep]
    assert tied.planned.result.feasible and tied.planned.peak_bytes <= budget
    # a restriction: never below the full MILP's optimum (both proven within the MILP's relative gap)
    assert tied.last.objective_s >= full.last.objective_s * (1 - MilpOptions().mip_rel_gap)
    # the tied plan starts the full MILP, which keeps it or finds better
    again = solve_region_milp(model, budget, allow_swap=True, planner="optimal", start=tied.decisions)
    assert again.last.objective_s <= tied.last.objective_s * (1 + 1e-9)



def test_measured_layers_whose_times_differ_by_noise_are_still_one_run(a100, gpt2):
    """A profile measured on a device times each layer's ops a little differently: the layers are tied
    all the same (a tied column costs its layers' times summed, so the tied MILP prices them right)."""
    ops = tuple(dataclasses.replace(o, fwd_s=o.fwd_s * (1 + 0.01 * (i % 7)), bwd_s=o.bwd_s * (1 - 0.01 * (i % 5)))
                for i, o in enumerate(gpt2.ops))
    noisy = dataclasses.replace(gpt2, ops=ops)
    model = RegionModel(noisy, a100)
    assert identical_runs(model) == [list(range(1, 9))]
    budget = resolve_budget(0.4, noisy)
    tied = solve_region_milp(model, budget, allow_swap=True, planner="optimal", ties=layer_ties(model, 2))
    # its objective is the re-run time of its plan in the noisy profile's own op times
    rerun = {p for a in noisy.activations if tied.decisions[a.key] is Decision.RECOMPUTE for p in a.producers}
    assert tied.last.objective_s == pytest.approx(sum(noisy.ops[o].fwd_s for o in rerun), rel=1e-6)

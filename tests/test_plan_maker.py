"""plan_maker.py in process, on the two-region toy step (conftest.two_region_profile: keep-all 60 B)
and toy hardware: a plan within the budget from the configured planner, else from the fastest
fallback, else an error with every reason; budgets in bytes; what plans may do under ZeRO-3; a plan
fitted to a device without streams; installed and re-planned."""

from __future__ import annotations

import logging

import pytest
import torch

from slackswap_ds.config import load_config
from slackswap_ds.coordination import Coordinator
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.plan import Decision
from slackswap_ds.plan_maker import FALLBACK_PLANNERS, PlanMaker, fate_bytes
from slackswap_ds.shapes import ShapeState
from slackswap_ds.shares import PRIVATE

from conftest import toy_hardware, two_region_profile

KEY = (((2, 8), "torch.int64"),)


def maker(**section) -> PlanMaker:
    cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4", **section}})
    hw = toy_hardware()
    return PlanMaker(cfg, hw, torch.nn.Linear(1, 1), Coordinator(cfg, hw))


def test_the_configured_planners_plan_when_it_has_one():
    planned = maker().within_budget(two_region_profile(), 40, "slackswap", PRIVATE)
    assert planned.plan.planner == "slackswap" and planned.peak_bytes <= 40


def test_without_one_the_fastest_fallback_within_the_budget_is_used_and_said(caplog):
    """keep-all cannot keep 40 B; of the fallbacks, full-recompute (16 s) is faster than offload-all
    (20 s) on the toy link; at 30 B only offload-all fits (the heuristic planner finds nothing)."""
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        planned = maker().within_budget(two_region_profile(), 40, "keep-all", PRIVATE)
    assert planned.plan.planner == "full-recompute" and planned.result.step_s == 16.0
    assert "planner keep-all found no plan within 40 B (keep-all: its plan peaks at 60 B" in caplog.text
    assert "using full-recompute instead (simulated step 16000.00 ms)" in caplog.text
    assert maker().within_budget(two_region_profile(), 30, "slackswap", PRIVATE).plan.planner == "offload-all"
    assert FALLBACK_PLANNERS == ("offload-all", "full-recompute")


def test_no_plan_anywhere_is_one_error_with_every_reason():
    with pytest.raises(BudgetInfeasibleError) as raised:
        maker().within_budget(two_region_profile(), 5, "keep-all", PRIVATE)
    message = str(raised.value)
    assert message.startswith("no planner keeps this step's saved activations within 5 B (activation_budget 0.5): ")
    for reason in ("keep-all: its plan peaks at 60 B", "offload-all: offload-all peaks at 30 B",
                   "full-recompute: its plan peaks at 40 B"):
        assert reason in message
    assert message.endswith("The smallest budget that works here is 30 B (offload-all): raise activation_budget "
                            "(or host_pool_bytes_per_node)")


def test_budgets_in_bytes_and_a_size_above_the_device_said_once(caplog):
    profile = two_region_profile()  # keep-all 60 B
    assert maker().budget_for(profile) == 30 and maker(activation_budget=0.8).budget_for(profile) == 48
    assert maker().budget_for(profile, holds=2) == 60
    big = maker(activation_budget="4GiB")  # the toy device has 1 GB
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        assert big.budget_for(profile) == big.budget_for(profile, holds=10) == 4 << 30
    assert caplog.text.count("is more than the device's memory (1,000,000,000 B, toy)") == 1


def test_under_zero3_plans_may_not_recompute():
    profile = two_region_profile()
    plans = maker()
    assert plans.plannable(profile) is profile
    plans.recompute = False
    assert [a.recomputable for a in plans.plannable(profile).activations] == [False] * 4
    assert plans.plannable(plans.plannable(profile)) == plans.plannable(profile)


def test_under_zero3_a_tensor_is_recomputed_only_inside_its_own_layer_call():
    # region r1 also reads r0's y (a layer's output the next layer saves), and r1's replay needs r0's z
    # (a layer's input): a replay inside r0's backward serves neither, so both are kept or swapped;
    # r1's y and r0's w are read and needed in their own region alone
    from slackswap_ds.step_profile import Activation, Op, StepProfile

    ops = [Op("r0:0:a", 1, 2, "r0"), Op("r0:1:b", 1, 2, "r0"), Op("r1:0:a", 1, 2, "r1"), Op("r1:1:b", 1, 2, "r1")]
    acts = [Activation("r0:x", 10, (0,)), Activation("r0:y", 20, (1, 2), (0,), ("r0:x",)),
            Activation("r0:z", 20, (1,), (0,), ("r0:x",)), Activation("r0:w", 20, (1,), (0,), ("r0:x",)),
            Activation("r1:y", 20, (3,), (2,), ("r0:z",))]
    profile = StepProfile("toy", ops, acts)
    assert profile.read_outside_their_call() == ["r0:y", "r0:z"]
    plans = maker()
    assert plans.plannable(profile) is profile  # no ZeRO-3: every recomputable tensor stays so
    plans.zero_layers = object()  # (what gather_layers_whole returned: tests/test_deepspeed_api.py)
    assert [a.key for a in plans.plannable(profile).activations if a.recomputable] == ["r0:w", "r1:y"]


def test_a_plan_is_agreed_alone_installed_and_describes_its_bytes():
    plans = maker()
    profile = two_region_profile()
    agreed = plans.agree(profile, 40, KEY)  # one rank: the node facts and the agreement are its own
    assert agreed.ranks == 1 and plans.coordinator.shares.own == plans.coordinator.shares.plan
    state = ShapeState()
    plans.install(state, agreed)
    assert state.plan is agreed.plan and state.executor.plan is agreed.plan and plans.pool is not None
    assert state.prediction.peak_bytes <= 40 and 0 < state.prediction.throughput <= 1
    split = agreed.plan.bytes_by_decision(profile)
    assert fate_bytes(agreed.plan, profile) == (f"keep {split[Decision.KEEP]:,} B, swap {split[Decision.SWAP]:,} B, "
                                                f"recompute {split[Decision.RECOMPUTE]:,} B")
    assert sum(split.values()) == 60
    assert not plans.follow(state)  # nothing was re-planned: the state describes what runs
    assert not plans.after_step(state)


def test_a_replan_after_a_demotion_never_recomputes_what_failed():
    plans = maker(planner="full-recompute")
    profile = two_region_profile()
    plans.agree(profile, 40, KEY)
    plan = plans.within_budget(profile, 40, "full-recompute").plan
    pinned, again = plans.replan(profile, plan, {"r0:y": "differs"})
    assert not pinned.by_key["r0:y"].recomputable and again.decision["r0:y"] is not Decision.RECOMPUTE
    assert plan.decision["r0:y"] is Decision.RECOMPUTE

"""Planners. All share one signature: ``plan(profile, hardware, budget_bytes, share=PRIVATE, holds=1) -> Planned``
(`holds`: micro-batches a pipeline stage holds at once under 1F1B; `share`: the rank's share of its
node, shares.py; `Planned`: the plan with its one lowering and simulation, imported from here)."""

from __future__ import annotations

from typing import Callable

from ..errors import UnknownNameError
from .anchors import (plan_deepcompile_offload, plan_megatron_offload, plan_torchtitan_ilp, plan_torchtitan_op_sac,
                      plan_torchtune_offload)
from .baselines import (
    plan_full_recompute,
    plan_keep_all,
    plan_megatron_selective,
    plan_offload_all,
    plan_recompute_knapsack,
)
from .common import Planned, keep_all_result, refusal
from .optimal import plan_optimal
from .slackswap import plan_slackswap, plan_slackswap_greedy

PlannerFn = Callable[..., Planned]

PLANNERS: dict[str, PlannerFn] = {
    "slackswap": plan_slackswap,
    "optimal": plan_optimal,
    "slackswap-greedy": plan_slackswap_greedy,
    "full-recompute": plan_full_recompute,
    "megatron-selective": plan_megatron_selective,
    "offload-all": plan_offload_all,
    "recompute-knapsack": plan_recompute_knapsack,
    "keep-all": plan_keep_all,
    # the anchors a user would pick instead (anchors.py)
    "deepcompile-offload": plan_deepcompile_offload,
    "torchtune-offload": plan_torchtune_offload,
    "torchtitan-ilp": plan_torchtitan_ilp,
    "megatron-offload": plan_megatron_offload,
    "torchtitan-op-sac": plan_torchtitan_op_sac,
}


def get_planner(name: str) -> PlannerFn:
    try:
        return PLANNERS[name]
    except KeyError:
        raise UnknownNameError("planner", name, list(PLANNERS)) from None


__all__ = ["PLANNERS", "Planned", "get_planner", "keep_all_result", "refusal"]

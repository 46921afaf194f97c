"""The plans users would otherwise run, on the same signature as ours:
``plan(profile, hardware, budget_bytes, share=PRIVATE, holds=1) -> Planned``.

Each refuses (BudgetInfeasibleError) rather than emit a plan the simulator finds over budget.
"""

from __future__ import annotations

from ..errors import BudgetInfeasibleError
from ..hardware import Hardware
from ..plan import Decision, Plan, lower
from ..shares import PRIVATE, Share
from ..simulator import simulate
from ..step_profile import StepProfile
from .common import Planned, RegionModel, alap_triggers, finalize, keep_all
from .milp import solve_region_milp

# Ops that make up the attention core (scores, softmax, attention dropout), by op-name suffix, and the
# attention-over-V matmul that Megatron's checkpointed core attention re-runs with them.
ATTENTION_CORE_OPS = ("scores", "softmax", "attn_dropout")
CORE_ATTENTION_REPLAY = ATTENTION_CORE_OPS + ("av",)


NON_LAYER_REGIONS = {"embed", "head", "pre", "post"}  # analytic and measured names


def _is_layer(region: str) -> bool:
    return region not in NON_LAYER_REGIONS and not region.startswith("between.")


def _op_name(profile: StepProfile, i: int) -> str:
    return profile.ops[i].key.rsplit(":", 1)[-1]


def plan_keep_all(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE, holds: int = 1) -> Planned:
    """Keep every activation (the ideal when memory is unlimited)."""
    return finalize(profile, keep_all(profile), hw=hw, budget_bytes=budget_bytes, share=share, planner="keep-all",
                    holds=holds)


def plan_full_recompute(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE, holds: int = 1) -> Planned:
    """DeepSpeed / torch per-layer checkpointing: keep each layer's input, and in backward re-run the
    layer's whole forward (every op, also those whose outputs no backward reads, such as the last
    matmul and residual add: `Plan.replay`)."""
    dec = keep_all(profile)
    for a in profile.activations:
        if a.recomputable and _is_layer(profile.region_of(a)):
            dec[a.key] = Decision.RECOMPUTE
    checkpointed = {profile.region_of(a) for a in profile.activations if dec[a.key] is Decision.RECOMPUTE}
    replay = tuple(o.key for o in profile.ops if o.region in checkpointed)
    return finalize(profile, dec, hw=hw, budget_bytes=budget_bytes, share=share, planner="full-recompute",
                    replay=replay, holds=holds)


def plan_megatron_selective(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE, holds: int = 1) -> Planned:
    """Megatron selective recompute (Korthikanti et al.): checkpoint the core attention, i.e. drop the
    tensors only the attention core makes (scores, softmax, dropout) and in backward re-run the core,
    the probs x V matmul included (`Plan.replay`)."""
    dec = keep_all(profile)
    for a in profile.activations:
        if a.recomputable and all(_op_name(profile, p) in ATTENTION_CORE_OPS for p in a.producers):
            dec[a.key] = Decision.RECOMPUTE
    checkpointed = {profile.region_of(a) for a in profile.activations if dec[a.key] is Decision.RECOMPUTE}
    replay = tuple(o.key for i, o in enumerate(profile.ops)
                   if o.region in checkpointed and _op_name(profile, i) in CORE_ATTENTION_REPLAY)
    return finalize(profile, dec, hw=hw, budget_bytes=budget_bytes, share=share, planner="megatron-selective",
                    replay=replay, holds=holds)


def plan_offload_all(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE, holds: int = 1) -> Planned:
    """Offload every saved tensor (torch save_on_cpu / torchtune OffloadActivations): forward waits
    for each copy-out so device memory stays bounded; backward prefetches as late as possible. It
    keeps nothing, so micro-batches in flight (`holds`) add nothing on the device, but each pins
    its own copies."""
    dec = {a.key: Decision.SWAP for a in profile.activations}
    if share.host_pool_bytes is not None and holds * profile.total_bytes > share.host_pool_bytes:
        raise BudgetInfeasibleError(
            f"offload-all: {holds} x {profile.total_bytes:,} B of activations exceed the host pool of "
            f"{share.host_pool_bytes:,} B"
        )
    triggers = alap_triggers(profile, dec, hw, share)
    plan = Plan.build(profile, dec, budget_bytes=budget_bytes, hardware_digest=hw.digest, planner="offload-all",
                      prefetch=triggers, blocking=True)
    schedule = lower(profile, plan)
    res = simulate(schedule, share.limit(hw), budget_bytes=budget_bytes, record=False)
    if not res.feasible:
        raise BudgetInfeasibleError(f"offload-all peaks at {res.peak_bytes:,} B, over the budget of {budget_bytes:,} B")
    return Planned(plan, schedule, res)


def plan_recompute_knapsack(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE, holds: int = 1) -> Planned:
    """torch.compile's activation memory budget: an exact knapsack over recomputation only (no
    offload) minimising recompute time, solved as a MILP over the region memory model."""
    model = RegionModel(profile, hw, share, holds)
    return solve_region_milp(model, budget_bytes, allow_swap=False, planner="recompute-knapsack").planned

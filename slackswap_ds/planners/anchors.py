"""What a user would pick instead of SlackSwap in 2026 (the anchors of docs/simulator.md), each planning
as its system does, on the same signature as every planner:
``plan(profile, hardware, budget_bytes, share=PRIVATE, holds=1) -> Planned``.

Each decides per rank, with the whole PCIe link it measured (none of them knows that two GPUs share
a switch uplink), and is then lowered and simulated like any plan on the share the rank really has
(`share`). Where that puts it over the budget it raises BudgetInfeasibleError, like every planner,
with the plan it made attached (`error.planned`), so that a comparison can show by how much it
over-commits the shared uplink.

* ``deepcompile-offload``: DeepSpeed DeepCompile's `offload_activation` pass;
* ``torchtune-offload``: torchtune's `OffloadActivations`;
* ``torchtitan-ilp``: a per-tensor keep / recompute / offload ILP planned with one rank's bandwidth
  (torchtitan's `auto_perf_maxing` line of work); here the exact MILP of planners/milp.py;
* ``megatron-offload``: Megatron-core's selective recompute with fine-grained activation offloading
  of the core attention (`--recompute-granularity selective --fine-grained-activation-offloading
  --offload-modules core_attn`);
* ``torchtitan-op-sac``: torchtitan's per-op selective activation checkpointing (`--activation_
  checkpoint.mode selective --activation_checkpoint.selective_ac_option op`), a torch selective-
  checkpoint policy on every transformer block.

Each function's docstring cites the rules it implements, and where our profile cannot say what the
system reads (dtypes, aliasing), what it assumes instead.
"""

from __future__ import annotations

from ..errors import BudgetInfeasibleError
from ..hardware import Hardware
from ..plan import END_OF_FORWARD, Decision, Plan
from ..shares import PRIVATE, Share
from ..step_profile import StepProfile
from .baselines import CORE_ATTENTION_REPLAY, plan_megatron_selective
from .common import Planned, RegionModel, finalize, keep_all, simulated
from .milp import solve_region_milp

# deepspeed/compile/passes/offload_activation.py (DeepSpeed 0.19.8): MIN_OFFLOAD_SIZE
DEEPCOMPILE_MIN_OFFLOAD_BYTES = 5 * 1024 * 1024
# torchtune/training/_activation_offloading.py: OffloadActivations(min_offload_size=1024)
TORCHTUNE_MIN_OFFLOAD_BYTES = 1024


def plan_deepcompile_offload(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                             holds: int = 1) -> Planned:
    """DeepCompile's `offload_activation` (deepspeed/compile/passes/offload_activation.py, 0.19.8):

    1. eligible: every saved tensor of at least MIN_OFFLOAD_SIZE = 5 MiB (`_eligible_activations`;
       it also skips non-floating-point and aliasing values, which our profile does not tell apart);
    2. the floor: the step's peak with every eligible tensor offloaded (`offload_activation_floor`,
       measured there; simulated here, on the link the rank really has, as a measurement would be);
    3. headroom = budget - floor; eligible tensors come back to the device largest first, each whose
       bytes fit the headroom left, the others skipped (`_plan_against_floor_fwd`);
    4. each reload starts early enough that the backward compute before the tensor's first use covers
       its copy, size / the H2D bandwidth one rank measured, and no earlier (`_reload_activation_bwd`);
       its check of each earlier start against the backward memory profile is left to the simulator.
    Recompute is the compiler partitioner's, outside the pass: none here. Forward waits for each copy
    where the tensor's last forward use ends (`wait_offload` after it, `_insertion_point_after_last_use`),
    so that its device memory is freed: a blocking plan (forward waits for a copy before its next op)."""
    eligible = sorted((a for a in profile.activations if a.bytes >= DEEPCOMPILE_MIN_OFFLOAD_BYTES),
                      key=lambda a: (-a.bytes, a.key))
    decisions = keep_all(profile)
    for a in eligible:
        decisions[a.key] = Decision.SWAP
    floor = _simulated(profile, decisions, hw, share, budget_bytes, holds, "deepcompile-offload").result.peak_bytes
    headroom = budget_bytes - floor
    for a in eligible:
        if a.bytes <= headroom:
            decisions[a.key] = Decision.KEEP
            headroom -= a.bytes
    return _judged(_simulated(profile, decisions, hw, share, budget_bytes, holds, "deepcompile-offload"),
                   budget_bytes)


def plan_torchtune_offload(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                           holds: int = 1) -> Planned:
    """torchtune's `OffloadActivations` (torchtune/training/_activation_offloading.py): every saved
    tensor of at least `min_offload_size` = 1024 B is copied to the host on a side stream in forward,
    and compute waits for the copy of the tensor saved `max_fwd_stash_size` = 5 saves earlier before
    going on (`pack_tensor`): nearly a blocking plan (which waits for each copy before the next op; a
    window of 5 would let a little more overlap, and hold up to 5 tensors more); in backward each one
    is brought back when autograd unpacks it (`unpack_tensor_with_streams`: the copy starts at its
    first use and compute waits for it), so no copy-in is triggered ahead of the op that reads it."""
    decisions = keep_all(profile)
    for a in profile.activations:
        if a.bytes >= TORCHTUNE_MIN_OFFLOAD_BYTES:
            decisions[a.key] = Decision.SWAP
    return _judged(_simulated(profile, decisions, hw, share, budget_bytes, holds, "torchtune-offload",
                              just_in_time=True), budget_bytes)


def plan_torchtitan_ilp(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                        holds: int = 1) -> Planned:
    """A per-tensor keep / recompute / offload ILP with one rank's measured bandwidth (torchtitan's
    `auto_perf_maxing`, pytorch/torchtitan #4636: an ILP per layer against the peak at every backward
    position, the host budget, and the bandwidth one rank measured). Here the exact MILP over the
    region memory model (planners/milp.py, the `optimal` planner's), solved for the whole link, and
    then simulated on the rank's real share."""
    model = RegionModel(profile, hw, PRIVATE, holds)
    planned = solve_region_milp(model, budget_bytes, allow_swap=True, planner="torchtitan-ilp").planned
    if share == PRIVATE:
        return planned
    return _judged(simulated(profile, planned.plan, hw, share, holds), budget_bytes)


def plan_megatron_offload(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                          holds: int = 1) -> Planned:
    """Megatron-core's `--recompute-granularity selective` with `--fine-grained-activation-offloading
    --offload-modules core_attn` (megatron/core/transformer/README.md, "Fine-grained Activation
    Offloading"): the core attention is checkpointed (the `megatron-selective` baseline: its scores,
    softmax and dropout are run again in backward), and the tensors the core attention module saves,
    its inputs q, k and v, are offloaded after its forward, the copy overlapping what follows
    (`group_prefetch_offload_commit`); in backward, when a layer's core attention starts its backward,
    the next offloaded module's tensors (the layer before's q, k, v) are reloaded ("Reload the
    corresponding tensors of next module"), the last layer's at the start of backward. Modules are
    found by the cost model's op names (analytic profiles, as `megatron-selective`)."""
    selective = plan_megatron_selective(profile, hw, max(budget_bytes, profile.total_bytes)).plan  # (its decisions)
    decisions = dict(selective.decision)
    core = {i for i, o in enumerate(profile.ops) if o.key.rsplit(":", 1)[-1] in CORE_ATTENTION_REPLAY}
    first_core_bwd: dict[str, str] = {}  # region -> the op whose backward ends just before its core's starts
    for i in sorted(core, reverse=True):
        region = profile.ops[i].region
        if region not in first_core_bwd and i + 1 < len(profile.ops):
            first_core_bwd[region] = profile.ops[i + 1].key
    regions = list(dict.fromkeys(profile.ops[i].region for i in sorted(core)))
    next_layer = dict(zip(regions, regions[1:]))  # the layer whose core attention's backward comes just before
    triggers = {}
    for a in profile.activations:
        reads_core = any(u in core for u in a.users)
        made_in_core = any(p in core for p in a.producers)
        if reads_core and not made_in_core and decisions[a.key] is Decision.KEEP:
            decisions[a.key] = Decision.SWAP
            triggers[a.key] = first_core_bwd.get(next_layer.get(profile.region_of(a)), END_OF_FORWARD)
    plan = Plan.build(profile, decisions, budget_bytes=budget_bytes, hardware_digest=hw.digest,
                      planner="megatron-offload", prefetch=triggers, replay=selective.replay)
    return _judged(simulated(profile, plan, hw, share, holds), budget_bytes)


# torchtitan's op-SAC save list (`_save_list` / `op_sac_save_list` beside `_apply_ac_to_transformer_block`;
# its file moved between releases): the outputs of mm and of the fused attention kernels (SDPA flash /
# efficient) are saved; the cost model's op names for them. A fused QKV projection counts as
# torchtitan's three mms (wq, wk, wv), in q, k, v order.
SAC_MM_OPS = ("qkv", "proj", "fc1", "fc2", "gate", "up", "down", "router")
SAC_SAVED_KERNELS = ("flash_attn",)
_QKV = {"q": 0, "k": 1, "v": 2}


def plan_torchtitan_op_sac(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                           holds: int = 1) -> Planned:
    """torchtitan's per-op selective activation checkpointing (torchtitan `apply_ac` with
    `selective_ac_option = "op"`, `_custom_policy`): every transformer block is checkpointed with a
    policy that "saves output of all compute ops, except every second mm": an mm's output is saved
    when the block's running mm count is odd, recomputed when it is even; SDPA's outputs are saved;
    everything else the block saves (norm outputs and statistics, activations, products, dropout
    masks) is recomputed in backward from what was saved. The embedding and the head are not
    checkpointed. bmm (unfused attention's scores and P·V) is not on the save list: recomputed."""
    decisions = keep_all(profile)
    first_mm = _first_mm_count(profile)
    for a in profile.activations:
        if not a.recomputable or profile.region_of(a) in ("embed", "head"):
            continue
        made_by = _made_by(profile, a.producers)
        name = profile.ops[made_by].key.rsplit(":", 1)[-1]
        if name in SAC_MM_OPS:  # q, k and v of a fused projection: its first, second and third mm
            count = first_mm[made_by] + (_QKV.get(a.key.rsplit(":", 1)[-1], 0) if name == "qkv" else 0)
            saved = count % 2 == 1
        else:
            saved = name in SAC_SAVED_KERNELS
        decisions[a.key] = Decision.KEEP if saved else Decision.RECOMPUTE
    return finalize(profile, decisions, hw=hw, budget_bytes=budget_bytes, share=share, planner="torchtitan-op-sac",
                    holds=holds)


def _made_by(profile: StepProfile, producers: tuple[int, ...]) -> int:
    """The op whose output a saved tensor is, RoPE looked through: torchtitan saves wq's and wk's
    outputs and recomputes their rotation; the cost model saves the rotated q and k (the same bytes;
    the rotation's recompute, < 1% of a layer, is skipped)."""
    ordered = sorted(producers)
    while len(ordered) > 1 and profile.ops[ordered[-1]].key.endswith(":rope"):
        ordered.pop()
    return ordered[-1]


def _first_mm_count(profile: StepProfile) -> dict[int, int]:
    """For each mm op, the block's running mm count at it (torchtitan's policy counts per block; a
    fused QKV projection counts three)."""
    counts: dict[str, int] = {}  # region -> mms so far
    out = {}
    for i, o in enumerate(profile.ops):
        name = o.key.rsplit(":", 1)[-1]
        if name in SAC_MM_OPS:
            out[i] = counts.get(o.region, 0) + 1
            counts[o.region] = out[i] + (2 if name == "qkv" else 0)
    return out


def _simulated(profile: StepProfile, decisions: dict[str, Decision], hw: Hardware, share: Share, budget_bytes: int,
               holds: int, planner: str, just_in_time: bool = False) -> Planned:
    """The plan of `decisions` (forward waiting for its copies, as both offloading anchors do), each
    copy-in triggered as the anchor does (`_reload_starts`), lowered and simulated on the rank's real share."""
    plan = Plan.build(profile, decisions, budget_bytes=budget_bytes, hardware_digest=hw.digest, planner=planner,
                      prefetch=_reload_starts(profile, decisions, hw, just_in_time), blocking=True)
    return simulated(profile, plan, hw, share, holds)


def _reload_starts(profile: StepProfile, decisions: dict[str, Decision], hw: Hardware,
                   just_in_time: bool) -> dict[str, str]:
    """Each swapped tensor's copy-in trigger: the backward op after which it starts. Backward runs the
    ops in reverse, so the ops whose backward comes just before tensor `a`'s first use are
    a.first_read + 1, + 2, ...; the copy starts after the last of them it has to cover, walking back
    until their backward time covers size / H2D on the whole link (no walk: `just_in_time`)."""
    ops, rate = profile.ops, hw.h2d_bps
    triggers = {}
    for a in profile.activations:
        if decisions[a.key] is not Decision.SWAP:
            continue
        copy_s, covered, start = a.bytes / rate, 0.0, a.first_read + 1
        while not just_in_time and start < len(ops) and covered < copy_s:
            covered += ops[start].bwd_s
            start += 1
        triggers[a.key] = ops[start].key if start < len(ops) else END_OF_FORWARD
    return triggers


def _judged(planned: Planned, budget_bytes: int) -> Planned:
    if not planned.result.feasible:
        error = BudgetInfeasibleError(f"{planned.plan.planner}: its plan peaks at "
                                      f"{planned.result.peak_bytes + planned.held_bytes:,} B, over the budget of "
                                      f"{budget_bytes:,} B")
        error.planned = planned
        raise error
    return planned

"""The anchors' planners (planners/anchors.py): each plan worked out by hand from the system's own rule
on a toy profile, and what each does on the paper's three workloads at a 0.5 budget, alone on its link
and as a DGX A100 rank sharing a switch uplink (they plan for the whole link: over budget there, with
the plan attached to the refusal, never silently)."""

import sys
import pathlib

import pytest

from slackswap_ds.budget import resolve_budget
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import load_hardware, load_node
from slackswap_ds.plan import END_OF_FORWARD, Decision
from slackswap_ds.planners import get_planner
from slackswap_ds.shares import PRIVATE, Share
from slackswap_ds.step_profile import Activation, Op, StepProfile
from slackswap_ds.workloads import workload

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from conftest import toy_hardware  # noqa: E402

MiB = 1 << 20
INSTANT = toy_hardware(d2h=1e15, h2d=1e15, duplex_d2h=1e15, duplex_h2d=1e15)


def four_layers() -> StepProfile:
    """Four one-op layers (forward 1 s, backward 2 s), each saving one tensor its own backward reads:
    a 8 MiB, b 6 MiB, c 12 MiB, d 1 MiB (below DeepCompile's 5 MiB floor, above torchtune's 1 KiB).
    Backward runs l3, l2, l1, l0."""
    ops = [Op(f"l{i}:0:op", 1, 2, f"l{i}") for i in range(4)]
    sizes = {"a": 8, "b": 6, "c": 12, "d": 1}
    return StepProfile("four", ops, [Activation(f"l{i}:{n}", s * MiB, (i,)) for i, (n, s) in enumerate(sizes.items())])


def decisions(planned) -> dict[str, str]:
    return {k.split(":")[1]: d.value for k, d in planned.plan.decision.items()}


def test_deepcompile_brings_back_the_largest_that_fit_the_headroom_above_its_floor():
    """Eligible: a, b, c (>= 5 MiB). Floor, all three offloaded (copies instant): backward starts with
    d and c (c's reload covers l3's backward: trigger end of forward), then b comes as d leaves, so
    c + b = 18 MiB. Reloads: each covers one backward op (a copy takes ~0 s, one op's 2 s covers it):
    b after l3, a after l2. Budget 30 MiB: headroom 12, c (12) fits, a (8) and b (6) no longer.
    Budget 20: headroom 2, nothing comes back. Budget 17: below the floor: refused, plan attached."""
    p = four_layers()
    planner = get_planner("deepcompile-offload")
    at_30 = planner(p, INSTANT, 30 * MiB)
    assert decisions(at_30) == {"a": "swap", "b": "swap", "c": "keep", "d": "keep"}
    assert dict(at_30.plan.prefetch) == {"l0:a": "l2:0:op", "l1:b": "l3:0:op"}
    assert at_30.result.peak_bytes == 18 * MiB
    at_20 = planner(p, INSTANT, 20 * MiB)
    assert decisions(at_20) == {"a": "swap", "b": "swap", "c": "swap", "d": "keep"}
    assert dict(at_20.plan.prefetch)["l2:c"] == END_OF_FORWARD
    with pytest.raises(BudgetInfeasibleError, match="deepcompile-offload: its plan peaks at 18,874,368 B") as e:
        planner(p, INSTANT, 17 * MiB)
    assert e.value.planned.result.peak_bytes == 18 * MiB


def test_deepcompile_starts_a_slow_reload_as_many_backward_ops_early_as_its_copy_takes():
    """H2D at 2 MiB/s, budget 20 MiB (the floor is 18: nothing comes back): a's 8 MiB take 4 s, two
    backward ops (l2, l1), so its copy starts after l3; b's 3 s and c's 6 s reach back past l3: both
    start when backward does."""
    p = four_layers()
    slow = toy_hardware(d2h=1e15, h2d=2 * MiB, duplex_d2h=1e15, duplex_h2d=2 * MiB)
    planned = get_planner("deepcompile-offload")(p, slow, 20 * MiB)
    assert planned.plan.decision["l0:a"] is Decision.SWAP
    assert dict(planned.plan.prefetch) == {"l0:a": "l3:0:op", "l1:b": END_OF_FORWARD, "l2:c": END_OF_FORWARD}


def test_torchtune_offloads_every_tensor_above_1_kib_and_brings_each_back_at_its_use():
    """All four swapped; each copy-in starts when backward reaches the tensor's reader (trigger: the
    op just before it in backward), so at 1 MiB/s every copy is exposed: compute waits 1 + 12 + 6 +
    8 = 27 s, and the step is 4 s forward + 8 s backward + 27 s."""
    p = four_layers()
    link = toy_hardware(d2h=1e15, h2d=MiB, duplex_d2h=1e15, duplex_h2d=MiB)
    planned = get_planner("torchtune-offload")(p, link, 100 * MiB)
    assert set(decisions(planned).values()) == {"swap"}
    assert dict(planned.plan.prefetch) == {"l0:a": "l1:0:op", "l1:b": "l2:0:op", "l2:c": "l3:0:op",
                                           "l3:d": END_OF_FORWARD}
    assert planned.result.stall_s["compute"] == pytest.approx(27, rel=1e-6)
    assert planned.result.step_s == pytest.approx(39, rel=1e-6)


def test_torchtitan_ilp_is_the_optimum_for_the_whole_link_judged_on_the_shared_one():
    p = workload("bert-large", load_hardware("a100-80g-pcie4"), layers=4, micro_batch=4)
    hw = load_hardware("a100-80g-pcie4")
    budget = resolve_budget(0.5, p)
    alone = get_planner("torchtitan-ilp")(p, hw, budget)
    assert alone.plan.decision == get_planner("optimal")(p, hw, budget).plan.decision
    half = Share(d2h_bps=hw.d2h_bps / 2, h2d_bps=hw.h2d_bps / 2)
    try:
        shared = get_planner("torchtitan-ilp")(p, hw, budget, half)
    except BudgetInfeasibleError as e:
        shared = e.planned
    assert shared.plan.decision == alone.plan.decision  # (blind to the share: the same tensors)
    assert shared.result.step_s >= alone.result.step_s


def test_megatron_offloads_the_core_attention_inputs_and_reloads_a_layer_ahead():
    """Selective recompute of the core attention (softmax, dropout mask and output: run again), and its
    saved inputs q, k, v offloaded; layer 0's are reloaded when layer 1's core attention starts its
    backward (after the backward of layer 1's projection, the op before it in backward), the last
    layer's when backward starts."""
    hw = load_hardware("a100-80g-pcie4")
    p = workload("gpt2-xl", hw, layers=2)
    planned = get_planner("megatron-offload")(p, hw, resolve_budget(0.9, p))
    moved = {k: d.value for k, d in planned.plan.decision.items() if d is not Decision.KEEP}
    assert moved == {f"layers.{i}.attn:{t}": d for i in (0, 1) for t, d in
                     (("q", "swap"), ("k", "swap"), ("v", "swap"), ("softmax.out", "recompute"),
                      ("attn_dropout.mask", "recompute"), ("attn_dropout.out", "recompute"))}
    assert dict(planned.plan.prefetch) == {**{f"layers.0.attn:{t}": "layers.1.attn:6:proj" for t in "qkv"},
                                           **{f"layers.1.attn:{t}": END_OF_FORWARD for t in "qkv"}}
    assert planned.plan.replay == get_planner("megatron-selective")(p, hw, p.total_bytes).plan.replay


# (slow, for suite time: each solves torchtitan's ILP, about 20 s here; the anchors' own rules are
# checked in the suite on small cases above)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-large", "gpt2-xl", "llama-7b"])
def test_each_anchor_on_the_paper_workloads_at_half_budget_fits_or_says_its_peak(name):
    """Alone on an A100's link and as a DGX A100 rank: a plan within the budget, or a refusal carrying
    the plan, over the budget. Simulated today: the two offload-only anchors hold 0.5 everywhere (their
    forward waits for its copies: slow, not large); the ILP holds it alone, and overshoots on the
    shared uplink it did not plan for (its copies take twice as long there); Megatron's offload of the
    core attention holds it where there is a core attention to offload."""
    hw = load_hardware("a100-80g-pcie4")
    p = workload(name, hw)
    budget = resolve_budget(0.5, p)
    outcome = {}
    for planner in ("deepcompile-offload", "torchtune-offload", "torchtitan-ilp", "megatron-offload",
                    "torchtitan-op-sac"):
        for where, share in (("alone", PRIVATE), ("dgx", Share.of_node(load_node("dgx-a100")))):
            if planner == "torchtitan-ilp" and where == "dgx" and name != "gpt2-xl":
                continue  # (a MILP solve each: the DGX case once, suite time; benchmarks/node_dgx.py has all)
            try:
                planned = get_planner(planner)(p, hw, budget, share)
                assert planned.result.peak_bytes <= budget
                outcome[planner, where] = "fits"
            except BudgetInfeasibleError as e:
                assert e.planned.result.peak_bytes + e.planned.held_bytes > budget
                outcome[planner, where] = "over"
    assert outcome == {("deepcompile-offload", "alone"): "fits", ("deepcompile-offload", "dgx"): "fits",
                       ("torchtune-offload", "alone"): "fits", ("torchtune-offload", "dgx"): "fits",
                       ("torchtitan-ilp", "alone"): "fits", **({("torchtitan-ilp", "dgx"): "over"} if name == "gpt2-xl" else {}),
                       # (llama-7b's attention is one fused op: no core attention to checkpoint or offload)
                       **{("megatron-offload", where): "over" if name == "llama-7b" else "fits"
                          for where in ("alone", "dgx")},
                       # op-SAC's decisions are fixed by its policy and it swaps nothing: its peak is the
                       # same wherever it runs (24-38% of the keep-all peak on these three)
                       **{("torchtitan-op-sac", where): "fits" for where in ("alone", "dgx")}}


def test_torchtitan_op_sac_saves_every_other_mm_and_the_attention_kernels_outputs():
    """torchtitan's per-op policy on a Llama block (mms in order: wq 1, wk 2, wv 3, wo 4, w1 5, w3 6, w2 7):
    save the outputs of odd-numbered mms (q, v, gate) and of the fused attention (its output and
    log-sum-exp), recompute the rest the block saves; the embedding and head are not checkpointed."""
    hw = load_hardware("a100-80g-pcie4")
    p = workload("llama-7b", hw, layers=2, seq=256, micro_batch=1)
    planned = get_planner("torchtitan-op-sac")(p, hw, p.total_bytes)
    kept = {a.key.split(":", 1)[1] for a in p.activations
            if a.key.startswith("layers.1.") and planned.plan.decision[a.key] is Decision.KEEP}
    assert kept == {"x", "q", "v", "attn.lse", "attn.out", "gate.out"}  # (x: the block's input, its checkpoint)
    assert all(planned.plan.decision[a.key] is Decision.KEEP for a in p.activations
               if p.region_of(a) in ("embed", "head"))
    # GPT-2 (fused QKV counted as three mms; unfused attention's bmm and softmax are not on the list)
    g = workload("gpt2-xl", hw, layers=2, seq=128, micro_batch=1)
    planned = get_planner("torchtitan-op-sac")(g, hw, g.total_bytes)
    kept = {a.key.split(":", 1)[1] for a in g.activations
            if a.key.startswith("layers.0.") and planned.plan.decision[a.key] is Decision.KEEP}
    assert kept == {"x", "q", "v", "fc1.out"}
    with pytest.raises(BudgetInfeasibleError):  # fixed decisions: a budget below its peak is refused
        get_planner("torchtitan-op-sac")(p, hw, p.total_bytes // 4)

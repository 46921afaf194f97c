"""The default planner's PACK choice (planners/packing.py; named apart from tests/runtime/test_packing.py,
which pytest could not import beside it): it packs where packing makes the step faster within the
budget, only as much as the budget needs, never where the plan without packing is as fast;
Plan.packed round-trips, is checked, and the lowering stores, copies and times it."""

import pytest

from slackswap_ds.errors import BudgetInfeasibleError, PlanError
from slackswap_ds.plan import UNPACKED, Decision, Kind, Plan, lower
from slackswap_ds.planners import PLANNERS, get_planner
from slackswap_ds.planners.packing import packed_view
from slackswap_ds.simulator import simulate
from slackswap_ds.step_profile import Activation, Op, StepProfile

import sys, pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from conftest import toy_hardware  # noqa: E402

MASK, PACKED, PACK_S = 400, 52, 0.01


def masked_layers(n: int = 4) -> StepProfile:
    """n layers: an input x (100 B, unrecomputable), a dear activation y (300 B, re-made by a 5 s op)
    and a dropout mask m (400 B, packable to 52 B at 0.01 s a way, re-made by the same 5 s op)."""
    ops, acts = [], []
    for r in range(n):
        region, first = f"layers.{r}", 3 * r
        ops += [Op(f"{region}:0:mm", 5, 10, region), Op(f"{region}:1:drop", 0.1, 0.1, region),
                Op(f"{region}:2:mm", 1, 2, region)]
        acts += [Activation(f"{region}:x", 100, (first,)),
                 Activation(f"{region}:y", 300, (first + 1,), (first,), (f"{region}:x",)),
                 Activation(f"{region}:m", MASK, (first + 2,), (first, first + 1), (f"{region}:x",),
                            packed_bytes=PACKED, pack_s=PACK_S)]
    return StepProfile("masked", ops, acts)


SLOW_LINK = dict(d2h=1.0, h2d=1.0, duplex_d2h=1.0, duplex_h2d=0.5)  # bytes per second: nothing hides a swap


def test_a_plan_packs_what_it_says_and_round_trips():
    p = masked_layers()
    decisions = {a.key: Decision.KEEP for a in p.activations}
    plan = Plan.build(p, decisions, budget_bytes=1, hardware_digest="h", planner="t", packed=("layers.0:m",))
    assert Plan.from_json(plan.to_json()) == plan and plan.to_json()["packed"] == ["layers.0:m"]
    assert "packed" not in Plan.build(p, decisions, budget_bytes=1, hardware_digest="h", planner="t").to_json()
    assert plan.packed_bytes(p) == (MASK, PACKED)
    with pytest.raises(PlanError, match="not mark it packable"):
        Plan.build(p, decisions, budget_bytes=1, hardware_digest="h", planner="t", packed=("layers.0:y",))
    with pytest.raises(PlanError, match="not kept or swapped"):
        Plan.build(p, {**decisions, "layers.0:m": Decision.RECOMPUTE}, budget_bytes=1, hardware_digest="h",
                   planner="t", packed=("layers.0:m",))
    rebuilt = plan.rebuilt(p, {**decisions, "layers.0:m": Decision.RECOMPUTE})
    assert rebuilt.packed == ()  # a tensor recomputed after a re-plan is not packed any more


def test_the_lowering_stores_copies_and_times_packed_bytes():
    p = masked_layers(2)
    decisions = {a.key: Decision.KEEP for a in p.activations}
    decisions["layers.0:m"] = Decision.SWAP
    plan = Plan.build(p, decisions, budget_bytes=10**6, hardware_digest="h", planner="t",
                      packed=("layers.0:m", "layers.1:m"))
    s = lower(p, plan)
    [out] = [s.instrs[i] for i in s.stream("d2h")]
    [back] = [s.instrs[i] for i in s.stream("h2d")]
    assert out.nbytes == back.nbytes == PACKED
    assert s.act_bytes["layers.1:m"] == PACKED and s.act_bytes["layers.1:m" + UNPACKED] == MASK - PACKED
    compute = {(s.instrs[i].kind, s.instrs[i].name): s.instrs[i] for i in s.stream("compute")}
    assert compute[Kind.FWD, "layers.1:2:mm"].seconds == pytest.approx(1 + PACK_S)  # packs what it saves
    unpacks = compute[Kind.BWD, "layers.1:2:mm"]  # its first reader unpacks it: whole from then on
    assert unpacks.seconds == pytest.approx(2 + PACK_S) and unpacks.alloc_start == ("layers.1:m" + UNPACKED,)
    assert "layers.1:m" + UNPACKED in unpacks.free_end


def test_the_packed_view_has_packed_bytes_and_the_kernels_in_its_ops():
    p = masked_layers(1)
    view = packed_view(p)
    assert view.by_key["layers.0:m"].bytes == PACKED and not view.packable
    assert view.ops[2].fwd_s == pytest.approx(1 + PACK_S) and view.ops[2].bwd_s == pytest.approx(2 + PACK_S)


def test_the_default_planner_packs_where_it_saves_recompute():
    """Keep-all holds 3200 B; at 1700 B (no swap can hide) the plan without packing must recompute
    some dear tensors; packing the masks (400 -> 52 B for 0.02 s) recomputes fewer."""
    p, hw = masked_layers(), toy_hardware(**SLOW_LINK)
    planned = get_planner("slackswap")(p, hw, 1700)
    plain = get_planner("slackswap-greedy")(p, hw, 1700)
    assert planned.plan.packed and planned.result.step_s < plain.result.step_s - 1
    assert all(planned.plan.decision[k] is not Decision.RECOMPUTE for k in planned.plan.packed)
    assert simulate(lower(p, planned.plan), hw, budget_bytes=1700).peak_bytes <= 1700
    # only what the budget needs: unpacking any one of them would not fit (or would recompute)
    for key in planned.plan.packed:
        fewer = tuple(k for k in planned.plan.packed if k != key)
        alone = Plan.build(p, planned.plan.decision, budget_bytes=1700, hardware_digest=hw.digest, planner="t",
                           packed=fewer)
        assert simulate(lower(p, alone), hw, budget_bytes=1700).peak_bytes > 1700


def test_no_packing_where_the_plan_without_it_is_as_fast():
    p, hw = masked_layers(), toy_hardware(**SLOW_LINK)
    assert get_planner("slackswap")(p, hw, p.total_bytes).plan.packed == ()


def test_the_anchors_and_baselines_never_pack():
    """Every planner but the default, at a budget where packing is what the default does (the table of
    docs/benchmarks.md, "Which fates each planner uses")."""
    p, hw = masked_layers(), toy_hardware(**SLOW_LINK)
    assert get_planner("slackswap")(p, hw, 1700).plan.packed  # (the budget where packing pays)
    planned = 0
    for name in PLANNERS:
        if name == "slackswap":
            continue
        for budget in (1700, p.total_bytes):  # (offload-all and the offloading anchors plan swaps only at some)
            try:
                result = get_planner(name)(p, hw, budget)
            except (PlanError, BudgetInfeasibleError):
                continue
            assert result.plan.packed == (), name
            planned += 1
    assert planned >= len(PLANNERS) - 1

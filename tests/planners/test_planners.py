"""Every plan any planner emits is feasible in the simulator; baselines do what they claim."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap_ds.budget import resolve_budget
from slackswap_ds.errors import BudgetInfeasibleError, UnknownNameError
from slackswap_ds.plan import Decision, lower
from slackswap_ds.planners import PLANNERS, get_planner, keep_all_result
from slackswap_ds.shares import PRIVATE, Share
from slackswap_ds.simulator import simulate
from slackswap_ds.step_profile import Activation, Op, StepProfile
from slackswap_ds.workloads import workload

import sys, pathlib

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from conftest import toy_hardware  # noqa: E402


@st.composite
def profiles(draw):
    """Random region-structured profiles: each region saves its input (not recomputable) and a few
    tensors recomputable from earlier tensors of the same region, some of them packable."""
    ops, acts = [], []
    for r in range(draw(st.integers(1, 5))):
        region = f"layers.{r}"
        first = len(ops)
        n_ops = draw(st.integers(1, 4))
        for j in range(n_ops):
            ops.append(Op(f"{region}:{j}:op", draw(st.floats(0.1, 5)), draw(st.floats(0.1, 10)), region))
        keys = [f"{region}:x"]
        acts.append(Activation(keys[0], draw(st.integers(0, 50)), (first,)))
        for j in range(1, n_ops):
            producer = first + draw(st.integers(0, j - 1))
            deps = tuple(draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)))
            extra_user = draw(st.integers(first + j, first + n_ops - 1))
            key = f"{region}:t{j}"
            nbytes = draw(st.integers(1, 60))
            packable = draw(st.booleans())  # (PACK: the default planner may pack it)
            acts.append(Activation(key, nbytes, tuple(sorted({first + j, extra_user})), (producer,), deps,
                                   packed_bytes=draw(st.integers(0, nbytes)) if packable else None,
                                   pack_s=draw(st.floats(0, 1)) if packable else 0.0))
            keys.append(key)
    return StepProfile("random", ops, acts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=profiles(), frac=st.floats(0.1, 1.0), d2h=st.floats(1, 40), name=st.sampled_from(sorted(PLANNERS)))
def test_every_emitted_plan_is_feasible(p, frac, d2h, name):
    hw = toy_hardware(d2h=d2h, h2d=d2h, duplex_d2h=d2h, duplex_h2d=d2h / 2, latency=0.01)
    budget = max(1, resolve_budget(frac, p))
    try:
        plan = get_planner(name)(p, hw, budget).plan
    except BudgetInfeasibleError:
        return
    plan.check(p)
    res = simulate(lower(p, plan), hw, budget_bytes=budget)
    assert res.peak_bytes <= budget


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=profiles(), d2h=st.floats(1, 40), name=st.sampled_from(sorted(PLANNERS)))
def test_every_planner_emits_a_plan_when_everything_fits(p, d2h, name):
    """The other side of the test above: a planner that always refused would pass it."""
    hw = toy_hardware(d2h=d2h, h2d=d2h, duplex_d2h=d2h, duplex_h2d=d2h / 2, latency=0.01)
    budget = resolve_budget(1.0, p)  # the keep-all peak: keep-all itself fits
    plan = get_planner(name)(p, hw, budget).plan
    assert simulate(lower(p, plan), hw, budget_bytes=budget).peak_bytes <= budget


def test_unknown_planner_lists_choices():
    with pytest.raises(UnknownNameError, match="valid choices: deepcompile-offload, full-recompute, keep-all"):
        get_planner("magic")


@pytest.fixture(scope="module")
def small_bert(a100):
    return workload("bert-large", a100, layers=4, micro_batch=4)


def test_full_recompute_keeps_only_layer_inputs(small_bert, a100):
    p = small_bert
    plan = PLANNERS["full-recompute"](p, a100, resolve_budget(0.5, p)).plan
    for a in p.activations:
        in_layer = p.region_of(a).startswith("layers.")
        expected = Decision.RECOMPUTE if in_layer and a.recomputable else Decision.KEEP
        assert plan.decision[a.key] is expected, a.key


def test_megatron_recomputes_exactly_the_attention_core(small_bert, a100):
    p = small_bert
    plan = PLANNERS["megatron-selective"](p, a100, resolve_budget(0.9, p)).plan
    recomputed = {a.layer_class for a in p.activations if plan.decision[a.key] is Decision.RECOMPUTE}
    assert recomputed == {"layers.*.attn:softmax.out", "layers.*.attn:attn_dropout.mask",
                          "layers.*.attn:attn_dropout.out"}


def test_offload_all_swaps_everything_and_blocks(small_bert, a100):
    p = small_bert
    plan = PLANNERS["offload-all"](p, a100, resolve_budget(0.5, p)).plan
    assert set(plan.decision.values()) == {Decision.SWAP} and plan.blocking


def test_keep_all_refuses_a_budget_below_its_peak(small_bert, a100):
    with pytest.raises(BudgetInfeasibleError, match="over the budget"):
        PLANNERS["keep-all"](small_bert, a100, resolve_budget(0.9, small_bert)).plan


def test_host_pool_limits_swaps(small_bert, a100):
    p = small_bert
    budget = resolve_budget(0.5, p)
    plan = PLANNERS["slackswap"](p, a100, budget, Share(host_pool_bytes=0)).plan
    assert Decision.SWAP not in plan.decision.values()
    with pytest.raises(BudgetInfeasibleError, match="host pool"):
        PLANNERS["offload-all"](p, a100, budget, Share(host_pool_bytes=1)).plan


def test_budget_resolution():
    p = StepProfile("p", [Op("a:0", 1, 1, "a")], [Activation("a:x", 1000, (0,))])
    assert resolve_budget(0.5, p) == 500 and resolve_budget(1, p) == 1000 and resolve_budget(4096, p) == 4096
    for bad in (0, -1, True, "half"):
        with pytest.raises(ValueError, match="budget must be"):
            resolve_budget(bad, p)


@pytest.mark.parametrize("name, overrides", [("bert-large", {"layers": 6}), ("gpt2-xl", {"layers": 6, "micro_batch": 2}),
                                             pytest.param("llama-7b", {"layers": 6, "micro_batch": 1},
                                                          marks=pytest.mark.slow)])  # (suite time: 20 s here)
def test_slackswap_beats_baselines_and_is_near_optimal(a100, name, overrides):
    p = workload(name, a100, **overrides)
    ideal = keep_all_result(p, a100).step_s
    budget = resolve_budget(0.5, p)
    thr = {}
    for planner in ("slackswap", "optimal", "full-recompute", "megatron-selective", "offload-all",
                    "recompute-knapsack"):
        try:
            plan = PLANNERS[planner](p, a100, budget, PRIVATE).plan
        except BudgetInfeasibleError:
            continue
        res = simulate(lower(p, plan), a100, budget_bytes=budget, ideal_s=ideal, record=False)
        assert res.feasible
        thr[planner] = 100 * res.throughput
    ours = thr.pop("slackswap")
    best = thr.pop("optimal")
    assert ours >= best - 0.5
    assert all(ours >= other for other in thr.values()), thr


def _recompute_s(p, plan):
    return sum(ins.seconds for ins in lower(p, plan).instrs if ins.kind.value == "recompute")


def test_full_recompute_replays_whole_layers_as_deepspeed_does(a100):
    # Llama has no dropout: no saved tensor needs the down projection or the residual add re-run, but
    # a checkpointed block re-runs its whole forward, so the baseline pays for every layer op.
    p = workload("llama-7b", a100, layers=3, micro_batch=1, seq=256)
    plan = PLANNERS["full-recompute"](p, a100, resolve_budget(0.5, p)).plan
    layer_fwd = sum(o.fwd_s for o in p.ops if o.region.startswith("layers."))
    assert _recompute_s(p, plan) == pytest.approx(layer_fwd, rel=1e-12)
    assert any(k.endswith(":down") for k in plan.replay) and any(k.endswith(":add") for k in plan.replay)
    needed = {p.ops[i].key for a in p.activations if plan.decision[a.key] is Decision.RECOMPUTE for i in a.producers}
    assert not needed >= set(plan.replay)  # the replay is more than the tensors need


def test_megatron_selective_replays_the_attention_over_v_matmul(small_bert, a100):
    p = small_bert
    plan = PLANNERS["megatron-selective"](p, a100, resolve_budget(0.9, p)).plan
    core = [o for o in p.ops if o.key.rsplit(":", 1)[-1] in ("scores", "softmax", "attn_dropout", "av")]
    assert {o.key for o in core} == set(plan.replay)
    assert _recompute_s(p, plan) == pytest.approx(sum(o.fwd_s for o in core), rel=1e-12)


def test_a_plan_without_replay_keeps_its_json_and_one_with_it_round_trips(small_bert, a100):
    from slackswap_ds.errors import PlanError
    from slackswap_ds.plan import Plan

    p = small_bert
    plain = PLANNERS["slackswap"](p, a100, resolve_budget(0.5, p)).plan
    assert "replay" not in plain.to_json()
    plan = PLANNERS["full-recompute"](p, a100, resolve_budget(0.5, p)).plan
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.digest == plan.digest and back.replay
    with pytest.raises(PlanError, match="replay names 1 op"):
        Plan.build(p, plan.decision, budget_bytes=1, hardware_digest="", planner="x", replay=("nope:0:op",))


def test_release_keeps_every_drop_the_model_budget_does_not_need(a100):
    # Among plans that meet the budget, prefer the one that drops least: a greedy planner overshoots,
    # an exact one leaves free swaps in. Start from dropping everything possible.
    from slackswap_ds.planners.common import RegionModel, model_peak, release

    p = workload("gpt2-xl", a100, layers=6, micro_batch=2)
    model = RegionModel(p, a100)
    everything = {a.key: Decision.RECOMPUTE if a.recomputable else Decision.SWAP for a in p.activations}
    for frac in (0.3, 0.5, 0.95):
        target = resolve_budget(frac, p)
        dec = release(model, everything, target)
        assert model_peak(model, dec) <= target
        for a in p.activations:  # no single drop left could be kept within the target
            if dec[a.key] is not Decision.KEEP and a.bytes:
                assert model_peak(model, {**dec, a.key: Decision.KEEP}) > target, (frac, a.key)
    assert release(model, everything, 1) == everything  # a target nothing meets: left as given


def test_the_optimal_plan_drops_nothing_its_model_budget_does_not_need(a100):
    from slackswap_ds.planners.common import RegionModel, model_peak
    from slackswap_ds.planners.optimal import solve_optimal

    p = workload("gpt2-xl", a100, layers=6, micro_batch=2)
    res = solve_optimal(p, a100, resolve_budget(0.5, p))
    dec, target, model = res.plan.decision, res.last.model_budget_bytes, RegionModel(p, a100)
    for a in p.activations:
        if dec[a.key] is not Decision.KEEP and a.bytes:
            assert model_peak(model, {**dec, a.key: Decision.KEEP}) > target, a.key


def test_the_milp_returns_its_solves_in_the_result():
    from slackswap_ds.hardware import load_hardware
    from slackswap_ds.planners.milp import MilpOptions
    from slackswap_ds.planners.optimal import solve_optimal

    hw = load_hardware("a100-80g-pcie4")
    p = workload("bert-large", hw, layers=3, micro_batch=2, seq=128)
    budget = resolve_budget(0.5, p)
    res = solve_optimal(p, hw, budget, options=MilpOptions(time_limit_s=10.0, mip_rel_gap=0.0))
    assert res.plan.planner == "optimal" and res.solves
    last = res.last
    assert last.model_budget_bytes <= budget and 0 <= last.bound_s <= last.objective_s + 1e-12
    assert last.gap == pytest.approx(0.0, abs=1e-6)  # a zero-gap solve is proven optimal
    assert _recompute_s(p, res.plan) <= last.objective_s + 1e-12  # giving drops back never costs time


def test_a_refusal_is_named_once_whoever_reports_it():
    from slackswap_ds.planners import refusal

    assert refusal("slackswap", BudgetInfeasibleError("slackswap: no plan")) == "no plan"
    assert refusal("optimal", BudgetInfeasibleError("HiGHS said no")) == "HiGHS said no"
    assert refusal("slackswap", BudgetInfeasibleError("slackswapper: x")) == "slackswapper: x"


@pytest.mark.parametrize("holds", [2, 3])
def test_prefetches_retimed_for_synchronous_copies_count_the_micro_batches_held(a100, holds):
    # a pipeline stage's plan made for the A100, run where copies are synchronous (CPU): the
    # retimed plan must still fit the budget with the other held micro-batches' kept bytes
    from slackswap_ds.hardware import Hardware
    from slackswap_ds.planners.common import fit_triggers

    prof = workload("gpt2-xl", a100)
    budget = int(0.5 * holds * prof.total_bytes)
    planned = PLANNERS["slackswap"](prof, a100, budget, holds=holds)
    fitted = fit_triggers(prof, planned, a100, Hardware.instant_copies(), holds=holds)
    held = (holds - 1) * fitted.plan.bytes_by_decision(prof)[Decision.KEEP]
    assert fitted.plan.decision == planned.plan.decision and fitted.held_bytes == held
    assert fitted.schedule == lower(prof, fitted.plan)  # the retimed plan's one lowering
    assert simulate(fitted.schedule, Hardware.instant_copies()).peak_bytes + held <= budget


# ---- the greedy's trade (slackswap.py step 3b) ------------------------------------------------------
@pytest.fixture(scope="module")
def gh200():
    from slackswap_ds.hardware import load_hardware

    return load_hardware("gh200")


def _greedy_pct(profile, hw, fraction: float) -> tuple[float, object]:
    planned = get_planner("slackswap-greedy")(profile, hw, resolve_budget(fraction, profile))
    return 100 * keep_all_result(profile, hw).step_s / planned.result.step_s, planned


def test_the_greedys_swaps_never_ride_on_producers_it_re_runs_anyway(gh200):
    # a swapped tensor whose producers re-run anyway (an attention-dropout mask once its dropout output
    # is recomputed) costs link time and pinned bytes for nothing: recomputing it is free
    profile = workload("gpt2-xl", gh200, layers=8)
    for fraction in (0.2, 0.3, 0.4):
        plan = _greedy_pct(profile, gh200, fraction)[1].plan
        rerun: dict[str, set[int]] = {}
        for a in profile.activations:
            if plan.decision[a.key] is Decision.RECOMPUTE:
                rerun.setdefault(profile.region_of(a), set()).update(a.producers)
        riders = [a.key for a in profile.activations if plan.decision[a.key] is Decision.SWAP and a.recomputable
                  and set(a.producers) <= rerun.get(profile.region_of(a), set())]
        assert riders == [], (fraction, riders)


@pytest.mark.parametrize("fraction", [0.2, 0.3])
def test_the_trade_gives_the_greedy_what_the_optimum_does_on_a_fast_link(gh200, monkeypatch, fraction):
    # GPT-2 XL on the GH200 preset: the greedy without step 3b swapped attention-dropout masks and kept
    # softmax outputs; the trade recomputes the masks with their outputs and swaps dearer recomputes
    from slackswap_ds.planners import slackswap

    profile = workload("gpt2-xl", gh200, layers=8)
    traded, _ = _greedy_pct(profile, gh200, fraction)
    monkeypatch.setattr(slackswap._State, "trade", lambda self, target: None)
    alone, _ = _greedy_pct(profile, gh200, fraction)
    optimum = 100 * keep_all_result(profile, gh200).step_s / get_planner("optimal")(
        profile, gh200, resolve_budget(fraction, profile)).result.step_s
    assert alone + 0.5 < traded <= optimum + 1e-9, (alone, traded, optimum)

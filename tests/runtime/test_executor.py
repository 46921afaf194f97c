"""The executor on tiny GPT-2, BERT and Llama models (dropout on): exact under planned and random
plans, within budget, equal to the simulator where their semantics coincide, reading the lowered
Schedule, and counting every fallback."""

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import slackswap_ds as ss
from slackswap_ds.errors import BudgetInfeasibleError, PlanError
from slackswap_ds.hardware import Hardware
from slackswap_ds.plan import Decision, Kind, Plan, lower
from slackswap_ds.planners.common import keep_all
from slackswap_ds.runtime.device import Device
from slackswap_ds.runtime.executor import Executor
from slackswap_ds.runtime.host_pool import HostPool
from slackswap_ds.runtime.program import Program
from slackswap_ds.simulator import simulate

from exactness import apply_on, assert_exact, assert_peak_as_predicted, emulated, profile, random_plan, run, swap_all

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 16, 2, 128


def tiny(kind: str, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=64, attention_dropout=0.1,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                      pad_token_id=0)
        model = transformers.BertForMaskedLM(cfg)
    return model.to(dtype).train()


def step(model, ids):
    kwargs = {} if isinstance(model, transformers.BertForMaskedLM) else {"use_cache": False}
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.loss


@pytest.fixture(scope="module", params=["gpt2", "bert", "llama"])
def setup(request):
    transformers.logging.set_verbosity_error()
    model = tiny(request.param)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    return model, ids, profile(model, step, ids), run(model, step, ids)


def recompute_ops(schedule) -> list[str]:
    return sorted(ins.name for ins in schedule.instrs if ins.kind is Kind.RECOMPUTE)


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
def test_planned_steps_are_exact_within_budget_and_rerun_exactly_the_schedules_ops(setup, budget):
    model, ids, prof, reference = setup
    try:
        plan = ss.plan(prof, "a100-80g-pcie4", budget)
    except BudgetInfeasibleError:
        assert budget < 0.5  # 0.5 and 0.75 must be feasible
        pytest.skip(f"no plan at {budget}")
    ex = ss.apply(model, plan, prof)
    assert_exact(run(model, step, ids, ex), reference)  # the verifying first step
    assert ex.stats.last_step.verified in (True, None)
    assert_exact(run(model, step, ids, ex), reference)
    last = ex.stats.last_step
    assert last.peak_device_bytes <= plan.budget_bytes
    assert sorted(set(last.recomputed_ops)) == recompute_ops(lower(prof, plan))
    assert last.unplanned_reruns == 0 and last.fallbacks == {}


@pytest.mark.parametrize("planner", ["keep-all", "offload-all", "full-recompute", "slackswap"])
def test_measured_peak_against_the_simulated_peak(setup, planner):
    """With synchronous CPU copies the simulator on `Hardware.instant_copies()` is the executor's
    model: equal for keep-all and offload-all (blocking: forward waits for every copy-out); never
    below the measurement otherwise (backward's position is only seen at unpacks). Plans are made
    for the hardware they run on, so they fit the budget there."""
    model, ids, prof, _ = setup
    budget = 1.0 if planner == "keep-all" else 0.5
    plan = ss.plan(prof, Hardware.instant_copies(), budget, planner=planner)
    assert plan.blocking is (planner == "offload-all")
    with ss.apply(model, plan, prof) as stats:
        for _ in range(2):
            step(model, ids)
    assert_peak_as_predicted(stats.last_step.peak_device_bytes, prof, plan, exact=planner in ("keep-all", "offload-all"))
    assert stats.last_step.copy_waits == 0


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_random_plans_are_exact(setup, seed):
    model, ids, prof, reference = setup
    plan = random_plan(prof, seed)
    ex = ss.apply(model, plan, prof)
    assert_exact(run(model, step, ids, ex), reference)
    assert_exact(run(model, step, ids, ex), reference)
    assert sorted(set(ex.stats.last_step.recomputed_ops)) == recompute_ops(lower(prof, plan))
    assert ex.stats.last_step.peak_device_bytes <= simulate(lower(prof, plan), Hardware.instant_copies()).peak_bytes


def test_the_executor_reads_the_lowered_schedule(setup):
    """Triggers, recompute sets and blocking come from the Schedule's instructions."""
    _, _, prof, _ = setup
    plan = random_plan(prof, 3)
    schedule = lower(prof, plan)
    program = Program(schedule, prof)
    index = {o.key: i for i, o in enumerate(prof.ops)}
    rerun = {(prof.ops[index[ins.name]].region, ins.name) for ins in schedule.instrs if ins.kind is Kind.RECOMPUTE}
    assert {(r, program.op_keys[r, k]) for r, ks in program.rerun.items() for k in ks} == rerun
    copy_ins = sorted(ins.name for ins in schedule.instrs if ins.kind is Kind.COPY_IN)
    assert sorted(k for _, keys in program.triggers for k in keys) == copy_ins == sorted(plan.keys(Decision.SWAP))
    assert program.blocking is plan.blocking
    with pytest.raises(PlanError, match="another plan"):
        ss.apply(tiny("gpt2"), random_plan(prof, 4), prof, schedule=schedule)


def test_no_host_allocation_after_warm_up():
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    prof = profile(model, step, ids)
    pool = HostPool(None, Device.current())  # the device ss.apply copies on (emulated or not)
    ex = ss.apply(model, swap_all(prof), prof, pool=pool)
    with ex:
        for _ in range(2):
            step(model, ids)
        warm = pool.stats().allocations
        for _ in range(20):
            step(model, ids)
    assert warm > 0 and pool.stats().allocations == warm
    assert ex.stats.steps == 22 and ex.stats.last_step.swapped_bytes == prof.total_bytes
    assert pool.stats().bytes_in_use == 0  # every buffer back in the pool


def test_exhausted_host_pool_keeps_tensors_counts_and_warns_once(caplog):
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    prof = profile(model, step, ids)
    reference = run(model, step, ids)
    ex = ss.apply(model, swap_all(prof), prof, pool=HostPool(0, Device.cpu()))
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        assert_exact(run(model, step, ids, ex), reference)
        run(model, step, ids, ex)
    last = ex.stats.last_step
    assert last.fallbacks == {"host pool exhausted: kept": len(prof.activations)}
    assert last.kept_bytes == prof.total_bytes and last.swapped_bytes == 0
    assert len([r for r in caplog.records if "host pool exhausted" in r.getMessage()]) == 1


def test_steps_the_profile_did_not_see_stay_exact_and_say_so():
    """Other shapes: the same keys with other sizes, planned anyway (`resized`), a keep or a
    prefetch that would pass the plan's budget to host (counted; backward's regenerated and read
    tensors are larger than planned all the same); other saves than the profile's: to host
    (`fallbacks`). Either way the gradients are exact."""
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    prof = profile(model, step, ids)
    plan = random_plan(prof, 1)
    other = torch.randint(1, VOCAB, (BATCH, 2 * SEQ))
    ex = ss.apply(model, plan, prof)
    assert_exact(run(model, step, other, ex), run(model, step, other))
    last = ex.stats.last_step
    assert last.resized > 0 and last.fallbacks
    assert set(last.fallbacks) <= {"a prefetch over the budget: copied in when read", "over the budget if kept: swapped"}

    def more(m, b):  # saves tensors the profile never saw, after the layers
        out = m(input_ids=b, labels=b, use_cache=False)
        loss = out.loss + out.logits.sin().pow(2).mean()
        loss.backward()
        return loss

    assert_exact(run(model, more, ids, ex), run(model, more, ids))
    assert ex.stats.last_step.fallbacks["not in the plan's profile: swapped"] > 0


def test_plan_for_another_profile_is_refused():
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    prof = profile(model, step, ids)
    other = profile(model, step, torch.randint(1, VOCAB, (BATCH, SEQ * 2)))
    plan = Plan.build(other, keep_all(other), budget_bytes=1, hardware_digest="any", planner="test")
    with pytest.raises(PlanError, match="plan again for this profile"):
        ss.apply(model, plan, prof)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_bf16_steps_are_exact(kind):
    model = tiny(kind, torch.bfloat16)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    prof = profile(model, step, ids)
    reference = run(model, step, ids)
    plans = [ss.plan(prof, "a100-80g-pcie4", b) for b in (0.5, 0.75)]
    plans += [ss.plan(prof, "a100-80g-pcie4", 0.5, planner=n) for n in ("full-recompute", "offload-all")]
    plans += [random_plan(prof, seed) for seed in range(3)]
    for plan in plans:
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, step, ids, ex), reference)
        assert_exact(run(model, step, ids, ex), reference)


def test_in_place_change_of_a_saved_tensor_never_gives_a_wrong_gradient():
    """Autograd refuses a saved tensor modified in place, but cannot see it through saved-tensor
    hooks (torch skips the check then). A kept tensor would hand backward the changed values, so
    the executor checks its version itself and raises autograd's error; a swapped one was copied
    when it was saved, so backward gets the values forward used: the true gradient."""

    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8)])

        def forward(self, x):
            y = self.layers[0](x).sigmoid()  # sigmoid saves its output
            out = (y * 3).sum()
            y.add_(1)
            return out

    def sneaky_step(m, b):
        loss = m(b)
        loss.backward()
        return loss

    def honest_step(m, b):  # the same loss without the in-place change
        loss = m.layers[0](b).sigmoid().mul(3).sum()
        loss.backward()
        return loss

    model, x = Sneaky(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sneaky_step(model, x)  # plain autograd
    prof = profile(model, honest_step, x)
    plans = {d: Plan.build(prof, {a.key: d for a in prof.activations}, budget_bytes=0, hardware_digest="any",
                           planner="test") for d in (Decision.KEEP, Decision.SWAP)}
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with ss.apply(model, plans[Decision.KEEP], prof):
            sneaky_step(model, x)
    # a swap copied synchronously (CPU) holds the values forward used: the honest step's gradients
    if not Device.current().has_streams:
        assert_exact(run(model, sneaky_step, x, ss.apply(model, plans[Decision.SWAP], prof)),
                     run(model, honest_step, x))
    # an asynchronous copy (a GPU's; the emulated device) may read before or after the change: autograd's error
    changed = "modified by an inplace operation: saved tensor 'after.layers.0:0:sigmoid' is at version 1"
    with pytest.raises(RuntimeError, match=changed):
        with apply_on(emulated("20ms"), model, plans[Decision.SWAP], prof):
            sneaky_step(model, x)


def test_recorded_timeline_is_a_trace_of_the_measured_step():
    from slackswap_ds.sim_report import chrome_trace

    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    prof = profile(model, step, ids)
    # swap what cannot be recomputed, recompute the rest: every kind of span appears
    plan = Plan.build(prof, {a.key: Decision.RECOMPUTE if a.recomputable else Decision.SWAP
                             for a in prof.activations}, budget_bytes=prof.total_bytes,
                      hardware_digest="any", planner="test")
    ex = ss.apply(model, plan, prof, record=True)
    with ex as stats:
        step(model, ids)
    timeline = stats.last_timeline
    kinds = {(e.stream, e.kind) for e in timeline.events}
    assert {("compute", "fwd"), ("compute", "bwd"), ("d2h", "copy_out"), ("h2d", "copy_in"),
            ("compute", "recompute")} <= kinds
    fwd = [e.name for e in timeline.events if e.kind == "fwd"]
    assert fwd == [o.key for o in prof.ops]  # every forward op, in order, named as in the profile
    assert max(m[2] for m in timeline.memory) == stats.last_step.peak_device_bytes
    trace = chrome_trace(timeline, title="measured", budget_bytes=plan.budget_bytes)
    assert trace["otherData"]["peak_bytes"] == stats.last_step.peak_device_bytes


def test_tensors_on_another_device_are_left_alone_and_counted():
    """A CPU tensor saved by a model whose parameters are elsewhere (attention kernels' seed and
    offset tensors on CUDA) is not an activation of the device: the executor leaves it to autograd."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x):
            return self.layers[0](x).sum()

    model = Mixed().to("meta")  # parameters on another device type than the saved tensors
    ex = ss.apply(model, Plan.build(ss.StepProfile("empty", (), ()), {}, budget_bytes=0, hardware_digest="any",
                                    planner="test"), ss.StepProfile("empty", (), ()))
    with ex as stats:
        x = torch.randn(3, 4, requires_grad=True)
        (x.sin() * 2).sum().backward()
    assert stats.last_step.other_device_bytes == 3 * 4 * 4 and stats.last_step.kept_bytes == 0


def test_the_shelter_sends_every_saved_tensor_to_host():
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    reference = run(model, step, ids)
    shelter = Executor.shelter(model)
    assert_exact(run(model, step, ids, shelter), reference)
    last = shelter.stats.last_step
    assert shelter.plan is None and last.kept_bytes == 0 and last.swapped_bytes > 0
    assert shelter.resident_bytes == 0


def test_a_derived_plans_budget_is_held_at_run_time():
    """A derived profile's sizes are predictions (derive.py), so its program holds the plan's budget
    at run time: a keep that would take the device's saved bytes over it goes to host, a prefetch
    that would waits until backward reads the tensor. The same plans over the measured profile run
    as planned, over that budget. Exact either way."""
    import dataclasses

    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    reference = run(model, step, ids)
    measured = profile(model, step, ids)
    derived = dataclasses.replace(measured, meta=(*measured.meta, ("source", "derived")))
    budget = sum(a.bytes for a in measured.activations) // 3
    runs = {}
    for prof in (measured, derived):
        for decision in (Decision.KEEP, Decision.SWAP):  # SWAP: every copy-in at the end of forward
            plan = Plan.build(prof, {a.key: decision for a in prof.activations}, budget_bytes=budget,
                              hardware_digest="any", planner="test")
            ex = ss.apply(model, plan, prof, verify=False)
            assert_exact(run(model, step, ids, ex), reference)
            runs[prof is derived, decision] = ex.stats.last_step
    assert runs[False, Decision.KEEP].kept_bytes > budget and runs[False, Decision.KEEP].fallbacks == {}
    held = runs[True, Decision.KEEP]
    assert 0 < held.kept_bytes <= budget and held.fallbacks["over the budget if kept: swapped"] > 0
    swapped, waited = runs[False, Decision.SWAP], runs[True, Decision.SWAP]
    assert swapped.peak_device_bytes > budget and swapped.copy_waits == 0
    assert waited.peak_device_bytes < swapped.peak_device_bytes and waited.copy_waits > 0
    assert waited.fallbacks["a prefetch over the budget: copied in when read"] > 0

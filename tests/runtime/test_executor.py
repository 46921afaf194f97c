"""Steps under any plan give the unmodified model's loss and gradients, bit for bit."""

import random

import pytest
import torch
from torch import nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slackswap_ds as ss
from slackswap_ds.errors import BudgetInfeasibleError, PlanError
from slackswap_ds.hardware import Hardware
from slackswap_ds.plan import Decision, Plan, lower
from slackswap_ds.planners.common import keep_all
from slackswap_ds.runtime.device import Device
from slackswap_ds.runtime.host_pool import HostPool
from slackswap_ds.simulator import simulate

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 16, 2, 128


def tiny(kind: str, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=64, attention_dropout=0.1,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                      pad_token_id=0)
        model = transformers.BertForMaskedLM(cfg)
    return model.to(dtype).train()


def step(model, ids):
    kwargs = {} if isinstance(model, transformers.BertForMaskedLM) else {"use_cache": False}
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out.loss


def run(model, ids, ctx=None, seed=1, step_fn=None):
    """One step (dropout on) from a fixed RNG state; loss and every gradient. `step_fn` defaults to
    `step` (an HF model on token ids)."""
    step_fn = step_fn or step
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if ctx is None:
        loss = step_fn(model, ids)
    else:
        with ctx:
            loss = step_fn(model, ids)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_exact(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def recompute_ops(profile, plan) -> list[str]:
    return sorted({profile.ops[p].key for a in profile.activations if plan.decision[a.key] is Decision.RECOMPUTE
                   for p in a.producers})


@pytest.fixture(scope="module", params=["gpt2", "bert", "llama"])
def setup(request):
    model = tiny(request.param)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    return model, ids, profile, run(model, ids)


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
def test_planned_steps_are_exact_and_within_budget(setup, budget):
    model, ids, profile, reference = setup
    try:
        plan = ss.plan(profile, "a100-80g-pcie4", budget)
    except BudgetInfeasibleError:
        pytest.skip(f"no plan at {budget}")
    ex = ss.apply(model, plan, profile)
    result = run(model, ids, ex)
    assert_exact(result, reference)
    last = ex.stats.last_step
    assert last.peak_device_bytes <= plan.budget_bytes
    assert sorted(last.recomputed_ops) == recompute_ops(profile, plan)
    assert last.fallbacks == {}


@pytest.mark.parametrize("planner", ["slackswap", "full-recompute", "offload-all", "recompute-knapsack"])
def test_measured_peak_equals_the_simulated_peak(setup, planner):
    """On the CPU accelerator copies are synchronous: simulated with instant copies, the plan's
    predicted peak is exactly the executor's own accounting."""
    model, ids, profile, _ = setup
    try:
        plan = ss.plan(profile, "a100-80g-pcie4", 0.5, planner=planner)
    except BudgetInfeasibleError:
        pytest.skip("infeasible")
    predicted = simulate(lower(profile, plan), Hardware.instant_copies()).peak_bytes
    with ss.apply(model, plan, profile) as stats:
        step(model, ids)
    assert stats.last_step.peak_device_bytes == predicted <= plan.budget_bytes
    assert stats.last_step.copy_waits == 0  # every swapped tensor was back by its prefetch trigger


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_random_plans_are_exact(setup, seed):
    model, ids, profile, reference = setup
    rng = random.Random(seed)
    dec = {a.key: rng.choice([Decision.KEEP, Decision.SWAP] + [Decision.RECOMPUTE] * a.recomputable)
           for a in profile.activations}
    plan = Plan.build(profile, dec, budget_bytes=profile.total_bytes, hardware_digest="any", planner="random")
    ex = ss.apply(model, plan, profile)
    assert_exact(run(model, ids, ex), reference)
    assert sorted(ex.stats.last_step.recomputed_ops) == recompute_ops(profile, plan)
    predicted = simulate(lower(profile, plan), Hardware.instant_copies()).peak_bytes
    assert ex.stats.last_step.peak_device_bytes == predicted


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_bf16_steps_are_exact(kind):
    model = tiny(kind, torch.bfloat16)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    reference = run(model, ids)
    plans = []
    for budget in (0.25, 0.5, 0.75):
        try:
            plans.append(ss.plan(profile, "a100-80g-pcie4", budget))
        except BudgetInfeasibleError:
            pass
    plans += [ss.plan(profile, "a100-80g-pcie4", 0.5, planner=n) for n in ("full-recompute", "offload-all")]
    for seed in range(2):
        rng = random.Random(seed)
        dec = {a.key: rng.choice([Decision.KEEP, Decision.SWAP] + [Decision.RECOMPUTE] * a.recomputable)
               for a in profile.activations}
        plans.append(Plan.build(profile, dec, budget_bytes=0, hardware_digest="any", planner="random"))
    assert len(plans) == 7
    for plan in plans:
        assert_exact(run(model, ids, ss.apply(model, plan, profile)), reference)


def swap_everything(profile):
    return Plan.build(profile, {a.key: Decision.SWAP for a in profile.activations}, budget_bytes=0,
                      hardware_digest="any", planner="test")


def test_no_host_allocation_after_warm_up():
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    pool = HostPool(None, Device.current())
    ex = ss.apply(model, swap_everything(profile), profile, pool=pool)
    with ex:
        for _ in range(2):
            step(model, ids)
        warm = pool.stats().allocations
        for _ in range(20):
            step(model, ids)
    assert warm > 0 and pool.stats().allocations == warm
    assert ex.stats.steps == 22 and ex.stats.last_step.swapped_bytes == profile.total_bytes


def test_exhausted_host_pool_keeps_tensors_and_says_so():
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    reference = run(model, ids)
    ex = ss.apply(model, swap_everything(profile), profile, pool=HostPool(0, Device.current()))
    assert_exact(run(model, ids, ex), reference)
    last = ex.stats.last_step
    assert last.fallbacks == {"host pool exhausted: kept": len(profile.activations)}
    assert last.kept_bytes == profile.total_bytes and last.swapped_bytes == 0


def test_plan_for_another_profile_is_refused():
    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    other = ss.profile_step(model, step, torch.randint(1, VOCAB, (BATCH, SEQ * 2)), warmup=0)
    plan = Plan.build(other, keep_all(other), budget_bytes=1, hardware_digest="any", planner="test")
    with pytest.raises(PlanError, match="plan again for this profile"):
        ss.apply(model, plan, profile)


def test_model_that_checkpoints_inside_runs_exactly_under_a_swap_plan():
    """HF gradient checkpointing (torch.utils.checkpoint, non-reentrant) inside the model: the
    checkpoint keeps its own saves; what reaches SlackSwap (layer inputs, head) is swapped exactly."""
    model = tiny("gpt2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    layer_inputs = [a for a in profile.activations if a.key.endswith(":input.0") and ".h." in a.key]
    assert len(layer_inputs) == 6
    reference = run(model, ids)
    ex = ss.apply(model, swap_everything(profile), profile)
    assert_exact(run(model, ids, ex), reference)
    assert ex.stats.last_step.swapped_bytes == profile.total_bytes and ex.stats.last_step.fallbacks == {}


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class _DeepSpeedCheckpointed(nn.Module):
    """Megatron-DeepSpeed style: every other layer goes through deepspeed.checkpointing.checkpoint."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(4)])

    def forward(self, x):
        import deepspeed

        for i, layer in enumerate(self.layers):
            x = deepspeed.checkpointing.checkpoint(layer, x) if i % 2 else layer(x)
        return x.pow(2).mean()


def test_model_calling_deepspeed_checkpointing_inside_is_exact_under_random_plans(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    torch.manual_seed(0)
    model = _DeepSpeedCheckpointed().train()
    x = torch.randn(8, 16)

    def ds_step(m, batch):
        loss = m(batch)
        loss.backward()
        return loss

    profile = ss.profile_step(model, ds_step, x, warmup=0)
    # the checkpointed layers (1, 3) keep their own saves; layers 0 and 2 are SlackSwap's
    assert {a.key.split(":")[0] for a in profile.activations} == {"layers.0", "layers.2", "post"}

    reference = run(model, x, step_fn=ds_step)
    assert len(reference[1]) == len(list(model.parameters()))  # every parameter has a gradient
    for seed in range(4):
        rng = random.Random(seed)
        dec = {a.key: rng.choice([Decision.KEEP, Decision.SWAP] + [Decision.RECOMPUTE] * a.recomputable)
               for a in profile.activations}
        plan = Plan.build(profile, dec, budget_bytes=0, hardware_digest="any", planner="random")
        assert_exact(run(model, x, ss.apply(model, plan, profile), step_fn=ds_step), reference)


def test_recorded_timeline_is_a_trace_of_the_measured_step(tmp_path):
    from slackswap_ds.report import chrome_trace

    model = tiny("gpt2")
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    profile = ss.profile_step(model, step, ids, warmup=0)
    # swap what cannot be recomputed, recompute the rest: every kind of span appears
    plan = Plan.build(profile, {a.key: Decision.RECOMPUTE if a.recomputable else Decision.SWAP
                                for a in profile.activations}, budget_bytes=profile.total_bytes,
                      hardware_digest="any", planner="test")
    ex = ss.apply(model, plan, profile, record=True)
    with ex as stats:
        step(model, ids)
    timeline = stats.last_timeline
    kinds = {(e.stream, e.kind) for e in timeline.events}
    assert ("compute", "fwd") in kinds and ("compute", "bwd") in kinds
    assert {("d2h", "copy_out"), ("h2d", "copy_in")} <= kinds
    assert ("compute", "recompute") in kinds
    fwd = [e.name for e in timeline.events if e.kind == "fwd"]
    assert fwd == [o.key for o in profile.ops]  # every forward op, in order, named as in the profile
    assert max(m[2] for m in timeline.memory) == stats.last_step.peak_device_bytes
    trace = chrome_trace(timeline, title="measured", budget_bytes=plan.budget_bytes)
    assert trace["otherData"]["peak_bytes"] == stats.last_step.peak_device_bytes

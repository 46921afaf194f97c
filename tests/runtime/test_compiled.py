"""Compiled models (runtime/compiled.py): each block of the stack compiled on its own runs as
compiled under every plan, loss and every gradient equal to the same compiled model without
SlackSwap (dropout on), within the budget, with no recompilation once planned; any other compiled
part is refused by name, never trained with other numerics or wrong gradients.

The suite keeps aot_eager on three families and inductor on GPT-2; `benchmarks/compiled_sweep.py`
runs the full sweep (every family, inductor, more random plans)."""

from __future__ import annotations

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds.runtime.compiled import CompiledCodeError
from slackswap_ds.runtime.regions import find_layers

from exactness import assert_exact, fake_clock, profile, random_plan, run, without_caches

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)

LAYERS = 8  # a compiled block's backward reads all its saved tensors at once: with the zoo's 2 or 3
# layers one block is a third of the step, too much for a 0.5 budget; with 8 it is not


def build(name: str):
    """The zoo's GPT-2 (SDPA), Llama (grouped-query attention, rotary) and BERT (MLM), dropout on,
    with LAYERS layers."""
    hf, P, PAD = transformers, zoo.P, zoo.PAD
    if name == "gpt2":
        config = zoo._gpt2_config("sdpa")
        config.n_layer = LAYERS
        return zoo._build(hf.GPT2LMHeadModel, config, torch.float32)
    if name == "llama":
        config = hf.LlamaConfig(vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=zoo.POSITIONS,
                                attention_dropout=P, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
                                attn_implementation="sdpa")
        return zoo._build(hf.LlamaForCausalLM, config, torch.float32)
    config = hf.BertConfig(vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                           num_attention_heads=4, max_position_embeddings=zoo.POSITIONS, hidden_dropout_prob=P,
                           attention_probs_dropout_prob=P, pad_token_id=PAD, attn_implementation="eager")
    return zoo._build(hf.BertForMaskedLM, config, torch.float32)


FAMILIES = ["gpt2", "llama", "bert"]


@pytest.fixture(autouse=True, scope="module")
def quiet_transformers():
    transformers.logging.set_verbosity_error()


def compile_blocks(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """torchtitan's pattern: every layer of every block stack replaced by its torch.compile."""
    for path, layer in find_layers(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        parent[int(name)] = torch.compile(layer, backend=backend)
    return model


def dynamo_compiles() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def plans_for(prof, random_plans: int) -> dict:
    plans = {f"slackswap@{b}": ss.plan(prof, "a100-80g-pcie4", b) for b in (0.5, 0.75)}
    plans["full-recompute"] = ss.plan(prof, "a100-80g-pcie4", 1.0, planner="full-recompute")
    plans.update({f"random {seed}": random_plan(prof, seed) for seed in range(random_plans)})
    return plans


def check_every_plan(name: str, backend: str, random_plans: int) -> None:
    model, batch = build(name)
    model = compile_blocks(without_caches(model), backend)
    reference = run(model, zoo.step, batch)
    assert_exact(run(model, zoo.step, batch), reference)  # (the compiled model is deterministic here)
    # (1 ms an op: a whole compiled block is one op, and at 1 us none of its copies would hide)
    torch.manual_seed(1)
    prof = ss.profile_step(model, zoo.step, batch, warmup=0, timer=fake_clock(1e-3))
    compiled_ops = [op for op in prof.ops if op.key.endswith(":compiled")]
    assert len(compiled_ops) == len(find_layers(model)), "one opaque op per compiled block call"
    inside = [a for a in prof.activations if a.users and prof.ops[a.saved_at].key.endswith(":compiled")]
    assert inside and not any(a.recomputable for a in inside)  # kept or swapped, never recomputed
    for label, plan in plans_for(prof, random_plans).items():
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, zoo.step, batch, ex), reference)  # the first (verifying) step
        compiles = dynamo_compiles()
        assert_exact(run(model, zoo.step, batch, ex), reference)
        assert dynamo_compiles() == compiles, f"{label}: recompiled after the plan's first step"
        assert ex.stats.last_step.peak_device_bytes <= plan.budget_bytes, label
        assert not ex.stats.last_step.fallbacks, label


@pytest.mark.parametrize("name", FAMILIES)
def test_every_plan_of_a_model_compiled_per_block_is_exact_aot_eager(name):
    check_every_plan(name, "aot_eager", random_plans=10)


def test_every_plan_of_gpt2_compiled_per_block_with_inductor_is_exact():
    """inductor draws dropout from its own random stream: any eager re-run inside a block would give
    other masks, so this fails if a plan ever runs a compiled block other than as compiled."""
    check_every_plan("gpt2", "inductor", random_plans=3)


def test_the_same_blocks_uncompiled_are_still_planned_as_before():
    """Beside the compiled path, an eager model keeps its recomputes (nothing opaque)."""
    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    prof = profile(without_caches(model), zoo.step, batch)
    assert not any(op.key.endswith(":compiled") for op in prof.ops)
    assert any(a.recomputable for a in prof.activations)


@pytest.mark.parametrize("how", ["whole model", "module.compile()", "inside a block"])
def test_a_compiled_part_that_is_not_a_block_is_refused_by_name(how):
    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    without_caches(model)
    if how == "whole model":
        target, named = torch.compile(model, backend="aot_eager"), "the whole model"
    elif how == "module.compile()":  # DeepSpeed's engine.compile() compiles the module in place
        model.compile(backend="aot_eager")
        target, named = model, "the whole model"
    else:
        model.transformer.h[1].mlp = torch.compile(model.transformer.h[1].mlp, backend="aot_eager")
        target, named = model, "transformer.h.1.mlp"
    with pytest.raises(CompiledCodeError, match=named) as e:
        profile(target, zoo.step, batch)
    assert "torch.compile(block)" in str(e.value) and '"enabled": false' in str(e.value)
    eager, _ = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    prof = profile(without_caches(eager), zoo.step, batch)
    with pytest.raises(CompiledCodeError, match=named):
        ss.apply(target, ss.plan(prof, "a100-80g-pcie4", 0.5), prof)

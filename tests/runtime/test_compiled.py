"""Compiled models (runtime/compiled.py): each block of the stack compiled on its own runs as
compiled under every plan (its saves kept, swapped, or recomputed by running the call again whole
from its random state), loss and every gradient equal to the same compiled model without SlackSwap
(dropout on), within the budget, with no recompilation once planned; any other compiled part is
first changed to that layout (compile_layout.py) and said in the log; what cannot be is refused by
name, never trained with wrong gradients.

The suite keeps aot_eager on three families and inductor on GPT-2; `benchmarks/compiled_sweep.py`
runs the full sweep (every family, inductor, more random plans)."""

from __future__ import annotations

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds.plan import Decision
from slackswap_ds.runtime.compiled import CompiledCodeError
from slackswap_ds.runtime.regions import find_layers

from exactness import assert_exact, fake_clock, profile, random_plan, run, soak, without_caches

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


def compile_whole(model: torch.nn.Module, backend: str, how: str) -> torch.nn.Module:
    if how == "torch.compile(model)":
        return torch.compile(model, backend=backend)
    model.compile(backend=backend)  # DeepSpeed's engine.compile() and HF torch_compile=True through it
    return model


def check_every_plan(name: str, backend: str, random_plans: int, whole: str | None = None) -> None:
    """Every plan of `plans_for` on model `name` compiled per block, or whole (`whole`: how), with
    `backend`: loss and every gradient equal to the compiled model without SlackSwap (compiled whole:
    with aot_eager, the model as the user compiled it; with inductor, per block as SlackSwap compiles
    it, see compile_layout.py), within the budget, no recompilation once planned."""
    model, batch = build(name)
    model = without_caches(model)
    model = compile_blocks(model, backend) if whole is None else compile_whole(model, backend, whole)
    reference = run(model, zoo.step, batch)
    assert_exact(run(model, zoo.step, batch), reference)  # (the compiled model is deterministic here)
    # (1 ms an op: a whole compiled block is one op, and at 1 us none of its copies would hide)
    torch.manual_seed(1)
    prof = ss.profile_step(model, zoo.step, batch, warmup=0, timer=fake_clock(1e-3))
    if whole is not None:
        per_block = run(model, zoo.step, batch)  # (the layout SlackSwap changed it to, no plan)
        if backend == "aot_eager":
            assert_exact(per_block, reference)
        reference = per_block
    compiled_ops = [op for op in prof.ops if op.key.endswith(":compiled")]
    assert len(compiled_ops) == len(find_layers(model)), "one opaque op per compiled block call"
    inside = [a for a in prof.activations if prof.ops[a.saved_at].key.endswith(":compiled")]
    made = [a for a in inside if a.recomputable]  # made by the call (not its inputs): regenerated by running it
    assert made and all(a.producers == (a.saved_at,) for a in made)
    plans = plans_for(prof, random_plans)
    assert plans["full-recompute"].keys(Decision.RECOMPUTE) and any(p.keys(Decision.RECOMPUTE) for p in plans.values())
    for label, plan in plans.items():
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, zoo.step, batch, ex), reference)  # the first (verifying) step
        compiles = dynamo_compiles()
        assert_exact(run(model, zoo.step, batch, ex), reference)
        assert dynamo_compiles() == compiles, f"{label}: recompiled after the plan's first step"
        last = ex.stats.last_step
        assert last.peak_device_bytes <= plan.budget_bytes, label
        assert not last.fallbacks and last.unplanned_reruns == 0, label
        recomputed = sum(a.bytes for a in prof.activations if plan.decision[a.key] is Decision.RECOMPUTE)
        assert last.recomputed_bytes == recomputed, label  # every planned recompute made, by running calls again


@pytest.mark.parametrize("name", FAMILIES)
def test_every_plan_of_a_model_compiled_per_block_is_exact_aot_eager(name):
    check_every_plan(name, "aot_eager", random_plans=10)


def test_every_plan_of_gpt2_compiled_per_block_with_inductor_is_exact():
    """inductor draws dropout from its own random stream: any eager re-run inside a block would give
    other masks, so this fails if a plan ever runs a compiled block other than as compiled."""
    check_every_plan("gpt2", "inductor", random_plans=3)


@pytest.mark.parametrize("name, how", [("gpt2", "torch.compile(model)"),
                                       pytest.param("llama", "model.compile()", marks=pytest.mark.slow),  # (suite time)
                                       ("bert", "torch.compile(model)")])
def test_every_plan_of_a_model_compiled_whole_is_exact_aot_eager(name, how):
    """Compiled whole, SlackSwap compiles each block on its own instead (compile_layout.py): with
    aot_eager, every plan gives the loss and gradients of the model compiled whole."""
    check_every_plan(name, "aot_eager", random_plans=3, whole=how)


@pytest.mark.slow  # (suite time: inductor compiles; benchmarks/compiled_sweep.py --whole runs it on more models)
def test_every_plan_of_gpt2_compiled_whole_with_inductor_is_exact_to_it_compiled_per_block():
    check_every_plan("gpt2", "inductor", random_plans=3, whole="model.compile()")


def test_the_same_blocks_uncompiled_are_still_planned_as_before():
    """Beside the compiled path, an eager model keeps its recomputes (nothing opaque)."""
    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    prof = profile(without_caches(model), zoo.step, batch)
    assert not any(op.key.endswith(":compiled") for op in prof.ops)
    assert any(a.recomputable for a in prof.activations)


def test_a_compiled_function_inside_an_eager_layer_runs_compiled_under_every_plan(caplog):
    """A `torch.compile`d function (inductor, dropout inside) called by eager layers, as HF calls its
    compiled flex attention: under SlackSwap's dispatch modes Dynamo ran it eagerly, and the loss
    differed under every plan (other dropout masks). Now it runs compiled: loss and every gradient
    equal the model without SlackSwap. A replay cannot see inside it (replaying it gave wrong
    gradients in about one run of eight: its kernels wrote into a buffer the replay handed back), so
    the profile finds such layers, says so once, and their saves are kept or swapped, never recomputed."""
    import logging

    import torch.nn.functional as F

    model, batch = zoo.ZOO["llama"].build(torch.float32)
    model = without_caches(model)

    def activation(x):
        return F.dropout(F.silu(x), 0.1, training=True) * 1.5

    compiled = torch.compile(activation, backend="inductor")
    for layer in model.model.layers:
        del layer.mlp.act_fn  # (a submodule: nn.Module refuses a function in its place)
        layer.mlp.act_fn = compiled
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    plans = [ss.plan(prof, "a100-80g-pcie4", 0.5, planner="offload-all"), random_plan(prof, 0), random_plan(prof, 1)]
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        for plan in plans:
            ex = ss.apply(model, plan, prof)
            assert_exact(run(model, zoo.step, batch, ex), reference)
            assert_exact(run(model, zoo.step, batch, ex), reference)
            assert ex.stats.last_step.peak_device_bytes <= plan.budget_bytes
    said = [r.getMessage() for r in caplog.records if "call compiled code" in r.getMessage()]
    assert len(said) == 1 and "(model.layers.0, model.layers.1, model.layers.2)" in said[0]
    assert not any(a.recomputable for a in prof.activations if a.key.startswith("model.layers."))


def test_a_python_profiler_already_set_during_the_profiled_step_is_said_and_left_in_place(caplog):
    """The profiled step watches forward's Python calls for compiled code inside eager layers; another
    profiler's hook cannot be chained to, so it stays, and the log says what SlackSwap cannot see."""
    import logging
    import sys

    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)

    def theirs(frame, event, arg):
        return None

    sys.setprofile(theirs)
    try:
        with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
            profile(without_caches(model), zoo.step, batch)
        assert sys.getprofile() is theirs
    finally:
        sys.setprofile(None)
    assert any("a Python profiler (sys.setprofile) is active" in r.getMessage() for r in caplog.records)


def test_blocks_compiled_under_hugging_faces_gradient_checkpointing_are_planned_exactly():
    """HF's gradient checkpointing around blocks compiled each on its own: each compiled block's
    backward recomputes its dropout through the `run_with_rng_state` higher-order operator, which
    reached the profiler's dispatch mode and stopped the step ("no rule registered for
    HigherOrderOperator"). It runs as it is now: loss and every gradient equal the same model."""
    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    model = without_caches(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = compile_blocks(model, "aot_eager")
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    for seed in (0, 1):
        plan = random_plan(prof, seed)
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, zoo.step, batch, ex), reference)
        assert ex.stats.last_step.peak_device_bytes <= plan.budget_bytes


def test_a_compiled_part_inside_a_block_makes_the_block_compiled_and_is_said(caplog):
    """`h[1].mlp` compiled inside an eager block: SlackSwap compiles block h.1 whole with its settings
    instead (and says so); every plan exact (aot_eager: the same numbers in either layout)."""
    import logging

    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    without_caches(model)
    model.transformer.h[1].mlp = torch.compile(model.transformer.h[1].mlp, backend="aot_eager")
    reference = run(model, zoo.step, batch)
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        prof = ss.profile_step(model, zoo.step, batch, warmup=0, timer=fake_clock(1e-3))
    assert "transformer.h.1.mlp (torch.compile(module), backend aot_eager) runs eagerly around its blocks, and 1 " \
           "block(s) of transformer.h are compiled each on its own" in caplog.text
    assert [op.key for op in prof.ops if op.key.endswith(":compiled")] and \
        all("h.1" in op.key for op in prof.ops if op.key.endswith(":compiled"))
    for seed in range(3):
        ex = ss.apply(model, random_plan(prof, seed), prof)
        assert_exact(run(model, zoo.step, batch, ex), reference)


def test_a_compiled_wrapper_slackswap_was_not_given_is_said_and_trains_exactly(caplog):
    """The issue's first try: `mc = torch.compile(model)`, but `model` given to ss.apply. SlackSwap
    cannot see the wrapper; Dynamo traces its hooks. The step stays exact (what the graphs save is
    handled as unplanned: swapped, counted as fallbacks) and the log says what happened and what to do,
    once."""
    import logging

    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    without_caches(model)
    prof = profile(model, zoo.step, batch)
    wrapper = torch.compile(model, backend="aot_eager")
    reference = run(wrapper, zoo.step, batch)
    ex = ss.apply(model, random_plan(prof, 0), prof)
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        for _ in range(2):
            assert_exact(run(wrapper, zoo.step, batch, ex), reference)
    said = [r.getMessage() for r in caplog.records if "called from compiled code" in r.getMessage()]
    assert len(said) == 1 and "Give SlackSwap the compiled module itself" in said[0]


def test_a_plan_made_before_the_model_was_compiled_is_refused_when_the_compiled_model_runs_it():
    """ss.apply's executor made for the eager model, then model.compile(): the plan is for the eager
    program, and Dynamo would trace SlackSwap's hooks inside the new graph (it crashed there, "no_dispatch()").
    Entering the executor says what changed and what to do, before anything runs."""
    model, batch = build("gpt2")
    prof = profile(model, zoo.step, batch)
    ex = ss.apply(model, ss.plan(prof, "a100-80g-pcie4", 0.5), prof)
    model.compile(backend="aot_eager")
    with pytest.raises(CompiledCodeError, match=r"compiled after SlackSwap took it \(compiled parts now: the whole "
                                                r"model; when its plan was made: none\).*Compile the model first"):
        run(model, zoo.step, batch, ex)


def test_a_part_compiled_by_something_else_is_refused_by_name():
    """`_compiled_call_impl` set by something other than module.compile(): its settings cannot be read
    to compile the blocks instead, so SlackSwap stops, naming it and what to do."""
    model, batch = zoo.ZOO["gpt2-sdpa"].build(torch.float32)
    without_caches(model)
    model.transformer._compiled_call_impl = model.transformer._call_impl  # (someone's own wrapper)
    with pytest.raises(CompiledCodeError, match="transformer .GPT2Model. is compiled by something other") as e:
        profile(model, zoo.step, batch)
    assert "torch.compile(blocks[i])" in str(e.value) and '"enabled": false' in str(e.value)


class _BreakingBlock(torch.nn.Module):
    """A block whose compiled forward has a graph break in the middle (eager code between two
    compiled graphs) and dropout on both sides of it."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down, self.drop = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width), \
            torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(torch.nn.functional.gelu(self.up(x)))
        torch._dynamo.graph_break()
        return x + self.drop(self.down(torch.tanh(h)))


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 32, layers: int = 6):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(_BreakingBlock(width) for _ in range(layers))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor", "eager"])
def test_a_graph_break_inside_a_compiled_block_is_planned_around_exactly(backend):
    """Two compiled graphs and eager code between them inside each block (and with backend "eager",
    Dynamo's graphs run as plain ops): the block is still one opaque op, run again whole where a
    plan recomputes in it, the gradients the compiled model's."""
    torch.manual_seed(0)
    model = compile_blocks(_Stack().train(), backend)
    batch = torch.randn(4, 8, 32)

    def step(m, x):
        loss = m(x)
        loss.backward()
        return loss

    reference = run(model, step, batch)
    torch.manual_seed(1)
    prof = ss.profile_step(model, step, batch, warmup=0, timer=fake_clock(1e-3))
    assert sum(op.key.endswith(":compiled") for op in prof.ops) == 6
    assert any(a.recomputable for a in prof.activations)
    for seed in range(4):
        plan = random_plan(prof, seed)
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, step, batch, ex), reference)
        assert_exact(run(model, step, batch, ex), reference)
        assert ex.stats.last_step.peak_device_bytes <= plan.budget_bytes


def test_a_block_recompiled_while_slackswap_hooks_are_active_is_traced_without_them():
    """Mixtral's routing gives data-dependent shapes and graph breaks: Dynamo compiles its blocks again
    during the profiled step, with SlackSwap's saved-tensor hooks active, and traces through the pack
    hook; the hook is the identity to Dynamo (no crash from inside it), and gradients stay exact. The
    eager code between a block's graphs calls the hooks with Dynamo's frame callback active: Dynamo
    never compiles them as frames of their own there (it did, tracing them as the identity: those saves
    unseen), and the saves a later block's inner graph reads are read by that block (they were the earlier
    block's: its replay then ran a block early), so a slackswap plan's measured peak is the simulator's
    (it was 221,056 B against 173,716 B) and within the budget."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from slackswap_ds.hardware import Hardware
    from slackswap_ds.plan import lower
    from slackswap_ds.runtime.executor import Executor
    from slackswap_ds.simulator import simulate

    torch._dynamo.reset()
    model, batch = zoo.ZOO["mixtral"].build(torch.float32)
    model = compile_blocks(without_caches(model), "aot_eager")
    reference = run(model, zoo.step, batch)
    torch.manual_seed(1)
    prof = ss.profile_step(model, zoo.step, batch, warmup=0, timer=fake_clock(1e-3))
    plans = {"slackswap@0.5": ss.plan(prof, "a100-80g-pcie4", 0.5)} | {f"random {s}": random_plan(prof, s) for s in (0, 1)}
    for label, plan in plans.items():
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, zoo.step, batch, ex), reference)
        assert_exact(run(model, zoo.step, batch, ex), reference)
        if label.startswith("slackswap"):
            peak = ex.stats.last_step.peak_device_bytes
            assert peak <= plan.budget_bytes
            assert peak == simulate(lower(prof, plan), Hardware.instant_copies()).peak_bytes
    assert not _debug_get_cache_entry_list(Executor._pack.__code__)
    assert not _debug_get_cache_entry_list(Executor._unpack.__code__)


@pytest.mark.slow  # (suite time: tests/runtime/test_loops.py soaks a plan that recomputes in the suite)
def test_soak_200_steps_of_a_compiled_model_under_a_plan_that_recomputes_and_swaps_leaves_memory_flat():
    """GPT-2 compiled whole (SlackSwap compiles its blocks), a random plan that swaps and recomputes
    inside the compiled blocks: after 200 steps the live tensors, the process's RSS and Dynamo's
    compile count have not grown since step 100, and the executor holds no saved byte."""
    model, batch = build("gpt2")
    model = compile_whole(without_caches(model), "aot_eager", "model.compile()")
    torch.manual_seed(1)
    prof = ss.profile_step(model, zoo.step, batch, warmup=0, timer=fake_clock(1e-3))
    inside = {a.key for a in prof.activations if prof.ops[a.saved_at].key.endswith(":compiled")}
    plan = next(p for p in (random_plan(prof, seed) for seed in range(20))
                if inside & set(p.keys(Decision.RECOMPUTE)) and inside & set(p.keys(Decision.SWAP)))
    ex = ss.apply(model, plan, prof)
    def step():
        model.zero_grad(set_to_none=True)
        zoo.step(model, batch)

    with ex:  # (the allocators settle in the first ~100 steps)
        samples = soak(step, 200, (100, 199), dynamo_compiles)
    assert ex.stats.steps == 200 and ex.stats.last_step.ops_recomputed > 0 and not ex.stats.last_step.fallbacks
    (tensors_100, rss_100, compiles_100), (tensors_199, rss_199, compiles_199) = samples
    assert tensors_199 <= tensors_100 and compiles_199 == compiles_100  # (one fewer seen: a test before's, late)
    assert rss_199 - rss_100 < 4 << 20, (rss_100 >> 20, rss_199 >> 20)
    assert ex.resident_bytes == 0

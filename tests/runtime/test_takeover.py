"""What a model brings that would fight a plan: a KV cache left on, or its own activation
checkpointing (Hugging Face's, torch.utils.checkpoint, deepspeed.checkpointing). Under SlackSwap
the cache is off and checkpoint calls run inline, logged once, and the result is the unmodified
model's bit for bit."""

import logging

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import slackswap_ds as ss
from slackswap_ds.plan import Decision
from slackswap_ds.runtime import takeover

from exactness import assert_exact, profile, random_plan, run

transformers = pytest.importorskip("transformers")

VOCAB = 128


@pytest.fixture(autouse=True)
def fresh_log_state():
    transformers.logging.set_verbosity_error()
    takeover._said.clear()  # each test sees the once-per-process lines
    yield
    takeover._said.clear()


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).train()
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).train()


def cached_step(model, ids):
    """A training step that leaves Hugging Face's default use_cache=True (and asks for it)."""
    out = model(input_ids=ids, labels=ids, use_cache=True)
    out.loss.backward()
    return out.loss


def recompute_everything(prof):
    return ss.Plan.build(prof, {a.key: Decision.RECOMPUTE if a.recomputable else Decision.SWAP
                                for a in prof.activations}, budget_bytes=0, hardware_digest="any", planner="test")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_use_cache_is_turned_off_logged_once_and_the_step_is_exact(kind, caplog):
    model = tiny(kind)
    ids = torch.randint(1, VOCAB, (2, 16))
    assert model.config.use_cache is True
    reference = run(model, cached_step, ids)  # the unmodified model, cache on
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        prof = profile(model, cached_step, ids)
        plans = [recompute_everything(prof), ss.plan(prof, "a100-80g-pcie4", 0.5)] + \
            [random_plan(prof, s) for s in range(4)]
        for plan in plans:
            ex = ss.apply(model, plan, prof)
            assert_exact(run(model, cached_step, ids, ex), reference)
            assert_exact(run(model, cached_step, ids, ex), reference)
            assert ex.stats.last_step.peak_device_bytes <= plan.budget_bytes or plan.planner != "slackswap"
            assert ex.stats.last_step.fallbacks == {} and ex.stats.demotions == []
    messages = [r.getMessage() for r in caplog.records]
    assert sum("use_cache turned off" in m for m in messages) == 1
    assert model.config.use_cache is True  # given back when SlackSwap is done


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_enable: deprecated name
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_gradient_checkpointing_is_taken_over(kind, caplog):
    plain = tiny(kind)
    model = tiny(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(1, VOCAB, (2, 16))
    reference = run(model, cached_step, ids)  # the model as its user runs it: checkpointed
    assert_exact(run(plain, cached_step, ids), reference)  # checkpointing is exact anyway
    original = tuc.CheckpointFunction, tuc._checkpoint_without_reentrant_generator
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        prof = profile(model, cached_step, ids)
        # the profile sees every activation: budgets are fractions of the real keep-all footprint
        assert prof.total_bytes == profile(plain, cached_step, ids).total_bytes
        assert sum(a.recomputable for a in prof.activations) > 3 * 5
        for plan in [ss.plan(prof, "a100-80g-pcie4", b) for b in (0.5, 0.75)] + [random_plan(prof, 0)]:
            ex = ss.apply(model, plan, prof)
            assert_exact(run(model, cached_step, ids, ex), reference)
            assert_exact(run(model, cached_step, ids, ex), reference)
            assert ex.stats.last_step.peak_device_bytes <= plan.budget_bytes
    lines = [r.getMessage() for r in caplog.records if "torch.utils.checkpoint" in r.getMessage()]
    assert len(lines) == 1 and "SlackSwap replaces activation checkpointing" in lines[0]
    assert (tuc.CheckpointFunction, tuc._checkpoint_without_reentrant_generator) == original


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class _Checkpointed(nn.Module):
    """Megatron-DeepSpeed style (deepspeed.checkpointing) and plain torch (reentrant) checkpoints."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(4)])

    def forward(self, x):
        import deepspeed

        for i, layer in enumerate(self.layers):
            if i == 1:
                x = deepspeed.checkpointing.checkpoint(layer, x)
            elif i == 2:
                x = tuc.checkpoint(layer, x, use_reentrant=True)
            else:
                x = layer(x)
        return x.pow(2).mean()


def test_checkpoint_calls_inside_the_model_run_inline(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from slackswap_ds import checkpointing

    torch.manual_seed(0)
    model = _Checkpointed().train()
    x = torch.randn(8, 16, requires_grad=True)

    def step(m, batch):
        loss = m(batch)
        loss.backward()
        return loss

    reference = run(model, step, x)
    assert len(reference[1]) == len(list(model.parameters()))
    prof = profile(model, step, x)
    assert {a.key.split(":")[0] for a in prof.activations} >= {f"layers.{i}" for i in range(4)}
    assert not checkpointing.is_installed()  # installed only while SlackSwap runs
    for seed in range(4):
        assert_exact(run(model, step, x, ss.apply(model, random_plan(prof, seed), prof)), reference)
    assert not checkpointing.is_installed() and not checkpointing.plan_active()

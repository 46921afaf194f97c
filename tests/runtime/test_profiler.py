"""profile_step on real models: keys, bytes and regeneration facts of every saved tensor."""

import pytest
import torch
from torch import nn

from slackswap_ds.planners import PLANNERS
from slackswap_ds.budget import resolve_budget
from slackswap_ds.plan import lower
from slackswap_ds.runtime.naming import is_gap
from slackswap_ds.runtime.profiler import ProfileSession, profile_step
from slackswap_ds.simulator import simulate

transformers = pytest.importorskip("transformers")


def lm_step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss


def tiny(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).train()
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return transformers.LlamaForCausalLM(cfg).train()
    cfg = transformers.BertConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=64, pad_token_id=0)
    return transformers.BertForMaskedLM(cfg).train()


def saved_storage_bytes(model, step, batch) -> int:
    """Independent count: bytes of distinct storages saved for backward, parameters and buffers
    excluded."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, batch)
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_profile_counts_every_saved_storage_once_and_no_parameters(kind):
    model = tiny(kind)
    ids = torch.randint(1, 128, (2, 16))
    profile = profile_step(model, lm_step, ids, warmup=0)
    assert profile.total_bytes == saved_storage_bytes(model, lm_step, ids)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.total_bytes > 0 and params > 0
    assert len({a.key for a in profile.activations}) == len(profile.activations)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_identical_layers_have_identical_activations(kind):
    profile = profile_step(tiny(kind), lm_step, torch.randint(1, 128, (2, 16)), warmup=0)
    layers = [r for r in profile.regions if not is_gap(r)]
    assert len(layers) == 3
    shapes = [[(a.layer_class, a.bytes, a.recomputable) for a in profile.region_acts[r]] for r in layers]
    assert shapes[1] == shapes[2]
    # the first layer also owns tensors every layer saves (Llama's rotary tables: saved first there),
    # which it cannot recompute; they shift its ordinals, so compare without the keys
    first = [s[1:] for s in shapes[0]]
    for s in shapes[1]:
        first.remove(s[1:])
    assert all(not recomputable for _, recomputable in first)
    # each layer's input hidden state is saved and cannot be recomputed inside the layer
    assert all(not profile.region_acts[r][0].recomputable for r in layers)


def test_keys_are_stable_across_steps():
    model = tiny("gpt2")
    ids = torch.randint(1, 128, (2, 16))
    first = profile_step(model, lm_step, ids, warmup=0)
    second = profile_step(model, lm_step, ids, warmup=0)
    assert [a.key for a in first.activations] == [a.key for a in second.activations]
    assert [o.key for o in first.ops] == [o.key for o in second.ops]


class Block(nn.Module):
    """h = x @ w is saved by sin (its input) and by mul (an input): one activation, two users."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = x @ self.w
        return h.sin() * h


class TwoSaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])

    def forward(self, x):
        return self.layers[0](x).sum()


def test_tensor_saved_twice_is_one_activation_with_two_users():
    model = TwoSaves()
    x = torch.randn(4, 8, requires_grad=True)
    profile = profile_step(model, lambda m, b: m(b).backward(), x, warmup=0)
    # saved in this order: x (by mm, for w's gradient), h (by sin, then again by mul), sin(h) (by mul)
    assert [a.key for a in profile.activations] == ["layers.0:0:input", "layers.0:1:mm", "layers.0:2:sin"]
    h = profile.by_key["layers.0:1:mm"]
    assert h.bytes == 4 * 8 * 4
    assert [profile.ops[u].key for u in h.users] == ["layers.0:1:sin", "layers.0:2:mul"]
    assert [profile.ops[p].key for p in h.producers] == ["layers.0:0:mm"]
    assert h.deps == ("layers.0:0:input",)  # regenerating h re-runs mm, which reads x


def test_measured_profile_can_be_planned_and_simulated(a100):
    profile = profile_step(tiny("gpt2"), lm_step, torch.randint(1, 128, (2, 16)), warmup=0)
    budget = resolve_budget(0.5, profile)
    plan = PLANNERS["slackswap"](profile, a100, budget).plan
    res = simulate(lower(profile, plan), a100, budget_bytes=budget)
    assert res.feasible and res.step_s > 0


def test_the_profiled_step_sends_every_saved_tensor_to_host():
    """The step that measures the model holds, at any time, only what backward is using (so it
    fits a budget that keep-all does not); it still measures every op and every saved byte."""
    model = tiny("gpt2")
    ids = torch.randint(1, 128, (2, 16))
    with ProfileSession(model) as session:
        lm_step(model, ids)
    profile = session.profile()
    stats = session.stats
    assert stats.swapped_bytes == profile.total_bytes == saved_storage_bytes(model, lm_step, ids)
    assert stats.kept_bytes == 0 and stats.fallbacks == {}
    assert 0 < stats.peak_device_bytes <= max(a.bytes for a in profile.activations) * 4
    assert int(dict(profile.meta)["profiled_peak_bytes"]) == stats.peak_device_bytes
    assert all(o.fwd_s > 0 for o in profile.ops) and sum(o.bwd_s for o in profile.ops) > 0


def test_gradient_accumulation_profiles_one_micro_step():
    model = tiny("gpt2")
    ids = torch.randint(1, 128, (2, 16))

    def accumulate(m, batch):
        for _ in range(3):
            loss = lm_step(m, batch)
        return loss

    assert profile_step(model, accumulate, ids, warmup=0).structure_digest == \
        profile_step(model, lm_step, ids, warmup=0).structure_digest

"""Hugging Face config.json -> ModelSpec: real configs (tests/data/hf_configs, copied from the Hub), bytes equal
to the presets of the same shape, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slackswap_ds.errors import InvalidFileError, ProfileError
from slackswap_ds.hardware import load_hardware
from slackswap_ds.model_config import SUPPORTED_FAMILIES, spec_from_hf_config
from slackswap_ds.workloads import transformer_profile, workload

HW = load_hardware("a100-80g-pcie4")
CONFIGS = Path(__file__).parent / "data" / "hf_configs"
GPT2_XL = CONFIGS / "gpt2-xl.json"
BERT_LARGE = CONFIGS / "bert-large-uncased.json"
LLAMA2_7B = CONFIGS / "Llama-2-7b-hf.json"
MISTRAL_7B = CONFIGS / "Mistral-7B-v0.1.json"
QWEN2_7B = CONFIGS / "Qwen2-7B.json"
MIXTRAL = CONFIGS / "Mixtral-8x7B-v0.1.json"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- each family parses to the config's values ----------------------------------------------------
# (file, layers, hidden, heads, kv_heads, ffn, vocab, ffn_kind, norm, placement, dropout, flash, rope)
EXPECTED = [
    (GPT2_XL, 48, 1600, 25, 25, 6400, 50257, "gelu", "layernorm", "pre", 0.1, False, False),
    (BERT_LARGE, 24, 1024, 16, 16, 4096, 30522, "gelu", "layernorm", "post", 0.1, False, False),
    (LLAMA2_7B, 32, 4096, 32, 32, 11008, 32000, "swiglu", "rmsnorm", "pre", 0.0, True, True),
    (MISTRAL_7B, 32, 4096, 32, 8, 14336, 32000, "swiglu", "rmsnorm", "pre", 0.0, True, True),
    (QWEN2_7B, 28, 3584, 28, 4, 18944, 152064, "swiglu", "rmsnorm", "pre", 0.0, True, True),
    (MIXTRAL, 32, 4096, 32, 8, 14336, 32000, "swiglu", "rmsnorm", "pre", 0.0, True, True),
]


@pytest.mark.parametrize("row", EXPECTED, ids=lambda row: row[0].stem)
def test_each_family_parses_to_the_config_values(row):
    path, layers, hidden, heads, kv, ffn, vocab, kind, norm, placement, dropout, flash, rope = row
    spec = spec_from_hf_config(path, seq=512, micro_batch=2)
    got = (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.ffn_kind, spec.norm,
           spec.norm_placement, spec.dropout, spec.flash, spec.rope)
    assert got == (layers, hidden, heads, kv, ffn, vocab, kind, norm, placement, dropout, flash, rope)
    assert (spec.seq, spec.micro_batch, spec.dtype_bytes) == (512, 2, 2)
    assert spec.source.startswith(f"Hugging Face config {path.name} ")
    assert "read: " in spec.source


def test_transformers_reads_the_same_dims():
    """The fixtures mean to transformers what they mean here (skipped where transformers is absent)."""
    transformers = pytest.importorskip("transformers")
    for path, layers, hidden, heads, kv, ffn, vocab, *_ in EXPECTED:
        cfg = load(path)
        hf = transformers.AutoConfig.for_model(**cfg)
        hf_ffn = (hf.n_inner or 4 * hf.n_embd) if cfg["model_type"] == "gpt2" else hf.intermediate_size
        hf_kv = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
        assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf_kv, hf_ffn, hf.vocab_size) == (
            layers, hidden, heads, kv, ffn, vocab), path.name


def test_name_and_source():
    assert spec_from_hf_config(LLAMA2_7B, seq=2048, micro_batch=1).name == "meta-llama/Llama-2-7b-hf"
    assert spec_from_hf_config(GPT2_XL, seq=1024, micro_batch=1).name == "gpt2"  # no _name_or_path
    assert spec_from_hf_config(GPT2_XL, seq=1024, micro_batch=1, name="xl").name == "xl"
    src = spec_from_hf_config(GPT2_XL, seq=1024, micro_batch=1).source
    for field in ("n_layer=48", "n_embd=1600", "n_head=25", "n_inner=None (4*n_embd)", "resid_pdrop=0.1",
                  "n_positions=1024", "vocab_size=50257"):
        assert field in src
    assert "sliding_window=4096 (not modelled" in spec_from_hf_config(MISTRAL_7B, seq=8192, micro_batch=1).source
    assert "sliding_window" not in spec_from_hf_config(QWEN2_7B, seq=8192, micro_batch=1).source  # switched off


def test_dict_and_directory_inputs(tmp_path):
    from_dict = spec_from_hf_config(load(BERT_LARGE), seq=128, micro_batch=1)
    from_file = spec_from_hf_config(BERT_LARGE, seq=128, micro_batch=1)
    assert from_dict == dataclasses.replace(from_file, source=from_dict.source)
    assert from_dict.source.startswith("Hugging Face config a config dict ")
    (tmp_path / "config.json").write_text(BERT_LARGE.read_text())
    assert spec_from_hf_config(tmp_path, seq=128, micro_batch=1).layers == 24
    assert spec_from_hf_config(str(BERT_LARGE), seq=128, micro_batch=1).hidden == 1024


def test_overrides_reach_the_spec():
    spec = spec_from_hf_config(GPT2_XL, seq=256, micro_batch=3, dtype_bytes=4, flash=True)
    assert (spec.seq, spec.micro_batch, spec.dtype_bytes, spec.flash) == (256, 3, 4, True)
    assert spec_from_hf_config(LLAMA2_7B, seq=256, micro_batch=1, flash=False).flash is False


def test_missing_kv_heads_and_n_inner_take_transformers_defaults():
    cfg = load(LLAMA2_7B)
    del cfg["num_key_value_heads"]
    assert spec_from_hf_config(cfg, seq=64, micro_batch=1).kv_heads == 32
    cfg = {**load(GPT2_XL), "n_inner": 5000}
    assert spec_from_hf_config(cfg, seq=64, micro_batch=1).ffn == 5000


# ---- bytes equal the preset of the same shape ------------------------------------------------------
@pytest.mark.parametrize("path,preset,seq,micro_batch", [
    (GPT2_XL, "gpt2-xl", 1024, 16),
    (BERT_LARGE, "bert-large", 512, 16),
    (LLAMA2_7B, "llama-7b", 2048, 6),
], ids=["gpt2-xl", "bert-large", "llama-7b"])
def test_profile_equals_the_preset(path, preset, seq, micro_batch):
    got = transformer_profile(spec_from_hf_config(path, seq=seq, micro_batch=micro_batch), HW)
    want = workload(preset, HW)
    assert got.total_bytes == want.total_bytes
    assert [o.key for o in got.ops] == [o.key for o in want.ops]
    assert [(a.key, a.bytes) for a in got.activations] == [(a.key, a.bytes) for a in want.activations]


def test_mixtral_experts():
    spec = spec_from_hf_config(MIXTRAL, seq=4096, micro_batch=1)
    assert (spec.experts, spec.experts_per_token, spec.kv_heads) == (8, 2, 8)
    dense = spec_from_hf_config(MISTRAL_7B, seq=4096, micro_batch=1)
    assert (dense.experts, dense.experts_per_token) == (1, 1)
    # Mixtral is Mistral's attention with a routed MLP: its profile has the dense model's attention
    # tensors and, per layer, a router and two experts' MLP tensors for every token
    moe, mistral = (transformer_profile(dataclasses.replace(x, layers=1), HW) for x in (spec, dense))
    attn = lambda p: [(a.key, a.bytes) for a in p.activations if ".attn:" in a.key]  # noqa: E731
    assert attn(moe) == attn(mistral)
    b, s, f = 1, 4096, spec.ffn
    assert moe.by_key["layers.0.mlp:gate.out"].bytes == 2 * b * s * f * 2  # two experts per token, 16-bit
    assert any(o.key.endswith(":router") for o in moe.ops)


# ---- errors --------------------------------------------------------------------------------------
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("model_type", ["t5", None])
def test_unknown_or_missing_model_type_lists_the_families(tmp_path, model_type):
    cfg = load(LLAMA2_7B)
    if model_type is None:
        del cfg["model_type"]
    else:
        cfg["model_type"] = model_type
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ProfileError) as exc:
        spec_from_hf_config(path, seq=128, micro_batch=1)
    msg = one_line(exc)
    assert str(path) in msg
    assert ("'t5'" if model_type else "no model_type") in msg
    for family in SUPPORTED_FAMILIES:
        assert family in msg


def test_missing_keys_are_all_named():
    cfg = load(MIXTRAL)
    for key in ("hidden_size", "vocab_size", "num_local_experts"):
        del cfg[key]
    cfg["intermediate_size"] = None
    with pytest.raises(ProfileError) as exc:
        spec_from_hf_config(cfg, seq=128, micro_batch=1)
    msg = one_line(exc)
    for key in ("hidden_size", "vocab_size", "num_local_experts", "intermediate_size"):
        assert key in msg
    assert "num_attention_heads" not in msg


def test_seq_longer_than_the_positions():
    spec_from_hf_config(BERT_LARGE, seq=512, micro_batch=1)
    with pytest.raises(ProfileError, match=r"seq 513 exceeds the model's maximum positions \(512\)") as exc:
        spec_from_hf_config(BERT_LARGE, seq=513, micro_batch=1)
    assert "bert-large-uncased.json" in one_line(exc)
    with pytest.raises(ProfileError, match=r"maximum positions \(1024\)"):
        spec_from_hf_config(GPT2_XL, seq=2048, micro_batch=1)


@pytest.mark.parametrize("seq,micro_batch", [(0, 1), (128, -1), (128.0, 1), (True, 1), (128, "2")])
def test_seq_and_micro_batch_must_be_positive_ints(seq, micro_batch):
    with pytest.raises(ProfileError, match="must be a positive integer"):
        spec_from_hf_config(GPT2_XL, seq=seq, micro_batch=micro_batch)


@pytest.mark.parametrize("text,what", [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_bad_json(tmp_path, text, what):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(InvalidFileError, match=what) as exc:
        spec_from_hf_config(path, seq=128, micro_batch=1)
    assert "broken.json" in one_line(exc)
    with pytest.raises(InvalidFileError, match="cannot read"):
        spec_from_hf_config(tmp_path / "absent.json", seq=128, micro_batch=1)


def test_gpt2_with_differing_dropouts():
    with pytest.raises(ProfileError, match="one dropout probability") as exc:
        spec_from_hf_config({**load(GPT2_XL), "attn_pdrop": 0.0}, seq=128, micro_batch=1)
    assert "attn_pdrop=0.0" in one_line(exc)
    with pytest.raises(ProfileError, match="one dropout probability"):
        spec_from_hf_config({**load(BERT_LARGE), "hidden_dropout_prob": 0.2}, seq=128, micro_batch=1)
    assert spec_from_hf_config({**load(GPT2_XL), "attn_pdrop": 0, "resid_pdrop": 0, "embd_pdrop": 0.0},
                               seq=128, micro_batch=1).dropout == 0


def test_activation_functions():
    with pytest.raises(ProfileError, match="hidden_act must be 'silu'.*'gelu'"):
        spec_from_hf_config({**load(LLAMA2_7B), "hidden_act": "gelu"}, seq=128, micro_batch=1)
    with pytest.raises(ProfileError, match="hidden_act must be a GeLU variant.*'relu'"):
        spec_from_hf_config({**load(BERT_LARGE), "hidden_act": "relu"}, seq=128, micro_batch=1)
    with pytest.raises(ProfileError, match="activation_function must be a GeLU variant"):
        spec_from_hf_config({**load(GPT2_XL), "activation_function": "relu"}, seq=128, micro_batch=1)
    assert spec_from_hf_config({**load(BERT_LARGE), "hidden_act": "gelu_new"}, seq=128, micro_batch=1).ffn == 4096


def test_unmodelled_llama_variants_are_rejected():
    with pytest.raises(ProfileError, match="head_dim 256 differs"):
        spec_from_hf_config({**load(MISTRAL_7B), "head_dim": 256}, seq=128, micro_batch=1)
    assert spec_from_hf_config({**load(MISTRAL_7B), "head_dim": 128}, seq=128, micro_batch=1).head_dim == 128
    with pytest.raises(ProfileError, match="attention_dropout 0.1 is not modelled"):
        spec_from_hf_config({**load(QWEN2_7B), "attention_dropout": 0.1}, seq=128, micro_batch=1)
    with pytest.raises(ProfileError, match="position_embedding_type 'relative_key'"):
        spec_from_hf_config({**load(BERT_LARGE), "position_embedding_type": "relative_key"}, seq=128, micro_batch=1)


def test_bad_values_name_the_key_and_the_file():
    with pytest.raises(ProfileError, match=r"hf config \(dict\): hidden_size must be a positive integer, got '4096'"):
        spec_from_hf_config({**load(LLAMA2_7B), "hidden_size": "4096"}, seq=128, micro_batch=1)
    with pytest.raises(ProfileError, match=r"hf config \(dict\): invalid model spec.*divisible by heads"):
        spec_from_hf_config({**load(LLAMA2_7B), "num_attention_heads": 30}, seq=128, micro_batch=1)
    with pytest.raises(ProfileError, match="experts_per_token"):
        spec_from_hf_config({**load(MIXTRAL), "num_experts_per_tok": 9}, seq=128, micro_batch=1)
    with pytest.raises(ProfileError, match="dtype_bytes"):
        spec_from_hf_config(GPT2_XL, seq=128, micro_batch=1, dtype_bytes=3)

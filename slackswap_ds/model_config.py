"""A Hugging Face ``config.json`` turned into a `ModelSpec` (standard library only; no transformers import).

`spec_from_hf_config` reads the model's dims from the config and takes what a config does not hold (sequence
length, micro-batch, activation dtype, fused attention or not) from the caller. Supported ``model_type`` values
are `SUPPORTED_FAMILIES`:

* ``gpt2``: pre-LayerNorm, GeLU MLP (``n_inner``, or ``4·n_embd`` when absent/null), learned positions.
* ``bert``: post-LayerNorm, GeLU MLP (``hidden_act`` must be a GeLU variant), absolute positions only.
* ``llama``, ``mistral``, ``qwen2``: pre-RMSNorm, SwiGLU MLP (``hidden_act`` must be ``silu``), RoPE, grouped-query
  attention (``num_key_value_heads``, the head count when absent/null, as transformers does).
* ``mixtral``: as llama, with ``num_local_experts`` experts per layer, ``num_experts_per_tok`` per token.

What is not modelled, and what that means for the bytes
-------------------------------------------------------
* Dropout: `ModelSpec` has one probability, applied to the embeddings, the attention probabilities and every
  residual branch. GPT-2 (``resid/embd/attn_pdrop``) and BERT (``hidden_dropout_prob``,
  ``attention_probs_dropout_prob``) map exactly only when their probabilities agree, so differing ones are an
  error. The Llama-style families have only ``attention_dropout``, no embedding or residual dropout, so a
  non-zero one is an error too: it cannot be expressed without inventing residual dropout masks.
* Sliding-window attention (Mistral ``sliding_window``, Qwen2 ``use_sliding_window``) is treated as full causal
  attention. Saved bytes do not change: a fused kernel saves q, k, v, the output and the log-sum-exp whatever
  the window, and HF's eager path applies the window as a mask over a full s x s score tensor. Only the
  attention FLOPs (so the op times) are over-counted, and only when ``seq`` exceeds the window.
* Attention/MLP biases (Qwen2's qkv bias), RoPE scaling and norm epsilons do not change the bytes saved for
  backward and are ignored; tied embeddings (``tie_word_embeddings``) only count the model's parameters once.
  A ``head_dim`` other than ``hidden_size / num_attention_heads`` changes every attention tensor and is rejected.
* The head is the workload model's (final norm, LM head over the vocabulary, cross-entropy): BERT's MLM
  transform and NSP heads are not modelled (as for the ``bert-large`` preset).
* ``qwen3`` (per-head q/k RMSNorm, an explicit head_dim) and ``roberta`` (``max_position_embeddings`` counts
  padding offsets) do not map exactly and are not supported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import InvalidFileError, ProfileError
from .files import JSON_ERRORS, json_problem
from .workloads import ModelSpec

SUPPORTED_FAMILIES = ("gpt2", "bert", "llama", "mistral", "qwen2", "mixtral")
_LLAMA_STYLE = ("llama", "mistral", "qwen2", "mixtral")
_BERT_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
              "max_position_embeddings")
# Keys without which there is no shape: transformers would fill them from its class defaults (a 4096-wide model,
# say), which silently describes another model, so they are required here.
_REQUIRED = {
    "gpt2": ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"),
    "bert": _BERT_KEYS,
    "llama": _BERT_KEYS,
    "mistral": _BERT_KEYS,
    "qwen2": _BERT_KEYS,
    "mixtral": _BERT_KEYS + ("num_local_experts", "num_experts_per_tok"),
}


class _Reader:
    """One parsed config: typed reads that remember each key read (for `ModelSpec.source`)."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where, self.read = cfg, where, []

    def error(self, msg: str) -> ProfileError:
        return ProfileError(f"{self.where}: {msg}")

    def posint(self, key: str) -> int:
        v = self.cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise self.error(f"{key} must be a positive integer, got {v!r}")
        self.read.append(f"{key}={v}")
        return v

    def opt(self, key: str, default: Any) -> Any:
        """`key`, or transformers' class default when it is absent or null."""
        v = self.cfg.get(key)
        if v is None:
            self.read.append(f"{key}={default!r} (absent: HF default)")
            return default
        self.read.append(f"{key}={v!r}")
        return v

    def dropout(self, keys: tuple[str, ...], default: float) -> float:
        probs = {k: self.opt(k, default) for k in keys}
        if len(set(probs.values())) > 1:
            raise self.error("the model has one dropout probability (embeddings, attention and residual alike); "
                             f"this config's differ: {', '.join(f'{k}={v!r}' for k, v in probs.items())}")
        return probs[keys[0]]


def _gpt2(r: _Reader) -> dict[str, Any]:
    hidden, heads = r.posint("n_embd"), r.posint("n_head")
    if r.cfg.get("n_inner") is None:  # transformers: n_inner None -> 4 * n_embd
        r.read.append("n_inner=None (4*n_embd)")
        ffn = 4 * hidden
    else:
        ffn = r.posint("n_inner")
    act = r.opt("activation_function", "gelu_new")
    if not str(act).startswith("gelu"):
        raise r.error(f"activation_function must be a GeLU variant (the model's MLP is GeLU), got {act!r}")
    return dict(layers=r.posint("n_layer"), hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, ffn_kind="gelu",
                norm="layernorm", norm_placement="pre", vocab=r.posint("vocab_size"),
                dropout=r.dropout(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.1), max_pos=r.posint("n_positions"))


def _bert(r: _Reader) -> dict[str, Any]:
    heads = r.posint("num_attention_heads")
    act = r.opt("hidden_act", "gelu")
    if not str(act).startswith("gelu"):
        raise r.error(f"hidden_act must be a GeLU variant (the model's MLP is GeLU), got {act!r}")
    pos = r.cfg.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise r.error(f"position_embedding_type {pos!r} is not modelled (only 'absolute')")
    return dict(layers=r.posint("num_hidden_layers"), hidden=r.posint("hidden_size"), heads=heads, kv_heads=heads,
                ffn=r.posint("intermediate_size"), ffn_kind="gelu", norm="layernorm", norm_placement="post",
                vocab=r.posint("vocab_size"),
                dropout=r.dropout(("hidden_dropout_prob", "attention_probs_dropout_prob"), 0.1),
                max_pos=r.posint("max_position_embeddings"))


def _llama(r: _Reader) -> dict[str, Any]:
    hidden, heads = r.posint("hidden_size"), r.posint("num_attention_heads")
    kv_heads = heads if r.cfg.get("num_key_value_heads") is None else r.posint("num_key_value_heads")
    head_dim = r.cfg.get("head_dim")
    if head_dim is not None and (hidden % heads or head_dim != hidden // heads):
        raise r.error(f"head_dim {head_dim!r} differs from hidden_size / num_attention_heads ({hidden}/{heads}); "
                      "a separate head dimension is not modelled")
    act = r.opt("hidden_act", "silu")
    if act != "silu":
        raise r.error(f"hidden_act must be 'silu' (the model's gated MLP is SwiGLU), got {act!r}")
    p = r.opt("attention_dropout", 0.0)
    if p:
        raise r.error(f"attention_dropout {p!r} is not modelled: the model's one dropout probability would also "
                      "add embedding and residual dropout, which this family does not have")
    spec = dict(layers=r.posint("num_hidden_layers"), hidden=hidden, heads=heads, kv_heads=kv_heads,
                ffn=r.posint("intermediate_size"), ffn_kind="swiglu", norm="rmsnorm", norm_placement="pre",
                vocab=r.posint("vocab_size"), dropout=0.0, rope=True, max_pos=r.posint("max_position_embeddings"))
    family = r.cfg["model_type"]
    if family == "mixtral":
        spec.update(experts=r.posint("num_local_experts"), experts_per_token=r.posint("num_experts_per_tok"))
    # Qwen2 switches its window on with use_sliding_window (default False); Mistral/Mixtral use it when set
    window = r.cfg.get("sliding_window") if r.cfg.get("use_sliding_window", family != "qwen2") else None
    if window is not None:
        r.read.append(f"sliding_window={window!r} (not modelled: full causal attention)")
    return spec


_MAPPERS = {"gpt2": _gpt2, "bert": _bert, **{f: _llama for f in _LLAMA_STYLE}}


def _load(config: str | os.PathLike | dict) -> tuple[dict[str, Any], str, str]:
    """(parsed config, 'hf config <where>' for messages, file name for `source`)."""
    if isinstance(config, dict):
        return config, "hf config (dict)", "a config dict"
    path = Path(config)
    if path.is_dir():  # a model directory: its config.json
        path = path / "config.json"
    where = f"hf config {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidFileError(f"{where}: cannot read it ({e})") from None
    try:
        cfg = json.loads(text)
    except JSON_ERRORS as e:
        raise InvalidFileError(f"{where}: {json_problem(e)}") from None
    if not isinstance(cfg, dict):
        raise InvalidFileError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, where, path.name


def spec_from_hf_config(config: str | os.PathLike | dict, *, seq: int, micro_batch: int, name: str | None = None,
                        dtype_bytes: int = 2, flash: bool | None = None) -> ModelSpec:
    """The `ModelSpec` of a Hugging Face ``config.json`` (a path, a model directory, or a parsed dict) trained at
    `seq` tokens x `micro_batch` sequences per GPU with `dtype_bytes`-byte activations.

    `flash` defaults by family. True for llama/mistral/qwen2/mixtral: they have no attention dropout and are
    trained with fused kernels (SDPA or FlashAttention-2) that save only the log-sum-exp. False for gpt2/bert:
    their original implementations (HF's eager attention path, the one the ``gpt2-xl``/``bert-large`` presets
    model) materialise the s x s scores, probabilities and attention-dropout mask. Recent transformers releases
    also run GPT-2/BERT through SDPA by default: pass ``flash=True`` to model such a run.
    `name` defaults to the config's ``_name_or_path``, else its ``model_type``.
    """
    cfg, where, fname = _load(config)
    for arg, v in (("seq", seq), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ProfileError(f"{where}: {arg} must be a positive integer, got {v!r}")
    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        what = "no model_type" if family is None else f"unsupported model_type {family!r}"
        raise ProfileError(f"{where}: {what}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    missing = [k for k in _REQUIRED[family] if cfg.get(k) is None]
    if missing:
        raise ProfileError(f"{where}: {family} config is missing required key(s): {', '.join(missing)}")
    r = _Reader(cfg, where)
    fields = _MAPPERS[family](r)
    fields["tied_embeddings"] = bool(r.opt("tie_word_embeddings", True))  # (transformers' default: tied)
    fields["causal"] = family != "bert"  # decoders mask the future; BERT's encoder attends both ways
    max_pos = fields.pop("max_pos")
    if seq > max_pos:
        raise ProfileError(f"{where}: seq {seq} exceeds the model's maximum positions ({max_pos})")
    if flash is None:
        flash = family in _LLAMA_STYLE
    if name is None:
        name = cfg.get("_name_or_path") or family
    source = f"Hugging Face config {fname} (model_type {family}); read: {', '.join(r.read)}"
    try:
        return ModelSpec(name=name, seq=seq, micro_batch=micro_batch, dtype_bytes=dtype_bytes, flash=flash,
                         source=source, **fields)
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from None

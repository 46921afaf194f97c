"""Analytic per-op profiles of one transformer training step (BERT-Large, GPT-2 XL, Llama-style).

A `ModelSpec` (dims, sequence length, micro-batch, dtype, attention kind) plus a `Hardware` gives a
`StepProfile`: every forward op with its forward/backward time, and every tensor saved for backward
with its exact byte count, the op(s) whose backward read it (`users`), the op(s) whose forward would
regenerate it (`producers`) and the saved tensors those producers need (`deps`).

Modules: `spec` (`ModelSpec`, `Parallel`), `presets` (the preset files in ``configs/workloads/``,
each with its sources), `builder` (op costs, the timing model, embedding and head), `layer` (one
transformer layer block by block, and the saved-bytes rules).

Regions and keys
----------------
``embed`` (embedding gather [+ LayerNorm for post-LN models] [+ dropout]), ``layers.<l>`` for each
layer, ``head`` (final norm, LM head over the full vocabulary, cross-entropy). Op keys are
``<module>:<index in module>:<name>``, e.g. ``layers.3.attn:1:qkv``, ``layers.3.mlp:2:gelu``,
``head:1:lm_head``; activation keys are ``<module>:<tensor>``, e.g. ``layers.3.attn:softmax.out``, so
`Activation.layer_class` groups the same tensor of identical layers.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..errors import ProfileError
from ..hardware import Hardware, load_hardware
from ..step_profile import Activation, Op, StepProfile, packed_size
from .builder import MASK_BYTES, MASK_SUFFIX, CostBuilder, add_embedding, add_head
from .layer import add_layer
from .presets import load_workload_file, preset_spec, presets, workload_names, workloads_dir
from .spec import FFN_KINDS, NORM_PLACEMENTS, NORMS, ModelSpec, Parallel

__all__ = ["FFN_KINDS", "MAX_SAVED_BYTES", "NORMS", "NORM_PLACEMENTS", "PRESETS", "ModelSpec", "Parallel",
           "build_costs", "layer_activation_bytes", "layer_forward_flops", "load_workload_file", "model_params",
           "preset_spec", "presets", "region_params", "transformer_profile", "workload", "workload_names",
           "workloads_dir"]

# the saved activations one micro-batch of a profile may hold: 2^50 B (1 PiB, some 14,000 GPUs of 80 GB).
# Above it a mistyped seq or micro-batch is likelier than a model; and the planners count bytes in
# 64-bit integers, which a stage holding up to 4096 such micro-batches (2^62 B) still fits
MAX_SAVED_BYTES = 2**50


def __getattr__(name: str) -> Mapping[str, ModelSpec]:
    # PRESETS is read from the preset files on first use, not at import: a malformed file is then an
    # error of the command that reads it, and $SLACKSWAP_WORKLOADS_DIR may be set after the import.
    if name == "PRESETS":
        return presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def workload(name: str, hardware: Hardware | str, parallel: Parallel | None = None, **overrides) -> StepProfile:
    """The analytic profile of preset `name` on `hardware` (one rank of a `parallel` cut, if given);
    `overrides` replace ModelSpec fields (`preset_spec`)."""
    spec = preset_spec(name, **overrides)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    return transformer_profile(spec, hw, parallel or Parallel())


def build_costs(spec: ModelSpec, par: Parallel, layers: Iterable[int] | None = None, embed: bool = True,
                head: bool = True) -> CostBuilder:
    """The op costs and saved tensors of one step (or of a pipeline stage's part of it), in forward order."""
    par.check(spec)
    builder = CostBuilder(spec, par)
    if embed:
        add_embedding(builder)
    for layer in range(spec.layers) if layers is None else layers:
        add_layer(builder, layer)
    if head:
        add_head(builder)
    return builder


# ---- public entry points -----------------------------------------------------------------------
def transformer_profile(spec: ModelSpec, hw: Hardware, par: Parallel = Parallel(), *,
                        layers: Iterable[int] | None = None, embed: bool = True, head: bool = True,
                        name: str | None = None) -> StepProfile:
    """The analytic `StepProfile` of one training step of `spec` on `hw`, on one rank of a `par`
    cut (see the module docstring); `layers`, `embed`, `head` select a pipeline stage's part."""
    builder = build_costs(spec, par, layers, embed, head)
    index = {c.key: i for i, c in enumerate(builder.costs)}
    ops = []
    try:
        for c in builder.costs:
            fwd, bwd = c.times(hw, par.tp)
            ops.append(Op(c.key, fwd, bwd, c.region))
    except ValueError as e:
        raise ProfileError(str(e)) from None
    acts = [
        Activation(
            a.key,
            a.bytes,
            tuple(sorted(index[u] for u in a.users)),
            tuple(sorted(index[p] for p in a.producers)),
            a.deps,
            **mask_packing(a.key, a.bytes, hw),
        )
        for a in builder.saved
    ]
    saved = sum(a.bytes for a in acts)
    if saved > MAX_SAVED_BYTES:
        raise ProfileError(f"{spec.name}: one micro-batch of seq {spec.seq} x micro-batch {spec.micro_batch} saves "
                           f"{saved:,} B of activations for backward, over the simulator's limit of "
                           f"{MAX_SAVED_BYTES:,} B (2^50 B, 1 PiB: some 14,000 GPUs of 80 GB); is the sequence "
                           f"length or the micro-batch mistyped?")
    meta = {"source": "analytic", "hardware": hw.name, "hardware_digest": hw.digest, **spec.to_meta(),
            **par.to_meta()}
    return StepProfile(name=name or spec.name, ops=tuple(ops), activations=tuple(acts), meta=tuple(meta.items()))


def mask_packing(key: str, nbytes: int, hw: Hardware) -> dict:
    """A dropout mask is packable (PACK, docs/packing.md): CUDA's `native_dropout` saves it as
    `bool`, which the runtime's profiler marks two-valued by its dtype (runtime/tracing.py) and
    packs to a bit per element. Its packing and unpacking kernels are memory-bound, each way at
    the preset's elementwise rate (`Hardware.elementwise_s`) over the bytes read and written."""
    if not key.endswith(MASK_SUFFIX):
        return {}
    packed = packed_size(nbytes, MASK_BYTES)
    if packed >= nbytes:
        return {}  # (a mask of a few elements: its two patterns alone are as large)
    return {"packed_bytes": packed, "pack_s": hw.elementwise_s(nbytes + packed)}


def layer_forward_flops(spec: ModelSpec, par: Parallel = Parallel()) -> float:
    """Matmul FLOPs of one layer's forward on one rank, summed over the same op list that is timed."""
    return float(sum(c.flops for c in build_costs(spec, par, layers=[0], embed=False, head=False).costs))


def layer_activation_bytes(spec: ModelSpec, par: Parallel = Parallel()) -> int:
    """Bytes saved for backward by one layer region on one rank (its input included)."""
    return sum(a.bytes for a in build_costs(spec, par, layers=[0], embed=False, head=False).saved)


def model_params(spec: ModelSpec, par: Parallel = Parallel()) -> int:
    """Weight elements of the whole model on one rank of a `par` cut (`region_params` of every
    region, a tied embedding table counted once)."""
    total = sum(region_params(spec, par).values())
    return total - spec.vocab * spec.hidden // par.tp if spec.tied_embeddings else total


def region_params(spec: ModelSpec, par: Parallel = Parallel(), *, layers: Iterable[int] | None = None,
                  embed: bool = True, head: bool = True) -> dict[str, int]:
    """Weight elements each region owns on one rank of a `par` cut (matmul weights and the embedding
    table; norm and bias vectors are left out: < 0.1% of a transformer's parameters). A model with
    tied embeddings counts the table in both the embedding and the LM head, as a pipeline does."""
    out: dict[str, int] = {}
    for c in build_costs(spec, par, layers, embed, head).costs:
        out[c.region] = out.get(c.region, 0) + int(c.params)
    return out

"""Analytic per-op profiles of one transformer training step (BERT-Large, GPT-2 XL, Llama-style).

A `ModelSpec` (dims, sequence length, micro-batch, dtype, attention kind) plus a `Hardware` gives a
`StepProfile`: every forward op with its forward/backward time, and every tensor saved for backward
with its exact byte count, the op(s) whose backward read it (`users`), the op(s) whose forward would
regenerate it (`producers`) and the saved tensors those producers need (`deps`).

Regions and keys
----------------
``embed`` (embedding gather [+ LayerNorm for post-LN models] [+ dropout]), ``layers.<l>`` for each
layer, ``head`` (final norm, LM head over the full vocabulary, cross-entropy). Op keys are
``<module>:<index in module>:<name>``, e.g. ``layers.3.attn:1:qkv``, ``layers.3.mlp:2:gelu``,
``head:1:lm_head``; activation keys are ``<module>:<tensor>``, e.g. ``layers.3.attn:softmax.out``, so
`Activation.layer_class` groups the same tensor of identical layers.

Timing model (a roofline; every constant comes from the `Hardware` preset)
------------------------------------------------------------------------
* Matmul ops (linear layers, QK^T, probs·V, LM head): one GEMM call each, forward time =
  ``max(flops / hw.gemm_rate(flops), bytes / hw.hbm_bps)``, the rate read off the preset's measured
  GEMM curve (small GEMMs do not fill the GPU) and ``bytes`` = the input, weight (or second operand)
  and output, each read or written once. Backward runs two GEMMs of the same size (input and weight
  gradients): 2x the forward FLOPs and bytes, 2x the time.
* FlashAttention: one fused kernel each way, at the preset's measured attention speed
  (``hw.attention_s``). Forward FLOPs ``4·b·s²·h`` (QK^T and P·V), bytes = q, k, v, output and the
  fp32 log-sum-exp; backward ``2.5x`` the forward FLOPs (it recomputes the scores) and reads q, k,
  v, o, dO, lse and writes dq, dk, dv.
* Causal masking is counted as no FLOP saving (full ``s²`` scores), for flash and non-flash alike.
* Elementwise, normalisation, softmax, dropout, RoPE, embedding and cross-entropy ops are HBM-bound:
  time = bytes read + written / ``hw.hbm_bps``, forward and backward each with its own byte count
  (e.g. softmax forward reads x and writes y; backward reads y and dy and writes dx). A residual add's
  backward is charged the gradient sum at the residual fork (read 2, write 1).
* Tensor parallelism (`Parallel`): collectives are ops of their own on the compute stream (Megatron
  runs them synchronously), timed by ``hw.collective_s`` from the preset's measured NCCL bus
  bandwidth; see `Parallel` for which run where.
* Mixture of experts (``experts`` > 1): a router matmul, softmax + top-k, a dispatch copy of each
  token to its ``experts_per_token`` experts, the experts' MLPs on the routed copies (every expert's
  weights read once) and a weighted combine.
* Parameter reads of norms and biases, the optimizer step and data-parallel communication are not
  modelled here (the step is one rank's forward and backward of one micro-batch).

Saved bytes (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models")
------------------------------------------------------------------------------------------------
Activations are ``dtype_bytes`` per element, dropout masks 1 byte, log-sum-exp / RMSNorm rstd /
log-softmax fp32. For a GPT/BERT layer (LayerNorm, GeLU MLP with ffn = 4h, dropout > 0, no flash,
dtype 2) one layer saves exactly ``s·b·h·(34 + 5·a·s/h)`` bytes: LayerNorm mean/rstd (fp32, b·s
each) are ignored as in the paper. FlashAttention replaces the ``5·a·s²·b`` attention-core bytes by the
fp32 log-sum-exp ``4·b·a·s`` (its dropout, if any, is regenerated from the RNG state in-kernel).
RMSNorm saves its input and an fp32 rstd (4·b·s); its output is saved once, as the next matmul's
input. A tensor saved by two ops is one `Activation` with two users.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from .errors import ProfileError, UnknownNameError
from .hardware import Hardware, load_hardware
from .profile import Activation, Op, StepProfile

FFN_KINDS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
_MASK_BYTES = 1  # dropout masks: one byte per element (torch.bool)
_FP32 = 4  # log-sum-exp, RMSNorm rstd, log-softmax


@dataclass(frozen=True)
class ModelSpec:
    """One transformer training configuration: model dims plus the per-GPU micro-batch shape."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    ffn_kind: str  # "gelu" (fc1 -> GeLU -> fc2) | "swiglu" (down(silu(gate(x)) * up(x)))
    norm: str  # "layernorm" | "rmsnorm"
    norm_placement: str  # "pre" (GPT, Llama) | "post" (BERT: LayerNorm after each residual add)
    dropout: float  # probability; 0 = no dropout ops and no masks
    vocab: int
    seq: int
    micro_batch: int
    dtype_bytes: int  # 2 for bf16/fp16 activations, 4 for fp32
    flash: bool  # fused FlashAttention core (no s² tensors saved)
    source: str  # where the dims, seq and micro-batch come from
    rope: bool = False  # rotary position embedding applied to q and k (Llama)
    experts: int = 1  # mixture of experts: MLPs per layer (1 = a dense MLP)
    experts_per_token: int = 1  # MLPs each token is routed to (Mixtral: 2 of 8)

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.name, str) or not self.name.strip():
            problems.append(f"name must be a non-empty string, got {self.name!r}")
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch", "experts",
                  "experts_per_token"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{f} must be a positive integer, got {v!r}")
        if not problems:
            if self.hidden % self.heads:
                problems.append(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
            if self.heads % self.kv_heads:
                problems.append(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
            if self.experts_per_token > self.experts:
                problems.append(f"experts_per_token ({self.experts_per_token}) must be at most experts ({self.experts})")
        if self.ffn_kind not in FFN_KINDS:
            problems.append(f"ffn_kind must be one of {list(FFN_KINDS)}, got {self.ffn_kind!r}")
        if self.norm not in NORMS:
            problems.append(f"norm must be one of {list(NORMS)}, got {self.norm!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            problems.append(f"norm_placement must be one of {list(NORM_PLACEMENTS)}, got {self.norm_placement!r}")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            problems.append(f"dropout must be a probability in [0, 1), got {d!r}")
        if self.dtype_bytes not in (2, 4) or isinstance(self.dtype_bytes, bool):
            problems.append(f"dtype_bytes must be 2 (bf16/fp16) or 4 (fp32), got {self.dtype_bytes!r}")
        for f in ("flash", "rope"):
            if not isinstance(getattr(self, f), bool):
                problems.append(f"{f} must be True or False, got {getattr(self, f)!r}")
        if not isinstance(self.source, str):
            problems.append(f"source must be a string, got {self.source!r}")
        if problems:
            raise ProfileError(f"invalid model spec {self.name!r}: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_meta(self) -> dict[str, str]:
        return {f"model.{f.name}": str(getattr(self, f.name)) for f in dataclasses.fields(self)}


# ---- presets -----------------------------------------------------------------------------------
_LLM_FOUNDRY = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c), table "
    "'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'"
)

PRESETS: dict[str, ModelSpec] = {
    "bert-large": ModelSpec(
        name="bert-large", layers=24, hidden=1024, heads=16, kv_heads=16, ffn=4096, ffn_kind="gelu",
        norm="layernorm", norm_placement="post", dropout=0.1, vocab=30522, seq=512, micro_batch=16,
        dtype_bytes=2, flash=False,
        source=(
            "dims: BERT-Large (Devlin et al. 2018: L=24, H=1024, A=16, ffn 4096, vocab 30522, dropout 0.1). "
            "seq 512 / micro-batch 16: NVIDIA/DeepLearningExamples "
            "PyTorch/LanguageModeling/BERT/scripts/configs/pretrain_config.sh (commit 2de29455), "
            "dgxa100_8gpu_fp16 phase 2 (seq-512 dataset): train_batch_size_phase2=4096 with "
            "gradient_accumulation_steps_phase2=256; run_pretraining.py setup_training() divides "
            "train_batch_size by gradient_accumulation_steps and logs it as batch_size_per_gpu, so "
            "4096/256 = 16 sequences per GPU per micro-step (fp16). NVIDIA pads the vocab to 30528 and "
            "its MLM head transform (dense+GeLU) and NSP head are not modelled here."
        ),
    ),
    "gpt2-xl": ModelSpec(
        name="gpt2-xl", layers=48, hidden=1600, heads=25, kv_heads=25, ffn=6400, ffn_kind="gelu",
        norm="layernorm", norm_placement="pre", dropout=0.1, vocab=50257, seq=1024, micro_batch=16,
        dtype_bytes=2, flash=False,
        source=(
            "dims: GPT-2 XL / 1558M (Radford et al. 2019; HF gpt2-xl config: n_layer 48, n_embd 1600, "
            "n_head 25, vocab 50257, n_ctx 1024, dropout 0.1). seq 1024 / micro-batch 16: karpathy/llm.c "
            "scripts/run_gpt2_1558M.sh (commit 039904ee): '-b 16 -t 1024 -r 0' (16 sequences of 1024 per "
            "GPU, no recompute, 8x H100 80GB, bf16). That run used cuDNN flash attention and no dropout; "
            "this preset keeps the original GPT-2 choices (dropout 0.1, unfused attention) - override "
            "flash=True / dropout=0 to match llm.c. The DeepSpeed ZeRO tutorial "
            "(microsoft/DeepSpeed docs/_tutorials/zero.md) trains the 1.5B GPT-2 at batch 1 per V100 "
            "on purpose (to isolate model-state memory): micro_batch=1 reproduces it."
        ),
    ),
    "llama-7b": ModelSpec(
        name="llama-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, ffn_kind="swiglu",
        norm="rmsnorm", norm_placement="pre", dropout=0.0, vocab=32000, seq=2048, micro_batch=6,
        dtype_bytes=2, flash=True, rope=True,
        source=(
            "dims: LLaMA-7B (Touvron et al. 2023: 32 layers, d 4096, 32 heads, SwiGLU ffn 11008, RMSNorm, "
            "RoPE, vocab 32000). seq 2048 / micro-batch 6: " + _LLM_FOUNDRY + ", row '7b | 2048 | 8 | "
            "a100_80gb | MFU 64.23': MicroBatchSize 6, no activation checkpointing, amp_bf16, flash "
            "attention (the benchmarked model is MPT-7B, a GeLU/LayerNorm/ALiBi model of the same width "
            "and depth; its micro-batch is used for this Llama-style shape)."
        ),
    ),
    "gpt3-175b": ModelSpec(
        name="gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152, ffn_kind="gelu",
        norm="layernorm", norm_placement="pre", dropout=0.1, vocab=51200, seq=2048, micro_batch=1,
        dtype_bytes=2, flash=False,
        source=(
            "dims: GPT-3 175B (Brown et al. 2020: 96 layers, d 12288, 96 heads, ffn 4d, seq 2048). vocab 51200 "
            "(Megatron's padded GPT-2 vocabulary), micro-batch 1: Korthikanti et al. 2022 (arXiv 2205.05198), "
            "Table 3: TP 8, PP 8, 64 GPUs, global batch 64, micro-batch 1, fp16 mixed precision, unfused "
            "(non-flash) attention with dropout."
        ),
    ),
    "megatron-22b": ModelSpec(
        name="megatron-22b", layers=48, hidden=6144, heads=64, kv_heads=64, ffn=24576, ffn_kind="gelu",
        norm="layernorm", norm_placement="pre", dropout=0.1, vocab=51200, seq=2048, micro_batch=4,
        dtype_bytes=2, flash=False,
        source=(
            "Korthikanti et al. 2022 (arXiv 2205.05198), Table 3: 22B GPT, 48 layers, hidden 6144, 64 heads, "
            "ffn 4h, seq 2048, vocab 51200, TP 8, PP 1, 8 GPUs, global batch 4, micro-batch 4 (Table 4 times one "
            "of its layers, Table 5 its iteration)."
        ),
    ),
    "llama-13b": ModelSpec(
        name="llama-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, ffn_kind="swiglu",
        norm="rmsnorm", norm_placement="pre", dropout=0.0, vocab=32000, seq=2048, micro_batch=2,
        dtype_bytes=2, flash=True, rope=True,
        source=(
            "dims: LLaMA-13B (Touvron et al. 2023: 40 layers, d 5120, 40 heads, SwiGLU ffn 13824, RMSNorm, RoPE, "
            "vocab 32000). seq 2048 / micro-batch 2: " + _LLM_FOUNDRY + ", row '13b | 2048 | 8 | a100_80gb': "
            "MicroBatchSize 2, no activation checkpointing (MPT-13B, a model of the same width and depth)."
        ),
    ),
    "llama-70b": ModelSpec(
        name="llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, ffn_kind="swiglu",
        norm="rmsnorm", norm_placement="pre", dropout=0.0, vocab=32000, seq=2048, micro_batch=8,
        dtype_bytes=2, flash=True, rope=True,
        source=(
            "dims: Llama-2-70B (Touvron et al. 2023 / HF Llama-2-70b config: 80 layers, d 8192, 64 heads, "
            "8 KV heads (GQA), SwiGLU ffn 28672, RMSNorm, RoPE, vocab 32000). seq 2048 / micro-batch 8: "
            + _LLM_FOUNDRY + ", row '70b | 2048 | 64 | a100_80gb': MicroBatchSize 8, FULL_SHARD, with "
            "activation checkpointing (MPT-70B, not Llama-2; Llama-2 itself trained at seq 4096 and its "
            "paper gives no per-GPU micro-batch). Used for planner-speed benchmarks."
        ),
    ),
}


def workload_names() -> list[str]:
    return sorted(PRESETS)


def preset_spec(name: str, **overrides) -> ModelSpec:
    """Preset `name` with `overrides` replacing ModelSpec fields; a changed preset is named after
    what changed (``gpt2-xl[layers=6,seq=128]``) unless `overrides` names it."""
    if name not in PRESETS:
        raise UnknownNameError("workload", name, workload_names())
    valid = [f.name for f in dataclasses.fields(ModelSpec)]
    unknown = sorted(k for k in overrides if k not in valid)
    if unknown:
        raise ProfileError(f"unknown ModelSpec field(s) {unknown} for workload {name!r}; valid fields: {valid}")
    spec = PRESETS[name]
    changed = {k: v for k, v in overrides.items() if k != "name" and getattr(spec, k) != v}
    if changed and "name" not in overrides:
        overrides = {**overrides, "name": f"{name}[" + ",".join(f"{k}={changed[k]}" for k in sorted(changed)) + "]"}
    return dataclasses.replace(spec, **overrides)


def workload(name: str, hardware: Hardware | str, parallel: Parallel | None = None, **overrides) -> StepProfile:
    """The analytic profile of preset `name` on `hardware` (one rank of a `parallel` cut, if given);
    `overrides` replace ModelSpec fields (`preset_spec`)."""
    spec = preset_spec(name, **overrides)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    return transformer_profile(spec, hw, parallel or Parallel())


# ---- parallelism --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Parallel:
    """How one rank's share of the model is cut (Megatron-LM's tensor and sequence parallelism).

    `tp` ranks split every layer's heads and MLP width, the LM head's vocabulary and its cross-entropy
    (vocab-parallel); the rest of a layer (norms, dropout, residuals) is replicated on each rank, or
    with `sp` (sequence parallel) split along the sequence. Collectives per layer (Korthikanti et al.
    2022, Fig. 5): without SP an all-reduce after the attention projection and after the MLP in
    forward, and one at each block's input in backward; with SP an all-gather before and a
    reduce-scatter after each block in forward, the mirror in backward plus the re-gather of each
    block's saved input (Megatron keeps only the shard of it)."""

    tp: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ProfileError(f"tp must be a positive integer, got {self.tp!r}")
        if not isinstance(self.sp, bool):
            raise ProfileError(f"sp must be True or False, got {self.sp!r}")
        if self.sp and self.tp == 1:
            raise ProfileError("sequence parallelism splits along the tensor-parallel group: it needs tp > 1")

    def check(self, spec: ModelSpec) -> None:
        """Refuse a cut the model does not allow, naming every problem."""
        t, problems = self.tp, []
        if spec.heads % t:
            problems.append(f"heads ({spec.heads}) must be divisible by tp ({t})")
        if spec.kv_heads % t and t % spec.kv_heads:
            problems.append(f"kv_heads ({spec.kv_heads}) must divide or be divisible by tp ({t})")
        if spec.ffn % t:
            problems.append(f"ffn ({spec.ffn}) must be divisible by tp ({t})")
        if self.sp and spec.seq % t:
            problems.append(f"seq ({spec.seq}) must be divisible by tp ({t}) for sequence parallelism")
        if t > 1 and spec.experts > 1:
            problems.append("tensor parallelism of mixture-of-experts layers is not modelled")
        if problems:
            raise ProfileError(f"cannot cut {spec.name!r} {t} ways: " + "; ".join(problems))

    def to_meta(self) -> dict[str, str]:
        """Only a cut model says how it is cut: an uncut profile keeps its digest."""
        return {} if self == Parallel() else {"parallel.tp": str(self.tp), "parallel.sp": str(self.sp)}


# ---- the model as hardware-free op costs and saved tensors -------------------------------------
@dataclass(frozen=True)
class _Cost:
    """One forward op before it meets a Hardware: its GEMM calls (FLOPs of each), HBM bytes and
    collectives ((kind, buffer bytes) each), forward and backward."""

    key: str
    region: str
    gemms: tuple[float, ...] = ()
    bytes: float = 0.0
    bwd_gemms: tuple[float, ...] = ()
    bwd_bytes: float = 0.0
    comms: tuple[tuple[str, float], ...] = ()
    bwd_comms: tuple[tuple[str, float], ...] = ()
    attention: bool = False  # a fused attention kernel (its own measured speed), not a GEMM
    params: float = 0.0  # weight elements the op owns on this rank (for gradients and the optimizer)

    @property
    def flops(self) -> float:
        return float(sum(self.gemms))

    def times(self, hw: Hardware, tp: int) -> tuple[float, float]:
        kernel_s = hw.attention_s if self.attention else hw.gemm_s

        def one(gemms, nbytes, comms):
            compute = max(sum(kernel_s(f) for f in gemms), nbytes / hw.hbm_bps)
            return compute + sum(hw.collective_s(kind, b, tp) for kind, b in comms)

        return one(self.gemms, self.bytes, self.comms), one(self.bwd_gemms, self.bwd_bytes, self.bwd_comms)


@dataclass(frozen=True)
class _Saved:
    key: str
    bytes: int
    users: tuple[str, ...]  # op keys
    producers: tuple[str, ...] = ()  # op keys
    deps: tuple[str, ...] = ()  # activation keys


class _Builder:
    """Collects op costs (keys numbered per module, in forward order) and saved tensors."""

    def __init__(self, spec: ModelSpec, par: Parallel) -> None:
        self.spec, self.par = spec, par
        self.B = spec.dtype_bytes
        self.costs: list[_Cost] = []
        self.saved: list[_Saved] = []
        self._counters: dict[str, int] = {}

    def _key(self, module: str, name: str) -> str:
        i = self._counters.get(module, 0)
        self._counters[module] = i + 1
        return f"{module}:{i}:{name}"

    def matmul(self, region: str, module: str, name: str, flops: float, elems: float, params: float = 0.0) -> str:
        """One GEMM call touching `elems` elements (input + weight/second operand + output) once each;
        `params`: its weight elements (0 for activation x activation products such as QK^T).
        Backward: two GEMMs of the same FLOPs (input and weight gradients) and twice the bytes."""
        key = self._key(module, name)
        nbytes = elems * self.B
        self.costs.append(_Cost(key, region, (flops,), nbytes, (flops, flops), 2 * nbytes, params=params))
        return key

    def attention(self, region: str, module: str, name: str, flops: float, nbytes: float, bwd_flops: float,
                  bwd_bytes: float) -> str:
        """One fused attention kernel each way (FlashAttention), at the hardware's attention speed."""
        key = self._key(module, name)
        self.costs.append(_Cost(key, region, (flops,), nbytes, (bwd_flops,), bwd_bytes, attention=True))
        return key

    def hbm(self, region: str, module: str, name: str, fwd_bytes: float, bwd_bytes: float) -> str:
        key = self._key(module, name)
        self.costs.append(_Cost(key, region, (), fwd_bytes, (), bwd_bytes))
        return key

    def own(self, key: str, params: float) -> None:
        """Record that op `key` owns `params` weight elements (an embedding table)."""
        i = next(i for i, c in enumerate(self.costs) if c.key == key)
        self.costs[i] = dataclasses.replace(self.costs[i], params=params)

    def collective(self, region: str, module: str, name: str, fwd: tuple[tuple[str, float], ...],
                   bwd: tuple[tuple[str, float], ...]) -> str:
        key = self._key(module, name)
        self.costs.append(_Cost(key, region, comms=fwd, bwd_comms=bwd))
        return key

    def save(self, key: str, nbytes: int, users: Iterable[str], producers: Iterable[str] = (),
             deps: Iterable[str] = ()) -> str:
        self.saved.append(_Saved(key, int(nbytes), tuple(users), tuple(producers), tuple(deps)))
        return key

    # ---- tensor-parallel cuts ----
    def replicated(self, n: int) -> int:
        """Elements of a tensor the blocks replicate (norms, dropout, residuals): a 1/tp sequence
        shard with sequence parallelism."""
        return n // self.par.tp if self.par.sp else n

    def block_input(self, region: str, module: str, n: int) -> list[str]:
        """The collective that hands a block its full input (Megatron's f / all-gather): [] uncut."""
        t, nbytes = self.par.tp, n * self.B
        if t == 1:
            return []
        if self.par.sp:  # backward: reduce-scatter the input gradient, and re-gather the saved shard
            return [self.collective(region, module, "all_gather", (("all_gather", nbytes),),
                                    (("reduce_scatter", nbytes), ("all_gather", nbytes)))]
        return [self.collective(region, module, "tp_in", (), (("all_reduce", nbytes),))]

    def block_output(self, region: str, module: str, n: int) -> list[str]:
        """The collective that sums a block's partial outputs (Megatron's g / reduce-scatter)."""
        t, nbytes = self.par.tp, n * self.B
        if t == 1:
            return []
        if self.par.sp:
            return [self.collective(region, module, "reduce_scatter", (("reduce_scatter", nbytes),),
                                    (("all_gather", nbytes),))]
        return [self.collective(region, module, "tp_out", (("all_reduce", nbytes),), ())]


def _norm_op(bld: _Builder, region: str, module: str, name: str, n: int) -> str:
    """LayerNorm/RMSNorm forward reads x, writes y (+ fp32 rstd for RMSNorm); backward reads x and
    dy (+ rstd) and writes dx."""
    B, rows = bld.B, n // bld.spec.hidden
    extra = _FP32 * rows if bld.spec.norm == "rmsnorm" else 0
    return bld.hbm(region, module, name, 2 * n * B + extra, 3 * n * B + extra)


def _save_norm_stats(bld: _Builder, module: str, tag: str, op: str, n: int, inp: str) -> list[str]:
    """RMSNorm's fp32 rstd (b·s·4 bytes), saved by the norm op; LayerNorm stats are ignored (Korthikanti)."""
    if bld.spec.norm != "rmsnorm":
        return []
    return [bld.save(f"{module}:{tag}.rstd", _FP32 * (n // bld.spec.hidden), [op], [op], [inp])]


def _embed(bld: _Builder) -> None:
    spec, B = bld.spec, bld.B
    full = spec.micro_batch * spec.seq * spec.hidden
    n = bld.replicated(full)
    r = m = "embed"
    # Gather (token [+ learned position / segment] rows): forward reads the rows and writes the output;
    # backward reads dy and read-modify-writes the embedding-gradient rows. Cut: each rank gathers the
    # rows of its vocabulary shard, and the partial outputs are summed (all-reduce or reduce-scatter).
    gather = bld.hbm(r, m, "gather", 2 * full * B, 3 * full * B)
    bld.own(gather, -(-spec.vocab // bld.par.tp) * spec.hidden)  # this rank's vocabulary rows
    chain = [gather] + bld.block_output(r, m, full)
    if spec.norm_placement == "post":  # BERT: LayerNorm on the summed embeddings
        ln = _norm_op(bld, r, m, "ln", n)
        bld.save(f"{m}:ln.in", n * B, [ln], list(chain))
        _save_norm_stats(bld, m, "ln", ln, n, f"{m}:ln.in")
        chain.append(ln)
    if spec.dropout > 0:
        # dropout: forward reads x, writes y and the 1-byte mask; backward reads dy and mask, writes dx.
        drop = bld.hbm(r, m, "dropout", n * (2 * B + _MASK_BYTES), n * (2 * B + _MASK_BYTES))
        chain.append(drop)
        # The mask is regenerated from the RNG state by re-running the region's ops from the token ids.
        bld.save(f"{m}:dropout.mask", n * _MASK_BYTES, [drop], chain)


def _attention_core(bld: _Builder, region: str, A: str, q: str, k: str, v: str, q_prod: list[str],
                    kv_prod: list[str], qkv_in: str) -> tuple[str, str, list[str]]:
    """Saves q, k, v and the attention-core tensors of this rank's heads. Returns (context key, op
    that outputs it, context deps)."""
    spec, B = bld.spec, bld.B
    b, s, d = spec.micro_batch, spec.seq, spec.head_dim
    a = spec.heads // bld.par.tp
    n = b * s * a * d  # q and the context: this rank's heads
    nkv = b * s * _kv_heads(bld) * d
    core_flops = 2.0 * b * s * s * a * d  # each of QK^T and P·V: 2·b·a·s²·d
    if spec.flash:
        lse = _FP32 * b * a * s
        fwd_bytes = (n + 2 * nkv + n) * B + lse
        bwd_bytes = (n + 2 * nkv + 2 * n) * B + lse + (n + 2 * nkv) * B  # read q,k,v,o,dO,lse; write dq,dk,dv
        flash = bld.attention(region, A, "flash_attn", 2 * core_flops, fwd_bytes, 2.5 * 2 * core_flops, bwd_bytes)
        bld.save(q, n * B, [flash], q_prod, [qkv_in])
        bld.save(k, nkv * B, [flash], kv_prod, [qkv_in])
        bld.save(v, nkv * B, [flash], _unrotated(kv_prod), [qkv_in])
        bld.save(f"{A}:attn.lse", lse, [flash], [flash], [q, k, v])
        # the flash output is the output projection's input: one tensor, saved by both ops
        return f"{A}:attn.out", flash, [q, k, v]
    N = b * a * s * s  # elements of the scores / probabilities
    scores = bld.matmul(region, A, "scores", core_flops, n + nkv + N)
    bld.save(q, n * B, [scores], q_prod, [qkv_in])
    bld.save(k, nkv * B, [scores], kv_prod, [qkv_in])
    # fused scale + mask + softmax: forward reads x, writes y; backward reads y and dy, writes dx
    softmax = bld.hbm(region, A, "softmax", 2 * N * B, 3 * N * B)
    probs_users = [softmax]
    if spec.dropout > 0:
        drop = bld.hbm(region, A, "attn_dropout", N * (2 * B + _MASK_BYTES), N * (2 * B + _MASK_BYTES))
        av = bld.matmul(region, A, "av", core_flops, N + nkv + n)
        bld.save(f"{A}:softmax.out", N * B, probs_users, [scores, softmax], [q, k])
        bld.save(f"{A}:attn_dropout.mask", N * _MASK_BYTES, [drop], [drop], [f"{A}:softmax.out"])
        bld.save(f"{A}:attn_dropout.out", N * B, [av], [drop], [f"{A}:softmax.out"])
        probs = f"{A}:attn_dropout.out"
    else:
        av = bld.matmul(region, A, "av", core_flops, N + nkv + n)
        bld.save(f"{A}:softmax.out", N * B, probs_users + [av], [scores, softmax], [q, k])
        probs = f"{A}:softmax.out"
    bld.save(v, nkv * B, [av], _unrotated(kv_prod), [qkv_in])
    return f"{A}:context", av, [probs, v]


def _unrotated(producers: list[str]) -> list[str]:
    """v's producers: those of q and k but RoPE, which rotates only q and k."""
    return [p for p in producers if not p.endswith(":rope")]


def _kv_heads(bld: _Builder) -> int:
    """This rank's key/value heads: split like the query heads, or replicated when fewer than tp."""
    kv, t = bld.spec.kv_heads, bld.par.tp
    return kv // t if kv >= t else 1


def _residual(bld: _Builder, region: str, module: str, n: int) -> tuple[str, str | None]:
    """Residual add (with dropout on the branch when dropout > 0). Returns (op key, mask key or None)."""
    B = bld.B
    fork = 3 * n * B  # backward: gradient sum at the residual fork (read 2, write 1)
    if bld.spec.dropout > 0:
        op = bld.hbm(region, module, "dropout_add", n * (3 * B + _MASK_BYTES), n * (2 * B + _MASK_BYTES) + fork)
        return op, f"{module}:resid_dropout.mask"
    return bld.hbm(region, module, "add", 3 * n * B, fork), None


def _layer(bld: _Builder, l: int) -> None:
    spec, B, t = bld.spec, bld.B, bld.par.tp
    b, s, h, f = spec.micro_batch, spec.seq, spec.hidden, spec.ffn
    d = spec.head_dim
    a_r, kv_r, f_r = spec.heads // t, _kv_heads(bld), f // t  # this rank's heads and MLP width
    bs = b * s
    full = bs * h  # a block's full input or output (what the collectives move)
    n = bld.replicated(full)  # norms, dropout, residuals: this rank's elements
    qkv_out = (a_r + 2 * kv_r) * d
    region, A, M = f"layers.{l}", f"layers.{l}.attn", f"layers.{l}.mlp"
    pre = spec.norm_placement == "pre"
    nm = "ln" if spec.norm == "layernorm" else "rmsnorm"
    x = f"{A}:x"  # the layer input: the region input, not recomputable here

    # ---- attention block ----
    if pre:
        norm1 = _norm_op(bld, region, A, f"{nm}1", n)
        bld.save(x, n * B, [norm1])
        _save_norm_stats(bld, A, f"{nm}1", norm1, n, x)
        qkv_in = f"{A}:{nm}1.out"
    gather1 = bld.block_input(region, A, full)
    qkv = bld.matmul(region, A, "qkv", 2.0 * bs * h * qkv_out, bs * h + h * qkv_out + bs * qkv_out,
                     params=h * qkv_out)
    if pre:  # with SP the shard is saved, and backward gathers it again (counted in block_input)
        bld.save(qkv_in, n * B, [qkv], [norm1], [x])
    else:
        qkv_in = x
        bld.save(x, n * B, [qkv])
    q_prod = gather1 + [qkv]
    if spec.rope:  # rotate q and k: reads and writes both; backward the same (cos/sin are constants)
        rot = bs * (a_r + kv_r) * d
        rope = bld.hbm(region, A, "rope", 2 * rot * B, 2 * rot * B)
        q_prod = q_prod + [rope]
    ctx, ctx_op, ctx_deps = _attention_core(bld, region, A, f"{A}:q", f"{A}:k", f"{A}:v", q_prod, q_prod, qkv_in)
    ctx_elems = bs * a_r * d
    proj = bld.matmul(region, A, "proj", 2.0 * bs * a_r * d * h, ctx_elems + a_r * d * h + bs * h,
                      params=a_r * d * h)
    # with flash the core's output is also what its own backward reads: one tensor, two users
    bld.save(ctx, ctx_elems * B, [ctx_op, proj] if spec.flash else [proj], [ctx_op], ctx_deps)
    attn_out = [proj] + bld.block_output(region, A, full)
    add1, mask1 = _residual(bld, region, A, n)
    if mask1:
        bld.save(mask1, n * _MASK_BYTES, [add1], attn_out + [add1], [ctx])

    # ---- norm of x + attn(x): LN2 before the MLP (pre-LN) or LN1 after the residual (post-LN) ----
    if pre:
        norm2 = _norm_op(bld, region, M, f"{nm}2", n)
        mlp_in_norm_in = f"{M}:{nm}2.in"
        bld.save(mlp_in_norm_in, n * B, [norm2], attn_out + [add1], [ctx, x])
        _save_norm_stats(bld, M, f"{nm}2", norm2, n, mlp_in_norm_in)
        mlp_in, mlp_in_prod, mlp_in_deps = f"{M}:{nm}2.out", [norm2], [mlp_in_norm_in]
        residual_in = mlp_in_norm_in
    else:
        norm1 = _norm_op(bld, region, A, f"{nm}1", n)
        ln1_in = f"{A}:{nm}1.in"
        bld.save(ln1_in, n * B, [norm1], attn_out + [add1], [ctx, x])
        _save_norm_stats(bld, A, f"{nm}1", norm1, n, ln1_in)
        mlp_in, mlp_in_prod, mlp_in_deps = f"{A}:{nm}1.out", [norm1], [ln1_in]
        residual_in = mlp_in

    # ---- MLP (dense, or mixture of experts) ----
    gather2 = bld.block_input(region, M, full)
    rows, x_mlp, x_prod, x_deps = bs, mlp_in, gather2 + mlp_in_prod, mlp_in_deps
    x_bytes = n * B  # with SP the shard is saved, and backward gathers it again
    if spec.experts > 1:
        # Router: logits over the experts, softmax + top-k (fp32 probabilities saved); dispatch copies
        # each token to its k experts; each expert's MLP runs on its tokens (every expert weight is
        # read once); combine sums the k outputs weighted by the router.
        E, k = spec.experts, spec.experts_per_token
        router = bld.matmul(region, M, "router", 2.0 * bs * h * E, bs * h + h * E + bs * E, params=h * E)
        bld.save(mlp_in, n * B, [router], x_prod, mlp_in_deps)
        route = bld.hbm(region, M, "route", bs * E * (B + _FP32) + bs * k * _FP32, bs * E * (2 * _FP32 + B))
        bld.save(f"{M}:route.probs", _FP32 * bs * E, [route], [router, route], [mlp_in])
        rows = bs * k
        dispatch = bld.hbm(region, M, "dispatch", (bs + rows) * h * B, (rows + bs) * h * B)
        x_mlp, x_prod, x_deps, x_bytes = f"{M}:dispatch.out", [router, route, dispatch], [mlp_in], rows * h * B
    nf = rows * f_r
    regather = gather2 if spec.experts == 1 else []  # re-running the MLP's first matmul gathers its input
    w = spec.experts * h * f_r  # weight elements of one projection (all experts)
    if spec.ffn_kind == "gelu":
        fc1 = bld.matmul(region, M, "fc1", 2.0 * rows * h * f_r, rows * h + w + nf, params=w)
        bld.save(x_mlp, x_bytes, [fc1], x_prod, x_deps)
        gelu = bld.hbm(region, M, "gelu", 2 * nf * B, 3 * nf * B)
        bld.save(f"{M}:fc1.out", nf * B, [gelu], regather + [fc1], [x_mlp])
        fc2 = bld.matmul(region, M, "fc2", 2.0 * rows * f_r * h, nf + w + rows * h, params=w)
        bld.save(f"{M}:gelu.out", nf * B, [fc2], [gelu], [f"{M}:fc1.out"])
        down, down_in = fc2, f"{M}:gelu.out"
    else:
        gate = bld.matmul(region, M, "gate", 2.0 * rows * h * f_r, rows * h + w + nf, params=w)
        silu = bld.hbm(region, M, "silu", 2 * nf * B, 3 * nf * B)
        up = bld.matmul(region, M, "up", 2.0 * rows * h * f_r, rows * h + w + nf, params=w)
        mul = bld.hbm(region, M, "mul", 3 * nf * B, 5 * nf * B)
        down = bld.matmul(region, M, "down", 2.0 * rows * f_r * h, nf + w + rows * h, params=w)
        bld.save(x_mlp, x_bytes, [gate, up], x_prod, x_deps)
        bld.save(f"{M}:gate.out", nf * B, [silu], regather + [gate], [x_mlp])
        bld.save(f"{M}:up.out", nf * B, [mul], regather + [up], [x_mlp])
        bld.save(f"{M}:silu.out", nf * B, [mul], [silu], [f"{M}:gate.out"])
        bld.save(f"{M}:mul.out", nf * B, [down], [mul], [f"{M}:silu.out", f"{M}:up.out"])
        down_in = f"{M}:mul.out"
    branch, branch_deps = [down], [down_in]
    if spec.experts > 1:
        combine = bld.hbm(region, M, "combine", rows * h * B + bs * k * _FP32 + bs * h * B,
                          bs * h * B + rows * h * B * 2 + bs * k * _FP32 * 2)
        bld.save(f"{M}:expert.out", rows * h * B, [combine], [down], [down_in])
        bld.save(f"{M}:route.weights", bs * k * _FP32, [combine], [router, route], [mlp_in])
        branch, branch_deps = [down, combine], [down_in, f"{M}:route.weights"]
    branch = branch + bld.block_output(region, M, full)
    add2, mask2 = _residual(bld, region, M, n)
    if mask2:
        bld.save(mask2, n * _MASK_BYTES, [add2], branch + [add2], branch_deps)
    if not pre:  # BERT: LayerNorm after the MLP residual; its output is the next layer's input
        norm2 = _norm_op(bld, region, M, f"{nm}2", n)
        ln2_in = f"{M}:{nm}2.in"
        bld.save(ln2_in, n * B, [norm2], branch + [add2], branch_deps + [residual_in])
        _save_norm_stats(bld, M, f"{nm}2", norm2, n, ln2_in)


def _head(bld: _Builder) -> None:
    spec, B, t = bld.spec, bld.B, bld.par.tp
    bs, h = spec.micro_batch * spec.seq, spec.hidden
    V = -(-spec.vocab // t)  # this rank's vocabulary shard (vocab-parallel LM head and cross-entropy)
    full = bs * h
    n = bld.replicated(full)
    r = m = "head"
    norm = _norm_op(bld, r, m, "final_norm", n)
    bld.save(f"{m}:norm.in", n * B, [norm])  # the last layer's output: region input
    _save_norm_stats(bld, m, "norm", norm, n, f"{m}:norm.in")
    gather = bld.block_input(r, m, full)
    lm_head = bld.matmul(r, m, "lm_head", 2.0 * bs * h * V, bs * h + h * V + bs * V, params=h * V)
    bld.save(f"{m}:norm.out", n * B, [lm_head], [norm], [f"{m}:norm.in"])
    # cross-entropy on fp32 log-softmax: forward reads logits, writes fp32 log-probs; backward reads
    # the log-probs and writes dlogits. Vocab-parallel: max, sum of exponentials and the target's
    # logit are all-reduced (3 fp32 per token).
    # (timed as one all-reduce before the fused op that writes the log-probs).
    ce_ops = []
    if t > 1:
        ce_ops.append(bld.collective(r, m, "ce_all_reduce", (("all_reduce", 3 * _FP32 * bs),), ()))
    ce = bld.hbm(r, m, "cross_entropy", bs * V * (B + _FP32), bs * V * (_FP32 + B))
    bld.save(f"{m}:ce.logprobs", _FP32 * bs * V, [ce], gather + [lm_head] + ce_ops + [ce], [f"{m}:norm.out"])


def _build(spec: ModelSpec, par: Parallel, layers: Iterable[int] | None = None, embed: bool = True,
           head: bool = True) -> _Builder:
    par.check(spec)
    bld = _Builder(spec, par)
    if embed:
        _embed(bld)
    for l in range(spec.layers) if layers is None else layers:
        _layer(bld, l)
    if head:
        _head(bld)
    return bld


# ---- public entry points -----------------------------------------------------------------------
def transformer_profile(spec: ModelSpec, hw: Hardware, par: Parallel = Parallel(), *,
                        layers: Iterable[int] | None = None, embed: bool = True, head: bool = True,
                        name: str | None = None) -> StepProfile:
    """The analytic `StepProfile` of one training step of `spec` on `hw`, on one rank of a `par`
    cut (see the module docstring); `layers`, `embed`, `head` select a pipeline stage's part."""
    bld = _build(spec, par, layers, embed, head)
    index = {c.key: i for i, c in enumerate(bld.costs)}
    ops = []
    try:
        for c in bld.costs:
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
        )
        for a in bld.saved
    ]
    meta = {"source": "analytic", "hardware": hw.name, "hardware_digest": hw.digest, **spec.to_meta(),
            **par.to_meta()}
    return StepProfile(name=name or spec.name, ops=tuple(ops), activations=tuple(acts), meta=tuple(meta.items()))


def layer_forward_flops(spec: ModelSpec, par: Parallel = Parallel()) -> float:
    """Matmul FLOPs of one layer's forward on one rank, summed over the same op list that is timed."""
    return float(sum(c.flops for c in _build(spec, par, layers=[0], embed=False, head=False).costs))


def layer_activation_bytes(spec: ModelSpec, par: Parallel = Parallel()) -> int:
    """Bytes saved for backward by one layer region on one rank (its input included)."""
    return sum(a.bytes for a in _build(spec, par, layers=[0], embed=False, head=False).saved)


def region_params(spec: ModelSpec, par: Parallel = Parallel(), *, layers: Iterable[int] | None = None,
                  embed: bool = True, head: bool = True) -> dict[str, int]:
    """Weight elements each region owns on one rank of a `par` cut (matmul weights and the embedding
    table; norm and bias vectors are left out: < 0.1% of a transformer's parameters). A model with
    tied embeddings counts the table in both the embedding and the LM head, as a pipeline does."""
    out: dict[str, int] = {}
    for c in _build(spec, par, layers, embed, head).costs:
        out[c.region] = out.get(c.region, 0) + int(c.params)
    return out

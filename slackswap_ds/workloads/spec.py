"""What a workload is: one transformer training configuration (`ModelSpec`) and how one rank's
share of it is cut (`Parallel`). Both validate themselves and name every problem at once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..attention_rates import DEFAULT_KERNEL, KERNELS
from ..errors import ProfileError

FFN_KINDS = ("gelu", "swiglu")
MAX_LAYERS = 1024  # a model the simulator takes (its profile has ops per layer; GPT-3 has 96, PaLM 118)
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")


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
    tied_embeddings: bool = False  # the LM head reuses the embedding table (GPT-2, BERT): one copy of its weights
    causal: bool = False  # decoder attention (GPT, Llama): a fused kernel skips the masked blocks
    attention_kernel: str = DEFAULT_KERNEL  # with `flash`: which fused kernel (`attention_rates.KERNELS`)
    # The loss's forward and backward are one kernel that reads each logit once and writes its gradient
    # in place (llm.c's fused_classifier), not a log-softmax saved for a backward kernel (PyTorch's)
    fused_loss: bool = False

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.name, str) or not self.name.strip():
            problems.append(f"name must be a non-empty string, got {self.name!r}")
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch", "experts",
                  "experts_per_token"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{f} must be a positive integer, got {v!r}")
            elif f == "layers" and v > MAX_LAYERS:
                problems.append(f"layers {v} is over the simulator's limit of {MAX_LAYERS} (a profile has ops "
                                f"per layer; published models have at most a few hundred)")
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
        for f in ("flash", "rope", "tied_embeddings", "causal", "fused_loss"):
            if not isinstance(getattr(self, f), bool):
                problems.append(f"{f} must be True or False, got {getattr(self, f)!r}")
        if self.attention_kernel not in KERNELS:
            problems.append(f"attention_kernel must be one of {list(KERNELS)}, got {self.attention_kernel!r}")
        if not isinstance(self.source, str):
            problems.append(f"source must be a string, got {self.source!r}")
        if problems:
            raise ProfileError(f"invalid model spec {self.name!r}: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_meta(self) -> dict[str, str]:
        return {f"model.{f.name}": str(getattr(self, f.name)) for f in dataclasses.fields(self)}


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

"""A training step as hardware-free op costs and saved tensors, and the parts outside the layers.

`CostBuilder` records, in forward order, each op's cost (GEMM FLOPs, HBM bytes, collectives; forward
and backward) and each tensor saved for backward; `OpCost.times` prices an op on a `Hardware`.
The embedding and the head are built here, the transformer layer in `layer.py`.

Timing model (a roofline; every constant comes from the `Hardware` preset)
------------------------------------------------------------------------
* Matmul ops (linear layers, QK^T, probs·V, LM head): one GEMM call each of a known (batch, m, n, k),
  forward time = ``max(hw.gemm_s(flops, shape), bytes / hw.hbm_bps)``, the rate read off the preset's
  measured GEMM curve and, where the preset gives SM counts and the curve's shapes, its shape's tile
  and wave quantization (`Hardware.gemm_s`); ``bytes`` = the input, weight (or second operand) and
  output, each read or written once. Backward runs two GEMMs of the same FLOPs (input gradient
  m x n by n x k, weight gradient k x m by m x n) and twice the bytes.
* FlashAttention: one fused kernel each way, at the preset's measured speed of the workload's kernel
  (``ModelSpec.attention_kernel``) for its head dim, mask and sequence length (``hw.attention_s``,
  `attention_rates`). Forward FLOPs ``4·b·s²·h`` (QK^T and P·V), bytes = q, k, v, output and the
  fp32 log-sum-exp; backward ``2.5x`` the forward FLOPs (it recomputes the scores) and reads q, k,
  v, o, dO, lse and writes dq, dk, dv.
* Causal masking (``ModelSpec.causal``): a fused kernel does only the key blocks at and below the
  diagonal (`layer.causal_fraction`); unfused attention computes every score (no saving).
* Elementwise, normalisation, softmax, dropout, RoPE, embedding and cross-entropy ops are HBM-bound:
  time = bytes read + written at ``hw.elementwise_s`` (the preset's measured elementwise rate, else
  ``hbm_bps``), forward and backward each with its own byte count
  (e.g. softmax forward reads x and writes y; backward reads y and dy and writes dx). A residual add's
  backward is charged the gradient sum at the residual fork (read 2, write 1).
* Tensor parallelism (`Parallel`): collectives are ops of their own on the compute stream (Megatron
  runs them synchronously), timed by ``hw.collective_s`` from the preset's measured NCCL bus
  bandwidth; see `Parallel` for which run where.
* Mixture of experts (``experts`` > 1): a router matmul, softmax + top-k, a dispatch copy of each
  token to its ``experts_per_token`` experts, the experts' MLPs on the routed copies (every expert's
  weights read once) and a weighted combine.
* Every kernel (a GEMM, an HBM-bound op, a collective) adds the preset's ``kernel_overhead_s``.
* Parameter reads of norms and biases, the optimizer step and data-parallel communication are not
  modelled here (the step is one rank's forward and backward of one micro-batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from ..attention_rates import AttentionShape
from ..hardware import GemmShape, Hardware
from .spec import ModelSpec, Parallel

MASK_BYTES = 1  # dropout masks: one byte per element (torch.bool)
MASK_SUFFIX = "dropout.mask"  # how every dropout mask's key ends (embedding, attention and residual dropout)
DROPOUT_OUT_SUFFIX = "attn_dropout.out"  # the attention dropout's output (av's backward reads it)
FP32 = 4  # log-sum-exp, RMSNorm rstd, log-softmax

Comms = tuple[tuple[str, float], ...]  # (collective kind, buffer bytes) each


@dataclass(frozen=True)
class OpCost:
    """One forward op before it meets a Hardware: its GEMM calls (FLOPs of each), HBM bytes and
    collectives, forward and backward."""

    key: str
    region: str
    gemms: tuple[float, ...] = ()
    bytes: float = 0.0
    bwd_gemms: tuple[float, ...] = ()
    bwd_bytes: float = 0.0
    comms: Comms = ()
    bwd_comms: Comms = ()
    attention: AttentionShape | None = None  # a fused attention kernel (its own measured speed), not a GEMM
    params: float = 0.0  # weight elements the op owns on this rank (for gradients and the optimizer)
    shapes: tuple[GemmShape, ...] = ()  # (batch, m, n, k) of each GEMM in `gemms` ((): FLOPs only)
    bwd_shapes: tuple[GemmShape, ...] = ()

    @property
    def flops(self) -> float:
        return float(sum(self.gemms))

    def times(self, hw: Hardware, tp: int) -> tuple[float, float]:
        def kernel_s(flops: float, shape: GemmShape | None) -> float:
            return hw.attention_s(flops, self.attention) if self.attention is not None else hw.gemm_s(flops, shape)

        def one(gemms, shapes, nbytes, comms):
            if gemms:  # GEMMs: compute or their operands' traffic, whichever is slower
                shapes = shapes or (None,) * len(gemms)
                compute = max(sum(kernel_s(f, sh) for f, sh in zip(gemms, shapes)), nbytes / hw.hbm_bps)
            else:
                compute = hw.elementwise_s(nbytes)
            kernels = (len(gemms) or int(nbytes > 0)) + len(comms)
            return (compute + kernels * hw.kernel_overhead_s
                    + sum(hw.collective_s(kind, b, tp) for kind, b in comms))

        return (one(self.gemms, self.shapes, self.bytes, self.comms),
                one(self.bwd_gemms, self.bwd_shapes, self.bwd_bytes, self.bwd_comms))


@dataclass(frozen=True)
class SavedTensor:
    key: str
    bytes: int
    users: tuple[str, ...]  # op keys
    producers: tuple[str, ...] = ()  # op keys
    deps: tuple[str, ...] = ()  # activation keys


class CostBuilder:
    """Collects op costs (keys numbered per module, in forward order) and saved tensors."""

    def __init__(self, spec: ModelSpec, par: Parallel) -> None:
        self.spec, self.par = spec, par
        self.bytes_per_element = spec.dtype_bytes
        self.costs: list[OpCost] = []
        self.saved: list[SavedTensor] = []
        self._counters: dict[str, int] = {}

    def _key(self, module: str, name: str) -> str:
        i = self._counters.get(module, 0)
        self._counters[module] = i + 1
        return f"{module}:{i}:{name}"

    def matmul(self, region: str, module: str, name: str, shape: GemmShape, elements: float,
               params: float = 0.0) -> str:
        """One GEMM call of `shape` (batch, m, n, k: `batch` products of m x k by k x n) touching
        `elements` (input + weight/second operand + output) once each; `params`: its weight elements
        (0 for activation x activation products such as QK^T). Backward: two GEMMs of the same FLOPs,
        the input gradient (m x n by n x k) and the weight gradient (k x m by m x n), and twice the bytes."""
        key = self._key(module, name)
        batch, m, n, k = shape
        flops = 2.0 * batch * m * n * k
        nbytes = elements * self.bytes_per_element
        self.costs.append(OpCost(key, region, (flops,), nbytes, (flops, flops), 2 * nbytes, params=params,
                                 shapes=(shape,), bwd_shapes=((batch, m, k, n), (batch, k, n, m))))
        return key

    def attention(self, region: str, module: str, name: str, flops: float, nbytes: float, bwd_flops: float,
                  bwd_bytes: float, shape: AttentionShape) -> str:
        """One fused attention kernel each way (FlashAttention), at the hardware's speed for its shape."""
        key = self._key(module, name)
        self.costs.append(OpCost(key, region, (flops,), nbytes, (bwd_flops,), bwd_bytes, attention=shape))
        return key

    def hbm(self, region: str, module: str, name: str, fwd_bytes: float, bwd_bytes: float) -> str:
        key = self._key(module, name)
        self.costs.append(OpCost(key, region, (), fwd_bytes, (), bwd_bytes))
        return key

    def own(self, key: str, params: float) -> None:
        """Record that op `key` owns `params` weight elements (an embedding table)."""
        i = next(i for i, c in enumerate(self.costs) if c.key == key)
        self.costs[i] = dataclasses.replace(self.costs[i], params=params)

    def collective(self, region: str, module: str, name: str, fwd: Comms, bwd: Comms) -> str:
        key = self._key(module, name)
        self.costs.append(OpCost(key, region, comms=fwd, bwd_comms=bwd))
        return key

    def save(self, key: str, nbytes: int, users: Iterable[str], producers: Iterable[str] = (),
             deps: Iterable[str] = ()) -> str:
        self.saved.append(SavedTensor(key, int(nbytes), tuple(users), tuple(producers), tuple(deps)))
        return key

    # ---- tensor-parallel cuts ----
    def replicated(self, elements: int) -> int:
        """Elements of a tensor the blocks replicate (norms, dropout, residuals): a 1/tp sequence
        shard with sequence parallelism."""
        return elements // self.par.tp if self.par.sp else elements

    def block_input(self, region: str, module: str, elements: int) -> list[str]:
        """The collective that hands a block its full input (Megatron's f / all-gather): [] uncut."""
        tp, nbytes = self.par.tp, elements * self.bytes_per_element
        if tp == 1:
            return []
        if self.par.sp:  # backward: reduce-scatter the input gradient, and re-gather the saved shard
            return [self.collective(region, module, "all_gather", (("all_gather", nbytes),),
                                    (("reduce_scatter", nbytes), ("all_gather", nbytes)))]
        return [self.collective(region, module, "tp_in", (), (("all_reduce", nbytes),))]

    def block_output(self, region: str, module: str, elements: int) -> list[str]:
        """The collective that sums a block's partial outputs (Megatron's g / reduce-scatter)."""
        tp, nbytes = self.par.tp, elements * self.bytes_per_element
        if tp == 1:
            return []
        if self.par.sp:
            return [self.collective(region, module, "reduce_scatter", (("reduce_scatter", nbytes),),
                                    (("all_gather", nbytes),))]
        return [self.collective(region, module, "tp_out", (("all_reduce", nbytes),), ())]

    # ---- parts every block uses ----
    def norm(self, region: str, module: str, name: str, elements: int) -> str:
        """LayerNorm/RMSNorm forward reads x, writes y (+ fp32 rstd for RMSNorm); backward reads x and
        dy (+ rstd) and writes dx."""
        bytes_per_element, rows = self.bytes_per_element, elements // self.spec.hidden
        rstd_bytes = FP32 * rows if self.spec.norm == "rmsnorm" else 0
        return self.hbm(region, module, name, 2 * elements * bytes_per_element + rstd_bytes,
                        3 * elements * bytes_per_element + rstd_bytes)

    def save_norm_stats(self, module: str, tag: str, op: str, elements: int, norm_input: str) -> list[str]:
        """RMSNorm's fp32 rstd (b·s·4 bytes), saved by the norm op; LayerNorm stats are ignored (Korthikanti)."""
        if self.spec.norm != "rmsnorm":
            return []
        return [self.save(f"{module}:{tag}.rstd", FP32 * (elements // self.spec.hidden), [op], [op], [norm_input])]

    def residual(self, region: str, module: str, elements: int) -> tuple[str, str | None]:
        """Residual add (with dropout on the branch when dropout > 0). Returns (op key, mask key or None)."""
        bytes_per_element = self.bytes_per_element
        fork = 3 * elements * bytes_per_element  # backward: gradient sum at the residual fork (read 2, write 1)
        if self.spec.dropout > 0:
            op = self.hbm(region, module, "dropout_add", elements * (3 * bytes_per_element + MASK_BYTES),
                          elements * (2 * bytes_per_element + MASK_BYTES) + fork)
            return op, f"{module}:resid_dropout.mask"
        return self.hbm(region, module, "add", 3 * elements * bytes_per_element, fork), None


def add_embedding(builder: CostBuilder) -> None:
    """Gather [+ LayerNorm for post-LN models] [+ dropout]: the ``embed`` region."""
    spec, bytes_per_element = builder.spec, builder.bytes_per_element
    block_elements = spec.micro_batch * spec.seq * spec.hidden
    elements = builder.replicated(block_elements)
    region = module = "embed"
    # Gather (token [+ learned position / segment] rows): forward reads the rows and writes the output;
    # backward reads dy and read-modify-writes the embedding-gradient rows. Cut: each rank gathers the
    # rows of its vocabulary shard, and the partial outputs are summed (all-reduce or reduce-scatter).
    gather = builder.hbm(region, module, "gather", 2 * block_elements * bytes_per_element,
                         3 * block_elements * bytes_per_element)
    vocab_per_rank = -(-spec.vocab // builder.par.tp)
    builder.own(gather, vocab_per_rank * spec.hidden)
    chain = [gather] + builder.block_output(region, module, block_elements)
    if spec.norm_placement == "post":  # BERT: LayerNorm on the summed embeddings
        norm = builder.norm(region, module, "ln", elements)
        builder.save(f"{module}:ln.in", elements * bytes_per_element, [norm], list(chain))
        builder.save_norm_stats(module, "ln", norm, elements, f"{module}:ln.in")
        chain.append(norm)
    if spec.dropout > 0:
        # dropout: forward reads x, writes y and the 1-byte mask; backward reads dy and mask, writes dx.
        dropout_bytes = elements * (2 * bytes_per_element + MASK_BYTES)
        dropout = builder.hbm(region, module, "dropout", dropout_bytes, dropout_bytes)
        chain.append(dropout)
        # The mask is regenerated from the RNG state by re-running the region's ops from the token ids.
        builder.save(f"{module}:dropout.mask", elements * MASK_BYTES, [dropout], chain)


def add_head(builder: CostBuilder) -> None:
    """Final norm, LM head over the full vocabulary, cross-entropy: the ``head`` region."""
    spec, bytes_per_element, tp = builder.spec, builder.bytes_per_element, builder.par.tp
    tokens, hidden = spec.micro_batch * spec.seq, spec.hidden
    vocab_per_rank = -(-spec.vocab // tp)  # vocab-parallel LM head and cross-entropy
    block_elements = tokens * hidden
    elements = builder.replicated(block_elements)
    region = module = "head"
    norm = builder.norm(region, module, "final_norm", elements)
    builder.save(f"{module}:norm.in", elements * bytes_per_element, [norm])  # the last layer's output: region input
    builder.save_norm_stats(module, "norm", norm, elements, f"{module}:norm.in")
    gather = builder.block_input(region, module, block_elements)
    lm_head = builder.matmul(region, module, "lm_head", (1, tokens, vocab_per_rank, hidden),
                             tokens * hidden + hidden * vocab_per_rank + tokens * vocab_per_rank,
                             params=hidden * vocab_per_rank)
    builder.save(f"{module}:norm.out", elements * bytes_per_element, [lm_head], [norm], [f"{module}:norm.in"])
    # cross-entropy on fp32 log-softmax: forward reads logits, writes fp32 log-probs; backward reads
    # the log-probs and writes dlogits. Vocab-parallel: max, sum of exponentials and the target's
    # logit are all-reduced (3 fp32 per token).
    # (timed as one all-reduce before the fused op that writes the log-probs).
    # With `fused_loss` one kernel reads the logits and writes their gradient over them (llm.c's
    # fused_classifier): nothing left for backward but the 16-bit dlogits it saved.
    all_reduce = []
    if tp > 1:
        all_reduce.append(builder.collective(region, module, "ce_all_reduce", (("all_reduce", 3 * FP32 * tokens),), ()))
    logits = tokens * vocab_per_rank
    if spec.fused_loss:
        cross_entropy = builder.hbm(region, module, "cross_entropy", logits * 2 * bytes_per_element, 0)
        saved, saved_bytes = f"{module}:ce.dlogits", bytes_per_element * logits
    else:
        cross_entropy = builder.hbm(region, module, "cross_entropy", logits * (bytes_per_element + FP32),
                                    logits * (FP32 + bytes_per_element))
        saved, saved_bytes = f"{module}:ce.logprobs", FP32 * logits
    builder.save(saved, saved_bytes, [cross_entropy], gather + [lm_head] + all_reduce + [cross_entropy],
                 [f"{module}:norm.out"])

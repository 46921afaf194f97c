"""One transformer layer as op costs and saved tensors, block by block: the attention block (norm
for pre-LN models, QKV projection, RoPE, the attention core, output projection, residual add), the
norm between the blocks, the MLP (dense, or a mixture of experts) with its residual add, and for
post-LN models (BERT) the norm after it. Timing rules are in `builder.py`.

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

from dataclasses import dataclass

from ..attention_rates import AttentionShape
from .builder import DROPOUT_OUT_SUFFIX, FP32, MASK_BYTES, CostBuilder

# The unit a causal mask skips: FlashAttention-2's query/key block (Dao 2023, arXiv 2307.08691, Sec. 3.3:
# block sizes chosen from {64, 128} x {64, 128}). 128 is assumed; with 64 the diagonal's extra work halves
# (at s = 2048: 53.1% of the full work against 51.6%).
FLASH_BLOCK = 128


@dataclass(frozen=True)
class LayerShape:
    """One layer's region and module names, and this rank's sizes, shared by its blocks."""

    region: str  # layers.<l>
    attention: str  # layers.<l>.attn: the attention block's ops and tensors
    mlp: str  # layers.<l>.mlp
    norm: str  # "ln" | "rmsnorm": how its norm ops are named
    pre_norm: bool  # pre-LN (GPT, Llama) or post-LN (BERT)
    tokens: int  # micro-batch x sequence
    block_elements: int  # a block's full input or output (what the collectives move)
    replicated_elements: int  # norms, dropout, residuals: this rank's elements
    heads_per_rank: int
    kv_heads_per_rank: int
    ffn_per_rank: int  # this rank's MLP width

    @classmethod
    def of(cls, builder: CostBuilder, layer: int) -> "LayerShape":
        spec, tp = builder.spec, builder.par.tp
        tokens = spec.micro_batch * spec.seq
        block_elements = tokens * spec.hidden
        region = f"layers.{layer}"
        return cls(region=region, attention=f"{region}.attn", mlp=f"{region}.mlp",
                   norm="ln" if spec.norm == "layernorm" else "rmsnorm", pre_norm=spec.norm_placement == "pre",
                   tokens=tokens, block_elements=block_elements,
                   replicated_elements=builder.replicated(block_elements), heads_per_rank=spec.heads // tp,
                   kv_heads_per_rank=_kv_heads_per_rank(builder), ffn_per_rank=spec.ffn // tp)

    @property
    def layer_input(self) -> str:
        """The layer's input: the region input, not recomputable here."""
        return f"{self.attention}:x"


def _kv_heads_per_rank(builder: CostBuilder) -> int:
    """This rank's key/value heads: split like the query heads, or replicated when fewer than tp."""
    kv_heads, tp = builder.spec.kv_heads, builder.par.tp
    return kv_heads // tp if kv_heads >= tp else 1


@dataclass(frozen=True)
class _Tensor:
    """A tensor a block reads, with what makes it again: the ops that produce it and the saved
    tensors they read."""

    key: str
    producers: list[str]
    deps: list[str]


def add_layer(builder: CostBuilder, layer: int) -> None:
    """The ops and saved tensors of layer `layer` (region ``layers.<layer>``), block by block."""
    shape = LayerShape.of(builder, layer)
    attention_ops, context = _attention_block(builder, shape)
    mlp_input, residual = _norm_between(builder, shape, attention_ops, context)
    mlp_ops, mlp_deps = _mlp_block(builder, shape, mlp_input)
    if not shape.pre_norm:
        _norm_after_mlp(builder, shape, mlp_ops, mlp_deps + [residual])


# ---- attention block ----------------------------------------------------------------------------
def _attention_block(builder: CostBuilder, shape: LayerShape) -> tuple[list[str], str]:
    """Norm (pre-LN), QKV projection, RoPE, the attention core, output projection, residual add.
    Returns (the ops from the output projection to the residual add, the context tensor)."""
    spec, bytes_per_element = builder.spec, builder.bytes_per_element
    region, module, layer_input = shape.region, shape.attention, shape.layer_input
    tokens, hidden, head_dim = shape.tokens, spec.hidden, spec.head_dim
    heads_per_rank, kv_heads_per_rank = shape.heads_per_rank, shape.kv_heads_per_rank
    elements = shape.replicated_elements
    qkv_width = (heads_per_rank + 2 * kv_heads_per_rank) * head_dim
    if shape.pre_norm:
        norm = builder.norm(region, module, f"{shape.norm}1", elements)
        builder.save(layer_input, elements * bytes_per_element, [norm])
        builder.save_norm_stats(module, f"{shape.norm}1", norm, elements, layer_input)
    gather = builder.block_input(region, module, shape.block_elements)
    qkv = builder.matmul(region, module, "qkv", (1, tokens, qkv_width, hidden),
                         tokens * hidden + hidden * qkv_width + tokens * qkv_width, params=hidden * qkv_width)
    if shape.pre_norm:  # with SP the shard is saved, and backward gathers it again (counted in block_input)
        qkv_input = f"{module}:{shape.norm}1.out"
        builder.save(qkv_input, elements * bytes_per_element, [qkv], [norm], [layer_input])
    else:
        qkv_input = layer_input
        builder.save(layer_input, elements * bytes_per_element, [qkv])
    qkv_producers = gather + [qkv]
    if spec.rope:  # rotate q and k: reads and writes both; backward the same (cos/sin are constants)
        rotated = tokens * (heads_per_rank + kv_heads_per_rank) * head_dim
        rope = builder.hbm(region, module, "rope", 2 * rotated * bytes_per_element, 2 * rotated * bytes_per_element)
        qkv_producers = qkv_producers + [rope]
    context, core = _attention_core(builder, shape, qkv_producers, qkv_input)
    context_elements = tokens * heads_per_rank * head_dim
    projection = builder.matmul(region, module, "proj", (1, tokens, hidden, heads_per_rank * head_dim),
                                context_elements + heads_per_rank * head_dim * hidden + tokens * hidden,
                                params=heads_per_rank * head_dim * hidden)
    # with flash the core's output is also what its own backward reads: one tensor, two users
    builder.save(context.key, context_elements * bytes_per_element, [core, projection] if spec.flash else [projection],
                 context.producers, context.deps)
    output = [projection] + builder.block_output(region, module, shape.block_elements)
    add, mask = builder.residual(region, module, elements)
    if mask:
        builder.save(mask, elements * MASK_BYTES, [add], output + [add], [context.key])
    return output + [add], context.key


def _attention_core(builder: CostBuilder, shape: LayerShape, qkv_producers: list[str],
                    qkv_input: str) -> tuple[_Tensor, str]:
    """Saves q, k, v and the attention-core tensors of this rank's heads. Returns (the context, not
    saved yet, and the op whose output it is)."""
    spec, bytes_per_element, module, region = builder.spec, builder.bytes_per_element, shape.attention, shape.region
    micro_batch, seq, head_dim = spec.micro_batch, spec.seq, spec.head_dim
    heads_per_rank, kv_heads_per_rank = shape.heads_per_rank, shape.kv_heads_per_rank
    q, k, v = f"{module}:q", f"{module}:k", f"{module}:v"
    q_elements = micro_batch * seq * heads_per_rank * head_dim  # q and the context: this rank's heads
    kv_elements = micro_batch * seq * kv_heads_per_rank * head_dim
    core_flops = 2.0 * micro_batch * seq * seq * heads_per_rank * head_dim  # each of QK^T and P·V: 2·b·a·s²·d
    if spec.flash:
        share = causal_fraction(seq) if spec.causal else 1.0  # a fused causal kernel skips the blocks above
        core_flops *= share  # the diagonal; unfused attention does not
        kernel = AttentionShape(spec.attention_kernel, head_dim, seq, spec.causal, share)
        lse_bytes = FP32 * micro_batch * heads_per_rank * seq
        fwd_bytes = (q_elements + 2 * kv_elements + q_elements) * bytes_per_element + lse_bytes
        # read q, k, v, o, dO, lse; write dq, dk, dv
        bwd_bytes = ((q_elements + 2 * kv_elements + 2 * q_elements) * bytes_per_element + lse_bytes
                     + (q_elements + 2 * kv_elements) * bytes_per_element)
        flash = builder.attention(region, module, "flash_attn", 2 * core_flops, fwd_bytes, 2.5 * 2 * core_flops,
                                  bwd_bytes, kernel)
        builder.save(q, q_elements * bytes_per_element, [flash], qkv_producers, [qkv_input])
        builder.save(k, kv_elements * bytes_per_element, [flash], qkv_producers, [qkv_input])
        builder.save(v, kv_elements * bytes_per_element, [flash], _unrotated(qkv_producers), [qkv_input])
        builder.save(f"{module}:attn.lse", lse_bytes, [flash], [flash], [q, k, v])
        # the flash output is the output projection's input: one tensor, saved by both ops
        return _Tensor(f"{module}:attn.out", [flash], [q, k, v]), flash
    score_elements = micro_batch * heads_per_rank * seq * seq  # the scores / probabilities
    # batched GEMMs, one per (sample, head): QK^T is s x d by d x s, P·V is s x s by s x d
    heads = micro_batch * heads_per_rank
    av_shape, av_elements = (heads, seq, head_dim, seq), score_elements + kv_elements + q_elements
    scores = builder.matmul(region, module, "scores", (heads, seq, seq, head_dim),
                            q_elements + kv_elements + score_elements)
    builder.save(q, q_elements * bytes_per_element, [scores], qkv_producers, [qkv_input])
    builder.save(k, kv_elements * bytes_per_element, [scores], qkv_producers, [qkv_input])
    # fused scale + mask + softmax: forward reads x, writes y; backward reads y and dy, writes dx
    softmax = builder.hbm(region, module, "softmax", 2 * score_elements * bytes_per_element,
                          3 * score_elements * bytes_per_element)
    softmax_out = f"{module}:softmax.out"
    if spec.dropout > 0:
        dropout_bytes = score_elements * (2 * bytes_per_element + MASK_BYTES)
        dropout = builder.hbm(region, module, "attn_dropout", dropout_bytes, dropout_bytes)
        av = builder.matmul(region, module, "av", av_shape, av_elements)
        builder.save(softmax_out, score_elements * bytes_per_element, [softmax], [scores, softmax], [q, k])
        builder.save(f"{module}:attn_dropout.mask", score_elements * MASK_BYTES, [dropout], [dropout], [softmax_out])
        probs = f"{module}:{DROPOUT_OUT_SUFFIX}"
        builder.save(probs, score_elements * bytes_per_element, [av], [dropout], [softmax_out])
    else:
        av = builder.matmul(region, module, "av", av_shape, av_elements)
        builder.save(softmax_out, score_elements * bytes_per_element, [softmax, av], [scores, softmax], [q, k])
        probs = softmax_out
    builder.save(v, kv_elements * bytes_per_element, [av], _unrotated(qkv_producers), [qkv_input])
    return _Tensor(f"{module}:context", [av], [probs, v]), av


def causal_fraction(seq: int) -> float:
    """Share of the full s x s attention work a fused causal kernel does: FlashAttention-2 (Dao 2023,
    arXiv 2307.08691, Sec. 3.1.1, "Causal masking") skips every key block wholly above the diagonal
    and computes the diagonal blocks in full. In n = ceil(s / B) blocks a side, n(n+1)/2 of n² are
    computed: half, plus half the diagonal."""
    n = -(-seq // FLASH_BLOCK)
    return (n + 1) / (2 * n)


def _unrotated(producers: list[str]) -> list[str]:
    """v's producers: those of q and k but RoPE, which rotates only q and k."""
    return [p for p in producers if not p.endswith(":rope")]


# ---- the norm of x + attention(x) ---------------------------------------------------------------
def _norm_between(builder: CostBuilder, shape: LayerShape, attention_ops: list[str],
                  context: str) -> tuple[_Tensor, str]:
    """The MLP's own norm before it (pre-LN: norm 2) or the attention block's norm after its residual
    (post-LN: norm 1). Returns (the MLP's input, the tensor the MLP's residual adds to)."""
    module = shape.mlp if shape.pre_norm else shape.attention
    name = f"{shape.norm}2" if shape.pre_norm else f"{shape.norm}1"
    elements = shape.replicated_elements
    norm = builder.norm(shape.region, module, name, elements)
    norm_input, norm_output = f"{module}:{name}.in", f"{module}:{name}.out"
    builder.save(norm_input, elements * builder.bytes_per_element, [norm], attention_ops,
                 [context, shape.layer_input])
    builder.save_norm_stats(module, name, norm, elements, norm_input)
    residual = norm_input if shape.pre_norm else norm_output  # what the MLP's residual add adds to
    return _Tensor(norm_output, [norm], [norm_input]), residual


# ---- MLP: dense, or mixture of experts ----------------------------------------------------------
@dataclass(frozen=True)
class _FeedForwardInput:
    """What the MLP's first projections read: the block's input, or its tokens routed to experts."""

    tensor: _Tensor
    rows: int  # tokens, or token copies (each token once per expert it is routed to)
    nbytes: int  # saved bytes
    regather: list[str]  # the collective that re-running the first projections repeats


@dataclass(frozen=True)
class _Routing:
    """The router's ops: the combine weights are made again by re-running them."""

    router: str
    route: str


def _mlp_block(builder: CostBuilder, shape: LayerShape, mlp_input: _Tensor) -> tuple[list[str], list[str]]:
    """The MLP and its residual add. Returns (its ops from the last projection to the residual add,
    the tensors they read)."""
    gather = builder.block_input(shape.region, shape.mlp, shape.block_elements)
    producers = gather + mlp_input.producers
    if builder.spec.experts > 1:
        routing, ffn_input = _route_to_experts(builder, shape, _Tensor(mlp_input.key, producers, mlp_input.deps))
    else:  # with SP the shard is saved, and backward gathers it again
        routing = None
        ffn_input = _FeedForwardInput(_Tensor(mlp_input.key, producers, mlp_input.deps), shape.tokens,
                                      shape.replicated_elements * builder.bytes_per_element, gather)
    ffn = _gelu_mlp if builder.spec.ffn_kind == "gelu" else _swiglu_mlp
    down, down_input = ffn(builder, shape, ffn_input)
    branch, branch_deps = [down], [down_input]
    if routing is not None:
        branch, branch_deps = _combine(builder, shape, ffn_input.rows, down, down_input, routing, mlp_input.key)
    branch = branch + builder.block_output(shape.region, shape.mlp, shape.block_elements)
    add, mask = builder.residual(shape.region, shape.mlp, shape.replicated_elements)
    if mask:
        builder.save(mask, shape.replicated_elements * MASK_BYTES, [add], branch + [add], branch_deps)
    return branch + [add], branch_deps


def _route_to_experts(builder: CostBuilder, shape: LayerShape,
                      mlp_input: _Tensor) -> tuple[_Routing, _FeedForwardInput]:
    """Router: logits over the experts, softmax + top-k (fp32 probabilities saved); dispatch copies
    each token to its k experts (each expert's MLP then runs on its tokens, every expert weight read
    once)."""
    spec, bytes_per_element, region, module = builder.spec, builder.bytes_per_element, shape.region, shape.mlp
    tokens, hidden, experts, per_token = shape.tokens, spec.hidden, spec.experts, spec.experts_per_token
    router = builder.matmul(region, module, "router", (1, tokens, experts, hidden),
                            tokens * hidden + hidden * experts + tokens * experts, params=hidden * experts)
    builder.save(mlp_input.key, shape.replicated_elements * bytes_per_element, [router], mlp_input.producers,
                 mlp_input.deps)
    route = builder.hbm(region, module, "route",
                        tokens * experts * (bytes_per_element + FP32) + tokens * per_token * FP32,
                        tokens * experts * (2 * FP32 + bytes_per_element))
    builder.save(f"{module}:route.probs", FP32 * tokens * experts, [route], [router, route], [mlp_input.key])
    rows = tokens * per_token
    dispatch = builder.hbm(region, module, "dispatch", (tokens + rows) * hidden * bytes_per_element,
                           (rows + tokens) * hidden * bytes_per_element)
    routed = _Tensor(f"{module}:dispatch.out", [router, route, dispatch], [mlp_input.key])
    return _Routing(router, route), _FeedForwardInput(routed, rows, rows * hidden * bytes_per_element, [])


@dataclass(frozen=True)
class _FeedForward:
    """The ops of one feed-forward branch over `rows` tokens: projections into its width and back
    (every expert's weights read once), and elementwise ops over its `width`-wide activations."""

    builder: CostBuilder
    shape: LayerShape
    rows: int

    @property
    def elements(self) -> int:
        return self.rows * self.shape.ffn_per_rank

    @property
    def nbytes(self) -> int:
        return self.elements * self.builder.bytes_per_element

    def _projection(self, name: str, out_features: int, in_features: int, elements_read_and_written: int) -> str:
        spec, width = self.builder.spec, self.shape.ffn_per_rank
        weights = spec.experts * spec.hidden * width  # weight elements of one projection (all experts)
        return self.builder.matmul(self.shape.region, self.shape.mlp, name, (1, self.rows, out_features, in_features),
                                   elements_read_and_written + weights, params=weights)

    def widen(self, name: str) -> str:
        """hidden -> width (fc1, gate, up)."""
        hidden, width = self.builder.spec.hidden, self.shape.ffn_per_rank
        return self._projection(name, width, hidden, self.rows * hidden + self.elements)

    def narrow(self, name: str) -> str:
        """width -> hidden (fc2, down)."""
        hidden, width = self.builder.spec.hidden, self.shape.ffn_per_rank
        return self._projection(name, hidden, width, self.elements + self.rows * hidden)

    def elementwise(self, name: str, forward_passes: int, backward_passes: int) -> str:
        """An HBM-bound op reading and writing `forward_passes` (backward: `backward_passes`) tensors of the width."""
        return self.builder.hbm(self.shape.region, self.shape.mlp, name, forward_passes * self.nbytes,
                                backward_passes * self.nbytes)


def _gelu_mlp(builder: CostBuilder, shape: LayerShape, x: _FeedForwardInput) -> tuple[str, str]:
    """fc1 -> GeLU -> fc2. Returns (the last projection, its saved input)."""
    branch, module = _FeedForward(builder, shape, x.rows), shape.mlp
    fc1 = branch.widen("fc1")
    builder.save(x.tensor.key, x.nbytes, [fc1], x.tensor.producers, x.tensor.deps)
    gelu = branch.elementwise("gelu", 2, 3)
    builder.save(f"{module}:fc1.out", branch.nbytes, [gelu], x.regather + [fc1], [x.tensor.key])
    fc2 = branch.narrow("fc2")
    builder.save(f"{module}:gelu.out", branch.nbytes, [fc2], [gelu], [f"{module}:fc1.out"])
    return fc2, f"{module}:gelu.out"


def _swiglu_mlp(builder: CostBuilder, shape: LayerShape, x: _FeedForwardInput) -> tuple[str, str]:
    """down(silu(gate(x)) * up(x)). Returns (the last projection, its saved input)."""
    branch, module = _FeedForward(builder, shape, x.rows), shape.mlp
    gate = branch.widen("gate")
    silu = branch.elementwise("silu", 2, 3)
    up = branch.widen("up")
    mul = branch.elementwise("mul", 3, 5)
    down = branch.narrow("down")
    nbytes = branch.nbytes
    builder.save(x.tensor.key, x.nbytes, [gate, up], x.tensor.producers, x.tensor.deps)
    builder.save(f"{module}:gate.out", nbytes, [silu], x.regather + [gate], [x.tensor.key])
    builder.save(f"{module}:up.out", nbytes, [mul], x.regather + [up], [x.tensor.key])
    builder.save(f"{module}:silu.out", nbytes, [mul], [silu], [f"{module}:gate.out"])
    builder.save(f"{module}:mul.out", nbytes, [down], [mul], [f"{module}:silu.out", f"{module}:up.out"])
    return down, f"{module}:mul.out"


def _combine(builder: CostBuilder, shape: LayerShape, rows: int, down: str, down_input: str, routing: _Routing,
             mlp_input: str) -> tuple[list[str], list[str]]:
    """The experts' outputs summed, weighted by the router. Returns (the branch's ops, what they read)."""
    bytes_per_element, region, module = builder.bytes_per_element, shape.region, shape.mlp
    tokens, hidden, per_token = shape.tokens, builder.spec.hidden, builder.spec.experts_per_token
    routed_bytes, token_bytes = rows * hidden * bytes_per_element, tokens * hidden * bytes_per_element
    combine = builder.hbm(region, module, "combine", routed_bytes + tokens * per_token * FP32 + token_bytes,
                          token_bytes + routed_bytes * 2 + tokens * per_token * FP32 * 2)
    builder.save(f"{module}:expert.out", rows * hidden * bytes_per_element, [combine], [down], [down_input])
    builder.save(f"{module}:route.weights", tokens * per_token * FP32, [combine], [routing.router, routing.route],
                 [mlp_input])
    return [down, combine], [down_input, f"{module}:route.weights"]


def _norm_after_mlp(builder: CostBuilder, shape: LayerShape, producers: list[str], deps: list[str]) -> None:
    """BERT: LayerNorm after the MLP residual; its output is the next layer's input."""
    name, elements = f"{shape.norm}2", shape.replicated_elements
    norm = builder.norm(shape.region, shape.mlp, name, elements)
    norm_input = f"{shape.mlp}:{name}.in"
    builder.save(norm_input, elements * builder.bytes_per_element, [norm], producers, deps)
    builder.save_norm_stats(shape.mlp, name, norm, elements, norm_input)

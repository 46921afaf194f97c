"""Train a GPT-style model split into pipeline stages (deepspeed.pipe.PipelineModule), optionally
with Megatron-style tensor parallelism inside each stage, under SlackSwap's per-stage plans:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/train_pipe.py --stages 2 \\
        --deepspeed_config configs/slackswap_pipe.json

Ranks are laid out as DeepSpeed's PipeModelDataParallelTopology: stages x data-parallel replicas x
`--tp` tensor-parallel shards (`--num_gpus` = stages x replicas x tp). Each batch runs the config's
gradient accumulation steps as micro-batches under 1F1B. Prints, on rank 0, one line per batch (loss,
time); each stage's first rank prints its plan's measured peak of saved bytes against its budget.
`--report DIR` writes every rank's stage, losses and a digest of its parameters as DIR/rank<r>.json
(tests compare them with the same run under `"enabled": false`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


def parse_args(argv=None):
    import deepspeed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel shards of each stage's layers")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6, help="batches (each of gradient_accumulation_steps micro-batches)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--report", help="write every rank's stage, losses and parameter digest to this folder")
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args(argv)


# ---- tensor parallelism, Megatron-style: f (identity forward, all-reduce backward) before a
# column-parallel layer, g (all-reduce forward, identity backward) after a row-parallel one -----
class _Shards:
    """The tensor-parallel group of this rank's shard (set once DeepSpeed has built its grid)."""

    group = None
    size, rank = 1, 0


class _CopyToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=_Shards.group)
        return grad


class _SumOverShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=_Shards.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _to_shards(x):
    return _CopyToShards.apply(x) if _Shards.size > 1 else x


def _sum_shards(x):
    return _SumOverShards.apply(x) if _Shards.size > 1 else x


def _sharded_linear(full: nn.Linear, tp: int, rank: int, dim: int, bias: bool = True) -> nn.Linear:
    """This shard's slice of `full` along `dim` of its weight (0: column-parallel, 1: row-parallel;
    a row-parallel layer's bias is added once, on shard 0)."""
    w = full.weight.detach().chunk(tp, dim=dim)[rank]
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        out.weight.copy_(w)
        if bias:
            b = full.bias.detach()
            out.bias.copy_(b.chunk(tp)[rank] if dim == 0 else (b if rank == 0 else torch.zeros_like(b)))
    return out


class Embedding(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(args.vocab, args.hidden), nn.Embedding(args.seq, args.hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.tokens(ids) + self.positions(pos))


class Block(nn.Module):
    """Pre-LN attention and MLP, heads and MLP columns split over `tp` shards. The full layer is
    made from the seed and then sliced, so every tp gives the same model."""

    def __init__(self, args, tp: int, rank: int):
        super().__init__()
        h = args.hidden
        qkv, proj, up, down = nn.Linear(h, 3 * h), nn.Linear(h, h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.heads = args.heads // tp
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        # q, k and v of this shard's heads: each of the three split the same way
        parts = [_sharded_linear(_rows(qkv, i, h), tp, rank, 0) for i in range(3)]
        self.qkv = nn.Linear(h, 3 * parts[0].out_features)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([p.weight for p in parts]))
            self.qkv.bias.copy_(torch.cat([p.bias for p in parts]))
        self.proj = _sharded_linear(proj, tp, rank, 1)
        self.up, self.down = _sharded_linear(up, tp, rank, 0), _sharded_linear(down, tp, rank, 1)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(_to_shards(self.ln1(x))).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        x = x + self.drop(_sum_shards(self.proj(a.transpose(1, 2).reshape(b, s, -1))))
        return x + self.drop(_sum_shards(self.down(F.gelu(self.up(_to_shards(self.ln2(x)))))))


def _rows(linear: nn.Linear, i: int, h: int) -> nn.Linear:
    part = nn.Linear(h, h)
    with torch.no_grad():
        part.weight.copy_(linear.weight[i * h:(i + 1) * h])
        part.bias.copy_(linear.bias[i * h:(i + 1) * h])
    return part


class Head(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(args.hidden), nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, x):
        return self.out(self.ln(x))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(args, tp: int, tp_rank: int) -> list[nn.Module]:
    torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its shard
    return [Embedding(args)] + [Block(args, tp, tp_rank) for _ in range(args.layers)] + [Head(args)]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # loopback unless the launcher says otherwise
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import slackswap_ds as ss

    deepspeed.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if args.heads % args.tp or world % (args.stages * args.tp):
        raise SystemExit(f"--heads {args.heads} and {world} ranks must divide by --tp {args.tp} "
                         f"(and the ranks by --stages {args.stages} x --tp)")
    topology = PipeModelDataParallelTopology(num_pp=args.stages, num_mp=args.tp,
                                             num_dp=world // (args.stages * args.tp))
    tp_rank = topology.get_coord(rank).model
    net = PipelineModule(layers=build(args, args.tp, tp_rank), topology=topology, loss_fn=lm_loss,
                         partition_method="uniform")
    if args.tp > 1:
        _Shards.group, _Shards.size, _Shards.rank = net._grid.get_slice_parallel_group(), args.tp, tp_rank
    engine, _, _, _ = ss.initialize(args=args, model=net, model_parameters=[p for p in net.parameters()],
                                    config=args.deepspeed_config)
    batch = engine.train_micro_batch_size_per_gpu()
    data = torch.Generator().manual_seed(args.seed + engine.grid.data_parallel_id)  # each replica its own tokens
    # dropout: fixed per stage replica, identical with or without SlackSwap; the same on a stage's
    # tensor-parallel shards, whose residual stream is replicated and must stay equal
    torch.manual_seed(args.seed + 1000 + engine.grid.data_parallel_id * args.stages + engine.stage_id)

    def micro_batches():
        while True:
            ids = torch.randint(1, args.vocab, (batch, args.seq + 1), generator=data)
            yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    runtime, stream, losses = getattr(engine, "slackswap", None), micro_batches(), []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch(stream)))
        dt = time.perf_counter() - t0
        if rank == 0:
            print(f"batch {step:3d}  loss {losses[-1]:.6f}  {dt * 1e3:8.1f} ms", flush=True)
    torch.distributed.barrier()  # the batch lines first, then one line per stage
    if runtime is not None and runtime.active_plan is not None and runtime.coordinator.leads_group():
        sys.stdout.write(f"stage {engine.stage_id}: saved activations {runtime.last_stats.peak_device_bytes / 2**10:.1f} KiB at "
                         f"the peak of the last batch ({runtime.holds} micro-batch(es) in flight) / budget "
                         f"{runtime.active_plan.budget_bytes / 2**10:.1f} KiB\n")  # one write: lines never interleave
        sys.stdout.flush()
    if args.report:
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in net.parameters())).hexdigest()
        Path(args.report, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "stage": engine.stage_id, "losses": losses, "parameters": digest,
             "digest": runtime.active_plan.digest if runtime is not None and runtime.active_plan else None}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

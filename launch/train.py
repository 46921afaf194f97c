"""Train a GPT-2- or Llama-style model (Hugging Face config, random init, synthetic tokens) with
DeepSpeed under SlackSwap:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/slackswap.json

Prints, on rank 0, one line per step: loss, step time, and saved-activation bytes on the device
against the budget (SlackSwap's own accounting). `--losses FILE` writes the loss sequence as JSON
(tests compare it with the same run under `"enabled": false`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def parse_args(argv=None):
    import deepspeed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--losses", help="write the per-step losses (rank 0) to this JSON file")
    ap.add_argument("--params", help="write a sha256 of the final parameters (rank 0; gathered under ZeRO-3) here")
    ap.add_argument("--compile-blocks", metavar="BACKEND",
                    help="torch.compile each transformer block with BACKEND (inductor, aot_eager), as torchtitan "
                         "does; SlackSwap keeps, swaps or runs again each block's compiled call")
    ap.add_argument("--rdrop", action="store_true",
                    help="R-Drop's loss: two training forwards of each batch (dropout differs), one backward of "
                         "both losses plus the mean squared distance of their logits")
    ap.add_argument("--compile-model", metavar="BACKEND",
                    help="engine.compile(backend=BACKEND) after initialize: the whole model compiled; SlackSwap "
                         "compiles each block on its own instead (said in the log)")
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args(argv)


def build_model(args) -> torch.nn.Module:
    import transformers

    if args.model == "gpt2":
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                      n_positions=args.seq, vocab_size=args.vocab, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                   intermediate_size=4 * args.hidden, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, vocab_size=args.vocab,
                                   max_position_embeddings=args.seq, attention_dropout=0.1,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def parameters_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in order (ZeRO-3's partitions gathered first)."""
    import hashlib

    import deepspeed

    params = list(model.parameters())
    digest = hashlib.sha256()
    with deepspeed.zero.GatheredParameters(params):
        for p in params:
            digest.update(p.detach().cpu().float().numpy().tobytes())
    return digest.hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # loopback unless the launcher says otherwise
    import deepspeed

    import slackswap_ds as ss

    torch.manual_seed(args.seed)
    model = build_model(args).train()
    if args.compile_blocks:
        blocks = model.transformer.h if args.model == "gpt2" else model.model.layers
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend=args.compile_blocks)
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    engine, _, _, _ = ss.initialize(args=args, model=model, model_parameters=model.parameters(),
                                    config=args.deepspeed_config)
    if args.compile_model:
        engine.compile(backend=args.compile_model)
    batch = engine.train_micro_batch_size_per_gpu()
    data = torch.Generator().manual_seed(args.seed + rank)  # each data-parallel rank its own tokens
    torch.manual_seed(args.seed + 1000 + rank)  # dropout: fixed per rank, identical with or without SlackSwap
    runtime = getattr(engine, "slackswap", None)
    losses = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(1, args.vocab, (batch, args.seq), generator=data).to(engine.device)
        t0 = time.perf_counter()
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        if args.rdrop:  # (two forwards before one backward: SlackSwap profiles and plans them as one step)
            other = engine(input_ids=ids, labels=ids, use_cache=False)
            loss = loss + other.loss + torch.nn.functional.mse_loss(out.logits, other.logits)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if rank == 0:
            act = ""
            if runtime is not None and runtime.last_stats is not None and runtime.active_plan is not None:
                s = runtime.last_stats
                act = (f"  activations {s.peak_device_bytes / 2**20:8.2f} MiB / budget "
                       f"{runtime.active_plan.budget_bytes / 2**20:.2f} MiB (kept {s.kept_bytes / 2**20:.2f}, "
                       f"swapped {s.swapped_bytes / 2**20:.2f}, recomputed {s.recomputed_bytes / 2**20:.2f})")
            elif runtime is not None and runtime.last_stats is not None and step <= runtime.cfg.profile_steps:
                act = (f"  activations {runtime.last_stats.peak_device_bytes / 2**20:8.2f} MiB on the device "
                       f"(warm-up in the shelter: saved tensors on host)")
            elif runtime is not None:
                act = "  (profiling: saved tensors on host)" if step == runtime.cfg.profile_steps + 1 else ""
            print(f"step {step:3d}  loss {losses[-1]:.6f}  {dt * 1e3:8.1f} ms{act}", flush=True)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if args.params:
        digest = parameters_digest(model)  # (every rank: ZeRO-3 gathers the partitions)
        if rank == 0:
            with open(args.params, "w") as f:
                f.write(digest)
    # leave the process group before the interpreter exits: a communication thread still running
    # during finalization aborts the process ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

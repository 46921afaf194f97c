"""What the adoption scripts share: a tiny GPT-2, its batches, and where the losses go.

Each script in this folder is a training script that has never heard of SlackSwap: it calls
DeepSpeed (directly, or through Hugging Face's Trainer or Accelerate) with a DeepSpeed JSON. The
tests start them through `python -m slackswap_ds.run` with the real launchers, with the JSON's
"slackswap" section enabled and disabled, and compare the losses."""

from __future__ import annotations

import argparse
import json
import os

import torch

SEQ, BATCH, STEPS, VOCAB = 16, 2, 6, 128


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--losses", required=True, help="rank 0 writes its per-step losses here (JSON)")
    ap.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    ap.add_argument("--torch-compile", metavar="BACKEND", help="Trainer scripts: TrainingArguments(torch_compile=True, "
                    "torch_compile_backend=BACKEND)")
    ap.add_argument("--steps", type=int, help="Trainer scripts: max_steps (default: the script's own)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="Trainer scripts: TrainingArguments(gradient_checkpointing=True)")
    return ap.parse_args(argv)


def trainer_options(args) -> dict:
    """The TrainingArguments that --torch-compile and --gradient-checkpointing ask for."""
    options = {"gradient_checkpointing": True} if args.gradient_checkpointing else {}
    if args.torch_compile:
        options.update(torch_compile=True, torch_compile_backend=args.torch_compile)
    return options


def model():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=VOCAB,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


def batch(i: int) -> torch.Tensor:
    """Batch i, the same on every rank and in every script."""
    return torch.randint(1, VOCAB, (SEQ,) if i < 0 else (BATCH, SEQ), generator=torch.Generator().manual_seed(i))


def write_losses(path: str, losses: list[float]) -> None:
    """Rank 0 writes the losses; then every rank leaves the process group (a communication thread
    still running while the interpreter exits aborts the process)."""
    if int(os.environ.get("RANK", "0")) == 0:
        with open(path, "w") as f:
            json.dump(losses, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()

"""A training script run several times in one launch, for tests that compare runs (launch/train.py
in tests/test_engine.py; launch/train_pipe.py and tests/pipe/worker.py in tests/test_stages.py): one
process group, and one import of torch, DeepSpeed and transformers per rank, serve every run.

    deepspeed --num_gpus N tests/launch/in_turn.py launch/train.py RUNS.json

RUNS.json is a list of [name, the script's arguments]. Each run is the script's own main() with its
arguments: a fresh model from its seed, a fresh engine, its prints, its files. Rank 0 prints
`=== RUN <name>` before each run once every rank is done with the one before, and `=== END` after
the last: the job's output between two such lines is one run's, from every rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import deepspeed
import torch


def mark(text: str) -> None:
    """`text` on rank 0, with every rank's output of the run before above it and none of the next."""
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(text, flush=True)
    torch.distributed.barrier()


def load_script(path: Path):
    """The training script at `path`, loaded as a module (its main(argv) is a run), its own folder
    on the path first, as `python script.py` has it."""
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("script")
    p.add_argument("runs")
    p.add_argument("--local_rank", type=int, default=0)  # DeepSpeed's launcher passes it
    args = p.parse_args()
    script = load_script(Path(args.script))
    runs = json.loads(Path(args.runs).read_text())
    deepspeed.init_distributed()  # as the script's main does; its own call then finds the group made
    leave = torch.distributed.destroy_process_group
    # the script's main leaves the process group as it ends (right for a job of one run): the next
    # run needs it, so it is left once, after the last
    torch.distributed.destroy_process_group = lambda *args, **kwargs: None
    for name, argv in runs:
        mark(f"=== RUN {name}")
        assert script.main(argv) == 0
    mark("=== END")
    leave()


if __name__ == "__main__":
    main()

"""A deepspeed.pipe.PipelineModule (2 stages; with 4 ranks, 2 stages x 2 data-parallel) trained by
`ss.initialize` for tests/test_stages.py: dropout on, 4 micro-batches per batch under 1F1B.

    deepspeed --num_gpus N tests/pipe/worker.py --config CONFIG.json --out DIR [--fault SCENARIO] [--lengths]
        [--compile-at B]

With --lengths, the module allows dynamic shapes and every data-parallel replica draws its own
sequence length (one of LENGTHS) for each batch, for BATCHES_OF_LENGTHS batches. With --compile-at B,
every Block is compiled (`Module.compile`, Dynamo's eager backend: the same kernels) before batch B.

(tests/launch/in_turn.py runs its main once per config in one launch.)

Every rank writes DIR/rank<r>.json: its stage, the batches' losses, and under SlackSwap its plan's
digest and budget, every stage's digest, and the peak of saved bytes measured in the planned
batches. Fault scenarios (the faulty rank in the name; each rank prints `FAULT-TEST enter <rank>`
as the batch that plans begins):
    stop3-agree   rank 3 (stage 1) stops (SIGSTOP) when its stage's agreement begins
    kill3-agree   rank 3 (stage 1) dies (os._exit) when its stage's agreement begins
    kill1-facts   rank 1 (stage 0) dies when the node facts exchange begins
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fault hooks
from fault_hooks import fault_before, ranks_from_mpi, say, stop_here  # noqa: E402

if __name__ == "__main__":
    ranks_from_mpi()  # before DeepSpeed reads them

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

import slackswap_ds as ss  # noqa: E402
from slackswap_ds import coordination, plan_maker  # noqa: E402

WIDTH, SEQ, BATCHES, BATCHES_OF_LENGTHS, LENGTHS = 32, 8, 4, 12, (6, 8, 12, 16)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fault", default="")
    p.add_argument("--lengths", action="store_true")
    p.add_argument("--compile-at", type=int, default=-1)
    args = p.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH)] + [Block() for _ in range(6)] + [torch.nn.Linear(WIDTH, WIDTH)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         dynamic_shape=args.lengths)
    with open(args.config) as f:
        config = json.load(f)
    engine, *_ = ss.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                               config=config)
    if args.fault == "stop3-agree" and rank == 3:
        fault_before(plan_maker, "agree", stop_here)
    if args.fault == "kill3-agree" and rank == 3:
        fault_before(plan_maker, "agree", lambda: os._exit(1))
    if args.fault == "kill1-facts" and rank == 1:
        fault_before(coordination, "exchange", lambda: os._exit(1))  # the node facts are the first exchange

    def batches():
        g = torch.Generator().manual_seed(1 + engine.grid.data_parallel_id)
        while True:
            seq = LENGTHS[int(torch.randint(len(LENGTHS), (), generator=g))] if args.lengths else SEQ
            for _ in range(engine.micro_batches):  # a batch of one length (the replicas' differ)
                yield torch.randn(2, seq, WIDTH, generator=g), torch.randn(2, seq, WIDTH, generator=g)

    data, losses, peak, steps, events = batches(), [], 0, [], []
    runtime = getattr(engine, "slackswap", None)
    for b in range(BATCHES_OF_LENGTHS if args.lengths else BATCHES):
        if b == 1 and args.fault:
            say(f"FAULT-TEST enter {rank}")
        if b == args.compile_at:
            for module in net.modules():
                if isinstance(module, Block):
                    module.compile(backend="eager")
        losses.append(float(engine.train_batch(data)))
        if runtime is None:
            continue
        events.append([e.name for e in runtime.events])
        if runtime.last_stats is not None and b >= 2:
            peak = max(peak, runtime.last_stats.peak_device_bytes)
        if runtime.active_plan is not None:
            steps.append([runtime.last_stats.peak_device_bytes, runtime.active_plan.budget_bytes])
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    out = {"rank": rank, "stage": engine.stage_id, "losses": losses, "parameters": params}
    if runtime is not None:
        state = next(iter(runtime.shapes.values()))
        out.update(digest=state.plan.digest, budget=state.plan.budget_bytes, peak=peak, holds=runtime.holds,
                   keep_all=runtime.holds * state.profile.total_bytes, stage_plans=runtime.coordinator.stage_plans,
                   predicted_peak=state.prediction.peak_bytes, layers=int(dict(state.profile.meta)["layers"]),
                   shelter_peak=runtime.shelter_peak, steps=steps, shapes=len(runtime.shapes), events=events,
                   profiled=runtime.profiled_steps, derived=runtime.derived_plans, summary=runtime.end_of_job())
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    say(f"FAULT-TEST done {rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One rank of a small DeepSpeed job under SlackSwap in which one fault happens, for
tests/test_faults.py. Started 4 times by the test (torch.distributed store: RANK etc. set) or by
`mpiexec -iface lo -n 4` (MPI: the ranks come from MPICH's PMI variables).

    worker.py SCENARIO TIMEOUT_S

Scenarios (the faulty rank in the name):
    stop0-plan    rank 0 stops (SIGSTOP) once it has planned, before it sends its plan
    stop3-agree   rank 3 stops when agreement begins
    kill2-facts   rank 2 dies (os._exit) when the node facts exchange begins
    shape3        rank 3 profiles a batch of another sequence length than the others (no fault: each
                  rank plans its own shapes)
    newshape23    after the first plan, ranks 2 and 3 get a new sequence length, ranks 0 and 1 do not
                  (no fault: ranks 2 and 3 plan alone, nobody waits)
    forward3      rank 3's model runs another forward (SiLU for GELU) on the same shapes
    lateforward3  from step 3 every rank runs a new length, and rank 3 a gated GELU (no fault that
                  stops the job: the later shape's structures are compared lazily)
    sync-mpi      "sync": "mpi" in a job that MPI did not launch
    ok            no fault (the stress of many rounds is in tests/faults/stress.py)

Each rank prints `FAULT-TEST enter <rank>` as the step with the fault begins; the test times every
rank's error from there.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fault hooks
from fault_hooks import fault_before, ranks_from_mpi, say, stop_here  # noqa: E402

if __name__ == "__main__":
    ranks_from_mpi()  # before DeepSpeed reads them

import slackswap_ds as ss  # noqa: E402
from slackswap_ds import coordination, plan_maker  # noqa: E402


class Block(torch.nn.Module):
    act = staticmethod(torch.nn.functional.gelu)  # forward3: SiLU on rank 3

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(self.act(self.up(x))))


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def main(scenario: str, timeout_s: float) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = Tiny(depth=12).train()  # a plan message of ~20 KB: above MPI's eager limit, so a send to a stopped rank stays pending
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "steps_per_print": 10 ** 6,
              "slackswap": {"activation_budget": 0.5, "hardware": "a100-80g-pcie4", "profile_steps": 1,
                            "sync_timeout_s": timeout_s, "log_level": "info",
                            "sync": "mpi" if scenario == "sync-mpi" else "auto"}}
    engine, _, _, _ = ss.initialize(model=model, model_parameters=model.parameters(), config=config)
    if scenario == "stop0-plan" and rank == 0:
        fault_before(plan_maker, "agree", stop_here)
    if scenario == "stop3-agree" and rank == 3:
        fault_before(plan_maker, "agree", stop_here)
    if scenario == "kill2-facts" and rank == 2:
        fault_before(coordination, "exchange", lambda: os._exit(1))  # the node facts
    if scenario == "forward3" and rank == 3:
        Block.act = staticmethod(torch.nn.functional.silu)
    seq = 8
    for step in range(1, 5):
        if scenario == "lateforward3" and step == 3:
            seq = 16
            if rank == 3:  # a gated GELU: it saves tensors the others' blocks do not
                Block.act = staticmethod(lambda t: torch.nn.functional.gelu(t) * torch.sigmoid(t))
        if step == 2 or (scenario == "newshape23" and step == 3):
            say(f"FAULT-TEST enter {rank}")
        if scenario == "shape3" and rank == 3 and step >= 2:
            seq = 12
        if scenario == "newshape23" and rank in (2, 3) and step >= 3:
            seq = 16
        x = torch.randn(2, seq, 32)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
    say(f"FAULT-TEST done {rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))

"""Run under `mpiexec -iface lo -n 4` by tests/test_dist.py; each rank writes its result as JSON to
$SLACKSWAP_TEST_OUT/<rank>.json (files, not stdout: four processes' lines can interleave)."""

import json
import os
import sys
import time

import torch

import slackswap_ds as ss
from slackswap_ds.agreement import AgreementError, agree, exchange
from slackswap_ds.channels import MpiChannel
from slackswap_ds.hardware import load_node
from slackswap_ds.node_facts import RankFacts, node_layout, shares_of
from slackswap_ds.plan import Decision, Plan


def tiny():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


class Blocks(torch.nn.Module):
    """Residual MLP blocks in plain torch: a model to plan for where no rank trains under the plan."""

    def __init__(self, width: int = 32, depth: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                                              torch.nn.Linear(4 * width, width))
                                          for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def model_and_batch(trains: bool):
    """The model and the batch (the same on every rank: replicas of one data-parallel step shape).
    Where the ranks train under the agreed plan and compare every gradient bit for bit, a GPT-2;
    where they only agree on a plan, refuse it or wait for it, plain torch blocks: a profile and a
    plan as well, without importing transformers (seconds of every rank's start)."""
    if trains:
        model = tiny()
        torch.manual_seed(100)
        ids = torch.randint(1, 128, (2, 16))
        return model, {"input_ids": ids, "labels": ids, "use_cache": False}
    torch.manual_seed(0)
    model = Blocks().train()
    return model, {"x": torch.randn(2, 16, 32)}


def step(model, batch):
    out = model(**batch)
    loss = out if torch.is_tensor(out) else out.loss
    loss.backward()
    return loss


def grads(model, batch, ctx=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    if ctx is None:
        loss = step(model, batch)
    else:
        with ctx:
            loss = step(model, batch)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def emit(row: dict) -> None:
    path = os.path.join(os.environ["SLACKSWAP_TEST_OUT"], f"{row['rank']}.json")
    with open(path + ".part", "w") as f:
        json.dump(row, f)
    os.replace(path + ".part", path)  # whole or absent: another rank may be counting the rows


def stay_for_every_row(world: int, limit_s: float = 60) -> None:
    """Leave only once every rank wrote its row (or after limit_s): MPICH's launcher kills the ranks
    still running once the others have left, and a late rank (stuck) has its own error to write."""
    deadline = time.monotonic() + limit_s
    rows = lambda: [f for f in os.listdir(os.environ["SLACKSWAP_TEST_OUT"]) if f.endswith(".json")]  # noqa: E731
    while len(rows()) < world and time.monotonic() < deadline:
        time.sleep(0.1)


def main(scenario: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    layout, local = node_layout(comm, ranks_per_node=2)
    out = {"rank": layout.rank, "node": layout.node, "local_rank": layout.local_rank,
           "node_ranks": list(layout.node_ranks)}
    node = load_node("dgx-a100")
    channel = MpiChannel(comm)
    if scenario == "shares":
        # every rank tells the others its node (MPI shared-memory grouping), uplink and demand, then
        # computes every rank's share exactly as the engine does
        demand = [int(x) for x in sys.argv[2:4]][layout.local_rank]
        pool = int(sys.argv[4])
        mine = RankFacts(node=f"mpi node {layout.node}", uplink=layout.local_rank // node.gpus_per_switch, demand=demand)
        facts = [RankFacts.from_json(b) for b in exchange(channel, "facts", mine.to_json(), 30, "node facts")]
        share = shares_of(facts, node.gpu, node.switch_uplink_bps, pool)[layout.rank]
        out.update(d2h=share.d2h_bps, h2d=share.h2d_bps, pool=share.host_pool_bytes, uplink=node.switch_uplink_bps)
        emit(out)
        return
    model, batch = model_and_batch(trains=scenario == "agree")
    profile = ss.profile_step(model, step, batch, warmup=0)
    plan = ss.plan(profile, "a100-80g-pcie4", 0.5) if layout.rank == 0 else None
    if scenario == "exit" and layout.rank == 1:
        emit({**out, "exited": True})
        sys.exit(0)
    if scenario == "stuck" and layout.rank == 1:
        import time

        time.sleep(float(sys.argv[2]) + 5)  # alive, but far too late
    tamper = None
    if scenario == "tamper" and layout.rank == 2:
        def tamper(p):
            key, dec = p.decisions[0]
            flipped = Decision.KEEP if dec is not Decision.KEEP else Decision.SWAP
            return Plan(((key, flipped),) + p.decisions[1:], p.prefetch, p.budget_bytes, p.profile_digest,
                        p.hardware_digest, p.planner, p.planner_version, p.blocking)
    import time

    began = time.monotonic()
    try:
        agreed_profile, agreed = agree(channel, profile, plan, timeout_s=float(sys.argv[2]) if len(sys.argv) > 2 else 30,
                                       on_receive=tamper)
    except AgreementError as e:
        emit({**out, "error": str(e), "seconds": time.monotonic() - began})
        stay_for_every_row(layout.world)
        return
    reference = grads(model, batch)
    result = grads(model, batch, ss.apply(model, agreed, agreed_profile))
    exact = torch.equal(result[0], reference[0]) and all(torch.equal(result[1][k], reference[1][k]) for k in reference[1])
    out.update(digest=agreed.digest, exact=exact)
    emit(out)


if __name__ == "__main__":
    main(sys.argv[1])

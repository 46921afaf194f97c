"""50 rounds of the agreement protocol (node facts exchange, then plan agreement) under
`mpiexec -iface lo -n 4`, each with random delays on random ranks, for tests/test_faults.py.
Every rank prints `STRESS ok <rank> <rounds> <digests>` when every round agreed."""

import random
import sys
import time

import torch

import slackswap_ds as ss
from slackswap_ds.agreement import agree, exchange
from slackswap_ds.channels import MpiChannel

from worker import Tiny  # tests/faults/worker.py: the same small model as the fault tests


def main(rounds: int, timeout_s: float) -> None:
    channel = MpiChannel()
    rank = channel.rank
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 8, 32)
    profile = ss.profile_step(model, lambda m, x: m(x).backward(), x, warmup=0)
    plan = ss.plan(profile, "a100-80g-pcie4", 0.5) if rank == 0 else None
    digests = set()
    for n in range(rounds):
        chaos = random.Random(n)  # the same draw on every rank: who is late, by how much, where
        late = chaos.sample(range(channel.world), chaos.randint(1, channel.world))
        delays = {r: chaos.uniform(0, 0.1) for r in late}
        where = chaos.choice(["exchange", "agree", "both"])
        if where in ("exchange", "both"):
            time.sleep(delays.get(rank, 0))
        facts = exchange(channel, "facts", f"rank {rank} round {n}", timeout_s, "facts")
        assert facts == [f"rank {r} round {n}" for r in range(channel.world)], facts
        if where in ("agree", "both"):
            time.sleep(delays.get(rank, 0))
        _, agreed = agree(channel, profile, plan, timeout_s)
        digests.add(agreed.digest)
    sys.stdout.write(f"STRESS ok {rank} {rounds} {len(digests)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))

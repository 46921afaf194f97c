"""Node coordination: which ranks share a node and a host uplink, each rank's share of the node's
PCIe uplinks and pinned pool, and the one Share a plan for every replica must fit.

Ranks on one node are grouped by MPI (`COMM_TYPE_SHARED`) under MPI launchers, by host name over
torch.distributed otherwise, or by `ranks_per_node` (consecutive ranks; for tests and launchers that
run several "nodes" on one host). Before planning, the ranks exchange their `RankFacts` (node, host
uplink, demand, and the step they plan: its input shapes and profile structure) through rank 0
with `agreement.exchange`; every rank then computes every rank's Share the same way (`shares_of`).
Where the replicas plan the same shapes, rank 0 plans with the tightest of their shares
(`tightest`), so that their one plan fits each of their links and pools; where their shapes
differ, each plans its own with its own share.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from .channels import mpi_module
from .hardware import Hardware
from .shares import Share, split_node


@dataclass(frozen=True)
class RankFacts:
    """What a rank tells the others before planning."""

    node: str  # ranks with equal `node` share host memory and switches
    uplink: int  # its GPU's host uplink on that node (topology.Topology.uplink_of)
    demand: int  # bytes it may want to pin: its activations above the budget
    shapes: str = ""  # the input shapes of the step it plans (data-parallel ranks' may differ)
    structure: str = ""  # its profile's structure digest (equal on ranks of equal shapes)

    @property
    def step(self) -> str:
        return f"input shapes {self.shapes}, profile {self.structure[:12]}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RankFacts":
        d = json.loads(text)
        return cls(str(d["node"]), int(d["uplink"]), int(d["demand"]), str(d.get("shapes", "")),
                   str(d.get("structure", "")))


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: its node, its place on the node, and who shares that node."""

    rank: int
    world: int
    node: int
    local_rank: int
    node_ranks: tuple[int, ...]

    @property
    def local_size(self) -> int:
        return len(self.node_ranks)


def node_layout(comm=None, ranks_per_node: int | None = None) -> tuple[Layout, object]:
    """(Layout, node-local communicator). Ranks on one host share memory (MPI COMM_TYPE_SHARED);
    `ranks_per_node` overrides that grouping (consecutive ranks), for tests and unusual launchers."""
    MPI = mpi_module()
    comm = comm or MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if ranks_per_node:
        local = comm.Split(color=rank // ranks_per_node, key=rank)
    else:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    members = np.zeros(local.Get_size(), dtype=np.int64)
    local.Allgather([np.array([rank], dtype=np.int64), MPI.INT64_T], [members, MPI.INT64_T])
    node_ranks = tuple(int(r) for r in members)
    leaders = np.zeros(world, dtype=np.int64)
    comm.Allgather([np.array([node_ranks[0]], dtype=np.int64), MPI.INT64_T], [leaders, MPI.INT64_T])
    node = sorted(set(int(x) for x in leaders)).index(node_ranks[0])
    return Layout(rank, world, node, node_ranks.index(rank), node_ranks), local


def shares_of(facts: Sequence[RankFacts], hw: Hardware, uplink_bps: float,
              host_pool_bytes_per_node: int | None, pinned_per_rank: int = 0) -> list[Share]:
    """Every rank's Share, in rank order: `split_node` over the ranks of each node, of the node's
    pool net of what each of its ranks pins for something else (`pinned_per_rank`: ZeRO-Offload's
    optimizer state)."""
    shares: list[Share | None] = [None] * len(facts)
    for node in dict.fromkeys(f.node for f in facts):
        ranks = [r for r, f in enumerate(facts) if f.node == node]
        pool = host_pool_bytes_per_node
        if pool is not None:
            pool = max(0, pool - pinned_per_rank * len(ranks))
        per_rank = split_node([facts[r].uplink for r in ranks], [facts[r].demand for r in ranks], hw, uplink_bps,
                              pool)
        for r, s in zip(ranks, per_rank):
            shares[r] = s
    return shares

"""Node coordination over MPI (mpi4py): which ranks share a node and a switch, each rank's share of
the node's PCIe uplinks and pinned pool, and one agreed plan for data-parallel replicas.

Agreement protocol (point to point, so a dead or stuck rank is *named*, never waited on forever):

    rank 0  -> every rank   payload: rank 0's profile and plan, canonical JSON bytes (no pickle)
    rank r  -> rank 0       report: does the plan fit r's own step? and the digest r received
    rank 0  -> every rank   verdict: "ok", or the error text naming the ranks at fault

Every wait polls a non-blocking request against one deadline (`timeout_s`). A rank that never
sends its report is named by rank 0; if rank 0 itself is gone, the others name it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import PlanError, SlackSwapError
from .hardware import Node
from .plan import Plan
from .planners.common import Share
from .profile import StepProfile

_FITS, _OTHER_STEP, _PLAN_UNFIT = 1, 2, 3  # a rank's report on the plan it received
_TAG_SIZE, _TAG_PAYLOAD, _TAG_REPORT, _TAG_VERDICT_SIZE, _TAG_VERDICT = 7101, 7102, 7103, 7104, 7105


class AgreementError(SlackSwapError):
    """Ranks that must run the same plan do not agree, or did not answer in time."""


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
    from mpi4py import MPI

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


def node_shares(node: Node, local_size: int, demands: list[int], host_pool_bytes: int | None) -> list[Share]:
    """Each local rank's Share of its node: the switch uplink split evenly among the ranks behind
    that switch (capped by the GPU's own rates), and the pinned pool split by demand (what each
    rank would swap): everyone gets its demand when they fit, else pool * demand / total demand."""
    if len(demands) != local_size:
        raise ValueError(f"need one demand per local rank ({local_size}), got {len(demands)}")
    shares = []
    per_switch = node.gpus_per_switch
    for local_rank in range(local_size):
        switch = local_rank // per_switch
        on_switch = min(per_switch, local_size - switch * per_switch)
        link = node.switch_uplink_bps / on_switch
        shares.append(Share(min(node.gpu.d2h_bps, link), min(node.gpu.h2d_bps, link), None))
    if host_pool_bytes is not None:
        total = sum(demands)
        pools = list(demands) if total <= host_pool_bytes else \
            [host_pool_bytes * d // total for d in demands]
        shares = [Share(s.d2h_bps, s.h2d_bps, int(p)) for s, p in zip(shares, pools)]
    return shares


def agree(comm, local: StepProfile, plan: Plan | None, timeout_s: float,
          on_receive: Callable[[Plan], Plan] | None = None) -> tuple[StepProfile, Plan]:
    """Rank 0's profile and plan on every rank of `comm` (see the module docstring).
    `on_receive` lets a test tamper with what a rank received."""
    from mpi4py import MPI

    rank, world = comm.Get_rank(), comm.Get_size()
    deadline = time.monotonic() + timeout_s
    if world == 1:
        return local, plan
    if rank == 0:
        payload = json.dumps({"profile": local.to_json(), "plan": plan.to_json()}).encode()
        body = np.frombuffer(payload, dtype=np.uint8)
        size = np.array([body.size], dtype=np.int64)
        sends = [comm.Isend([size, MPI.INT64_T], dest=r, tag=_TAG_SIZE) for r in range(1, world)]
        sends += [comm.Isend([body, MPI.BYTE], dest=r, tag=_TAG_PAYLOAD) for r in range(1, world)]
        reports = {}
        bufs = {r: np.zeros(65, dtype=np.uint8) for r in range(1, world)}
        reqs = {r: comm.Irecv([bufs[r], MPI.BYTE], source=r, tag=_TAG_REPORT) for r in range(1, world)}
        while reqs and time.monotonic() < deadline:
            for r in [r for r, q in reqs.items() if q.Test()]:
                reports[r] = bufs[r]
                del reqs[r]
            time.sleep(0.001)
        for q in reqs.values():
            q.Cancel()
        problems = []
        if reqs:
            problems.append(f"ranks {sorted(reqs)} did not report within sync_timeout_s={timeout_s:g} "
                            f"(exited or stuck before plan agreement)")
        other_step = sorted(r for r, b in reports.items() if b[0] == _OTHER_STEP)
        if other_step:
            problems.append(f"ranks {other_step} run a different step than rank 0 (saved-tensor names or "
                            f"bytes differ): they cannot share its plan")
        unfit = sorted(r for r, b in reports.items() if b[0] == _PLAN_UNFIT)
        if unfit:
            problems.append(f"ranks {unfit} received a plan that does not fit rank 0's own profile")
        mismatch = sorted(r for r, b in reports.items() if bytes(b[1:]).decode() != plan.digest)
        if mismatch:
            problems.append(f"ranks {mismatch} hold a plan whose digest differs from rank 0's "
                            f"{plan.digest[:12]} (corrupted or tampered in transit)")
        verdict = ("ok" if not problems else "; ".join(problems)).encode()
        vbody = np.frombuffer(verdict, dtype=np.uint8)
        vsize = np.array([vbody.size], dtype=np.int64)
        alive = [r for r in range(1, world) if r in reports]
        vsends = [comm.Isend([vsize, MPI.INT64_T], dest=r, tag=_TAG_VERDICT_SIZE) for r in alive]
        vsends += [comm.Isend([vbody, MPI.BYTE], dest=r, tag=_TAG_VERDICT) for r in alive]
        _wait_all(sends + vsends, deadline + timeout_s, "rank 0: sending the plan", cancel=True)
        if problems:
            raise AgreementError("plan agreement failed: " + "; ".join(problems))
        return local, plan

    size = np.zeros(1, dtype=np.int64)
    _wait_all([comm.Irecv([size, MPI.INT64_T], source=0, tag=_TAG_SIZE)], deadline,
              f"rank {rank}: rank 0 did not send a plan within sync_timeout_s={timeout_s:g}")
    body = np.zeros(int(size[0]), dtype=np.uint8)
    _wait_all([comm.Irecv([body, MPI.BYTE], source=0, tag=_TAG_PAYLOAD)], deadline,
              f"rank {rank}: rank 0's plan did not arrive within sync_timeout_s={timeout_s:g}")
    data = json.loads(body.tobytes().decode())
    profile = StepProfile.from_json(data["profile"])
    received = Plan.from_json(data["plan"])
    if on_receive is not None:
        received = on_receive(received)
    status = _FITS if profile.structure_digest == local.structure_digest else _OTHER_STEP
    try:
        received.check(profile)
    except PlanError:
        status = _PLAN_UNFIT
    report = np.frombuffer(bytes([status]) + received.digest.encode(), dtype=np.uint8).copy()
    _wait_all([comm.Isend([report, MPI.BYTE], dest=0, tag=_TAG_REPORT)], deadline,
              f"rank {rank}: rank 0 did not take this rank's report within sync_timeout_s={timeout_s:g}")
    vsize = np.zeros(1, dtype=np.int64)
    _wait_all([comm.Irecv([vsize, MPI.INT64_T], source=0, tag=_TAG_VERDICT_SIZE)], deadline + timeout_s,
              f"rank {rank}: no verdict from rank 0 within sync_timeout_s={timeout_s:g}")
    vbody = np.zeros(int(vsize[0]), dtype=np.uint8)
    _wait_all([comm.Irecv([vbody, MPI.BYTE], source=0, tag=_TAG_VERDICT)], deadline + timeout_s,
              f"rank {rank}: no verdict from rank 0 within sync_timeout_s={timeout_s:g}")
    verdict = vbody.tobytes().decode()
    if verdict != "ok":
        raise AgreementError(f"plan agreement failed (verdict of rank 0): {verdict}")
    return profile, received


def _wait_all(requests: list, deadline: float, message: str, cancel: bool = False) -> None:
    pending = list(requests)
    while pending:
        pending = [q for q in pending if not q.Test()]
        if not pending:
            return
        if time.monotonic() > deadline:
            if cancel:
                for q in pending:
                    q.Cancel()
                return
            raise AgreementError(message)
        time.sleep(0.001)

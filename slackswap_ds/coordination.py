"""How one rank agrees with the others: channels, node facts and shares, and giving up.

What is agreed, once per job, at its first planned step (every rank's first step after the
warm-up, so every rank is there):

    1. node facts  every rank sends rank 0 its node, host uplink, demand and step (dist.RankFacts),
                   and rank 0 answers with everyone's; each rank computes every rank's Share of its
                   node (uplink split among the ranks on it, pinned pool max-min fair by demand);
                   its own sizes its host pool (`exchange_facts`). The shares hold for the job.
    2. plan        where the ranks that run one plan are on the same input shapes, the first of
                   them plans with the tightest Share of theirs, so that the one plan fits every
                   replica (plan_maker.py); ranks of equal shapes but another profile structure run
                   another model (named: AgreementError). Where their shapes differ (a padding
                   collator's own lengths per rank), each rank plans its own with its own share.
    3. agreement   the one plan: its profile and plan as canonical JSON (no pickle); every rank
                   checks that the profile's structure (names and bytes, not times) equals its own
                   and that the plan fits; the verdict names the ranks at fault (agreement.py)

The ranks that agree on the job's first plan are the coordinator's *group*: every rank of a
data-parallel job, or the ranks of one pipeline stage (`stage`, `members`: its replicas and tensor-
parallel shards run the same layers; other stages run others). A stage's group agrees over a channel
of its own, and then every rank of the job tells every rank its stage and plan digest
(`stage_round`), so a rank of any stage that died or is stuck is named by every rank, and replicas
meant to hold one plan but holding another are named too.

Later input shapes are planned by each rank alone (plan_maker.plan_locally): a rank on a new length
never waits for another. Their profiles' structures are compared lazily (`compare_structure`):
each rank publishes its own per shape, and the later of two ranks that differ logs it.

Both exchanges go over MPI under MPI launchers, else over the torch.distributed store, each with a
deadline (`sync_timeout_s`): a dead or stuck rank is named, never waited on forever. A rank that
cannot go on shouts why and leaves (`give_up`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

import contextlib
import json

from .agreement import MARGIN_S, AgreementError, Channel, GaveUp, Solo, exchange, give_up
from .config import SlackSwapConfig
from .hardware import Hardware
from .logs import EVERY_RANK, SayOnce, log
from .machine import MPI_LAUNCH_VARS, gpu_index, has_mpi4py, host_uplinks, mpi_launched
from .node_facts import RankFacts, shares_of
from .shares import Share, tightest
from .step_profile import StepProfile

LINGER_S = 1.0  # how long a rank that gives up stays, so that the others can say why before it exits
# engines made in this process so far: every rank makes its engines in the same order, so the n-th
# is the same job on every rank (several runs may share one process group, and so one store)
_ENGINES = itertools.count()


@dataclass(frozen=True)
class Shares:
    """This rank's Share of its node, the one its plan is made with (the tightest of the ranks
    that run it), the lead rank's, and how many ranks share this rank's node."""

    own: Share
    plan: Share
    lead: Share
    node_ranks: int


class Coordinator:
    """The agreement side of one rank of a job (see the module docstring). Made as DeepSpeed starts,
    while every rank is alive: MPI's node grouping, and a stage's communicator, are collectives.
    `stage`, `members`: this rank's pipeline stage and the job ranks in it (None: a data-parallel
    engine, whose group is the whole job)."""

    def __init__(self, cfg: SlackSwapConfig, hw: Hardware, stage: int | None = None,
                 members: list[int] | None = None):
        self.cfg, self.hw = cfg, hw
        self.stage, self.members = stage, members
        self.topology, self.uplink_bps = host_uplinks(cfg.node, hw)
        self.sync = _transport(cfg.sync)
        self.mpi_node: int | None = None  # this rank's node by MPI shared memory (MPI launches only)
        if self.sync == "mpi" and not cfg.ranks_per_node:
            from .node_facts import node_layout

            self.mpi_node = node_layout()[0].node
        self.channel: Channel | None = None  # the job's channel, made on first use
        self.shares: Shares | None = None  # set by exchange_facts
        self.ledger = None  # channels.StructureLedger, made on first use (compare_structure)
        self.say_once = SayOnce()  # compare_structure's line for compiled code
        self.engine_index = next(_ENGINES)  # its keys in the store are this engine's (see _ENGINES)
        self.program = 0  # how often the model's compilation changed (new_program): its own ledger keys
        self.group: Channel | None = None  # a stage's agreement channel, made on first use
        self.stage_communicator = self.split(stage) if stage is not None else None  # (MPI: a collective, now)
        self.stage_plans: dict[int, str] = {}  # stage -> its plan digest, every stage's (stage_round)
        log.debug("slackswap: plans agreed over %s; host uplinks from %s", self.via, self.topology.source)

    @property
    def via(self) -> str:
        return "MPI" if self.sync == "mpi" else "torch.distributed"

    # ---- channels ------------------------------------------------------------------------------
    def job_channel(self) -> Channel:
        """The channel of every rank of the job: MPI or the torch.distributed store; one rank: none."""
        if self.channel is None:
            import torch.distributed as dist

            from .channels import MpiChannel, StoreChannel

            if self.sync == "mpi":
                self.channel = MpiChannel()
                _check_same_job(self.channel)
            elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self.channel = StoreChannel()
            else:
                self.channel = Solo()
        return self.channel

    def split(self, color: int):
        """Under MPI: the communicator of the ranks with this `color` (a collective of every rank:
        call it as DeepSpeed starts); else None."""
        if self.sync != "mpi":
            return None
        from .channels import mpi_module

        world = mpi_module().COMM_WORLD
        return world.Split(color, world.Get_rank())

    def group_channel(self, members: list[int], name: str, communicator=None) -> Channel:
        """The channel of a group of the job's ranks (`members`, ascending; numbered from 0 in the
        group, while errors name job ranks); `communicator`: the group's MPI communicator (`split`)."""
        from .channels import MpiChannel, StoreChannel

        if len(members) == 1:
            return Solo()
        if self.sync == "mpi":
            return MpiChannel(communicator, members=members)
        rank = self.job_channel().rank
        return StoreChannel(rank=members.index(rank), world=len(members), prefix=f"slackswap/{name}", members=members)

    # ---- the group that agrees on the job's first plan ------------------------------------------------
    def agreement_group(self) -> tuple[Channel, list[int] | None]:
        """The channel of the ranks that agree on the job's first plan, and their job ranks (None:
        every rank of the job)."""
        if self.stage is None:
            return self.job_channel(), None
        if self.group is None:
            self.group = self.group_channel(self.members, f"stage{self.stage}", self.stage_communicator)
        return self.group, self.members

    def group_size(self) -> int:
        return self.agreement_group()[0].world

    def leads_group(self) -> bool:
        """This rank is the first of its group (rank 0 of the job; a stage's first rank): it says
        what the group has alike."""
        rank = self.job_channel().rank
        return rank == (0 if self.stage is None else self.members[0])

    @contextlib.contextmanager
    def agreeing(self):
        """Around a group's agreement: a stage's failure is shouted to the whole job as well, so that
        the other stages hear it now rather than at their deadline."""
        try:
            yield
        except AgreementError as e:
            if self.stage is not None:
                give_up(self.job_channel(), str(e))
            raise

    def stage_round(self, digest: str, shared: bool) -> None:
        """After a stage agreed (`digest`, `shared`: its replicas hold one plan): every rank's stage
        and plan digest on every rank (the job-wide round names any rank of any stage that did not
        get here in time); replicas of one stage that agreed one plan must hold it. Nothing for a
        data-parallel engine (its group is the job)."""
        if self.stage is None:
            return
        channel, timeout = self.job_channel(), self.cfg.sync_timeout_s
        # a stage still agreeing may take its own sync_timeout_s first (its first rank then names
        # the culprit and shouts): the job-wide round waits that out before naming anyone
        texts = exchange(channel, "stageplans", json.dumps([self.stage, digest, shared]), timeout,
                         "stage and plan digest", grace_s=timeout + MARGIN_S)
        by_stage: dict[int, dict[str, list[int]]] = {}
        for rank, text in enumerate(texts):
            stage, theirs, one_plan = json.loads(text)
            if one_plan:  # replicas that agreed one plan must hold it (a rank's own plan is its own)
                by_stage.setdefault(stage, {}).setdefault(theirs, []).append(rank)
        split = {s: d for s, d in by_stage.items() if len(d) > 1}
        if split:
            raise AgreementError(f"rank {channel.rank}: ranks of one stage hold different plans: " + "; ".join(
                f"stage {s}: " + ", ".join(f"ranks {r} plan {d[:12]}" for d, r in sorted(ds.items()))
                for s, ds in sorted(split.items())))
        self.stage_plans = {s: next(iter(ds)) for s, ds in by_stage.items()}
        if channel.rank == 0:
            log.info("slackswap: per-stage plans agreed by %d ranks: %s", channel.world,
                     "; ".join(f"stage {s} {d[:12]}" for s, d in sorted(self.stage_plans.items())))

    def compare_structure(self, shapes: str, structure: str, compiled: bool = False) -> None:
        """Publish this rank's profile structure for input shapes `shapes` and log the ranks that
        published another one for them (channels.StructureLedger: lazily, never waiting). `compiled`:
        the profile has compiled calls, whose saved tensors are those of the graph Dynamo compiled on
        this rank (another rank may hold another graph for the same shapes: one compiled for them
        alone, one for dynamic shapes after a recompile): said once, as what it is."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        if self.ledger is None:
            from .channels import StructureLedger

            # (a pipeline's stages run other layers on the same shapes: each compares with its own)
            where = "" if self.stage is None else f".stage{self.stage}"
            self.ledger = StructureLedger(prefix=f"slackswap/structure/{self.engine_index}.{self.program}{where}")
        differ = self.ledger.publish(shapes, structure)
        if not differ:
            return
        theirs = "; ".join(f"rank {r}: {d[:12]}" for r, d in sorted(differ.items()))
        if not compiled:
            log.warning("slackswap rank %d: input shapes %s: ranks %s profiled them with another structure than "
                        "this rank's (%s here; %s): the ranks run different models or code paths on these shapes",
                        self.ledger.rank, shapes, sorted(differ), structure[:12], theirs, extra=EVERY_RANK)
        else:  # (expected of compiled code: once, at INFO)
            self.say_once("compiled structure", logging.INFO, "slackswap rank %d: input shapes %s: ranks %s profiled "
                          "them with another structure than this rank's (%s here; %s): the model runs compiled code, "
                          "and Dynamo compiled another graph for these shapes on each (one for them alone, one for "
                          "dynamic shapes after a recompile); each rank runs its own plan, exact to its own code "
                          "(said once)", self.ledger.rank, shapes, sorted(differ), structure[:12], theirs,
                          extra=EVERY_RANK)

    def new_program(self) -> None:
        """The model's compilation changed: the structures published for its old program are not
        compared with the new one's (a rank that has not changed yet would read as another model)."""
        self.ledger, self.program = None, self.program + 1

    # ---- node facts --------------------------------------------------------------------------------
    def exchange_facts(self, local: StepProfile, budget: int, shapes: str, holds: int = 1,
                       pinned: int | None = None, peers: list[int] | None = None) -> bool:
        """Tell every rank this rank's node, uplink, demand and step (`shapes`, `local`'s
        structure); from everyone's, this rank's Shares (`peers`: the ranks that run its plan, by
        default every rank; their first leads). Whether the peers plan one step (the same shapes);
        peers on the lead's shapes with another profile structure are named on every rank
        (AgreementError). `pinned`: host bytes ZeRO-Offload pins per rank (None: no offload)."""
        channel = self.job_channel()
        facts = RankFacts(node=self._node_key(channel.rank), uplink=self.topology.uplink_of[gpu_index() % self.topology.gpus],
                          demand=max(0, holds * local.total_bytes - budget), shapes=shapes,
                          structure=local.structure_digest)
        everyone = [RankFacts.from_json(b) for b in exchange(channel, "facts", facts.to_json(), self.cfg.sync_timeout_s,
                                                              "node facts (node, uplink, demand)")]
        peers = list(range(channel.world)) if peers is None else peers
        one_step = _one_step(channel.rank, everyone, peers)
        shares = shares_of(everyone, self.hw, self.uplink_bps, self.cfg.host_pool_bytes_per_node, pinned or 0)
        if pinned is not None:  # every replica runs the same ZeRO config: the same link penalty for all
            # (0 pinned here: each node's pool was netted of its ranks' optimizer state above)
            shares = [s.beside_zero_offload(self.hw, 0) for s in shares]
            log.info("slackswap: ZeRO-Offload copies gradients to the host during backward and pins %.2f GB of "
                     "optimizer state per rank: plans prefetch at the duplex rate (%.1f GB/s) and share only "
                     "what the node's pool has left", pinned / 1e9, shares[channel.rank].h2d(self.hw) / 1e9)
        node_ranks = [r for r, f in enumerate(everyone) if f.node == facts.node]
        own = shares[channel.rank]
        self.shares = Shares(own, tightest([shares[r] for r in peers]) if one_step else own, shares[peers[0]],
                             len(node_ranks))
        log.debug("slackswap rank %d: node %r ranks %s, uplink %d (%s), share %s; plans use %s", channel.rank,
                  facts.node, node_ranks, facts.uplink, self.topology.source, self.shares.own, self.shares.plan)
        if not one_step and channel.rank == peers[0]:
            log.info("slackswap: data-parallel ranks are on different input shapes (%s): each plans its own "
                     "shapes with its own share of the node from now on (no rank waits for another's planning)",
                     "; ".join(f"rank {r}: {everyone[r].shapes}" for r in peers))
        return one_step

    def _node_key(self, rank: int) -> str:
        """Ranks with equal keys share a node: by `ranks_per_node`, by MPI shared memory, or by host."""
        if self.cfg.ranks_per_node:
            return f"group {rank // self.cfg.ranks_per_node}"
        if self.mpi_node is not None:
            return f"mpi node {self.mpi_node}"  # MPI's COMM_TYPE_SHARED grouping, found at start
        return socket.gethostname()

    # ---- leaving -----------------------------------------------------------------------------------
    def give_up(self, error: Exception) -> None:
        """This rank cannot plan the step: the job stops, since its replicas cannot run one plan.
        The others hear why at once (agreement.give_up) instead of waiting out their deadline;
        this rank lingers a moment so that they can say so before a launcher tears the job down;
        and the process will exit without waiting for its peers (MPI_Finalize or a process group's
        shutdown would wait forever for a stuck one)."""
        channel = self.channel
        if channel is None or channel.world == 1:
            return
        if not isinstance(error, GaveUp):  # (give_up shouts once per channel: the protocol's own errors already did)
            give_up(channel, str(error) if isinstance(error, AgreementError) else f"{type(error).__name__}: {error}")
        text = str(error) if str(error).startswith(f"rank {channel.rank}") else f"rank {channel.rank}: {error}"
        log.error("slackswap %s (%s). The job stops: its ranks cannot agree on one plan", text,
                  type(error).__name__, extra=EVERY_RANK)
        time.sleep(LINGER_S)
        exit_without_peers()


def _transport(sync: str) -> str:
    """The config's "auto" | "mpi" | "torch" as the transport this process can use."""
    if sync == "auto":
        return "mpi" if mpi_launched() and has_mpi4py() else "torch"
    if sync == "mpi" and not mpi_launched():
        # each process would init MPI alone, call itself rank 0 of 1, plan alone and take the whole pool
        raise AgreementError('"sync": "mpi" needs a job launched by MPI (mpirun / mpiexec, srun --mpi, or '
                             'deepspeed --launcher mpich / openmpi), and this process was not (none of '
                             f'{", ".join(MPI_LAUNCH_VARS)} is set); use "sync": "auto" or "torch"')
    if sync == "mpi":  # mpi4py is the `mpi` extra's: said now, not at the first exchange
        from .channels import mpi_module

        mpi_module()
    return sync


def _check_same_job(channel) -> None:
    """MPI and torch.distributed must number the same job's ranks alike."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        theirs = (dist.get_rank(), dist.get_world_size())
        if theirs != (channel.rank, channel.world):
            raise AgreementError(
                f"MPI says this process is rank {channel.rank} of {channel.world}, torch.distributed says rank "
                f"{theirs[0]} of {theirs[1]}: the job was not launched as one MPI job of all its ranks; use "
                f"\"sync\": \"torch\" (or launch it with mpirun)")


def _one_step(rank: int, everyone: list[RankFacts], peers: list[int]) -> bool:
    """Whether `peers` plan one step: the lead's input shapes on every peer. A peer on the lead's
    shapes whose profile has another structure runs another model (AgreementError, on every rank)."""
    lead = everyone[peers[0]]
    others = {r: everyone[r].step for r in peers if everyone[r].shapes == lead.shapes
              and everyone[r].structure != lead.structure}
    if others:
        raise AgreementError(
            f"rank {rank}: ranks {sorted(others)} profiled another step than rank {peers[0]} on the same input "
            f"shapes ({lead.step}): " + "; ".join(f"rank {r}: {step}" for r, step in sorted(others.items()))
            + ". Data-parallel replicas must run the same model (the same layers, ops and saved tensors)")
    return all(everyone[r].shapes == lead.shapes for r in peers)


_exit_registered = False


def exit_without_peers() -> None:
    """At interpreter exit, end the process before MPI_Finalize or a process group's shutdown can
    wait for a peer that is stopped or gone (registered last, so it runs first). Exit status 1:
    the job failed."""
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True

    def exit_now():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    atexit.register(exit_now)


__all__ = ["Coordinator", "LINGER_S", "Shares", "exit_without_peers"]

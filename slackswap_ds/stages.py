"""SlackSwap under DeepSpeed's PipelineEngine: one plan per pipeline stage.

The ranks of one stage (its data-parallel replicas; with tensor parallelism, the shards of its
layers too) run the same layers on the same shapes; other stages run other layers, and under 1F1B
stage i holds the saved tensors of k = min(stages - i, micro-batches) micro-batches at once. So:

    hooks       PipelineEngine never calls engine.forward/backward: it runs its schedule's
                instructions through `_INSTRUCTION_MAP`. This engine gets its own copy of the map,
                whose ForwardPass and BackwardPass run each micro-batch inside an executor, every
                micro-batch a step of its own from its forward to the end of its backward
                (Executor.start/resume/finish, keyed by the micro-batch's pipe buffer).
    batches     a step here is one train_batch; the first `profile_steps` run plain.
    profiling   in the next, the first micro-batch is traced (ProfileSession); every other one runs
                under a shelter executor that sends its saved tensors to host, so the batch fits any
                budget. The most micro-batches open at once is counted: that is k.
    planning    the budget is the config's of the stage's keep-all peak, k x one micro-batch's saved
                bytes. Node facts go to every rank of the job (a node's link and pool are shared by
                its ranks whatever their stage); the stage's first rank plans for k micro-batches in
                flight (the planners' `holds`) with the tightest share of its stage's ranks, and the
                stage agrees on it over a channel of its own ranks. Then every rank tells every rank
                its stage and plan digest, so a rank of any stage that died or is stuck is named by
                every rank within sync_timeout_s, and replicas holding another plan are named too.
    later       every micro-batch runs under its stage's executor; the measured peak counts every
                micro-batch in flight.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .agreement import MARGIN_S, AgreementError, agree, exchange, give_up
from .engine import EVERY_RANK, SlackSwapRuntime, _shape_key, _ShapeState, log
from .plan import Decision
from .profile import StepProfile


@dataclass
class _Batch:
    """One train_batch run under SlackSwap."""

    profiling: tuple | None = None  # (buffer id, ProfileSession, shape key) of the micro-batch traced
    planned: tuple | None = None  # the shape key of the micro-batches run under a plan
    open: dict = field(default_factory=dict)  # buffer id -> the context its micro-batch runs in
    most_open: int = 0
    peak: int = 0  # device bytes of saved tensors, over every micro-batch in flight
    fallbacks: dict = field(default_factory=dict)


@dataclass
class StageRuntime(SlackSwapRuntime):
    """SlackSwapRuntime for a PipelineEngine (see the module docstring)."""

    stage: int = 0
    members: list = field(default_factory=list)  # job ranks of this stage, ascending
    group: Any = None  # the agreement Channel of this stage's ranks
    group_comm: Any = None  # MPI: this stage's communicator (split as DeepSpeed starts)
    batch: _Batch | None = None
    shelter: Any = None  # the executor of micro-batches not traced in a profiling batch
    last_batch_peak: int = 0  # the last planned batch's measured peak
    stage_plans: dict = field(default_factory=dict)  # stage -> plan digest, every stage's (from the exchange)
    said: set = field(default_factory=set)  # what was logged once

    def attach(self) -> None:
        from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

        self._prepare()
        engine = self.engine
        self.stage = int(engine.stage_id)
        self.members = sorted(self.module.topology().filter_match(pipe=self.stage))
        if self.sync == "mpi":
            from mpi4py import MPI

            world = MPI.COMM_WORLD  # a collective: now, as DeepSpeed starts (every rank alive)
            self.group_comm = world.Split(self.stage, world.Get_rank())
        self._say_unsupported()
        run_schedule = engine._exec_schedule
        instructions = dict(type(engine)._INSTRUCTION_MAP)  # the class's map stays as DeepSpeed's
        forward_pass, backward_pass = instructions[ForwardPass], instructions[BackwardPass]
        instructions[ForwardPass] = lambda eng, buffer_id: self._forward(forward_pass, eng, buffer_id)
        instructions[BackwardPass] = lambda eng, buffer_id: self._backward(backward_pass, eng, buffer_id)
        engine._INSTRUCTION_MAP = instructions
        engine._exec_schedule = lambda schedule: self._run(run_schedule, schedule)
        engine.slackswap = self

    def _say_unsupported(self) -> None:
        from .engine import _job_rank

        if _job_rank() != 0:  # one line per job: every rank has the same config
            return
        for name, what in (("plan_file", "plan files"), ("trace_file", "Chrome traces"),
                           ("pad_to_multiple", "input padding (pipeline inputs come from its data iterator)")):
            if getattr(self.cfg, name):
                log.warning("slackswap: %s is ignored under pipeline parallelism (%s are not supported with "
                            "per-stage plans yet)", name, what)

    # ---- one batch -----------------------------------------------------------------------------
    def _run(self, run_schedule, schedule) -> None:
        from deepspeed.runtime.pipe.schedule import TrainSchedule

        if not isinstance(schedule, TrainSchedule) or not torch.is_grad_enabled():
            return run_schedule(schedule)  # evaluation: not ours to manage
        self.steps += 1
        if self.steps <= self.cfg.profile_steps:
            return run_schedule(schedule)
        module = self.module
        interval = module.activation_checkpoint_interval
        if interval:  # SlackSwap replaces checkpointing: the plan sees and manages every activation
            self._say_once("checkpoint", logging.INFO, "slackswap: the pipeline's activation_checkpoint_interval=%d is "
                           "set aside for batches run under SlackSwap plans", interval)
        self.batch = batch = _Batch()
        module.activation_checkpoint_interval = 0
        try:
            run_schedule(schedule)
        finally:
            module.activation_checkpoint_interval = interval
            self.batch = None
        if batch.profiling is not None:
            _, session, key = batch.profiling
            try:
                self._plan_stage(self.shapes[key], session.profile(type(module).__name__), key, batch.most_open)
            except Exception as e:
                self._give_up(e)
                raise
        elif batch.planned is not None:
            from .runtime.executor import StepStats

            state = self.shapes[batch.planned]
            if batch.most_open > self.holds:
                self._say_once("holds", logging.WARNING, "slackswap: stage %d ran %d micro-batches at once, its plan "
                               "was made for %d: the peak may exceed the budget (the gradients are unaffected)",
                               self.stage, batch.most_open, self.holds)
            self.last_batch_peak = batch.peak
            self.last_stats = StepStats(peak_device_bytes=batch.peak, fallbacks=batch.fallbacks)
            self.active_plan = state.executor.plan
            self._report(state, self.last_stats)

    def _say_once(self, what: str, level: int, message: str, *args) -> None:
        if what not in self.said:
            self.said.add(what)
            log.log(level, message, *args)

    def _forward(self, forward_pass, engine, buffer_id: int):
        batch = self.batch
        if batch is None:
            return forward_pass(engine, buffer_id)
        runner = self._runner(batch, _micro_batch_key(engine, buffer_id), buffer_id)
        if runner is None:
            return forward_pass(engine, buffer_id)
        batch.open[buffer_id] = runner
        batch.most_open = max(batch.most_open, len(batch.open))
        with runner:
            _executor_of(runner).start(buffer_id)
            return forward_pass(engine, buffer_id)

    def _backward(self, backward_pass, engine, buffer_id: int):
        batch = self.batch
        runner = batch.open.pop(buffer_id, None) if batch is not None else None
        if runner is None:
            return backward_pass(engine, buffer_id)
        executor = _executor_of(runner)
        with runner:
            if hasattr(runner, "end_forward"):
                runner.end_forward()  # profiling: DeepSpeed's own work before backward is not the model's
            executor.resume(buffer_id)
            backward_pass(engine, buffer_id)
            executor.finish(buffer_id)
        if runner is not self.shelter and executor.plan is not None:
            stats = executor.stats.last_step
            batch.peak = max(batch.peak, stats.peak_device_bytes)
            for why, n in stats.fallbacks.items():
                batch.fallbacks[why] = batch.fallbacks.get(why, 0) + n

    def _runner(self, batch: _Batch, key: tuple, buffer_id: int):
        """The context a micro-batch runs in: its shape's executor; the profiler, for the first
        micro-batch of a shape without a plan; the shelter for the others of that batch; None
        (plain) for a new shape when re-planning is off."""
        state = self.shapes.get(key)
        if state is not None and state.executor is not None:
            self.shapes.move_to_end(key)
            batch.planned = key
            return state.executor
        if state is None and self.shapes and self.cfg.replan == "never":
            return None
        if batch.profiling is None:
            from .runtime.profiler import ProfileSession

            if state is None:
                self._make_room()
                self.shapes[key] = _ShapeState()
            session = ProfileSession(self.module)
            batch.profiling = (buffer_id, session, key)
            if self._channel().rank == self.members[0]:  # one line per stage
                log.info("slackswap: stage %d profiling a micro-batch of input shapes %s (saved tensors go to host "
                         "for this batch)", self.stage, [s for s, _ in key], extra=EVERY_RANK)
            return session
        if self.shelter is None:
            from .runtime.executor import Executor

            self.shelter = Executor(self.module, None, None)  # no plan: every saved tensor to host
        return self.shelter

    # ---- profile -> plan -> agree (stage) -> exchange (job) -> apply -----------------------------
    def _plan_stage(self, state: _ShapeState, local: StepProfile, key: tuple, holds: int) -> None:
        self.holds = holds
        channel, timeout = self._channel(), self.cfg.sync_timeout_s
        budget = self.cfg.budget.of(holds * local.total_bytes)  # of the stage's keep-all peak
        self._coordinate(channel, local, budget, key, peers=self.members)
        group = self._group_channel()
        plan = None
        if group.rank == 0:
            plan = self._fit_to_device(local, self._plan_within(local, budget, self.cfg.planner))
        try:
            profile, plan = agree(group, local, plan, timeout)
        except AgreementError as e:
            give_up(channel, str(e))  # the other stages hear it now, not at their deadline
            raise
        self._check_stages(channel, plan.digest)
        self._install(state, profile, plan)
        split = plan.bytes_by_decision(profile)
        self.active_plan, self.last_stats = None, None
        if group.rank == 0:  # one line per stage
            log.info("slackswap stage %d (ranks %s): %d micro-batch(es) in flight; budget %s B of %s B keep-all "
                     "(%d x %s B); per micro-batch keep %s B, swap %s B, recompute %s B; planner %s on %s predicts "
                     "%.1f%% of ideal throughput and a peak of %s B; plan %s agreed over %s by %d ranks",
                     self.stage, self.members, holds, f"{plan.budget_bytes:,}", f"{holds * profile.total_bytes:,}",
                     holds, f"{profile.total_bytes:,}", f"{split[Decision.KEEP]:,}", f"{split[Decision.SWAP]:,}",
                     f"{split[Decision.RECOMPUTE]:,}", plan.planner, self.hw.name, 100 * state.predicted_throughput,
                     f"{state.predicted_peak:,}", plan.digest[:12], self._via(), group.world, extra=EVERY_RANK)
        if channel.rank == 0:
            log.info("slackswap: per-stage plans agreed by %d ranks: %s", channel.world,
                     "; ".join(f"stage {s} {d[:12]}" for s, d in sorted(self.stage_plans.items())))

    def _check_stages(self, channel, digest: str) -> None:
        """Every rank's stage and plan digest on every rank (the job-wide round: names any rank of
        any stage that did not get here in time); replicas of one stage must hold one plan."""
        timeout = self.cfg.sync_timeout_s
        # a stage still agreeing may take its own sync_timeout_s first (its first rank then names
        # the culprit and shouts): the job-wide round waits that out before naming anyone
        texts = exchange(channel, "stageplans", json.dumps([self.stage, digest]), timeout, "stage and plan digest",
                         grace_s=timeout + MARGIN_S)
        by_stage: dict[int, dict[str, list[int]]] = {}
        for rank, text in enumerate(texts):
            stage, their = json.loads(text)
            by_stage.setdefault(stage, {}).setdefault(their, []).append(rank)
        split = {s: d for s, d in by_stage.items() if len(d) > 1}
        if split:
            raise AgreementError(f"rank {channel.rank}: ranks of one stage hold different plans: " + "; ".join(
                f"stage {s}: " + ", ".join(f"ranks {r} plan {d[:12]}" for d, r in sorted(ds.items()))
                for s, ds in sorted(split.items())))
        self.stage_plans = {s: next(iter(ds)) for s, ds in by_stage.items()}

    def _group_channel(self):
        """The agreement channel of this stage's ranks (numbered from 0; errors name job ranks)."""
        if self.group is None:
            from .agreement import Solo
            from .channels import MpiChannel, StoreChannel

            if len(self.members) == 1:
                self.group = Solo()
            elif self.sync == "mpi":
                self.group = MpiChannel(self.group_comm, members=self.members)
            else:
                rank = self._channel().rank
                self.group = StoreChannel(rank=self.members.index(rank), world=len(self.members),
                                          prefix=f"slackswap/stage{self.stage}", members=self.members)
        return self.group


def _micro_batch_key(engine, buffer_id: int) -> tuple:
    """The shapes a micro-batch's forward takes: its inputs, and on the last stage its labels."""
    buffers = engine.pipe_buffers
    labels = buffers.get("labels")
    label = labels[buffer_id] if engine.is_last_stage() and labels and len(labels) > buffer_id else None
    return _shape_key((buffers["inputs"][buffer_id], label), {})


def _executor_of(runner):
    return getattr(runner, "executor", runner)  # a ProfileSession runs one


__all__ = ["StageRuntime"]

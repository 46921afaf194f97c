"""SlackSwap under DeepSpeed's PipelineEngine: one plan per pipeline stage.

The ranks of one stage (its data-parallel replicas; with tensor parallelism, the shards of its
layers too) run the same layers on the same shapes; other stages run other layers, and under 1F1B
stage i holds the saved tensors of k = min(stages - i, micro-batches) micro-batches at once. So:

    hooks       PipelineEngine never calls engine.forward/backward: it runs its schedule's
                instructions. Its ForwardPass and BackwardPass run each micro-batch inside an
                executor, every micro-batch a step of its own from its forward to the end of its
                backward (Executor.start/resume/finish, keyed by the micro-batch's pipe buffer);
                deepspeed_api.hook_pipeline is where that touches DeepSpeed's private API.
    batches     a step here is one train_batch; the first `profile_steps` warm up in the shelter (every
                saved tensor to host: within any budget).
    profiling   in the next, the first micro-batch is traced (ProfileSession); every other one runs
                under a shelter executor that sends its saved tensors to host, so the batch fits any
                budget. The most micro-batches open at once is counted: that is k.
    planning    the budget is the config's of the stage's keep-all peak, k x one micro-batch's saved
                bytes. At the job's first plan, node facts go to every rank of the job (a node's link
                and pool are shared by its ranks whatever their stage); where the stage's ranks are on
                the same shapes, its first rank plans for k micro-batches in flight (the planners'
                `holds`) with the tightest share of its stage's ranks, and the stage agrees on it over
                a channel of its own ranks (where their shapes differ, `PipelineModule(dynamic_shape=
                True)` fed each replica its own lengths, each plans its own). Then every rank tells
                every rank its stage and plan digest, so a rank of any stage that died or is stuck is
                named by every rank within sync_timeout_s, and replicas meant to hold one plan but
                holding another are named too. Later shapes are planned by each rank alone.
    later       every micro-batch runs under its stage's executor; the measured peak counts every
                micro-batch in flight.
"""

from __future__ import annotations

import collections
import json
import logging
from dataclasses import dataclass, field

from .agreement import MARGIN_S, AgreementError, Channel, exchange, give_up
from .config import SlackSwapConfig
from .deepspeed_api import (checkpointing_set_aside, hook_pipeline, is_train_schedule, micro_batch_inputs,
                            stage_of, stage_ranks)
from .errors import SlackSwapError
from .logs import EVERY_RANK, SayOnce, job_rank, log
from .plan import Plan
from .plans import PlanMaker, plan_summary
from .profile import StepProfile
from .reporting import StepReports, at_exit, measured_on
from .runtime.executor import Executor
from .runtime.device import device_of
from .runtime.stats import StepStats
from .runtime.profiler import ProfileSession
from .shapes import Run, ShapeCache, ShapeKey, ShapeState, shape_key, shapes_of

Runner = Executor | ProfileSession  # what a micro-batch runs inside


@dataclass
class _Batch:
    """One train_batch run under SlackSwap."""

    warm_up: bool = False  # a batch of the first profile_steps: every micro-batch in the shelter
    profiling: tuple[int, ProfileSession, ShapeKey] | None = None  # (buffer id, session, key) of the traced micro-batch
    planned: ShapeKey | None = None  # the shape key of the micro-batches run under a plan
    open: dict[int, Runner] = field(default_factory=dict)  # buffer id -> the context its micro-batch runs in
    most_open: int = 0
    peak: int = 0  # device bytes of saved tensors, over every micro-batch in flight
    moved: tuple[int, int] = (0, 0)  # bytes swapped and recomputed, over its planned micro-batches
    fallbacks: collections.Counter = field(default_factory=collections.Counter)


class StageRuntime:
    """SlackSwap's runtime for a PipelineEngine (see the module docstring)."""

    def __init__(self, engine, cfg: SlackSwapConfig):
        self.engine, self.cfg = engine, cfg
        self.steps = 0
        self.shapes = ShapeCache(cfg.max_shapes, cfg.replan)
        self.last_stats: StepStats | None = None  # of the last batch run under a plan
        self.active_plan: Plan | None = None  # the plan of that batch
        self.stage_plans: dict[int, str] = {}  # stage -> plan digest, every stage's (from the exchange)
        self.batch: _Batch | None = None
        self.shelter: Executor | None = None  # warm-up batches, untraced micro-batches of a profiling batch
        self.shelter_peak = 0  # device bytes of saved tensors, the most of any micro-batch in the shelter
        self.group: Channel | None = None  # the agreement channel of this stage's ranks
        self.say_once = SayOnce()
        self.plans: PlanMaker | None = None  # set by attach
        self.reports: StepReports | None = None

    @property
    def coordinator(self):
        return self.plans.coordinator

    @property
    def holds(self) -> int:
        return self.plans.holds

    def attach(self) -> None:
        self.module = self.engine.module  # (initialize took its compiled parts: engine.take_compiled_model)
        self.plans = PlanMaker.for_engine(self.engine, self.cfg)
        self.device_type = device_of(self.module).type
        self.reports = StepReports(self.cfg, self.plans.hw, self.device_type)
        self.stage, self.members = stage_of(self.engine), stage_ranks(self.engine)
        self.group_communicator = self.coordinator.split(self.stage)  # MPI: a collective, now (every rank alive)
        self._say_unsupported()
        hook_pipeline(self.engine, self._forward, self._backward, self._run)
        self.engine.slackswap = self
        at_exit(self.end_of_job)

    def end_of_job(self) -> dict | None:
        """This stage's summary, said by its first rank (reporting.StepReports.end_of_job), once; run
        when the process exits, or by a script that wants it earlier. None if no batch ran."""
        return self.reports.end_of_job(self.stage, lead=job_rank() == self.members[0])

    def _say_unsupported(self) -> None:
        if job_rank() != 0:  # one line per job: every rank has the same config
            return
        for name, what in (("plan_file", "plan files"), ("trace_file", "Chrome traces"),
                           ("pad_to_multiple", "input padding (pipeline inputs come from its data iterator)")):
            if getattr(self.cfg, name):
                log.warning("slackswap: %s is ignored under pipeline parallelism (%s are not supported with "
                            "per-stage plans yet)", name, what)

    # ---- one batch -----------------------------------------------------------------------------
    def _run(self, run_schedule, schedule) -> None:
        if not is_train_schedule(schedule):
            return run_schedule()  # evaluation: not ours to manage
        self.steps += 1
        self.batch = batch = _Batch(warm_up=self.steps <= self.cfg.profile_steps)
        with checkpointing_set_aside(self.module) as interval:
            if interval:  # SlackSwap replaces checkpointing: the plan sees and manages every activation
                self.say_once("checkpoint", logging.INFO, "slackswap: the pipeline's activation_checkpoint_interval="
                              "%d is set aside for batches run under SlackSwap plans", interval)
            try:
                run_schedule()
            finally:
                self.batch = None
        if batch.planned is None:  # (a planned batch is reported against its plan: _batch_done)
            kind = "warm-up" if batch.warm_up else "profiled" if batch.profiling is not None else "shelter"
            self.reports.unplanned(kind, batch.peak, batch.fallbacks)
        if batch.profiling is not None:
            _, session, key = batch.profiling
            try:
                self._plan_stage(self.shapes[key], session.profile(type(self.module).__name__), key, batch.most_open)
            except Exception as e:
                self.coordinator.give_up(e)
                raise
        elif batch.planned is not None:
            self._batch_done(batch)
        elif batch.warm_up and self.steps == self.cfg.profile_steps:
            log.info("slackswap: stage %d: %d warm-up batch(es) done in the shelter: peak of saved activations on "
                     "the device %s B", self.stage, self.steps, f"{self.shelter_peak:,}", extra=EVERY_RANK)

    def _batch_done(self, batch: _Batch) -> None:
        state = self.shapes[batch.planned]
        if batch.most_open > self.holds:
            self.say_once("holds", logging.WARNING, "slackswap: stage %d ran %d micro-batches at once, its plan was "
                          "made for %d: the peak may exceed the budget (the gradients are unaffected)",
                          self.stage, batch.most_open, self.holds)
        self.last_stats = StepStats(peak_device_bytes=batch.peak, fallbacks=dict(batch.fallbacks))
        self.active_plan = state.plan
        self.reports.step(state.plan, state.prediction, batch.peak, batch.fallbacks, str(shapes_of(batch.planned)),
                          self.holds * state.profile.total_bytes, batch.moved)
        self.plans.after_step(state, self.steps)  # a re-plan followed; verify_every

    def _forward(self, forward_pass, buffer_id: int):
        batch = self.batch
        if batch is None:
            return forward_pass()
        runner = self._runner(batch, shape_key(micro_batch_inputs(self.engine, buffer_id), {}), buffer_id)
        if runner is None:
            return forward_pass()
        batch.open[buffer_id] = runner
        batch.most_open = max(batch.most_open, len(batch.open))
        with runner:
            _executor_of(runner).start(buffer_id)
            return forward_pass()

    def _backward(self, backward_pass, buffer_id: int):
        batch = self.batch
        runner = batch.open.pop(buffer_id, None) if batch is not None else None
        if runner is None:
            return backward_pass()
        executor = _executor_of(runner)
        with runner:
            if isinstance(runner, ProfileSession):
                runner.end_forward()  # profiling: DeepSpeed's own work before backward is not the model's
            executor.resume(buffer_id)
            backward_pass()
            executor.finish(buffer_id)
        stats = executor.stats.last_step
        if runner is self.shelter:
            self.shelter_peak = max(self.shelter_peak, stats.peak_device_bytes)
        batch.peak = max(batch.peak, stats.peak_device_bytes)
        batch.fallbacks.update(stats.fallbacks)
        if executor.plan is not None:
            batch.moved = (batch.moved[0] + stats.swapped_bytes, batch.moved[1] + stats.recomputed_bytes)

    def _runner(self, batch: _Batch, key: ShapeKey, buffer_id: int) -> Runner:
        """The context a micro-batch runs in: its shape's executor; the profiler, for the first
        micro-batch of a shape without a plan; the shelter for the others of that batch, for every
        micro-batch of a warm-up batch, and for a new shape when re-planning is off."""
        # one micro-batch is traced per batch: the others of a shape without a plan wait in the shelter
        run = Run.SHELTER if batch.warm_up else self.shapes.runner_for(key, self.plans.pool,
                                                                       add=batch.profiling is None)
        if run is Run.PLANNED:
            batch.planned = key
            return self.shapes[key].executor
        if run is Run.PROFILE and batch.profiling is None:
            session = ProfileSession(self.module)
            batch.profiling = (buffer_id, session, key)
            if self.coordinator.job_channel().rank == self.members[0]:  # one line per stage
                log.info("slackswap: stage %d profiling a micro-batch of input shapes %s (saved tensors go to host "
                         "for this batch)", self.stage, shapes_of(key), extra=EVERY_RANK)
            return session
        if run is Run.SHELTER and not batch.warm_up:
            self.say_once("shelter", logging.WARNING, "slackswap: stage %d: input shapes %s are new and replan is "
                          "\"never\": micro-batches of new shapes run in the shelter (every saved tensor to host)",
                          self.stage, shapes_of(key))
        if self.shelter is None:
            self.shelter = Executor.shelter(self.module)  # no plan: every saved tensor to host
        return self.shelter

    # ---- profile -> plan -> agree (stage) -> exchange (job) -> apply -----------------------------
    def _plan_stage(self, state: ShapeState, local: StepProfile, key: ShapeKey, holds: int) -> None:
        self.plans.holds = holds
        channel = self.coordinator.job_channel()
        budget = self.plans.budget_for(holds * local.total_bytes)  # of the stage's keep-all peak
        if self.coordinator.shares is not None:  # agreed at the job's first plan: this rank plans alone
            self._plan_alone(state, local, key, budget)
            return
        if self.group is None:
            self.group = self.coordinator.group_channel(self.members, f"stage{self.stage}", self.group_communicator)
        try:
            agreed = self.plans.agree(local, budget, key, self.group, peers=self.members, use_plan_file=False)
        except AgreementError as e:
            give_up(channel, str(e))  # the other stages hear it now, not at their deadline
            raise
        self._check_stages(channel, agreed.plan.digest, agreed.ranks == self.group.world)
        self.plans.install(state, agreed)
        self.active_plan, self.last_stats = None, None
        plan, profile = agreed.plan, agreed.profile
        if agreed.ranks == 1 and self.group.world > 1:
            self._say_own_plan(state, key, holds)
        elif self.group.rank == 0:  # one line per stage
            log.info("slackswap stage %d (ranks %s): %d micro-batch(es) in flight; budget %s B of %s B keep-all "
                     "(%d x %s B); per micro-batch %s; planner %s on %s predicts %.1f%% of ideal throughput and a "
                     "peak of %s B%s; plan %s agreed over %s by %d ranks", self.stage, self.members, holds,
                     f"{plan.budget_bytes:,}", f"{holds * profile.total_bytes:,}", holds, f"{profile.total_bytes:,}",
                     plan_summary(plan, profile), plan.planner, self.plans.hw.name,
                     100 * state.prediction.throughput, f"{state.prediction.peak_bytes:,}",
                     measured_on(self.device_type), plan.digest[:12],
                     self.coordinator.via, self.group.world, extra=EVERY_RANK)
        if channel.rank == 0:
            log.info("slackswap: per-stage plans agreed by %d ranks: %s", channel.world,
                     "; ".join(f"stage {s} {d[:12]}" for s, d in sorted(self.stage_plans.items())))

    def _plan_alone(self, state: ShapeState, local: StepProfile, key: ShapeKey, budget: int) -> None:
        """A later shape of this rank's: planned with its own share, no other rank asked or waited
        for; if no plan keeps the budget, its micro-batches run in the shelter (logged)."""
        try:
            agreed = self.plans.plan_locally(local, budget, key, use_plan_file=False)
        except SlackSwapError as e:
            state.shelter = True
            log.warning("slackswap stage %d rank %d: no plan for input shapes %s (%s: %s); their micro-batches run "
                        "in the shelter (every saved tensor to host)", self.stage, job_rank(), shapes_of(key),
                        type(e).__name__, e, extra=EVERY_RANK)
            return
        self.plans.install(state, agreed)
        self.active_plan, self.last_stats = None, None
        self._say_own_plan(state, key, self.holds)

    def _say_own_plan(self, state: ShapeState, key: ShapeKey, holds: int) -> None:
        plan = state.plan
        log.info("slackswap stage %d rank %d: input shapes %s: plan %s of this rank's own (%d micro-batch(es) in "
                 "flight); budget %s B; %s; predicts %.1f%% of ideal throughput%s", self.stage, job_rank(),
                 shapes_of(key), plan.digest[:12], holds, f"{plan.budget_bytes:,}", plan_summary(plan, state.profile),
                 100 * state.prediction.throughput, measured_on(self.device_type), extra=EVERY_RANK)

    def _check_stages(self, channel: Channel, digest: str, shared: bool) -> None:
        """Every rank's stage and plan digest on every rank (the job-wide round: names any rank of
        any stage that did not get here in time); replicas of one stage that agreed one plan must
        hold it (`shared`: this rank's plan is its stage's; not where the replicas' shapes differ)."""
        timeout = self.cfg.sync_timeout_s
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


def _executor_of(runner: Runner) -> Executor:
    return runner.executor if isinstance(runner, ProfileSession) else runner


__all__ = ["StageRuntime"]

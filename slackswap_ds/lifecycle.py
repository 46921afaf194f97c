"""The shape lifecycle: for a step of input shapes K, what it runs under and what follows it.

One lifecycle serves the DeepSpeed engine's hooks (engine.py) and the pipeline stages' (stages.py),
which only turn DeepSpeed's entry points into the calls below. A *step* is one training forward and
its backward on the engine (`forward`, `before_backward`, `after_backward`), one `train_batch` on a
pipeline stage (`begin_step`; `micro_batch_forward` and `micro_batch_backward` for each micro-batch,
keyed by its pipe buffer; `end_step`). Each micro-batch runs in a *runner*: the executor of its
shapes' plan, a ProfileSession, or the shelter (every saved tensor to host: what an op reads at once).

    the step's shapes              runs under                  what follows (shapes.Transition)
    a warm-up step                 the shelter                 WARMED_UP after the last one
    new, derivable (derive.py)     a plan derived for them     DERIVED; after its first step HELD,
                                                               or REFITTED (dims fitted, derived
                                                               again), or UNDERIVABLE (profiled next)
    new, not derivable             a ProfileSession            AGREED (the job's first plan, by the
                                                               coordinator's group), PLANNED_ALONE
                                                               (later shapes), or NO_PLAN
    planned                        its shapes' executor        REPLANNED after a failed verification
    without a plan (NO_PLAN;       the shelter                 -
      new under replan "never")

and at any step: a forward without backward ends its step at the next forward (ABANDONED); a second
forward of the same shapes joins a step, a profiled one too (TWO_FORWARDS: R-Drop and contrastive
losses are profiled and planned as one step of two forwards), but a profile with a forward whose
saves backward never read is dropped and its shapes profiled again (PROFILED_AGAIN); micro-batches
still open when a stage's step ends are closed (UNFINISHED); a model
compiled after the first step drops every plan and warms up again (COMPILED_ANEW); a replay that
fails in backward raises, its plan demoted already (REPLAY_FAILED); an error while the job's first
plan is made stops the job on every rank (GAVE_UP). `events` lists the last step's transitions.

The lifecycle takes its services (the plans of shapes, with the plan maker and the coordinator
behind them; the reports) and never calls back into the hooks.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from .compatibility import take_compiled_model
from .config import SlackSwapConfig
from .job_report import StepReports, at_exit, below_floor, say_compiled_anew
from .logs import EVERY_RANK, SayOnce, log
from .plan import Plan
from .plan_maker import PlanMaker
from .runtime.compiled import compiled_parts
from .runtime.device import device_of
from .runtime.executor import Executor
from .runtime.profiler import ProfileSession
from .runtime.replay import ReplayError
from .runtime.stats import StepStats
from .shape_plans import ShapePlans
from .shapes import Run, ShapeKey, Transition, model_dims, shapes_of

Runner = Executor | ProfileSession  # what a micro-batch's forward and backward run inside


def executor_of(runner: Runner) -> Executor:
    return runner.executor if isinstance(runner, ProfileSession) else runner


@dataclass
class Step:
    """One step (an engine's forward and backward; a stage's train_batch) as it runs."""

    number: int
    warm_up: bool
    open: dict[Hashable, Runner] = field(default_factory=dict)  # micro-batch tag -> its runner, until backward
    profiling: tuple[ProfileSession, ShapeKey] | None = None  # the one micro-batch traced, and its shapes
    planned: ShapeKey | None = None  # the shapes of its micro-batches run under a plan
    most_open: int = 0  # micro-batches open at once, at most (a stage's micro-batches in flight)
    peak: int = 0  # device bytes of saved tensors, over every micro-batch in flight
    moved: tuple[int, int, int] = (0, 0, 0)  # bytes swapped, recomputed and packed under its plan
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    budget_waits: int = 0  # copy-outs the host waited for so that saves stayed within the budget
    hooks_host_s: float = 0.0  # host seconds in SlackSwap's saved-tensor hooks (replays excluded)
    finished: list[StepStats] = field(default_factory=list)  # each micro-batch's counters, at its backward's end
    events: list[Transition] = field(default_factory=list)

    def note(self, event: Transition) -> None:
        if event not in self.events:
            self.events.append(event)

    def stats(self) -> StepStats:
        """Its counters: its one micro-batch's, or the peak and fallbacks over several."""
        if len(self.finished) == 1:
            return self.finished[0]
        return StepStats(peak_device_bytes=self.peak, fallbacks=dict(self.fallbacks))

    def finished_in(self, runner: Runner) -> StepStats:
        """A micro-batch's backward ended in `runner`: its counters into the step's; returns them."""
        executor = executor_of(runner)
        stats = executor.stats.last_step
        self.finished.append(stats)
        self.peak = max(self.peak, stats.peak_device_bytes)
        self.fallbacks.update(stats.fallbacks)
        self.budget_waits += stats.budget_waits
        self.hooks_host_s += stats.hooks_host_s
        if executor.plan is not None:
            self.moved = (self.moved[0] + stats.swapped_bytes, self.moved[1] + stats.recomputed_bytes,
                          self.moved[2] + stats.packed_bytes)
        return stats

    def close_unfinished(self) -> None:
        """Micro-batches whose backward never came (the step raised before it): closed, so that
        nothing they saved outlives the step."""
        if not self.open:
            return
        self.note(Transition.UNFINISHED)
        for tag, runner in self.open.items():
            if tag is None:  # the engine's step: its context is still entered
                runner.__exit__(None, None, None)
            else:
                with runner:
                    executor_of(runner).finish(tag)
        self.open.clear()


class ShapeLifecycle:
    """A rank's steps, from warm-up to planned (see the module docstring). `take_compiled()` takes
    the model into SlackSwap's compile layout and returns its compiled parts (compatibility.py)."""

    def __init__(self, module: torch.nn.Module, cfg: SlackSwapConfig, shape_plans: ShapePlans, reports: StepReports,
                 take_compiled: Callable[[], frozenset[str]]):
        self.module, self.cfg, self.shape_plans, self.reports = module, cfg, shape_plans, reports
        self.plans, self.coordinator = shape_plans.plans, shape_plans.coordinator
        self.take_compiled = take_compiled
        self.steps = 0
        self.warm_until = cfg.profile_steps  # the last warm-up step (later if the compilation changes)
        self.compiled: frozenset[str] = frozenset()  # the model's compiled parts its plans were made for
        self.step: Step | None = None  # the step running now
        self.shelter: Executor | None = None  # warm-up steps, untraced micro-batches, shapes without a plan
        self.shelter_peak = 0  # device bytes of saved tensors, the most of any micro-batch in the shelter
        self.step_shapes: ShapeKey | None = None  # the input shapes of the current (or last) step's latest forward
        self.last_stats: StepStats | None = None  # of the last step
        self.active_plan: Plan | None = None  # the plan of that step (None: warm-up, profiled or shelter)
        self.events: list[Transition] = []  # what happened in the last step, in order
        self.say_once = SayOnce()

    # ---- views (engine.slackswap is the lifecycle) --------------------------------------------------
    @property
    def shapes(self):
        return self.shape_plans.cache

    @property
    def profiled_steps(self) -> int:
        return self.shape_plans.profiled_steps

    @property
    def derived_plans(self) -> int:
        return self.shape_plans.derived_plans

    @property
    def stage(self) -> int | None:
        return self.coordinator.stage

    @property
    def holds(self) -> int:
        return self.plans.holds

    def end_of_job(self, state: str = "finished") -> dict | None:
        """The job's summary (job_report.StepReports.end_of_job), once; run when the process exits or
        is stopped by SIGTERM (`state` says so), or by a script that wants it earlier. None if no
        step ran."""
        return self.reports.end_of_job(self.stage, self.coordinator.leads_group(), state,
                                       profiled_steps=self.profiled_steps, derived_plans=self.derived_plans)

    # ---- the engine's step: a training forward and its backward ----------------------------------------
    def forward(self, key: ShapeKey) -> None:
        """A training forward of input shapes `key` begins: a step of its own, unless it joins the
        open one (a second forward before backward)."""
        if self.step is not None and not self._end_if_abandoned(key):
            return
        self.begin_step()
        runner = self._runner(key, None)
        try:
            runner.__enter__()
        except BaseException:
            self.step = None
            raise

    def before_backward(self) -> None:
        runner = self.step.open.get(None) if self.step is not None else None
        if isinstance(runner, ProfileSession):
            runner.end_forward()  # what runs from now until backward is DeepSpeed's, not the model's

    def after_backward(self, error: BaseException | None = None) -> None:
        step = self.step
        if step is None or None not in step.open:
            return
        runner = step.open.pop(None)
        runner.__exit__(None, None, None)
        self._finished(step, runner)
        self.end_step(error)

    def _end_if_abandoned(self, key: ShapeKey) -> bool:
        """If the open step's forward had no backward (its graph let go: "skip this batch"), end it
        here, so that the forward now (of shapes `key`) starts a step of its own; whether it ended.
        A profiled step cannot tell (the tracer keeps its graph's nodes alive): a forward of the same
        shapes joins it (R-Drop, contrastive losses: the profile sees every forward of the step) and
        the profile is dropped after its backward if one of its forwards had none (end_step); a
        forward of other shapes ends it unprofiled."""
        step = self.step
        runner = step.open.get(None)
        if isinstance(runner, ProfileSession):
            if key == step.profiling[1]:
                runner.another_forward()
                step.note(Transition.TWO_FORWARDS)
                return False
        elif runner is None or not runner.abandoned():
            return False
        step.note(Transition.ABANDONED)
        self.say_once("abandoned", logging.INFO, "slackswap: a training forward had no backward (its graph was let "
                      "go, or a forward of other shapes came): its step ended there, and the next forward is a step "
                      "of its own%s", " (the step was being profiled: these shapes are profiled again)"
                      if isinstance(runner, ProfileSession) else "")
        del step.open[None]
        runner.__exit__(None, None, None)
        self.step, self.events, self.active_plan = None, step.events, None
        self.last_stats = executor_of(runner).stats.last_step
        return True

    # ---- a stage's step: micro-batches in flight ---------------------------------------------------------
    def micro_batch_forward(self, tag: Hashable, key: ShapeKey, run: Callable[[], object]):
        """Micro-batch `tag`'s forward (`run()`), in its runner: a step of the executor's own from
        now until the end of its backward."""
        runner = self._runner(key, tag)
        with runner:
            executor_of(runner).start(tag)
            return run()

    def micro_batch_backward(self, tag: Hashable, run: Callable[[], object]) -> object:
        step = self.step
        runner = step.open.pop(tag, None) if step is not None else None
        if runner is None:
            return run()
        executor = executor_of(runner)
        with runner:
            if isinstance(runner, ProfileSession):
                runner.end_forward()  # DeepSpeed's own work before backward is not the model's
            executor.resume(tag)
            result = run()
            executor.finish(tag)
        self._finished(step, runner)
        return result

    # ---- steps -------------------------------------------------------------------------------------------
    def begin_step(self) -> Step:
        """A step begins (the engine's at its training forward): counted, and a model whose
        compilation changed since the last is taken in again."""
        self.steps += 1
        anew = False
        if self.steps == 1:
            self.compiled = self.take_compiled()
            if self.stage is None or self.coordinator.leads_group():
                self.reports.started(self.stage)
        elif frozenset(compiled_parts(self.module)) != self.compiled:
            self._compiled_anew()
            anew = True
        self.step = Step(self.steps, warm_up=self.steps <= self.warm_until)
        if anew:
            self.step.note(Transition.COMPILED_ANEW)
        return self.step

    def end_step(self, error: BaseException | None = None) -> None:
        """The step ended (`error`: what its backward or schedule raised): reported, and what follows."""
        step, self.step = self.step, None
        if step is None:
            return
        step.close_unfinished()
        self.events, self.active_plan = step.events, None
        self.last_stats = step.stats()
        if isinstance(error, ReplayError):  # its plan is demoted already: the next steps keep or swap it
            step.note(Transition.REPLAY_FAILED)
            log.error("slackswap rank %d: step %d cannot give exact gradients: %s. Its backward raised (stop, or "
                      "skip this batch: the next steps keep or swap what failed). A data-parallel job stops here: "
                      "its other ranks fail or wait in their gradient collective until the launcher ends the job",
                      self.shape_plans.rank, self.steps, error, extra=EVERY_RANK)
            return
        if error is not None:
            return
        if step.planned is not None:
            self._planned_step_done(step)
            return
        try:  # (reported after what follows it, so that the report counts that too)
            if step.profiling is not None:
                self._profiled_step_done(step)
            elif step.warm_up:
                self._warm_up_done(step)
        finally:
            kind = "warm-up" if step.warm_up else "profiled" if step.profiling is not None else "shelter"
            self.reports.unplanned(kind, step.peak, step.fallbacks, step.events)

    def _profiled_step_done(self, step: Step) -> None:
        """Its shapes' plan from the profile (the job's first: agreed; an error there stops the job
        on every rank), unless the profile is dropped."""
        session, key = step.profiling
        if self.shape_plans.drop_unread(key, session, step.events):
            return
        try:
            self.shape_plans.from_profile(key, session.profile(type(self.module).__name__), step.most_open, step.events,
                                          session.replaced_checkpointing)
        except Exception as e:
            step.note(Transition.GAVE_UP)
            self.coordinator.give_up(e)
            raise

    def _planned_step_done(self, step: Step) -> None:
        key = step.planned
        state = self.shapes[key]
        if step.most_open > self.holds:
            self.say_once("holds", logging.WARNING, "slackswap: %sran %d micro-batches at once, its plan was made "
                          "for %d: the peak may exceed the budget (the gradients are unaffected)", self._stage_said(),
                          step.most_open, self.holds)
        plan, prediction, keep_all = state.plan, state.prediction, self.holds * state.profile.total_bytes
        self.active_plan = plan
        unplanned = sum(stats.unplanned for stats in step.finished)
        resized = sum(stats.resized for stats in step.finished)
        self.shape_plans.after_planned_step(key, step.peak, unplanned, resized, step.events)  # (may re-plan or drop it)
        self.reports.step(plan, prediction, step.peak, step.fallbacks, str(shapes_of(key)), keep_all, step.moved,
                          step.events, step.budget_waits, step.hooks_host_s)

    # ---- runners -----------------------------------------------------------------------------------------
    def _runner(self, key: ShapeKey, tag: Hashable) -> Runner:
        """What micro-batch `tag` of shapes `key` runs in: its shapes' executor (with a plan derived
        for them now, if they are new and derivable); the profiler, for the first micro-batch of
        new shapes; the shelter for the others of that step, in warm-up, and for shapes without a plan."""
        step, self.step_shapes = self.step, key
        if step.warm_up:
            self._say_warm_up(step)
            run = Run.SHELTER
        else:  # one micro-batch is traced per step: the others of shapes without a plan wait in the shelter
            run = self.shapes.runner_for(key, self.plans.pool, add=step.profiling is None)
            if run is Run.PROFILE and step.profiling is None and self.shape_plans.derived(key, step.events):
                run = Run.PLANNED
        if run is Run.PLANNED:
            step.planned, runner = key, self.shapes[key].executor
            step.note(Transition.PLANNED)
        elif run is Run.PROFILE and step.profiling is None:
            runner = ProfileSession(self.module)
            step.profiling = (runner, key)
            step.note(Transition.PROFILE)
            self.shape_plans.profiling(key)
        else:
            if self.shelter is None:
                self.shelter = Executor.shelter(self.module)
            runner = self.shelter
            step.note(Transition.WARM_UP if step.warm_up else Transition.SHELTER)
            if not step.warm_up and run is Run.SHELTER and self.cfg.replan == "never":
                self.say_once("shelter", logging.WARNING, "slackswap: %sinput shapes %s are new and replan is "
                              "\"never\": steps of new shapes run in the shelter (every saved tensor to host: within "
                              "the budget, slower)", self._stage_said(), shapes_of(key))
        step.open[tag] = runner
        step.most_open = max(step.most_open, len(step.open))
        return runner

    def _finished(self, step: Step, runner: Runner) -> None:
        stats = step.finished_in(runner)
        if runner is self.shelter:
            self.shelter_peak = max(self.shelter_peak, stats.peak_device_bytes)

    def _compiled_anew(self) -> None:
        """The model was compiled (or its compilation changed) after SlackSwap's first step: its plans
        were made for another program (a compiled block is one opaque op to them), and the executors
        do not hook the new compiled parts. The model is taken into the compile layout again, every
        plan dropped, and it warms up and is profiled anew, as at the job's start (its first compiled
        steps are Dynamo's compilation: no profile of them)."""
        before, self.compiled = self.compiled, self.take_compiled()
        self.shape_plans.forget()
        self.shelter = None
        self.warm_until = self.steps + self.cfg.profile_steps - 1
        say_compiled_anew(self.steps, self.compiled, before, self.cfg.profile_steps)

    # ---- what the log says ------------------------------------------------------------------------------
    def _stage_said(self) -> str:
        return "" if self.stage is None else f"stage {self.stage}: "

    def _extra(self) -> dict | None:
        """Under pipeline parallelism every stage says its own (its first rank: logs.py)."""
        return EVERY_RANK if self.stage is not None and self.coordinator.leads_group() else None

    def _warm_up_done(self, step: Step) -> None:
        """A budget in bytes below what a warm-up step held (every saved tensor on host: what one op
        reads at once, the least any plan holds) cannot be kept by any plan: said at once, with the
        smallest budget that works (the first plan then stops the job, with every planner's reason).
        After the last warm-up step, its peak is said."""
        if step.number == self.warm_until:
            step.note(Transition.WARMED_UP)
            log.info("slackswap: %s%d warm-up step(s) done in the shelter: peak of saved activations on the device "
                     "%s B", self._stage_said(), self.cfg.profile_steps, f"{self.shelter_peak:,}",
                     extra=self._extra())
        below = below_floor(self.cfg, self.shelter_peak)
        if below:
            self.say_once("floor", logging.WARNING, "slackswap: %s%s", self._stage_said(), below)

    def _say_warm_up(self, step: Step) -> None:
        if step.number == self.warm_until - self.cfg.profile_steps + 1 and not step.open:
            log.info("slackswap: %sthe first %d step(s) warm up in the shelter: every saved tensor goes to host, so "
                     "the device holds only what an op reads at once (the least any plan can) until the step after "
                     "them is profiled", self._stage_said(), self.cfg.profile_steps)


def lifecycle_for(engine, cfg: SlackSwapConfig, plans: PlanMaker) -> ShapeLifecycle:
    """The lifecycle of `engine`'s model with `plans`, set as `engine.slackswap`; its summary is said
    when the process exits."""
    module = engine.module
    device_type = device_of(module).type
    lifecycle = ShapeLifecycle(module, cfg, ShapePlans(cfg, plans, model_dims(module), device_type),
                               StepReports(cfg, plans.hw, device_type), lambda: take_compiled_model(engine))
    engine.slackswap = lifecycle
    at_exit(lifecycle.end_of_job)
    return lifecycle


__all__ = ["Runner", "ShapeLifecycle", "Step", "executor_of", "lifecycle_for"]

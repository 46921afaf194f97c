"""DeepSpeed integration: `initialize(...)`, same signature and return as `deepspeed.initialize`.

Lifecycle, driven by the engine's own forward and backward (the user's loop does not change):

    steps <= profile_steps     warm-up (lazy initialisation, allocator settling) in the shelter: every
                               saved tensor to host, so that no step holds more than the budget
                               before the keep-all peak it is a fraction of is measured
    the step after             runs under a ProfileSession (every saved tensor to host, so it fits
                               the budget) -> measured StepProfile -> plan (rank 0)
                               -> agreed across ranks -> Executor for these shapes
    later steps                run under the executor of their input shapes; new shapes are
                               profiled and planned on their step (replan = "on_shape_change"),
                               or run in the shelter (replan = "never")
    eval-mode forwards         left alone (not counted as steps, never profiled or planned)

How a shape is planned and agreed: coordination.py and plans.py. A PipelineEngine gets per-stage
plans instead (stages.py).
"""

from __future__ import annotations

import logging

import torch

from .agreement import AgreementError  # noqa: F401  (re-exported: callers catch it from here)
from .config import SECTION, SlackSwapConfig, load_config
from .coordination import Coordinator
from .deepspeed_api import (MARK, config_given, hook_forward_backward, initialize_without_section,
                            is_pipeline_engine, remember_original)
from .logs import EVERY_RANK, SayOnce, log, setup_logging
from .plan import Plan
from .plans import Agreed, PlanMaker, plan_summary
from .reporting import StepReports, write_trace
from .runtime.executor import Executor
from .runtime.stats import StepStats
from .runtime.profiler import ProfileSession
from .shapes import Run, ShapeCache, ShapeKey, ShapeState, shape_key, shapes_of

# `deepspeed.initialize = ss.initialize` written by hand imports this module before the assignment
# happens: DeepSpeed's own function is kept now (deepspeed_api.py)
remember_original()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, *rest, config=None, config_params=None, **kwargs):
    """`deepspeed.initialize`, plus the `"slackswap"` section of the config. Returns the same
    tuple (engine, optimizer, training_dataloader, lr_scheduler); the engine's forward/backward
    then follow SlackSwap plans. Without a section, or with `"enabled": false`, it is plain DeepSpeed."""
    ds_config = config_given(args, config, config_params)
    cfg = load_config(ds_config if ds_config is not None else {})
    out = initialize_without_section(ds_config, SECTION, args,
                                     (model, optimizer, model_parameters, training_data, lr_scheduler, *rest), kwargs)
    engine = out[0]
    if cfg.enabled:
        setup_logging(cfg.log_level)
        if is_pipeline_engine(engine):  # its own schedule, several micro-batches in flight: stages.py
            from .stages import StageRuntime

            StageRuntime(engine, cfg).attach()
        else:
            SlackSwapRuntime(engine, cfg).attach()
    return out


setattr(initialize, MARK, True)  # recognised as SlackSwap's wherever it is bound


class SlackSwapRuntime:
    """Hooks the SlackSwap lifecycle into a DeepSpeed engine (see the module docstring)."""

    def __init__(self, engine, cfg: SlackSwapConfig):
        self.engine, self.cfg = engine, cfg
        self.steps = 0
        self.shapes = ShapeCache(cfg.max_shapes, cfg.replan)
        self.active: Executor | ProfileSession | None = None  # what the current step runs under
        self.active_key: ShapeKey | None = None  # its shape (None in the shelter)
        self.shelter: Executor | None = None  # warm-up steps, and new shapes when re-planning is off
        self.shelter_peak = 0  # device bytes of saved tensors, the most of any step in the shelter
        self.say_once = SayOnce()
        self.last_stats: StepStats | None = None  # of the last step (planned, profiled or in the shelter)
        self.active_plan: Plan | None = None  # the plan of that step (None: profiled or in the shelter)
        self.plans: PlanMaker | None = None  # set by attach
        self.reports: StepReports | None = None

    # views for users and tests (the services own these)
    @property
    def coordinator(self) -> Coordinator:
        return self.plans.coordinator

    @property
    def share(self):
        return self.coordinator.shares.own if self.coordinator.shares else None

    @property
    def plan_share(self):
        return self.coordinator.shares.plan if self.coordinator.shares else None

    def attach(self) -> None:
        self.module = self.engine.module
        self.plans = PlanMaker.for_engine(self.engine, self.cfg)
        self.reports = StepReports(self.cfg, self.plans.hw)
        hook_forward_backward(self.engine, self._before_forward, self._before_backward, self._after_backward)
        self.engine.slackswap = self

    # ---- per step ----------------------------------------------------------------------------
    def _before_forward(self, args: tuple, kwargs: dict) -> dict:
        kwargs = self._bucketed(args, kwargs)
        if self.active is not None or not torch.is_grad_enabled() or not self.module.training:
            return kwargs  # evaluation, or a second forward in the same step: not ours to manage
        self.steps += 1
        key = shape_key(args, kwargs)
        run = Run.SHELTER if self.steps <= self.cfg.profile_steps else self.shapes.runner_for(key, self.plans.pool)
        if run is Run.SHELTER:
            self._say_shelter(key)
            if self.shelter is None:
                self.shelter = Executor.shelter(self.module)
            self.active, key = self.shelter, None
        elif run is Run.PROFILE:
            log.info("slackswap: profiling a step of input shapes %s (saved tensors go to host for this step)",
                     shapes_of(key))
            self.active = ProfileSession(self.module)
        else:
            self.active = self.shapes[key].executor
        self.active_key = key
        # (checkpoint calls inside the model run inline under both: see runtime/takeover.py)
        self.active.__enter__()
        return kwargs

    def _say_shelter(self, key: ShapeKey) -> None:
        if self.steps == 1:
            log.info("slackswap: the first %d step(s) warm up in the shelter: every saved tensor goes to host, so "
                     "device activation memory stays within any budget until the step after them is profiled",
                     self.cfg.profile_steps)
        elif self.steps > self.cfg.profile_steps:
            self.say_once("shelter", logging.WARNING, "slackswap: input shapes %s are new and replan is \"never\": "
                          "steps of new shapes run in the shelter (every saved tensor to host: within the budget, "
                          "slower)", shapes_of(key))

    def _bucketed(self, args: tuple, kwargs: dict) -> dict:
        """A training forward's keyword inputs padded to `pad_to_multiple` (bucketing.py)."""
        multiple = self.cfg.pad_to_multiple
        if not multiple or not torch.is_grad_enabled() or not self.module.training:
            return kwargs
        from .bucketing import BucketingError, pad_to_multiple

        if any(isinstance(a, torch.Tensor) for a in args):
            raise BucketingError("pad_to_multiple pads keyword inputs (engine(input_ids=..., labels=...)); this "
                                 "forward got positional tensors, whose meaning is unknown: pass them by name, or "
                                 "pad in your collator and drop pad_to_multiple")
        return pad_to_multiple(kwargs, multiple)

    def _before_backward(self) -> None:
        if isinstance(self.active, ProfileSession):
            self.active.end_forward()  # profiling: the model's forward is over

    def _after_backward(self) -> None:
        context, key = self.active, self.active_key
        if context is None:
            return
        self.active = self.active_key = None
        context.__exit__(None, None, None)
        if key is None:  # the shelter: no plan, its saved tensors were on host
            self.last_stats, self.active_plan = context.stats.last_step, None
            self.shelter_peak = max(self.shelter_peak, self.last_stats.peak_device_bytes)
            if self.steps == self.cfg.profile_steps:
                log.info("slackswap: %d warm-up step(s) done in the shelter: peak of saved activations on the "
                         "device %s B", self.steps, f"{self.shelter_peak:,}")
            return
        state = self.shapes[key]
        if isinstance(context, ProfileSession):
            self.last_stats, self.active_plan = context.executor.stats.last_step, None
            try:
                self._make_plan(state, context.profile(type(self.module).__name__), key)
            except Exception as e:
                self.coordinator.give_up(e)
                raise
            return
        self.last_stats = stats = state.executor.stats.last_step
        self.active_plan = state.plan
        self.reports.step(state.plan, state.prediction, stats.peak_device_bytes, stats.fallbacks)
        timeline = state.executor.stats.last_timeline
        if timeline is not None and state.executor.record:
            state.executor.record = False  # one measured step is enough
            write_trace(timeline, self.cfg.trace_file, "measured", budget_bytes=state.plan.budget_bytes,
                        title=f"slackswap plan {state.plan.digest[:12]} (measured, rank 0)")
        self.plans.after_step(state, self.steps)  # a re-plan followed; verify_every

    # ---- profile -> plan -> agree -> apply ---------------------------------------------------
    def _make_plan(self, state: ShapeState, local, key: ShapeKey) -> None:
        channel = self.coordinator.job_channel()
        agreed = self.plans.agree(local, self.cfg.budget.of(local.total_bytes), key, channel)
        record = bool(self.cfg.trace_file and channel.rank == 0)
        sim = self.plans.install(state, agreed, record=record)
        self._say_plan(state, agreed, channel.rank, channel.world)
        if record:
            # the prediction now; the first measured step beside it (same format, see _after_backward),
            # unless the trace could not be written
            state.executor.record = write_trace(sim, self.cfg.trace_file, "predicted",
                                                budget_bytes=agreed.plan.budget_bytes,
                                                title=f"slackswap plan {agreed.plan.digest[:12]} (predicted)")

    def _say_plan(self, state: ShapeState, agreed: Agreed, rank: int, world: int) -> None:
        """One plan line per job (rank 0's), and one from each rank whose link share differs."""
        plan, shares = agreed.plan, self.coordinator.shares
        rank_hw = shares.own.limit(self.plans.hw)  # this rank's link as shared with its neighbours
        throughput = 100 * state.prediction.throughput
        if rank == 0:
            log.info("slackswap rank 0: budget %s B of %s B keep-all; %s; planner %s on %s (link share D2H %.1f / "
                     "H2D %.1f GB/s) predicts %.1f%% of ideal throughput; plan %s agreed over %s by %d ranks",
                     f"{plan.budget_bytes:,}", f"{agreed.profile.total_bytes:,}", plan_summary(plan, agreed.profile),
                     plan.planner, self.plans.hw.name, rank_hw.d2h_bps / 1e9, rank_hw.h2d_bps / 1e9, throughput,
                     plan.digest[:12], self.coordinator.via, world)
        elif shares.own != shares.lead:  # the same plan; what differs on this rank
            log.info("slackswap rank %d: plan %s with this rank's link share D2H %.1f / H2D %.1f GB/s and pool %s "
                     "(rank 0 differs) predicts %.1f%% of ideal throughput", rank, plan.digest[:12],
                     rank_hw.d2h_bps / 1e9, rank_hw.h2d_bps / 1e9, shares.own.host_pool_bytes, throughput,
                     extra=EVERY_RANK)


__all__ = ["AgreementError", "SlackSwapRuntime", "initialize"]

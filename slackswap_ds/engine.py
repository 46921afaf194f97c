"""DeepSpeed integration: `initialize(...)`, same signature and return as `deepspeed.initialize`.

Lifecycle, driven by the engine's own forward and backward (the user's loop does not change):

    steps <= profile_steps     warm-up (lazy initialisation, allocator settling) in the shelter: every
                               saved tensor to host, so that no step holds more than the budget
                               before the keep-all peak it is a fraction of is measured
    the step after             runs under a ProfileSession (every saved tensor to host, so it fits
                               the budget) -> measured StepProfile -> node shares and the plan
                               agreed across ranks (one plan where their shapes are equal, each
                               rank's own where they differ) -> Executor for these shapes
    later steps                run under the executor of their input shapes. A new shape gets a
                               plan of this rank's own (replan = "on_shape_change"): derived from
                               a measured profile of other shapes, on its very step (derive.py;
                               its first step checks the derived sizes), else profiled on its
                               step; or it runs in the shelter (replan = "never")
    eval-mode forwards         left alone (not counted as steps, never profiled or planned)
    compiled later             a model compiled (or compiled otherwise) after the first step is taken
                               into the compile layout again, its plans dropped, and it warms up and
                               is profiled anew, as at the start

How a shape is planned and agreed: coordination.py and plans.py. A PipelineEngine gets per-stage
plans instead (stages.py).
"""

from __future__ import annotations

import logging

import torch

from .agreement import AgreementError  # noqa: F401  (re-exported: callers catch it from here)
from .config import SECTION, ConfigError, SlackSwapConfig, load_config
from .errors import SlackSwapError
from .coordination import Coordinator
from .deepspeed_api import (MARK, compiled_autograd_enabled, config_file_of, config_given, deepcompile_active,
                            hook_forward_backward, initialize_without_section, is_pipeline_engine, remember_original)
from .logs import EVERY_RANK, SayOnce, log, said_once_per_job, setup_logging
from .plan import Plan
from .plans import PlanMaker
from .reporting import StepReports, at_exit, say_agreed_plan, say_compiled_anew, say_own_plan, write_trace
from .runtime.compiled import CompiledCodeError, check_model, compiled_parts
from .runtime.executor import Executor
from .runtime.device import device_of
from .runtime.replay import ReplayError
from .runtime.takeover import checkpointing_replaced
from .runtime.stats import StepStats
from .runtime.profiler import ProfileSession
from .shapes import Run, ShapeCache, ShapeKey, ShapeState, describe, model_dims, shape_key, shapes_of

# `deepspeed.initialize = ss.initialize` written by hand imports this module before the assignment
# happens: DeepSpeed's own function is kept now (deepspeed_api.py)
remember_original()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, *rest, config=None, config_params=None, **kwargs):
    """`deepspeed.initialize`, plus the `"slackswap"` section of the config. Returns the same
    tuple (engine, optimizer, training_dataloader, lr_scheduler); the engine's forward/backward
    then follow SlackSwap plans. Without a section, or with `"enabled": false`, it is plain DeepSpeed."""
    ds_config = config_given(args, config, config_params)
    try:
        cfg = load_config(ds_config if ds_config is not None else {})
        if cfg.enabled and isinstance(ds_config, dict):
            check_compile_section(ds_config)
    except ConfigError as e:  # every rank raises it alike: said once for the job, the file named if found
        source = e.source or (config_file_of(ds_config.get(SECTION), SECTION) if isinstance(ds_config, dict) else None)
        raise said_once_per_job(ConfigError(e.problems, source) if source != e.source else e) from None
    out = initialize_without_section(ds_config, SECTION, args,
                                     (model, optimizer, model_parameters, training_data, lr_scheduler, *rest), kwargs)
    engine = out[0]
    if cfg.enabled:
        setup_logging(cfg.log_level)
        take_compiled_model(engine)
        if is_pipeline_engine(engine):  # its own schedule, several micro-batches in flight: stages.py
            from .stages import StageRuntime

            StageRuntime(engine, cfg).attach()
        else:
            SlackSwapRuntime(engine, cfg).attach()
    return out


setattr(initialize, MARK, True)  # recognised as SlackSwap's wherever it is bound


def check_compile_section(ds_config: dict) -> None:
    """DeepCompile's `offload_activation` and SlackSwap both decide where saved activations live:
    never both at once (ConfigError naming the two switches)."""
    compile_section = ds_config.get("compile")
    if isinstance(compile_section, dict) and compile_section.get("deepcompile") and \
            compile_section.get("offload_activation"):
        raise ConfigError(['"compile": {"deepcompile": true, "offload_activation": true} and an enabled "slackswap" '
                           'section both place the saved activations. Choose one: "offload_activation": false (the '
                           'plan decides), or "slackswap": {"enabled": false} (DeepCompile decides)'])


def take_compiled_model(engine) -> frozenset[str]:
    """The engine's model in SlackSwap's compile layout (runtime/compile_layout.py: each block compiled
    on its own, said in the log if that changed anything), at initialize, again at the first step
    (engine.compile() may come in between) and whenever its compilation changes later; returns its
    compiled parts then. What it cannot take stops the job, said once."""
    try:
        if deepcompile_active(engine):
            raise CompiledCodeError('DeepCompile ("compile": {"deepcompile": true} and engine.compile()) compiles the '
                                    'whole model through its own graph passes, and SlackSwap carries its plans out '
                                    'per compiled block: use one of them. Without "deepcompile", engine.compile() '
                                    'works with SlackSwap (each block compiled on its own)')
        if compiled_autograd_enabled(engine):
            raise CompiledCodeError("engine.compile(compiled_autograd_enabled=True) compiles backward, where SlackSwap "
                                    "brings saved tensors back and runs blocks again: leave compiled autograd off "
                                    "under SlackSwap")
        return check_model(engine.module)
    except CompiledCodeError as e:
        raise said_once_per_job(e) from None


def bucketed(multiple: int, module, args: tuple, kwargs: dict) -> dict:
    """A training forward's keyword inputs padded to `multiple` (bucketing.py; 0: as they are)."""
    if not multiple or not torch.is_grad_enabled() or not module.training:
        return kwargs
    from .bucketing import BucketingError, pad_to_multiple

    if any(isinstance(a, torch.Tensor) for a in args):
        raise BucketingError("pad_to_multiple pads keyword inputs (engine(input_ids=..., labels=...)); this "
                             "forward got positional tensors, whose meaning is unknown: pass them by name, or "
                             "pad in your collator and drop pad_to_multiple")
    return pad_to_multiple(kwargs, multiple)


class SlackSwapRuntime:
    """Hooks the SlackSwap lifecycle into a DeepSpeed engine (see the module docstring)."""

    def __init__(self, engine, cfg: SlackSwapConfig):
        self.engine, self.cfg = engine, cfg
        self.steps = 0
        self.shapes = ShapeCache(cfg.max_shapes, cfg.replan)
        self.active: Executor | ProfileSession | None = None  # what the current step runs under
        self.active_key: ShapeKey | None = None  # its shape (None in the shelter)
        self.step_shapes: ShapeKey | None = None  # the input shapes of the current (or last) training step
        self.shelter: Executor | None = None  # warm-up steps, and new shapes when re-planning is off
        self.shelter_peak = 0  # device bytes of saved tensors, the most of any step in the shelter
        self.say_once = SayOnce()
        self.last_stats: StepStats | None = None  # of the last step (planned, profiled or in the shelter)
        self.active_plan: Plan | None = None  # the plan of that step (None: profiled or in the shelter)
        self.plans: PlanMaker | None = None  # set by attach
        self.reports: StepReports | None = None
        self.profiled_steps = 0  # steps this rank profiled (a new shape without a derivable plan)
        self.derived_plans = 0  # plans this rank derived for new shapes instead (derive.py)
        self.compiled: frozenset[str] = frozenset()  # the model's compiled parts its plans were made for
        self.warm_until = cfg.profile_steps  # the last warm-up step (later if the compilation changes)

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
        self.model_dims = model_dims(self.module)
        self.device_type = device_of(self.module).type
        self.reports = StepReports(self.cfg, self.plans.hw, self.device_type)
        hook_forward_backward(self.engine, self._before_forward, self._before_backward, self._after_backward)
        self.engine.slackswap = self
        at_exit(self.end_of_job)

    def end_of_job(self) -> dict | None:
        """The job's summary (logged by rank 0, written as JSON by it: `summary_file`), once; run
        when the process exits, or by a script that wants it earlier. None if no step ran."""
        return self.reports.end_of_job(profiled_steps=self.profiled_steps, derived_plans=self.derived_plans)

    # ---- per step ----------------------------------------------------------------------------
    def _before_forward(self, args: tuple, kwargs: dict) -> dict:
        kwargs = bucketed(self.cfg.pad_to_multiple, self.module, args, kwargs)
        if not torch.is_grad_enabled() or not self.module.training:
            return kwargs  # evaluation: not ours to manage
        if self.active is not None and not self._end_abandoned_step():
            return kwargs  # a second forward in the same step
        self.steps += 1
        if self.steps == 1:
            self.compiled = take_compiled_model(self.engine)
        elif frozenset(compiled_parts(self.module)) != self.compiled:
            self._compiled_anew()
        key = self.step_shapes = shape_key(args, kwargs)
        run = Run.SHELTER if self.steps <= self.warm_until else self.shapes.runner_for(key, self.plans.pool)
        if run is Run.PROFILE and self._derived_plan(key):
            run = Run.PLANNED
        if run is Run.SHELTER:
            self._say_shelter(key)
            if self.shelter is None:
                self.shelter = Executor.shelter(self.module)
            self.active, key = self.shelter, None
        elif run is Run.PROFILE:
            self.profiled_steps += 1
            self._say_profiling(key)
            self.active = ProfileSession(self.module)
        else:
            self.active = self.shapes[key].executor
        self.active_key = key
        # (checkpoint calls inside the model run inline under both: see runtime/takeover.py)
        self.active.__enter__()
        return kwargs

    def _compiled_anew(self) -> None:
        """The model was compiled (or its compilation changed) after SlackSwap's first step: its plans
        were made for another program (a compiled block is one opaque op to them), and SlackSwap's
        executors do not hook the new compiled parts. Take the model into the compile layout again, drop
        every plan and warm up and profile anew, as at the job's start (the first compiled steps are
        Dynamo's compilation: no profile of them)."""
        before = self.compiled
        self.compiled = take_compiled_model(self.engine)
        self.shapes, self.shelter = ShapeCache(self.cfg.max_shapes, self.cfg.replan), None
        self.warm_until = self.steps + self.cfg.profile_steps - 1
        self.coordinator.new_program()
        say_compiled_anew(self.steps, self.compiled, before, self.cfg.profile_steps)

    def _end_abandoned_step(self) -> bool:
        """If the running step's forward had no backward (its graph let go: "skip this batch"), end
        it here, so that this forward starts a step of its own under its own shapes' plan. Whether
        it ended. A profiled step cannot tell (the tracer keeps its graph's nodes): its first second
        forward ends it unprofiled, and its shapes are profiled again; if the next profile of those
        shapes sees a second forward too, the model's step has two (R-Drop), profiled as one."""
        context, state = self.active, self.shapes.get(self.active_key) if self.active_key else None
        if isinstance(context, ProfileSession):
            if state is None or state.two_forwards:
                return False
            state.two_forwards = True
            executor = context.executor
        else:
            executor = context
            if not executor.abandoned():
                return False
        self.say_once("abandoned", logging.INFO, "slackswap: a training forward had no backward (its graph was let "
                      "go, or another forward joins it): its step ended there, and the next forward is a step of its "
                      "own%s", " (the step was being profiled: these shapes are profiled again)"
                      if isinstance(context, ProfileSession) else "")
        self.active = self.active_key = None
        context.__exit__(None, None, None)
        self.last_stats = executor.stats.last_step
        return True

    def _say_profiling(self, key: ShapeKey) -> None:
        if self.coordinator.shares is None:  # the job's first plan: every rank profiles, rank 0 says so
            log.info("slackswap: profiling a step of input shapes %s (saved tensors go to host for this step)",
                     shapes_of(key))
        else:  # this rank's own shapes
            log.info("slackswap rank %d: profiling a step of input shapes %s (saved tensors go to host for this "
                     "step; profiled steps %d, derived plans %d)", self.rank, shapes_of(key), self.profiled_steps,
                     self.derived_plans, extra=EVERY_RANK)

    def _say_shelter(self, key: ShapeKey) -> None:
        if self.steps == self.warm_until - self.cfg.profile_steps + 1:
            log.info("slackswap: the first %d step(s) warm up in the shelter: every saved tensor goes to host, so "
                     "device activation memory stays within any budget until the step after them is profiled",
                     self.cfg.profile_steps)
        elif self.steps > self.warm_until and self.cfg.replan == "never":
            self.say_once("shelter", logging.WARNING, "slackswap: input shapes %s are new and replan is \"never\": "
                          "steps of new shapes run in the shelter (every saved tensor to host: within the budget, "
                          "slower)", shapes_of(key))

    def _before_backward(self) -> None:
        if isinstance(self.active, ProfileSession):
            self.active.end_forward()  # profiling: the model's forward is over

    def _after_backward(self, error: BaseException | None = None) -> None:
        context, key = self.active, self.active_key
        if context is None:
            return
        self.active = self.active_key = None
        context.__exit__(None, None, None)
        if isinstance(error, ReplayError):  # a later step's replay failed: its plan is demoted already
            log.error("slackswap rank %d: step %d cannot give exact gradients: %s. Its backward raised (stop, or "
                      "skip this batch: the next steps keep or swap what failed). A data-parallel job stops here: "
                      "its other ranks fail or wait in their gradient collective until the launcher ends the job",
                      self.rank, self.steps, error, extra=EVERY_RANK)
            return
        if key is None:  # the shelter: no plan, its saved tensors were on host
            stats, self.active_plan = context.stats.last_step, None
            self.last_stats = stats
            self.reports.unplanned("warm-up" if self.steps <= self.warm_until else "shelter",
                                   stats.peak_device_bytes, stats.fallbacks)
            self.shelter_peak = max(self.shelter_peak, stats.peak_device_bytes)
            if self.steps == self.warm_until:
                log.info("slackswap: %d warm-up step(s) done in the shelter: peak of saved activations on the "
                         "device %s B", self.cfg.profile_steps, f"{self.shelter_peak:,}")
            return
        state = self.shapes[key]
        if isinstance(context, ProfileSession):
            stats, self.active_plan = context.executor.stats.last_step, None
            self.last_stats = stats
            self.reports.unplanned("profiled", stats.peak_device_bytes, stats.fallbacks)
            try:
                self._make_plan(state, context.profile(type(self.module).__name__), key)
            except Exception as e:
                self.coordinator.give_up(e)
                raise
            return
        self.last_stats = stats = state.executor.stats.last_step
        self.active_plan = state.plan
        self.reports.step(state.plan, state.prediction, stats.peak_device_bytes, stats.fallbacks, str(shapes_of(key)),
                          state.profile.total_bytes, (stats.swapped_bytes, stats.recomputed_bytes))
        if not state.checked:
            state.checked = True
            if state.derived_from is not None and not self._derivation_held(key, state, stats):
                return
        timeline = state.executor.stats.last_timeline
        if timeline is not None and state.executor.record:
            state.executor.record = False  # one measured step is enough
            write_trace(timeline, self.cfg.trace_file, "measured", budget_bytes=state.plan.budget_bytes,
                        title=f"slackswap plan {state.plan.digest[:12]} (measured, rank 0)")
        self.plans.after_step(state, self.steps)  # a re-plan followed; verify_every

    # ---- profile -> plan -> agree -> apply ---------------------------------------------------
    @property
    def rank(self) -> int:
        return self.coordinator.job_channel().rank

    def _make_plan(self, state: ShapeState, local, key: ShapeKey) -> None:
        self.shapes.add_base(key, local, self.model_dims)
        budget = self.plans.budget_for(local.total_bytes)
        if self.coordinator.shares is not None:  # agreed at the job's first plan: this rank plans alone
            try:
                agreed = self.plans.plan_locally(local, budget, key)
            except SlackSwapError as e:
                self._shelter_shape(key, state, e)
                return
            self.plans.install(state, agreed)
            say_own_plan(self.rank, shapes_of(key), state, "planned from its profile", self.device_type)
            self.coordinator.compare_structure(describe(key), state.profile.structure_digest)
            return
        channel = self.coordinator.job_channel()
        agreed = self.plans.agree(local, budget, key, channel)
        record = bool(self.cfg.trace_file and channel.rank == 0)
        sim = self.plans.install(state, agreed, record=record)
        self.coordinator.compare_structure(describe(key), state.profile.structure_digest)
        if agreed.ranks == 1 and channel.world > 1:
            say_own_plan(self.rank, shapes_of(key), state, "planned from its profile (the ranks' shapes differ)",
                         self.device_type)
        else:
            say_agreed_plan(state, agreed, self.coordinator.shares, self.plans.hw, self.coordinator.via, channel.rank,
                            channel.world, self.device_type)
        if checkpointing_replaced():  # HF gradient_checkpointing ran inline: what it held, what the plan holds
            self.plans.say_replaced_checkpointing(local, budget)
        if record:
            # the prediction now; the first measured step beside it (same format, see _after_backward),
            # unless the trace could not be written
            state.executor.record = write_trace(sim, self.cfg.trace_file, "predicted",
                                                budget_bytes=agreed.plan.budget_bytes,
                                                title=f"slackswap plan {agreed.plan.digest[:12]} (predicted)")

    def _derived_plan(self, key: ShapeKey) -> bool:
        """A plan for new shapes `key` derived from a measured profile of other shapes (derive.py),
        installed, so that this step runs under it instead of being profiled; whether there is one.
        The job's first plan is always measured (and agreed)."""
        base = self.shapes.base_for(key) if self.cfg.derive_shapes else None
        if base is None or self.coordinator.shares is None:
            return False
        base_key, deriver = base
        derivation = deriver.derive(shapes_of(key))
        if derivation.profile is None:
            self.say_once(f"underivable {derivation.why}", logging.INFO, "slackswap: new input shapes are profiled, "
                          "not derived from others' (%s)", derivation.why)
            return False
        if not self._install_derived(key, derivation.profile, base_key):
            return False
        self.derived_plans += 1
        say_own_plan(self.rank, shapes_of(key), self.shapes[key], f"derived from the profile of {shapes_of(base_key)} "
                     f"(no profiled step; profiled steps {self.profiled_steps}, derived plans {self.derived_plans})",
                     self.device_type)
        return True

    def _install_derived(self, key: ShapeKey, profile, base_key: ShapeKey) -> bool:
        state = self.shapes[key]
        try:
            agreed = self.plans.plan_locally(profile, self.plans.budget_for(profile.total_bytes), key, use_plan_file=False)
        except SlackSwapError as e:
            log.info("slackswap rank %d: no plan for input shapes %s from a derived profile (%s); profiling them",
                     self.rank, shapes_of(key), e, extra=EVERY_RANK)
            return False
        self.plans.install(state, agreed)
        state.derived_from, state.checked = base_key, False
        return True

    def _derivation_held(self, key: ShapeKey, state: ShapeState, stats) -> bool:
        """After the first step under a derived plan: whether the step was what the derivation said
        (every saved tensor in it, at its derived size; the peak within the budget). Where sizes
        differed, the dims are fitted to this step's (derive.Deriver.learn) and the shape derived
        again; where that cannot explain the step, the shape is profiled on its next step. Logged."""
        unplanned = sum(1 for k in stats.sizes if k not in state.profile.by_key)  # (sizes: every save of the step)
        if not (stats.resized or unplanned or stats.peak_device_bytes > state.plan.budget_bytes):
            self.coordinator.compare_structure(describe(key), state.profile.structure_digest)
            return True
        deriver = self.shapes.bases.get(state.derived_from)
        if deriver is not None and not (unplanned or state.refitted) and stats.resized \
                and not deriver.learn(shapes_of(key), stats.sizes):
            again = deriver.derive(shapes_of(key)).profile
            if again is not None and all(stats.sizes.get(a.key, (None, a.bytes))[1] == a.bytes
                                         for a in again.activations):
                if self._install_derived(key, again, state.derived_from):
                    state.refitted = True
                    log.info("slackswap rank %d: %d saved tensor(s) of input shapes %s had other sizes than derived "
                             "(dims such as s - 1 or b * s): their dims are fitted to this step, the shapes "
                             "derived again (plan %s)", self.rank, stats.resized, shapes_of(key),
                             state.plan.digest[:12], extra=EVERY_RANK)
                    return False
        log.warning("slackswap rank %d: the plan derived for input shapes %s did not fit their step (%d saved "
                    "tensor(s) of another size than derived, %d not in the derived profile, peak %s B against a "
                    "budget of %s B): these shapes are profiled on their next step", self.rank, shapes_of(key),
                    stats.resized, unplanned, f"{stats.peak_device_bytes:,}", f"{state.plan.budget_bytes:,}",
                    extra=EVERY_RANK)
        self.shapes.drop(key)
        self.shapes.underivable.add(key)
        return False

    def _shelter_shape(self, key: ShapeKey, state: ShapeState, error: Exception) -> None:
        """No plan for `key` on this rank: its steps run in the shelter (within any budget, slower)."""
        state.shelter = True
        log.warning("slackswap rank %d: no plan for input shapes %s (%s: %s); their steps run in the shelter "
                    "(every saved tensor to host: within the budget, slower)", self.rank, shapes_of(key),
                    type(error).__name__, error, extra=EVERY_RANK)


__all__ = ["AgreementError", "SlackSwapRuntime", "initialize"]

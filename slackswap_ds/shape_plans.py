"""Plans for a rank's input shapes: made from a measured profile, derived from another shape's, checked.

The shape lifecycle (lifecycle.py) decides when; this module does it, with the plans service
(PlanMaker, and through it the coordinator) and the shapes it keeps (ShapeCache):

    from_profile   after a profiled step: the job's first plan is agreed by the coordinator's group
                   (every rank of the job, or a pipeline stage's ranks); every later one is this
                   rank's own, with its own share. No plan within the budget: the shapes run in
                   the shelter (logged).
    derived        a new shape's plan from a measured profile of other shapes (derive.py), on its
                   very step, instead of a profiled step.
    check_derived  after the first step under a derived plan: the derivation held, or its dims are
                   fitted to the step and derived again, or the shapes are profiled next.

Each records what it did as a lifecycle Transition in the step's `events`.
"""

from __future__ import annotations

import collections
import logging
import re

from .config import SlackSwapConfig
from .derive import Derivation
from .errors import SlackSwapError
from .job_report import say_agreed_plan, say_own_plan, say_replaced_checkpointing, say_stage_plan, write_job_trace
from .logs import EVERY_RANK, SayOnce, log
from .plan_maker import PlanMaker, checkpointing_held
from .shapes import ShapeCache, ShapeKey, ShapeState, Transition, describe, shapes_of
from .step_profile import StepProfile


Events = list  # a step's Transitions, in order


class ShapePlans:
    """The plans of one rank's input shapes (see the module docstring). `dims`: the model's
    parameter dims (shapes.model_dims); `stage`: the pipeline stage (None: a data-parallel engine)."""

    def __init__(self, cfg: SlackSwapConfig, plans: PlanMaker, dims: frozenset[int], device_type: str):
        self.cfg, self.plans, self.dims, self.device_type = cfg, plans, dims, device_type
        self.coordinator = plans.coordinator
        self.cache = ShapeCache(cfg.max_shapes, cfg.replan)
        self.profiled_steps = 0  # steps this rank profiled (its first included)
        self.derived_plans = 0  # plans this rank derived for new shapes instead (derive.py)
        self.stale: collections.Counter[ShapeKey] = collections.Counter()  # profiled again for unplanned saves
        self.say_once = SayOnce()
        self.said_kinds: set[str] = set()  # kinds of own plans said once (_say_own)

    @property
    def rank(self) -> int:
        return self.coordinator.job_channel().rank

    def forget(self) -> None:
        """Every plan and measured profile dropped (the model's program changed)."""
        self.cache = ShapeCache(self.cfg.max_shapes, self.cfg.replan)
        self.coordinator.new_program()

    def _compare_structure(self, key: ShapeKey, state) -> None:
        profile = state.profile
        self.coordinator.compare_structure(describe(key), profile.structure_digest, profile.runs_compiled_code)

    # ---- measured -----------------------------------------------------------------------------------
    def profiling(self, key: ShapeKey) -> None:
        """A step of shapes `key` is profiled now: counted, and said (the job's first by one rank of
        the coordinator's group; later ones by the rank whose shapes they are)."""
        self.profiled_steps += 1
        stage = self.coordinator.stage
        what, step = ("a step", "step") if stage is None else ("a micro-batch", "batch")
        if self.coordinator.shares is None:
            if self.coordinator.leads_group():
                log.info("slackswap: %sprofiling %s of input shapes %s (saved tensors go to host for this %s)",
                         "" if stage is None else f"stage {stage} ", what, shapes_of(key), step,
                         extra=None if stage is None else EVERY_RANK)
        else:  # (the first said; the next at DEBUG, counted in the periodic report)
            level = logging.DEBUG if "profiling" in self.said_kinds else logging.INFO
            self.said_kinds.add("profiling")
            log.log(level, "slackswap %s: profiling %s of input shapes %s (saved tensors go to host for this %s; "
                    "profiled steps %d, derived plans %d)", self.who(), what, shapes_of(key), step,
                    self.profiled_steps, self.derived_plans, extra=EVERY_RANK)

    def drop_unread(self, key: ShapeKey, session, events: Events) -> bool:
        """Whether the profile of a step of several forwards, one of which had no backward (its
        saves never read: a batch skipped, then the next one), is dropped: it would plan for a
        forward that steps do not have, so its shapes are profiled again (twice at most: a loop that
        always leaves one forward unread has it in its steps, and the profile plans for it)."""
        state = self.cache.get(key)
        unread = session.unread_forwards()
        if state is None or not unread or state.profiles_dropped >= 2:
            return False
        state.profiles_dropped += 1
        events.append(Transition.PROFILED_AGAIN)
        self.say_once("profiled again", logging.INFO, "slackswap: a profiled step had a forward without backward "
                      "(%d of its %d forwards): its shapes are profiled again", len(unread), len(session.forwards))
        return True

    # ---- from a profile ----------------------------------------------------------------------------------
    def from_profile(self, key: ShapeKey, local: StepProfile, holds: int, events: Events,
                     replaced_checkpointing: bool = False) -> None:
        """A plan for shapes `key` from their measured profile `local`, for `holds` micro-batches in
        flight: the job's first, agreed by the coordinator's group; later ones, this rank's own.
        `replaced_checkpointing`: the profiled step ran the model's own checkpoint calls inline
        (from then on this model's budgets are what that checkpointing held, unless one is set)."""
        state = self.cache[key]
        self.plans.replaced_checkpointing |= replaced_checkpointing
        self.plans.holds = holds
        self.cache.add_base(key, local, self.dims)
        budget = self.plans.budget_for(local, holds)
        if self.coordinator.shares is not None:  # agreed at the job's first plan: this rank plans alone
            try:
                agreed = self.plans.plan_locally(local, budget, key)
            except SlackSwapError as e:
                self._no_plan(key, state, e, events)
                return
            self.plans.install(state, agreed)
            events.append(Transition.PLANNED_ALONE)
            self._note_fallback(agreed.plan, events)
            self._say_own(key, state, "planned from its profile", "profiled")
            self._compare_structure(key, state)
            return
        record = bool(self.cfg.trace_file and self.rank == 0 and self.coordinator.stage is None)
        agreed = self.plans.agree(local, budget, key)
        sim = self.plans.install(state, agreed, record=record)
        events.append(Transition.AGREED)
        self._note_fallback(agreed.plan, events)
        self._compare_structure(key, state)
        if agreed.ranks == 1 and self.coordinator.group_size() > 1:
            self._say_own(key, state, "planned from its profile (the ranks' shapes differ)")
        elif self.coordinator.stage is not None:
            say_stage_plan(state, agreed, self.coordinator, self.plans.hw, holds, self.device_type)
        else:
            say_agreed_plan(state, agreed, self.coordinator, self.plans.hw, self.device_type)
        if self.plans.replaced_checkpointing:  # its own checkpointing ran inline: what it held, what the plan holds
            say_replaced_checkpointing(self.cfg, local.total_bytes, budget,
                                       checkpointing_held(local, self.plans.hw, holds))
        if record:  # the prediction now; the first measured step beside it (lifecycle.py)
            state.executor.record = write_job_trace(sim, self.cfg.trace_file, "predicted",
                                                    budget_bytes=agreed.plan.budget_bytes,
                                                    title=f"slackswap plan {agreed.plan.digest[:12]} (predicted)")

    def _no_plan(self, key: ShapeKey, state: ShapeState, error: Exception, events: Events) -> None:
        """No plan for `key` on this rank: its steps run in the shelter (the least a step holds, slower)."""
        state.shelter = True
        events.append(Transition.NO_PLAN)
        log.warning("slackswap %s: no plan for input shapes %s (%s: %s); their steps run in the shelter (every "
                    "saved tensor to host: the device holds only what an op reads at once; slower)", self.who(),
                    shapes_of(key), type(error).__name__, error, extra=EVERY_RANK)

    # ---- derived --------------------------------------------------------------------------------------
    def derived(self, key: ShapeKey, events: Events) -> bool:
        """A plan for new shapes `key` derived from a measured profile of other shapes, installed, so
        that their step runs under it instead of being profiled; whether there is one. The job's
        first plan is always measured (and agreed)."""
        base = self.cache.base_for(key) if self.cfg.derive_shapes else None
        if base is None or self.coordinator.shares is None:
            return False
        base_key, deriver = base
        try:
            derivation = deriver.derive(shapes_of(key))
        except SlackSwapError as e:  # a derivation that cannot hold: these shapes are profiled, never a raise
            derivation = Derivation(None, f"{type(e).__name__}: {e}")
        if derivation.profile is None:
            self.say_once("underivable " + re.sub(r"\d+", "N", derivation.why), logging.INFO,
                          "slackswap: new input shapes are profiled, not derived from others' (%s)", derivation.why)
            return False
        if not self._install_derived(key, derivation.profile, base_key):
            return False
        self.derived_plans += 1
        events.append(Transition.DERIVED)
        self._note_fallback(self.cache[key].plan, events)
        self._say_own(key, self.cache[key], f"derived from the profile of {shapes_of(base_key)} (no profiled step; "
                      f"profiled steps {self.profiled_steps}, derived plans {self.derived_plans})", "derived")
        return True

    def _install_derived(self, key: ShapeKey, profile: StepProfile, base_key: ShapeKey) -> bool:
        state = self.cache[key]
        budget = self.plans.budget_for(profile, self.plans.holds)
        try:
            agreed = self.plans.plan_locally(profile, budget, key, use_plan_file=False)
        except SlackSwapError as e:
            log.info("slackswap %s: no plan for input shapes %s from a derived profile (%s); profiling them",
                     self.who(), shapes_of(key), e, extra=EVERY_RANK)
            return False
        self.plans.install(state, agreed)
        state.derived_from, state.checked = base_key, False
        return True

    def check_derived(self, key: ShapeKey, state: ShapeState, peak: int, events: Events) -> bool:
        """After the first step under a derived plan (`peak`: its device bytes of saved tensors):
        whether it was what the derivation said (every saved tensor in it, at its derived size; the
        peak within the budget). Where sizes differed, the dims are fitted to this step's
        (derive.Deriver.learn) and the shapes derived again; where that cannot explain the step,
        they are profiled on their next step. Logged."""
        stats = state.executor.stats.last_step  # (sizes: every save of its last micro-batch)
        unplanned = sum(1 for k in stats.sizes if k not in state.profile.by_key)
        if not (stats.resized or unplanned or peak > state.plan.budget_bytes):
            events.append(Transition.HELD)
            self._compare_structure(key, state)
            return True
        deriver = self.cache.bases.get(state.derived_from)
        if deriver is not None and not (unplanned or state.refitted) and stats.resized \
                and not deriver.learn(shapes_of(key), stats.sizes):
            again = deriver.derive(shapes_of(key)).profile
            if again is not None and all(stats.sizes.get(a.key, (None, a.bytes))[1] == a.bytes
                                         for a in again.activations):
                if self._install_derived(key, again, state.derived_from):
                    state.refitted = True
                    events.append(Transition.REFITTED)
                    log.info("slackswap %s: %d saved tensor(s) of input shapes %s had other sizes than derived "
                             "(dims such as s - 1 or b * s): their dims are fitted to this step, the shapes derived "
                             "again (plan %s)", self.who(), stats.resized, shapes_of(key), state.plan.digest[:12],
                             extra=EVERY_RANK)
                    return False
        events.append(Transition.UNDERIVABLE)
        log.warning("slackswap %s: the plan derived for input shapes %s did not fit their step (%d saved tensor(s) "
                    "of another size than derived, %d not in the derived profile, peak %s B against a budget of %s "
                    "B): these shapes are profiled on their next step", self.who(), shapes_of(key), stats.resized,
                    unplanned, f"{peak:,}", f"{state.plan.budget_bytes:,}", extra=EVERY_RANK)
        self.cache.drop(key)
        self.cache.underivable.add(key)
        return False

    # ---- after a planned step ----------------------------------------------------------------------------
    def after_planned_step(self, key: ShapeKey, peak: int, unplanned: int, resized: int, events: Events) -> None:
        """A step ran under the plan of shapes `key` (`peak`: its device bytes of saved
        tensors; `unplanned`: how many it saved that the plan's profile does not have; `resized`: how
        many of another size than profiled): the first step under a derived plan checks it
        (check_derived); a measured plan whose step saved others (another code path, a second
        forward), or whose compiled code saved other sizes (Dynamo recompiled a block since the
        profile, for dynamic shapes: its n-th save is now another tensor), is profiled again (STALE,
        twice at most: a model that alternates keeps its plan, its other saves to host, the budget
        held); the first measured step of a recorded plan is written beside its predicted trace; a
        re-plan its verification made is followed (REPLANNED)."""
        state = self.cache[key]
        if not state.checked:
            state.checked = True
            if state.derived_from is not None and not self.check_derived(key, state, peak, events):
                return
        recompiled = resized and state.profile.runs_compiled_code
        if (unplanned or recompiled) and state.derived_from is None and self.stale[key] < 2:
            self.stale[key] += 1
            events.append(Transition.STALE)
            what = (f"saved {unplanned} tensor(s) its plan's profile does not have (another code path, or another "
                    "forward): they went to host" if unplanned else
                    f"ran compiled code that saved {resized} tensor(s) of other sizes than profiled (a block "
                    "recompiled since): the budget was held")
            log.info("slackswap %s: a step of input shapes %s %s, and these shapes are profiled again", self.who(),
                     shapes_of(key), what, extra=EVERY_RANK)
            self.cache.drop(key)
            return
        timeline = state.executor.stats.last_timeline
        if timeline is not None and state.executor.record:
            state.executor.record = False  # one measured step is enough
            write_job_trace(timeline, self.cfg.trace_file, "measured", budget_bytes=state.plan.budget_bytes,
                            title=f"slackswap plan {state.plan.digest[:12]} (measured, rank 0)")
        if self.plans.after_step(state):
            events.append(Transition.REPLANNED)

    def _note_fallback(self, plan, events: Events) -> None:
        if plan.planner != self.cfg.planner:  # (said once by the plan maker; counted from then on)
            events.append(Transition.FALLBACK_PLANNER)

    # ---- what the log says --------------------------------------------------------------------------------
    def who(self) -> str:
        """`rank r`, or `stage s rank r` under pipeline parallelism."""
        stage = self.coordinator.stage
        return f"rank {self.rank}" if stage is None else f"stage {stage} rank {self.rank}"

    def _say_own(self, key: ShapeKey, state: ShapeState, how: str, kind: str = "") -> None:
        """A plan of this rank's own; of a `kind` that repeats (a padding collator's new lengths
        every step: "derived", "profiled"), the first is said and the others are logged at DEBUG
        and counted in the periodic report (job_report.TALLIED)."""
        first = not kind or kind not in self.said_kinds
        self.said_kinds.add(kind)
        holds = self.plans.holds if self.coordinator.stage is not None else None
        say_own_plan(self.who(), shapes_of(key), state, how + ("" if not kind else "; the next such are counted in "
                     "the periodic report"), holds, self.device_type, logging.INFO if first else logging.DEBUG)


__all__ = ["Events", "ShapePlans"]

"""Plans for one rank's input shapes: made within the budget, fitted to the device, agreed, installed.

`PlanMaker` is what the shape lifecycle (lifecycle.py, shape_plans.py) uses to turn a measured or
derived profile into a running executor, on the DeepSpeed engine and on pipeline stages alike:

    within_budget   the configured planner's plan for `holds` micro-batches at once; if it finds
                    none within the budget, the fastest (simulated) of the fallbacks that does,
                    with a warning; if none does, BudgetInfeasibleError with every reason
    plannable       the profile planners see: under ZeRO-3, a tensor is recomputed only inside its own
                    layer call's backward, where ZeRO-3 has gathered the layer's parameters on every
                    rank (a replay elsewhere would gather them on one rank alone)
    fit_to_device   on a device without streams (DeepSpeed's CPU accelerator) copies are
                    synchronous: prefetches timed for the planning hardware are retimed if they
                    would push the peak over the budget there
    agree           node facts, the lead rank's plan (from plan_file if one was made for exactly
                    this job), and the agreement of every rank of the coordinator's group (the job,
                    or a pipeline stage; coordination.py); where their input shapes differ, each
                    rank's own plan
    plan_locally    a plan of this rank alone, with its own share: every shape after the job's first
    install         the shape's executor on this rank's host pool, and the prediction reports
                    compare with; the plan is not lowered or simulated again where the planner's
                    `Planned` already holds its schedule and its simulation on this rank's share
    replan          after a verifying step demoted tensors: planned again, locally
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from . import plan_file
from .agreement import agree
from .budget import AUTO_MARGIN, auto_budget_bytes
from .config import SlackSwapConfig
from .coordination import Coordinator
from .deepspeed_api import (ZeroLayers, gather_layers_whole, offloads_parameters, partitions_parameters,
                            zero_offload_pinned_bytes, zero_sharding)
from .errors import BudgetInfeasibleError, PlanError
from .hardware import Hardware
from .logs import EVERY_RANK, SayOnce, log
from .machine import device_room, resolve_hardware
from .plan import Plan, lower
from .plan_file import MadeFor
from .planners import PLANNERS, get_planner, keep_all_result, refusal
from .planners.common import Planned, fit_triggers, held_bytes, simulated
from .runtime.device import Device
from .runtime.executor import executor_for
from .runtime.host_pool import HostPool
from .runtime.regions import find_layers
from .shapes import Prediction, ShapeKey, ShapeState, describe
from .shares import PRIVATE, Share
from .simulator import SimResult, simulate
from .step_profile import StepProfile

# tried, fastest first by simulation, when the configured planner finds no plan within the budget:
# swapping everything needs only the host pool; recomputing everything, only the layer inputs
FALLBACK_PLANNERS = ("offload-all", "full-recompute")


@dataclass(frozen=True)
class Agreed:
    """The plan a rank runs, with the profile it was made for (the lead's, where a group runs one
    plan), the lead's `Planned` (a planner's, or the plan_file's plan simulated; None on the other
    ranks of a group), the share that `Planned` was simulated on, and how many ranks run the plan
    (1: a rank's own, `plan_locally`)."""

    profile: StepProfile
    plan: Plan
    planned: Planned | None
    share: Share | None = None
    ranks: int = 1


class PlanMaker:
    """Makes, agrees and installs one rank's plans (see the module docstring)."""

    def __init__(self, cfg: SlackSwapConfig, hw: Hardware, module: nn.Module, coordinator: Coordinator,
                 offload_pinned_bytes: int | None = None, recompute: bool = True, zero: tuple[int, int] = (0, 1),
                 zero_layers: ZeroLayers | None = None):
        self.cfg, self.hw, self.module, self.coordinator = cfg, hw, module, coordinator
        self.offload_pinned_bytes = offload_pinned_bytes  # ZeRO-Offload's pinned host bytes per rank (None: off)
        self.recompute = recompute  # plans may recompute
        self.zero = zero  # (ZeRO stage, ranks the model state is sharded over)
        self.zero_layers = zero_layers  # ZeRO-3: layers gathered whole, replayed inside their own backward
        self.auto_bytes: int | None = None  # an "auto" budget, found at the job's first plan
        self.said_too_large = False  # a size budget above the device's memory was warned about
        # the model's own checkpointing ran inline in a profiled step (ProfileSession): this model's,
        # not the process's (another engine's model in the same process may have none)
        self.replaced_checkpointing = False
        self.holds = 1  # micro-batches whose saved tensors are held at once (a pipeline stage's: stages.py)
        self.pool: HostPool | None = None  # one HostPool for every shape's executor
        self.said = SayOnce()  # what the job's plans and executors say once per kind

    @classmethod
    def for_engine(cls, engine, cfg: SlackSwapConfig, stage: int | None = None,
                   members: list[int] | None = None) -> "PlanMaker":
        """What every rank settles as DeepSpeed starts, for a data-parallel engine and a pipeline
        stage (`stage`, with the job ranks in it) alike: the hardware to plan for, how ranks agree
        (coordination.py), ZeRO's host traffic."""
        hw = resolve_hardware(cfg.hardware)
        if offloads_parameters(engine):
            log.warning("slackswap: ZeRO-Infinity parameter offload (offload_param) moves every layer's parameters "
                        "over the host link in forward and backward; plans do not account for that traffic yet, "
                        "so prefetches may stall (slower steps; the gradients are unaffected)")
        zero3 = partitions_parameters(engine)
        zero_layers = _zero3_layers(engine) if zero3 else None
        return cls(cfg, hw, engine.module, Coordinator(cfg, hw, stage, members), zero_offload_pinned_bytes(engine),
                   not zero3 or zero_layers is not None, zero_sharding(engine), zero_layers)

    def budget_for(self, profile: StepProfile, holds: int = 1) -> int:
        """The budget in bytes of a step of `profile` with `holds` micro-batches in flight: what the
        model's own checkpointing would have held where SlackSwap replaced it and the user set no
        `activation_budget` (taking over never raises memory), else `activation_budget` of the
        step's keep-all peak; "auto" is what the device has room for beside the model state, found
        once, at the job's first plan (the optimizer has stepped by then: its state is allocated),
        and logged."""
        if self.replaced_checkpointing and "activation_budget" not in self.cfg.model_fields_set:
            return checkpointing_held(profile, self.hw, holds)
        keep_all_bytes = holds * profile.total_bytes
        if self.cfg.budget.is_auto and self.auto_bytes is None:
            device, state, how = device_room(self.module, self.hw, *self.zero)
            self.auto_bytes = auto_budget_bytes(device, state)
            log.info("slackswap: activation_budget \"auto\" is %s B: the device's %s B less the model state's %s B "
                     "(%s) and a margin of %d%% (%s B)", f"{self.auto_bytes:,}", f"{device:,}", f"{state:,}", how,
                     round(100 * AUTO_MARGIN), f"{int(AUTO_MARGIN * device):,}")
            if self.auto_bytes == 0:
                raise BudgetInfeasibleError(f"activation_budget \"auto\": the model state ({state:,} B, {how}) "
                                            f"leaves no room on the device's {device:,} B; shard it (ZeRO) or give "
                                            f"activation_budget in bytes")
        budget = self.cfg.budget.of(keep_all_bytes, self.auto_bytes)
        if budget > self.hw.hbm_bytes and not self.cfg.budget.is_fraction and not self.said_too_large:
            self.said_too_large = True  # (a size: it binds no step on this device)
            log.warning("slackswap: activation_budget %s (%s B) is more than the device's memory (%s B, %s): it will "
                        "not bound a step here; give a fraction of the keep-all peak, a smaller size, or \"auto\"",
                        self.cfg.activation_budget, f"{budget:,}", f"{int(self.hw.hbm_bytes):,}", self.hw.name)
        return budget

    def plannable(self, profile: StepProfile) -> StepProfile:
        """`profile` as planners may plan it: without recompute where plans may not recompute."""
        if not self.recompute:
            keys = [a.key for a in profile.activations if a.recomputable]
        elif self.zero_layers is not None:
            keys = profile.read_outside_their_call()
        else:
            keys = []
        return profile.without_recompute(keys) if keys else profile  # (plannable twice is plannable once)

    # ---- making a plan ---------------------------------------------------------------------------
    def within_budget(self, profile: StepProfile, budget: int, planner: str, share: Share | None = None) -> Planned:
        """`planner`'s plan within `budget` on `share` (default: the shares' plan share), else the
        fastest fallback's (module docstring)."""
        share = share or self.coordinator.shares.plan
        try:
            return get_planner(planner)(profile, self.hw, budget, share, holds=self.holds)
        except BudgetInfeasibleError as e:
            reasons, found = [f"{planner}: {refusal(planner, e)}"], []
        for other in FALLBACK_PLANNERS:
            if other == planner:
                continue
            try:
                found.append((other, get_planner(other)(profile, self.hw, budget, share, holds=self.holds)))
            except BudgetInfeasibleError as e:
                reasons.append(f"{other}: {refusal(other, e)}")
        if not found:
            raise BudgetInfeasibleError(f"no planner keeps this step's saved activations within {budget:,} B "
                                        f"(activation_budget {self.cfg.activation_budget}): " + "; ".join(reasons)
                                        + f". The smallest budget that works here is {self._least(profile, share)}: "
                                        "raise activation_budget (or host_pool_bytes_per_node)")
        other, planned = min(found, key=lambda f: f[1].result.step_s)
        # (said once per kind: every new shape of a job may need it; the reports count the others)
        self.said(f"fallback {planner} {other}", logging.WARNING, "slackswap: planner %s found no plan within %s B "
                  "(%s); using %s instead (simulated step %.2f ms)", planner, f"{budget:,}", reasons[0], other,
                  1e3 * planned.result.step_s)
        return planned

    def _least(self, profile: StepProfile, share: Share) -> str:
        """The least peak a fallback planner holds this step to, on an unlimited budget, said as
        `N B (planner)`: what the smallest budget that works is."""
        budget, peaks = self.holds * profile.total_bytes, []
        for planner in FALLBACK_PLANNERS:
            try:
                peaks.append((get_planner(planner)(profile, self.hw, budget, share, holds=self.holds).peak_bytes,
                              planner))
            except BudgetInfeasibleError:  # (offload-all without the host pool it needs)
                continue
        return "{:,} B ({})".format(*min(peaks)) if peaks else f"the keep-all peak, {budget:,} B"

    def fit_to_device(self, profile: StepProfile, planned: Planned, share: Share | None = None) -> Planned:
        """`planned` (made on `share`, default the shares' plan share) as it should run on this
        device (module docstring; retimes are logged)."""
        if Device.current().has_streams:
            return planned
        fitted = fit_triggers(profile, planned, self.hw, Hardware.instant_copies(),
                              share or self.coordinator.shares.plan, holds=self.holds)
        if fitted is not planned:
            log.info("slackswap: copies are synchronous on this device; prefetches retimed so that the plan "
                     "stays within its budget here (%s -> %s)", planned.plan.digest[:12], fitted.plan.digest[:12])
        return fitted

    def agree(self, local: StepProfile, budget: int, key: ShapeKey) -> Agreed:
        """Steps 1-3 of coordination.py for `local` (this rank's profile of shape `key`): node facts
        with every rank of the job, the plan made by the first rank of the coordinator's group (the
        job, or a pipeline stage), and its agreement over the group's channel (then, for a stage,
        every stage's plan on every rank)."""
        coordinator, local = self.coordinator, self.plannable(local)
        channel, peers = coordinator.agreement_group()
        with coordinator.agreeing():
            if not coordinator.exchange_facts(local, budget, describe(key), self.holds, self.offload_pinned_bytes,
                                              peers):
                agreed = self.plan_locally(local, budget, key)
            else:
                plan = planned = None
                if channel.rank == 0:
                    planned = self._planned(local, budget, key, coordinator.shares.plan, use_plan_file=True)
                    plan = planned.plan
                profile, plan = agree(channel, local, plan, self.cfg.sync_timeout_s)
                agreed = Agreed(profile, plan, planned, coordinator.shares.plan, channel.world)
        coordinator.stage_round(agreed.plan.digest, agreed.ranks == channel.world)
        return agreed

    def plan_locally(self, local: StepProfile, budget: int, key: ShapeKey, use_plan_file: bool = True) -> Agreed:
        """This rank's own plan for `local` (of input shapes `key`), with its own share: no other
        rank is asked or waited for (the shares were agreed at the job's first plan). Rank 0 keeps
        its plans in plan_file too, unless not `use_plan_file` (a derived profile's, unchecked)."""
        share, local = self.coordinator.shares.own, self.plannable(local)
        planned = self._planned(local, budget, key, share, use_plan_file and self.coordinator.job_channel().rank == 0)
        return Agreed(local, planned.plan, planned, share)

    def _planned(self, local: StepProfile, budget: int, key: ShapeKey, share: Share, use_plan_file: bool) -> Planned:
        """The plan_file's plan made for exactly this (`use_plan_file`), else a new one within the
        budget on `share`, fitted to the device (and added to plan_file)."""
        made_for = self.made_for(local, budget, key, share) if use_plan_file and self.cfg.plan_file else None
        planned = self.load_plan(local, made_for, share) if made_for is not None else None
        if planned is None:
            planned = self.fit_to_device(local, self.within_budget(local, budget, self.cfg.planner, share), share)
            if made_for is not None:
                self.save_plan(plan_file.PlanEntry(made_for, planned.plan, local))
        return planned

    # ---- installing it -----------------------------------------------------------------------------
    def install(self, state: ShapeState, agreed: Agreed, record: bool = False) -> SimResult:
        """From now on this shape's steps run the agreed plan: its executor on this rank's host pool,
        and the prediction reports compare with (on this rank's link share; with `holds` > 1, the
        other micro-batches' kept bytes on top of the peak). Returns the simulation."""
        profile, plan, planned = agreed.profile, agreed.plan, agreed.planned
        shares = self.coordinator.shares
        if self.pool is None:
            self.pool = HostPool(shares.own.host_pool_bytes, Device.current())
        held = held_bytes(profile, plan.decision, self.holds)
        if planned is not None and planned.plan is plan:
            schedule = planned.schedule
        else:
            schedule = lower(profile, plan)  # this rank's one lowering of a plan it received
        if planned is not None and agreed.share == shares.own and not record:
            sim = planned.result  # the planner simulated it on this very share
        else:  # another share than the plan's, a plan received or read from a file, or a recorded trace
            sim = simulate(schedule, shares.own.limit(self.hw), budget_bytes=plan.budget_bytes - held, record=record)
        state.profile, state.plan = profile, plan
        state.search = planned.search if planned is not None else ""
        state.executor = executor_for(self.module, plan, profile, schedule=schedule, pool=self.pool,
                                      replan=self.replan, verify_every=self.cfg.verify_every, said=self.said,
                                      around_replay=self.zero_layers.replaying if self.zero_layers else None)
        state.prediction = self._prediction(profile, sim, held)
        return sim

    def after_step(self, state: ShapeState) -> bool:
        """After a planned step (or pipeline batch) of `state`'s shape: the state follows a re-plan
        that step's verification made; whether it did. (The executor verifies again every
        `verify_every` of its steps: runtime/steps.py.)"""
        return self.follow(state)

    def follow(self, state: ShapeState) -> bool:
        """After the executor re-planned (a failed verification demoted tensors): the state's plan,
        profile and prediction become those of the plan it runs now, so that reports, traces and
        `active_plan` describe what runs (logged). Whether it changed anything."""
        executor = state.executor
        if executor is None or executor.plan is None or executor.plan is state.plan:
            return False
        profile, plan = executor.profile, executor.plan
        held = held_bytes(profile, plan.decision, self.holds)
        sim = simulate(lower(profile, plan), self.coordinator.shares.own.limit(self.hw),
                       budget_bytes=plan.budget_bytes - held, record=False)
        state.profile, state.plan, state.prediction = profile, plan, self._prediction(profile, sim, held)
        log.info("slackswap: now running plan %s (re-planned without the recomputes that did not replay exactly; "
                 "%s), predicted %.1f%% of ideal, peak %s B of %s B", plan.digest[:12], fate_bytes(plan, profile),
                 100 * state.prediction.throughput, f"{state.prediction.peak_bytes:,}", f"{plan.budget_bytes:,}",
                 extra=EVERY_RANK)
        return True

    def _prediction(self, profile: StepProfile, sim: SimResult, held: int) -> Prediction:
        ideal = keep_all_result(profile, self.hw).step_s
        return Prediction(ideal / sim.step_s if sim.step_s else 1.0, sim.step_s, sim.peak_bytes + held)

    def replan(self, profile: StepProfile, plan: Plan, failures: dict[str, str]) -> tuple[StepProfile, Plan]:
        """After the verifying step demoted tensors: this rank plans again, locally, with its share
        (a nondeterministic kernel may misbehave on one rank only; ranks may then differ, logged)."""
        pinned = profile.without_recompute(failures)
        planner = plan.planner if plan.planner in PLANNERS else self.cfg.planner
        share = self.coordinator.shares.own
        return pinned, self.fit_to_device(pinned, self.within_budget(pinned, plan.budget_bytes, planner, share),
                                          share).plan

    # ---- plan files --------------------------------------------------------------------------------
    def made_for(self, profile: StepProfile, budget: int, key: ShapeKey, share: Share) -> MadeFor:
        """What a plan made now on `share` is made for (plan_file.MadeFor)."""
        return MadeFor(
            inputs=describe(key), structure=profile.structure_digest, budget_bytes=int(budget),
            hardware=f"{self.hw.name} {self.hw.digest}", planner=self.cfg.planner,
            share=share.describe(),
            world=f"{self.coordinator.job_channel().world} ranks, {self.coordinator.shares.node_ranks} per node")

    def load_plan(self, profile: StepProfile, made_for: MadeFor, share: Share) -> Planned | None:
        """The plan_file's plan made for exactly this job (rebuilt for this profile: the same
        decisions and triggers), lowered and simulated once, or None; a file with none, or whose
        plan does not keep this job's budget (an edited file), is refused with the reason."""
        path = self.cfg.plan_file
        if not path:
            return None
        entries = plan_file.read(path)  # a malformed or foreign file raises with the reason
        entry, why = plan_file.find(entries, made_for)
        planned = None
        if entry is not None:
            try:
                entry.plan.check(profile)
            except PlanError as e:
                raise PlanError(f"plan_file {path!r} does not fit this model's step: {e}; delete it to re-plan") from None
            planned = simulated(profile, entry.plan.rebuilt(profile), self.hw, share, self.holds)
            planned = self.fit_to_device(profile, planned, share)  # (a plan made offline, for streams)
            why = self._over_budget(planned, made_for.budget_bytes)
        if why:
            message = f"plan_file {path!r} has no plan made for this job ({'; '.join(why)})"
            if self.cfg.plan_file_mismatch == "error":
                raise PlanError(message + '; delete the file, or set "plan_file_mismatch": "replan"')
            log.warning("slackswap: %s: planning afresh", message)
            return None
        if planned is not None:  # (its digest is the file's, rebuilt: this step's own measured times)
            log.info("slackswap: using the plan in plan_file %s (%s there; %s as rebuilt for this step)", path,
                     entry.plan.digest[:12], planned.plan.digest[:12])
        return planned

    @staticmethod
    def _over_budget(planned: Planned, budget: int) -> list[str]:
        """Why a plan read from a file cannot run within `budget` (nothing if it can): its file was
        edited, or the simulator finds its peak over the budget."""
        plan = planned.plan
        if plan.budget_bytes != budget:
            return [f"its plan's budget is {plan.budget_bytes:,} B, the job's {budget:,} B"]
        if not planned.result.feasible or planned.peak_bytes > budget:
            return [f"its plan peaks at {planned.peak_bytes:,} B, over the budget of {budget:,} B"]
        return []

    def save_plan(self, entry: plan_file.PlanEntry) -> None:
        """Add the entry to plan_file (atomically; rank 0 only); a read-only file is left as it is."""
        path = self.cfg.plan_file
        if not path:
            return
        if not plan_file.writable(path):
            log.info("slackswap: plan_file %s is read-only: used as it is, not updated", path)
            return
        try:
            plan_file.write(path, plan_file.upsert(plan_file.read(path), entry))
        except OSError as e:  # the plan is made and agreed: losing the file must not stop training
            log.warning("slackswap: could not write plan_file %s (%s); the plan is used, not saved", path, e)


def _zero3_layers(engine) -> ZeroLayers | None:
    """ZeRO-3: the model's block-stack layers gathered whole (deepspeed_api.gather_layers_whole), so
    that plans may recompute; None (plans keep or swap) where it has none. Said once either way."""
    layers = [layer for _, layer in find_layers(engine.module)]
    zero_layers = gather_layers_whole(engine, layers)
    if zero_layers is not None:
        log.info("slackswap: ZeRO-3 gathers each of the model's %d layers whole (a leaf module) before its forward "
                 "and its backward, on every rank alike: a replay runs inside its layer's backward and gathers "
                 "nothing itself; tensors read outside their own layer are kept or swapped", len(layers))
    else:
        log.info("slackswap: ZeRO-3 without block-stack layers to gather whole: a replay would gather parameters "
                 "on one rank alone, so plans keep or swap saved tensors here, never recompute them")
    return zero_layers


def checkpointing_held(profile: StepProfile, hw: Hardware, holds: int = 1) -> int:
    """The device bytes of saved activations a model's own activation checkpointing holds at its
    peak, every layer recomputed: the full-recompute plan's peak for `holds` micro-batches in
    flight (planned on the profile as it is, recompute allowed: what the checkpointing does)."""
    planned = get_planner("full-recompute")(profile, hw, holds * profile.total_bytes, PRIVATE, holds=holds)
    return planned.peak_bytes


def fate_bytes(plan: Plan, profile: StepProfile) -> str:
    """`keep X B, swap Y B, recompute Z B, packed N B into M B` of a plan, as the plan lines say it
    (kept and swapped bytes before packing; `packed`, where the profile has packable tensors: the
    kept or swapped ones stored packed, and the bytes they are stored in)."""
    from .plan import Decision

    split = plan.bytes_by_decision(profile)
    packed, stored = plan.packed_bytes(profile)
    return (f"keep {split[Decision.KEEP]:,} B, swap {split[Decision.SWAP]:,} B, "
            f"recompute {split[Decision.RECOMPUTE]:,} B"
            + (f", packed {packed:,} B into {stored:,} B" if profile.packable else ""))


__all__ = ["Agreed", "FALLBACK_PLANNERS", "PlanMaker", "checkpointing_held", "fate_bytes"]

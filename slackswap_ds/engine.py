"""DeepSpeed integration: `initialize(...)`, same signature and return as `deepspeed.initialize`.

Lifecycle, driven by the engine's own forward and backward (the user's loop does not change):

    steps < profile_steps      plain DeepSpeed (safe mode: warm-up, allocator settling)
    step == profile_steps      the step runs under a ProfileSession (every saved tensor to host, so
                               it fits the budget) -> measured StepProfile -> plan (rank 0)
                               -> agreed across ranks -> Executor for these shapes
    later steps                run under the executor of their input shapes; new shapes are
                               profiled and planned on their step (replan = "on_shape_change")
    eval-mode forwards         left alone (not counted as steps, never profiled or planned)

Planning a shape, on every rank at the same step:
    1. node facts  every rank sends rank 0 its node, host uplink and demand (dist.RankFacts), and
                   rank 0 answers with everyone's; each rank computes every rank's Share of its node
                   (uplink split among the ranks on it, pinned pool max-min fair by demand); its own sizes
                   its host pool
    2. plan        rank 0 plans with the tightest Share of any rank, so the one plan fits every replica
    3. agreement   rank 0 sends its profile and plan as canonical JSON (no pickle); every rank checks
                   that the profile's structure (names and bytes, not times) equals its own and that
                   the plan fits; rank 0's verdict names the ranks at fault (agreement.py)
Both exchanges go over MPI under MPI launchers, else over the torch.distributed store, each with a
deadline (`sync_timeout_s`): a dead or stuck rank is named, never waited on forever.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .agreement import AgreementError  # noqa: F401  (re-exported: callers catch it from here)
from .config import SlackSwapConfig, load_config
from .errors import PlanError
from .hardware import Hardware, load_hardware
from .routing import MARK, original_initialize, remember_original
from .plan import Decision, Plan, lower
from .profile import StepProfile
from .simulator import simulate

log = logging.getLogger("slackswap_ds")
# `deepspeed.initialize = ss.initialize` written by hand imports this module before the assignment
# happens: DeepSpeed's own function is kept now (routing.py)
remember_original()


EVERY_RANK = {"every_rank": True}  # `extra=` of a record other ranks log too (what differs on them)


class _RankZero(logging.Filter):
    """On ranks other than 0, only warnings, errors and records marked EVERY_RANK get through:
    a job of N ranks says things once, and each rank says only where it differs."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING or getattr(record, "every_rank", False)


def _job_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _setup_logging(level: str) -> None:
    """Library output goes through the `slackswap_ds` logger, which gets a console handler if the
    application configured none, and says things once per job (`_RankZero`)."""
    log.setLevel(level.upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    for f in [f for f in log.filters if isinstance(f, _RankZero)]:
        log.removeFilter(f)
    log.addFilter(_RankZero(_job_rank()))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, *rest, config=None, config_params=None, **kwargs):
    """`deepspeed.initialize`, plus the `"slackswap"` section of the config. Returns the same
    tuple (engine, optimizer, training_dataloader, lr_scheduler); the engine's forward/backward
    then follow SlackSwap plans. Without a section, or with `"enabled": false`, it is plain DeepSpeed."""
    ds_config = config if config is not None else config_params
    if ds_config is None and args is not None:
        ds_config = getattr(args, "deepspeed_config", None)
    cfg = load_config(ds_config if ds_config is not None else {})
    if ds_config is not None:
        # DeepSpeed ignores unknown top-level keys; hand it the config without ours all the same,
        # and as the only config (it refuses one in args *and* one in the call)
        if isinstance(ds_config, (str, os.PathLike)):
            with open(ds_config) as f:
                ds_config = json.load(f)
        config, config_params = {k: v for k, v in ds_config.items() if k != "slackswap"}, None
        if args is not None and getattr(args, "deepspeed_config", None) is not None:
            args = argparse.Namespace(**{**vars(args), "deepspeed_config": None})
    out = original_initialize()(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                training_data=training_data, lr_scheduler=lr_scheduler, *rest, config=config,
                                config_params=config_params, **kwargs)
    engine = out[0]
    if cfg.enabled:
        _setup_logging(cfg.log_level)
        if _is_pipeline_engine(engine):  # its own schedule, several micro-batches in flight: stages.py
            from .stages import StageRuntime

            StageRuntime(engine, cfg).attach()
        else:
            SlackSwapRuntime(engine, cfg).attach()
    return out


def _is_pipeline_engine(engine) -> bool:
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:  # pragma: no cover - a DeepSpeed without pipeline support
        return False
    return isinstance(engine, PipelineEngine)


setattr(initialize, MARK, True)  # recognised as SlackSwap's wherever it is bound


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten((args, kwargs))[0]
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor))


def _inputs(key: tuple) -> str:
    """A shape key as people read it: `(2, 64) torch.int64; (2, 64) torch.int64`."""
    return "; ".join(f"{tuple(shape)} {dtype}" for shape, dtype in key)


def resolve_hardware(name: str) -> Hardware:
    """A preset, a path, or "auto": the preset of the CUDA device in use (A100/H100/H200/GH200);
    without one, a100-80g-pcie4 (logged)."""
    if name != "auto":
        return load_hardware(name)
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name().lower()
        total = torch.cuda.get_device_properties(0).total_memory
        for key, preset in (("gh200", "gh200"), ("h200", "h200-pcie5"), ("h100", "h100-pcie5")):
            if key in dev:
                return load_hardware(preset)
        if "a100" in dev:
            return load_hardware("a100-80g-pcie4" if total > 50e9 else "a100-40g-pcie4")
        log.warning("slackswap: no hardware preset for %r; planning for a100-80g-pcie4", dev)
    else:
        log.info("slackswap: no CUDA device; planning for a100-80g-pcie4 (set \"hardware\" to choose)")
    return load_hardware("a100-80g-pcie4")


@dataclass
class _ShapeState:
    profile: StepProfile | None = None
    plan: Plan | None = None
    executor: Any = None
    predicted_throughput: float = float("nan")
    predicted_step_s: float = float("nan")
    predicted_peak: int = 0


@dataclass
class SlackSwapRuntime:
    """Hooks the SlackSwap lifecycle into a DeepSpeed engine (see the module docstring)."""

    engine: Any
    cfg: SlackSwapConfig
    steps: int = 0
    shapes: "collections.OrderedDict" = field(default_factory=lambda: collections.OrderedDict())  # LRU last
    active: Any = None  # the context (tracer or executor) entered for the current step
    active_key: tuple | None = None
    last_stats: Any = None  # StepStats of the last step run under a plan
    active_plan: Plan | None = None  # the plan of that step
    share: Any = None  # this rank's Share of its node (link rates, pool bytes), set when planning
    plan_share: Any = None  # the Share rank 0 planned with: the tightest of all ranks'
    sync: str = "torch"  # how ranks agree: "mpi" or "torch" (resolved from the config's "auto")
    channel: Any = None  # the agreement.Channel of this job, made on first use
    mpi_node: int | None = None  # this rank's node by MPI shared memory (MPI launches only)
    pool: Any = None  # one HostPool for every shape's executor
    node_ranks: int = 1  # ranks on this rank's node (from the node facts)
    rank0_share: Any = None  # rank 0's Share (a rank logs its plan line only where its own differs)
    report: dict = field(default_factory=dict)  # since the last log_every report: steps, seconds, peak, fallbacks
    holds: int = 1  # micro-batches whose saved tensors are held at once (a pipeline stage's: stages.py)
    _said_offload_param: bool = False

    def attach(self) -> None:
        self._prepare()
        engine = self.engine
        forward, backward = engine.forward, engine.backward

        def slackswap_forward(*args, **kwargs):
            kwargs = self._bucketed(args, kwargs)
            self._before_forward(args, kwargs)
            return forward(*args, **kwargs)

        def slackswap_backward(loss, *args, **kwargs):
            if hasattr(self.active, "end_forward"):
                self.active.end_forward()  # profiling: the model's forward is over
            try:
                return backward(loss, *args, **kwargs)
            finally:
                self._after_backward()

        engine.forward = slackswap_forward
        engine.backward = slackswap_backward
        engine.slackswap = self

    def _prepare(self) -> None:
        """What every rank settles as DeepSpeed starts: hardware, host uplinks, how ranks agree."""
        self.module = self.engine.module
        self.hw = resolve_hardware(self.cfg.hardware)
        self.topology, self.uplink_bps = self._topology()
        self.sync = self.cfg.sync
        if self.sync == "auto":
            self.sync = "mpi" if _mpi_launched() and _has_mpi4py() else "torch"
        elif self.sync == "mpi" and not _mpi_launched():
            # each process would init MPI alone, call itself rank 0 of 1, plan alone and take the whole pool
            raise AgreementError('"sync": "mpi" needs a job launched by MPI (mpirun / mpiexec, srun --mpi, or '
                                 'deepspeed --launcher mpich / openmpi), and this process was not (none of '
                                 f'{", ".join(_MPI_LAUNCH_VARS)} is set); use "sync": "auto" or "torch"')
        if self.sync == "mpi" and not self.cfg.ranks_per_node:
            from .dist import node_layout

            # a collective, so here, as DeepSpeed starts (every rank alive), not when planning
            self.mpi_node = node_layout()[0].node
        log.debug("slackswap: plans agreed over %s; host uplinks from %s", self._via(), self.topology.source)

    # ---- per step ----------------------------------------------------------------------------
    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        if self.active is not None or not torch.is_grad_enabled() or not self.module.training:
            return  # evaluation, or a second forward in the same step: not ours to manage
        self.steps += 1
        key = _shape_key(args, kwargs)
        state = self.shapes.get(key)
        if self.steps <= self.cfg.profile_steps:
            return
        if state is None and self.shapes and self.cfg.replan == "never":
            return  # shapes changed, no re-planning: plain steps for these shapes
        if state is None:
            self._make_room()
        else:
            self.shapes.move_to_end(key)
        if state is None or state.executor is None:
            from .runtime.profiler import ProfileSession

            self.shapes[key] = state or _ShapeState()
            log.info("slackswap: profiling a step of input shapes %s (saved tensors go to host for this step)",
                     [s for s, _ in key])
            self.active, self.active_key = ProfileSession(self.module), key
        else:
            self.active, self.active_key = state.executor, key
        # (checkpoint calls inside the model run inline under both: see runtime/takeover.py)
        self.active.__enter__()

    def _bucketed(self, args: tuple, kwargs: dict) -> dict:
        """A training forward's keyword inputs padded to `pad_to_multiple` (bucketing.py)."""
        multiple = self.cfg.pad_to_multiple
        if not multiple or not torch.is_grad_enabled() or not self.module.training:
            return kwargs
        if any(isinstance(a, torch.Tensor) for a in args):
            from .bucketing import BucketingError

            raise BucketingError("pad_to_multiple pads keyword inputs (engine(input_ids=..., labels=...)); this "
                                 "forward got positional tensors, whose meaning is unknown: pass them by name, or "
                                 "pad in your collator and drop pad_to_multiple")
        from .bucketing import pad_to_multiple

        return pad_to_multiple(kwargs, multiple)

    def _make_room(self) -> None:
        """Before a new shape: keep at most `max_shapes - 1` others, dropping the least recently used."""
        dropped = []
        while len(self.shapes) >= self.cfg.max_shapes:
            key, _ = self.shapes.popitem(last=False)
            dropped.append([s for s, _ in key])
        if dropped:
            freed = self.pool.trim() if self.pool is not None else 0
            log.info("slackswap: max_shapes=%d plans kept; dropped the least recently used (input shapes %s; "
                     "%s B of pinned host memory freed); they are profiled again if they come back",
                     self.cfg.max_shapes, dropped, f"{freed:,}")

    def _after_backward(self) -> None:
        ctx, key = self.active, self.active_key
        if ctx is None:
            return
        self.active = self.active_key = None
        ctx.__exit__(None, None, None)
        state = self.shapes[key]
        if state.executor is None:
            try:
                self._make_plan(state, ctx.profile(type(self.module).__name__), key)
            except Exception as e:
                self._give_up(e)
                raise
        else:
            self.last_stats = state.executor.stats.last_step
            self.active_plan = state.plan
            self._report(state, self.last_stats)
            timeline = state.executor.stats.last_timeline
            if timeline is not None and state.executor.record:
                from .report import write_trace

                state.executor.record = False  # one measured step is enough
                write_trace(timeline, self._trace_path("measured"), budget_bytes=state.plan.budget_bytes,
                            title=f"slackswap plan {state.plan.digest[:12]} (measured, rank 0)")

    def _report(self, state: _ShapeState, stats) -> None:
        """Every `log_every` planned steps (rank 0): measured against predicted, and fallbacks."""
        import time

        now = time.perf_counter()
        r = self.report
        if "since" not in r:
            r.update(since=now, steps=0, peak=0, fallbacks={})
        r["steps"] += 1
        r["peak"] = max(r["peak"], stats.peak_device_bytes)
        for why, n in stats.fallbacks.items():
            r["fallbacks"][why] = r["fallbacks"].get(why, 0) + n
        if not self.cfg.log_every or r["steps"] < self.cfg.log_every:
            return
        seconds = (now - r["since"]) / r["steps"]
        log.info("slackswap: last %d planned steps: %.1f ms per step (wall clock, optimizer included; the plan "
                 "predicts %.1f ms for forward and backward on %s), peak of saved activations %s B (predicted %s B, "
                 "budget %s B)", r["steps"], 1e3 * seconds, 1e3 * state.predicted_step_s, self.hw.name,
                 f"{r['peak']:,}", f"{state.predicted_peak:,}", f"{state.plan.budget_bytes:,}")
        if r["fallbacks"]:
            log.warning("slackswap: in the last %d steps, saved tensors kept instead of planned: %s", r["steps"],
                        ", ".join(f"{n} x {why}" for why, n in sorted(r["fallbacks"].items())))
        self.report = {}

    # ---- profile -> plan -> agree -> apply ---------------------------------------------------
    def _make_plan(self, state: _ShapeState, local: StepProfile, key: tuple) -> None:
        from .agreement import agree

        channel = self._channel()
        rank = channel.rank
        budget = self.cfg.budget.of(local.total_bytes)
        self._coordinate(channel, local, budget, key)
        plan = None
        if rank == 0:
            made_for = self._made_for(local, budget, channel.world, key)
            plan = self._load_plan(local, made_for)
            if plan is None:
                plan = self._fit_to_device(local, self._plan_within(local, budget, self.cfg.planner))
                self._save_plan(made_for, plan)
        profile, plan = agree(channel, local, plan, self.cfg.sync_timeout_s)
        sim = self._install(state, profile, plan, record=bool(self.cfg.trace_file and rank == 0))
        rank_hw = self.share.limit(self.hw)  # this rank's link as shared with its neighbours
        split = plan.bytes_by_decision(profile)
        if rank == 0:
            log.info(
                "slackswap rank 0: budget %s B of %s B keep-all; keep %s B, swap %s B, recompute %s B; "
                "planner %s on %s (link share D2H %.1f / H2D %.1f GB/s) predicts %.1f%% of ideal throughput; "
                "plan %s agreed over %s by %d ranks", f"{plan.budget_bytes:,}", f"{profile.total_bytes:,}",
                f"{split[Decision.KEEP]:,}", f"{split[Decision.SWAP]:,}", f"{split[Decision.RECOMPUTE]:,}",
                plan.planner, self.hw.name, rank_hw.d2h_bps / 1e9, rank_hw.h2d_bps / 1e9,
                100 * state.predicted_throughput, plan.digest[:12], self._via(), channel.world)
        elif self.share != self.rank0_share:  # the same plan; what differs on this rank
            log.info("slackswap rank %d: plan %s with this rank's link share D2H %.1f / H2D %.1f GB/s and pool %s "
                     "(rank 0 differs) predicts %.1f%% of ideal throughput", rank, plan.digest[:12],
                     rank_hw.d2h_bps / 1e9, rank_hw.h2d_bps / 1e9, self.share.host_pool_bytes,
                     100 * state.predicted_throughput, extra=EVERY_RANK)
        if self.cfg.trace_file and rank == 0:
            from .report import write_trace

            # the prediction now; the first measured step replaces it (same format, see _after_backward)
            write_trace(sim, self._trace_path("predicted"), title=f"slackswap plan {plan.digest[:12]} (predicted)",
                        budget_bytes=plan.budget_bytes)
            state.executor.record = True

    def _install(self, state: _ShapeState, profile: StepProfile, plan: Plan, record: bool = False):
        """From now on this shape's steps run `plan`: its executor on this rank's host pool, and the
        prediction that reports compare with (simulated on this rank's link share; with `holds` > 1,
        the other micro-batches' kept bytes on top of the peak). Returns the simulation."""
        from .planners import keep_all_result
        from .planners.common import held_bytes
        from .runtime.device import Device
        from .runtime.executor import apply
        from .runtime.host_pool import HostPool

        state.profile, state.plan = profile, plan
        if self.pool is None:
            self.pool = HostPool(self.share.host_pool_bytes, Device.current())
        schedule = lower(profile, plan)  # lowered once: simulated here, executed by the executor
        state.executor = apply(self.module, plan, profile, schedule=schedule, pool=self.pool, replan=self._replan)
        held = held_bytes(profile, plan.decision, self.holds)
        sim = simulate(schedule, self.share.limit(self.hw), budget_bytes=plan.budget_bytes - held, record=record)
        ideal = keep_all_result(profile, self.hw).step_s
        state.predicted_throughput = ideal / sim.step_s if sim.step_s else 1.0
        state.predicted_step_s, state.predicted_peak = sim.step_s, sim.peak_bytes + held
        return sim

    def _give_up(self, error: Exception) -> None:
        """This rank cannot plan the step: the job stops, since its replicas cannot run one plan.
        The others hear why at once (agreement.give_up) instead of waiting out their deadline;
        this rank lingers a moment so that they can say so before a launcher tears the job down;
        and the process will exit without waiting for its peers (MPI_Finalize or a process group's
        shutdown would wait forever for a stuck one)."""
        import time

        from .agreement import GaveUp, give_up

        channel = self.channel
        if channel is None or channel.world == 1:
            return
        if not isinstance(error, GaveUp):  # (give_up shouts once per channel: the protocol's own errors already did)
            give_up(channel, str(error) if isinstance(error, AgreementError) else f"{type(error).__name__}: {error}")
        text = str(error) if str(error).startswith(f"rank {channel.rank}") else f"rank {channel.rank}: {error}"
        log.error("slackswap %s (%s). The job stops: its ranks cannot agree on one plan", text,
                  type(error).__name__, extra=EVERY_RANK)
        time.sleep(_LINGER_S)
        _exit_without_peers()

    def _replan(self, profile: StepProfile, plan: Plan, failures: dict[str, str]) -> tuple[StepProfile, Plan]:
        """After the verifying step demoted tensors: this rank plans again, locally, with its share
        (a nondeterministic kernel may misbehave on one rank only; ranks may then differ, logged)."""
        from .planners import PLANNERS

        pinned = profile.without_recompute(failures)
        planner = plan.planner if plan.planner in PLANNERS else self.cfg.planner
        return pinned, self._fit_to_device(pinned, self._plan_within(pinned, plan.budget_bytes, planner))

    def _plan_within(self, profile: StepProfile, budget: int, planner: str) -> Plan:
        """`planner`'s plan (for `holds` micro-batches at once); if it finds none within the budget,
        the fastest (simulated) of the fallbacks that does, with a warning; if none does,
        BudgetInfeasibleError with every reason."""
        from .errors import BudgetInfeasibleError
        from .planners import get_planner

        try:
            return get_planner(planner)(profile, self.hw, budget, self.plan_share, holds=self.holds).plan
        except BudgetInfeasibleError as e:
            reasons, found = [_reason(planner, e)], []
        for other in _FALLBACK_PLANNERS:
            if other == planner:
                continue
            try:
                planned = get_planner(other)(profile, self.hw, budget, self.plan_share, holds=self.holds)
            except BudgetInfeasibleError as e:
                reasons.append(_reason(other, e))
                continue
            found.append((planned.result.step_s, other, planned.plan))
        if not found:
            raise BudgetInfeasibleError(f"no planner keeps this step's saved activations within {budget:,} B "
                                        f"(activation_budget {self.cfg.activation_budget}): " + "; ".join(reasons)
                                        + ". Raise activation_budget or host_pool_bytes_per_node")
        step_s, other, plan = min(found, key=lambda f: f[0])
        log.warning("slackswap: planner %s found no plan within %s B (%s); using %s instead (simulated step %.2f ms)",
                    planner, f"{budget:,}", reasons[0], other, 1e3 * step_s)
        return plan

    def _fit_to_device(self, profile: StepProfile, plan: Plan) -> Plan:
        """On a device without streams (DeepSpeed's CPU accelerator) copies are synchronous: the
        plan runs as on `Hardware.instant_copies()`. Its prefetch triggers, timed for `hardware`,
        are retimed for that if they would push the peak over the budget there (logged)."""
        from .planners.common import fit_triggers
        from .runtime.device import Device

        if Device.current().has_streams:
            return plan
        from .planners.common import Planned, held_bytes
        planned = Planned(plan, lower(profile, plan), simulate(lower(profile, plan), self.plan_share.limit(self.hw)),
                          held_bytes(profile, plan.decision, self.holds))
        fitted = fit_triggers(profile, planned, self.hw, Hardware.instant_copies(), self.plan_share, holds=self.holds).plan
        if fitted is not plan:
            log.info("slackswap: copies are synchronous on this device; prefetches retimed so that the plan "
                     "stays within its budget here (%s -> %s)", plan.digest[:12], fitted.digest[:12])
        return fitted

    def _trace_path(self, kind: str) -> str:
        """trace_file for the measured step; <stem>.<kind><suffix> beside it for the prediction."""
        path = self.cfg.trace_file
        if kind == "measured":
            return path
        root, ext = os.path.splitext(path)
        return f"{root}.{kind}{ext or '.json'}"

    def _made_for(self, profile: StepProfile, budget: int, world: int, key: tuple):
        """What a plan made now is made for (planfile.MadeFor)."""
        from .planfile import MadeFor

        share = self.plan_share
        return MadeFor(
            inputs=_inputs(key),
            structure=profile.structure_digest, budget_bytes=int(budget), hardware=f"{self.hw.name} {self.hw.digest}",
            planner=self.cfg.planner,
            share=f"d2h {share.d2h_bps} h2d {share.h2d_bps} pool {share.host_pool_bytes}",
            world=f"{world} ranks, {self.node_ranks} per node")

    def _load_plan(self, profile: StepProfile, made_for) -> Plan | None:
        """The plan_file's plan made for exactly this job (rebuilt for this profile: the same
        decisions and triggers), or None; a file with none is refused with the reason."""
        from . import planfile

        path = self.cfg.plan_file
        if not path:
            return None
        entries = planfile.read(path)  # a malformed or foreign file raises with the reason
        entry, why = planfile.find(entries, made_for)
        if entry is None:
            if why:
                message = (f"plan_file {path!r} has no plan made for this job ({'; '.join(why)})")
                if self.cfg.plan_file_mismatch == "error":
                    raise PlanError(message + '; delete the file, or set "plan_file_mismatch": "replan"')
                log.warning("slackswap: %s: planning afresh", message)
            return None
        plan = entry.plan
        try:
            plan.check(profile)
        except PlanError as e:
            raise PlanError(f"plan_file {path!r} does not fit this model's step: {e}; delete it to re-plan") from None
        log.info("slackswap: using the plan in plan_file %s (%s)", path, plan.digest[:12])
        return plan.rebuilt(profile)

    def _save_plan(self, made_for, plan: Plan) -> None:
        """Add the plan to plan_file (atomically; rank 0 only); a read-only file is left as it is."""
        from . import planfile

        path = self.cfg.plan_file
        if not path:
            return
        if not planfile.writable(path):
            log.info("slackswap: plan_file %s is read-only: used as it is, not updated", path)
            return
        try:
            planfile.write(path, planfile.upsert(planfile.read(path), planfile.Entry(made_for, plan)))
        except OSError as e:  # the plan is made and agreed: losing the file must not stop training
            log.warning("slackswap: could not write plan_file %s (%s); the plan is used, not saved", path, e)

    # ---- node coordination -------------------------------------------------------------------
    def _via(self) -> str:
        return "MPI" if self.sync == "mpi" else "torch.distributed"

    def _topology(self):
        """(this node's Topology, the rate of one host uplink per direction): the config's node
        preset; else discovered on a CUDA machine; else (no CUDA) every GPU its own link."""
        from . import topology
        from .hardware import load_node

        if self.cfg.node is not None:
            node = load_node(self.cfg.node)
            return topology.from_node(node), node.switch_uplink_bps
        link = max(self.hw.d2h_bps, self.hw.h2d_bps)  # a discovered uplink: as fast as one GPU's link
        if torch.cuda.is_available():
            found = topology.discover(_pci_bus_ids())
            if found.source.startswith("default"):
                log.info("slackswap: host uplinks not discovered (%s); every GPU plans with its own link", found.source)
            return found, link
        return topology.default(int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)), link

    def _channel(self):
        """The job's agreement channel: MPI or the torch.distributed store; one rank: no channel."""
        if self.channel is None:
            import torch.distributed as dist

            from .agreement import Solo
            from .channels import MpiChannel, StoreChannel

            if self.sync == "mpi":
                self.channel = MpiChannel()
                if dist.is_available() and dist.is_initialized():
                    theirs = (dist.get_rank(), dist.get_world_size())
                    if theirs != (self.channel.rank, self.channel.world):
                        raise AgreementError(
                            f"MPI says this process is rank {self.channel.rank} of {self.channel.world}, "
                            f"torch.distributed says rank {theirs[0]} of {theirs[1]}: the job was not launched as "
                            f"one MPI job of all its ranks; use \"sync\": \"torch\" (or launch it with mpirun)")
            elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self.channel = StoreChannel()
            else:
                self.channel = Solo()
        return self.channel

    def _node_key(self, rank: int) -> str:
        """Ranks with equal keys share a node: by `ranks_per_node`, by MPI shared memory, or by host."""
        import socket

        if self.cfg.ranks_per_node:
            return f"group {rank // self.cfg.ranks_per_node}"
        if self.mpi_node is not None:
            return f"mpi node {self.mpi_node}"  # MPI's COMM_TYPE_SHARED grouping, found at attach
        return socket.gethostname()

    def _gpu(self) -> int:
        """This rank's GPU on its node: the CUDA device, else the local rank."""
        if torch.cuda.is_available():
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK") or 0)

    def _coordinate(self, channel, local: StepProfile, budget: int, key: tuple, peers: list[int] | None = None) -> None:
        """Tell every rank this rank's node, uplink, demand and step; from everyone's, set this rank's
        Share of its node (`share`, which sizes its host pool) and the tightest of its `peers`'
        (`plan_share`; peers: the ranks that run its plan, by default every rank). Peers planning
        another step than the first of them are named on every rank (AgreementError)."""
        from .agreement import exchange
        from .dist import RankFacts, shares_of, tightest

        gpu = self._gpu()
        facts = RankFacts(node=self._node_key(channel.rank), uplink=self.topology.uplink_of[gpu % self.topology.gpus],
                          demand=max(0, self.holds * local.total_bytes - budget),
                          step=f"input shapes {_inputs(key)}, profile {local.structure_digest[:12]}")
        everyone = [RankFacts.from_json(b) for b in exchange(channel, "facts", facts.to_json(), self.cfg.sync_timeout_s,
                                                              "node facts (node, uplink, demand)")]
        peers = list(range(channel.world)) if peers is None else peers
        lead = peers[0]
        others = {r: everyone[r].step for r in peers if everyone[r].step != everyone[lead].step}
        if others:
            raise AgreementError(
                f"rank {channel.rank}: ranks {sorted(others)} plan another step than rank {lead} "
                f"({everyone[lead].step}): " + "; ".join(f"rank {r}: {step}" for r, step in sorted(others.items()))
                + ". Data-parallel replicas must run the same model on the same input shapes at each step "
                  "(pad variable-length batches to a common length, e.g. with slackswap_ds.pad_to_multiple)")
        pinned = _zero_offload_pinned_bytes(self.engine)
        offload_param = getattr(self.engine, "zero_offload_param", lambda: None)()
        if offload_param is not None and not self._said_offload_param:
            self._said_offload_param = True
            log.warning("slackswap: ZeRO-Infinity parameter offload (offload_param) moves every layer's parameters "
                        "over the host link in forward and backward; plans do not account for that traffic yet, so "
                        "prefetches may stall (slower steps; the gradients are unaffected)")
        shares = shares_of(everyone, self.hw, self.uplink_bps, self.cfg.host_pool_bytes_per_node, pinned or 0)
        if pinned is not None:  # every replica runs the same ZeRO config: the same link penalty for all
            # (0 pinned here: each node's pool was netted of its ranks' optimizer state above)
            shares = [s.beside_zero_offload(self.hw, 0) for s in shares]
            log.info("slackswap: ZeRO-Offload copies gradients to the host during backward and pins %.2f GB of "
                     "optimizer state per rank: plans prefetch at the duplex rate (%.1f GB/s) and share only "
                     "what the node's pool has left", pinned / 1e9, shares[channel.rank].h2d(self.hw) / 1e9)
        self.share, self.rank0_share = shares[channel.rank], shares[lead]
        self.plan_share = tightest([shares[r] for r in peers])
        node_ranks = [r for r, f in enumerate(everyone) if f.node == facts.node]
        self.node_ranks = len(node_ranks)
        log.debug("slackswap rank %d: node %r ranks %s, uplink %d (%s), share %s; plans use %s", channel.rank,
                  facts.node, node_ranks, facts.uplink, self.topology.source, self.share, self.plan_share)


def _zero_offload_pinned_bytes(engine) -> int | None:
    """Host bytes DeepSpeed's ZeRO-Offload pins for this rank's optimizer state (fp32 master, m, v and
    gradient of its 1/dp partition: 16 B per parameter), or None without optimizer offload."""
    offloads = getattr(engine, "zero_cpu_offload", None)
    if offloads is None or not offloads():
        return None
    from .pipeline import PINNED_OPTIMIZER_BYTES_PER_PARAM

    params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return params // max(1, int(getattr(engine, "dp_world_size", 1))) * PINNED_OPTIMIZER_BYTES_PER_PARAM


# tried, fastest first by simulation, when the configured planner finds no plan within the budget:
# swapping everything needs only the host pool; recomputing everything, only the layer inputs
_FALLBACK_PLANNERS = ("offload-all", "full-recompute")


def _reason(planner: str, error: Exception) -> str:
    from .planners import refusal

    return f"{planner}: {refusal(planner, error)}"


_LINGER_S = 1.0  # how long a rank that gives up stays, so that the others can say why before it exits
_exit_registered = False


def _exit_without_peers() -> None:
    """At interpreter exit, end the process before MPI_Finalize or a process group's shutdown can
    wait for a peer that is stopped or gone (registered last, so it runs first). Exit status 1:
    the job failed."""
    import atexit

    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True

    def exit_now():
        import sys

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    atexit.register(exit_now)


_MPI_LAUNCH_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # set by MPICH/Hydra, Open MPI, PMIx


def _mpi_launched() -> bool:
    return any(v in os.environ for v in _MPI_LAUNCH_VARS)


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _pci_bus_ids() -> list[str] | None:
    """PCI bus ids of the visible CUDA devices, in ordinal order (None if torch does not say)."""
    ids = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        if not all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            return None
        ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return ids

"""DeepSpeed integration: `initialize(...)`, same signature and return as `deepspeed.initialize`.

Lifecycle, driven by the engine's own forward and backward (the user's loop does not change):

    steps < profile_steps      plain DeepSpeed (safe mode: warm-up, allocator settling)
    step == profile_steps      the step runs under a StepTracer -> measured StepProfile
                               -> plan (rank 0) -> agreed across ranks -> Executor for these shapes
    later steps                run under the executor of their input shapes; new shapes are
                               profiled and planned on their step (replan = "on_shape_change")

Agreement: rank 0 broadcasts its profile and plan as canonical JSON (no pickle); every rank checks
that the profile's structure (names and bytes, not times) equals its own and that the plan fits,
then all ranks run the same plan. A disagreement is an error naming the ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import SlackSwapConfig, load_config
from .errors import PlanError, SlackSwapError
from .hardware import Hardware, load_hardware
from .planners.common import Share
from .plan import Decision, Plan, lower
from .profile import StepProfile
from .simulator import simulate

log = logging.getLogger("slackswap_ds")


def _setup_logging(level: str) -> None:
    """The per-rank plan line must reach the console by default: give our logger a handler if
    the application configured none."""
    log.setLevel(level.upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


class AgreementError(SlackSwapError):
    """Ranks that must run the same plan do not agree."""


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, *rest, config=None, config_params=None, **kwargs):
    """`deepspeed.initialize`, plus the `"slackswap"` section of the config. Returns the same
    tuple (engine, optimizer, training_dataloader, lr_scheduler); the engine's forward/backward
    then follow SlackSwap plans. Without a section, or with `"enabled": false`, it is plain DeepSpeed."""
    import deepspeed

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
    out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, *rest, config=config,
                               config_params=config_params, **kwargs)
    engine = out[0]
    if cfg.enabled:
        _setup_logging(cfg.log_level)
        SlackSwapRuntime(engine, cfg).attach()
    return out


def _shape_key(args: tuple, kwargs: dict) -> tuple:
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten((args, kwargs))[0]
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor))


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


@dataclass
class SlackSwapRuntime:
    """Hooks the SlackSwap lifecycle into a DeepSpeed engine (see the module docstring)."""

    engine: Any
    cfg: SlackSwapConfig
    steps: int = 0
    shapes: dict = field(default_factory=dict)
    active: Any = None  # the context (tracer or executor) entered for the current step
    active_key: tuple | None = None
    last_stats: Any = None  # StepStats of the last step run under a plan
    active_plan: Plan | None = None  # the plan of that step
    share: Any = None  # this rank's planning Share (link rates, pool bytes)
    sync: str = "torch"  # how ranks agree: "mpi" or "torch" (resolved from the config's "auto")
    pool: Any = None  # one HostPool for every shape's executor
    _was_active: bool = False

    def attach(self) -> None:
        engine = self.engine
        self.module = engine.module
        self.hw = resolve_hardware(self.cfg.hardware)
        # the node's pinned pool, split evenly among its ranks (node coordination will split by demand)
        # ranks on this node: torchrun and our MPI shim set LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        node_pool = self.cfg.host_pool_bytes_per_node
        self.pool_bytes = None if node_pool is None else node_pool // max(1, local)
        self.share = Share(host_pool_bytes=self.pool_bytes)
        if self.cfg.node is not None:
            # this rank's share of its switch uplink and of the node's pool; data-parallel replicas
            # run the same model, so their demands are equal and the pool splits evenly
            from .dist import node_shares
            from .hardware import load_node

            node = load_node(self.cfg.node)
            local_rank = int(os.environ.get("LOCAL_RANK") or 0) % max(1, local)
            each_wants_all = [node_pool or 1] * max(1, local)  # equal demands: an even split of the pool
            self.share = node_shares(node, max(1, local), each_wants_all, node_pool)[local_rank]
        self.sync = self.cfg.sync
        if self.sync == "auto":
            # MPI when the job was launched by an MPI launcher (MPICH/Hydra or Open MPI set these)
            launched = any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
            self.sync = "mpi" if launched and _has_mpi4py() else "torch"
        log.debug("slackswap: plans agreed over %s", "MPI" if self.sync == "mpi" else "torch.distributed")
        forward, backward = engine.forward, engine.backward

        def slackswap_forward(*args, **kwargs):
            self._before_forward(args, kwargs)
            return forward(*args, **kwargs)

        def slackswap_backward(loss, *args, **kwargs):
            try:
                return backward(loss, *args, **kwargs)
            finally:
                self._after_backward()

        engine.forward = slackswap_forward
        engine.backward = slackswap_backward
        engine.slackswap = self

    # ---- per step ----------------------------------------------------------------------------
    def _before_forward(self, args: tuple, kwargs: dict) -> None:
        if self.active is not None or not torch.is_grad_enabled():
            return  # evaluation, or a second forward in the same step: not ours to manage
        self.steps += 1
        key = _shape_key(args, kwargs)
        state = self.shapes.get(key)
        if self.steps <= self.cfg.profile_steps:
            return
        if state is None and self.shapes and self.cfg.replan == "never":
            return  # shapes changed, no re-planning: plain steps for these shapes
        if state is None or state.executor is None:
            from .runtime.tracing import StepTracer

            self.shapes[key] = state or _ShapeState()
            self.active, self.active_key = StepTracer(self.module), key
        else:
            self.active, self.active_key = state.executor, key
        # checkpoint() calls (ss.install(), or ss.checkpointing directly) run inline under a plan,
        # and so under the tracer that makes the plan's profile too
        from .checkpointing import set_plan_active

        self._was_active = set_plan_active(True)
        self.active.__enter__()

    def _after_backward(self) -> None:
        ctx, key = self.active, self.active_key
        if ctx is None:
            return
        self.active = self.active_key = None
        try:
            ctx.__exit__(None, None, None)
        finally:
            from .checkpointing import set_plan_active

            set_plan_active(self._was_active)
        state = self.shapes[key]
        if state.executor is None:
            from .runtime.profiler import build_profile

            self._make_plan(state, build_profile(ctx, type(self.module).__name__))
        else:
            self.last_stats = state.executor.stats.last_step
            self.active_plan = state.plan
            timeline = state.executor.stats.last_timeline
            if timeline is not None and state.executor.record:
                from .report import write_trace

                state.executor.record = False  # one measured step is enough
                write_trace(timeline, self._trace_path("measured"), budget_bytes=state.plan.budget_bytes,
                            title=f"slackswap plan {state.plan.digest[:12]} (measured, rank 0)")

    # ---- profile -> plan -> agree -> apply ---------------------------------------------------
    def _make_plan(self, state: _ShapeState, local: StepProfile) -> None:
        from .planners import get_planner
        from .runtime.executor import apply

        rank, world = _rank_world()
        plan = None
        if rank == 0:
            plan = self._load_plan(local) or get_planner(self.cfg.planner)(
                local, self.hw, self.cfg.budget_for(local.total_bytes), self.share)
            if self.cfg.plan_file:
                plan.save(self.cfg.plan_file)
        if self.sync == "mpi":
            from mpi4py import MPI

            from .dist import agree as agree_mpi

            profile, plan = agree_mpi(MPI.COMM_WORLD, local, plan, self.cfg.sync_timeout_s)
        else:
            profile, plan = agree(local, plan, rank, world, self.cfg.sync_timeout_s)
        state.profile, state.plan = profile, plan
        from .runtime.device import Device
        from .runtime.host_pool import HostPool

        if self.pool is None:
            self.pool = HostPool(self.pool_bytes, Device.current())
        state.executor = apply(self.module, plan, profile, pool=self.pool)
        sim = simulate(lower(profile, plan), self.hw, budget_bytes=plan.budget_bytes, record=False)
        from .planners import keep_all_result

        ideal = keep_all_result(profile, self.hw).step_s
        state.predicted_throughput = ideal / sim.step_s if sim.step_s else 1.0
        split = plan.bytes_by_decision(profile)
        log.info(
            "slackswap rank %d: budget %s B of %s B keep-all; keep %s B, swap %s B, recompute %s B; "
            "planner %s on %s predicts %.1f%% of ideal throughput; plan %s agreed over %s",
            rank, f"{plan.budget_bytes:,}", f"{profile.total_bytes:,}", f"{split[Decision.KEEP]:,}",
            f"{split[Decision.SWAP]:,}", f"{split[Decision.RECOMPUTE]:,}", plan.planner, self.hw.name,
            100 * state.predicted_throughput, plan.digest[:12], "MPI" if self.sync == "mpi" else "torch.distributed")
        if self.cfg.trace_file and rank == 0:
            from .report import write_trace

            # the prediction now; the first measured step replaces it (same format, see _after_backward)
            res = simulate(lower(profile, plan), self.hw, budget_bytes=plan.budget_bytes)
            write_trace(res, self._trace_path("predicted"), title=f"slackswap plan {plan.digest[:12]} (predicted)",
                        budget_bytes=plan.budget_bytes)
            state.executor.record = True

    def _trace_path(self, kind: str) -> str:
        """trace_file for the measured step; <stem>.<kind><suffix> beside it for the prediction."""
        path = self.cfg.trace_file
        if kind == "measured":
            return path
        root, ext = os.path.splitext(path)
        return f"{root}.{kind}{ext or '.json'}"

    def _load_plan(self, profile: StepProfile) -> Plan | None:
        path = self.cfg.plan_file
        if not path or not os.path.exists(path):
            return None
        plan = Plan.load(path)  # malformed or foreign files raise with the reason
        try:
            plan.check(profile)
        except PlanError as e:
            raise PlanError(f"plan_file {path!r} does not fit this model's step: {e}; delete it to re-plan") from None
        # made for the same structure (times may differ): adopt it for this profile
        log.info("slackswap: using the plan in plan_file %s (%s)", path, plan.digest[:12])
        return Plan.build(profile, plan.decision, budget_bytes=plan.budget_bytes, hardware_digest=plan.hardware_digest,
                          planner=plan.planner, planner_version=plan.planner_version, prefetch=plan.trigger,
                          blocking=plan.blocking)


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(local: StepProfile, plan: Plan | None, rank: int, world: int, timeout_s: float) -> tuple[StepProfile, Plan]:
    """Rank 0's profile and plan on every rank, after every rank checked that they fit its own step
    (torch.distributed; MPI comes with node coordination)."""
    if world == 1:
        return local, plan
    import datetime

    import torch.distributed as dist

    if dist.get_backend() == "gloo":  # names the ranks that did not arrive, instead of hanging
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            raise AgreementError(f"plan agreement: not every rank arrived within sync_timeout_s={timeout_s}: {e}") from e
    payload = json.dumps({"profile": local.to_json(), "plan": plan.to_json()}) if rank == 0 else ""
    text = _broadcast_text(payload, dist)
    data = json.loads(text)
    profile = StepProfile.from_json(data["profile"])
    plan = Plan.from_json(data["plan"])
    ok = profile.structure_digest == local.structure_digest
    try:
        plan.check(profile)
    except PlanError:
        ok = False
    dev = _comm_device(dist)
    flags = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    gathered = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(world)]
    dist.all_gather(gathered, flags)
    bad = [r for r, f in enumerate(gathered) if int(f) == 0]
    if bad:
        raise AgreementError(
            f"ranks {bad} run a different step than rank 0 (saved-tensor names or bytes differ), so they "
            f"cannot share its plan; make every data-parallel rank run the same model on the same shapes"
        )
    return profile, plan


def _comm_device(dist) -> torch.device:
    """NCCL moves only device tensors; gloo (the CPU accelerator's ccl/gloo) host ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _broadcast_text(text: str, dist) -> str:
    dev = _comm_device(dist)
    raw = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    buf = raw.to(dev) if dist.get_rank() == 0 else torch.zeros(int(size), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().numpy().tobytes()).decode()

"""Run training steps under a Plan: keep, swap or recompute each saved tensor (packed or not), exactly.

`executor_for(model, plan, profile)` lowers the plan to its Schedule (plan.py) and returns an `Executor`,
a context manager: every step run inside follows the Schedule, read through its `Program`
(program.py). Saved-tensor hooks are the whole steady-state mechanism; no dispatch mode watches a
step, except inside the layer calls whose tensors the plan recomputes (calls.py, replay.py), as
torch's selective checkpointing does.

The executor installs the hooks and holds the parts that do the work, each in a module of its own:

    steps.py      which step runs now; pipeline micro-batches; what a closed step leaves in stats
    entries.py    each saved storage's entry: its name and decision, backward's arrival, release
    swaps.py      SWAP: copies to the host pool and back, prefetches
    calls.py      RECOMPUTE: layer calls recorded in forward, replayed in backward (replay.py)
    verify.py     the first step's check of every recompute; demotion and re-planning
    residency.py  the device bytes a plan's budget bounds (stats.last_step.peak_device_bytes)
    records.py    the per-step records they share (Step, Entry, Holder, CallRecord)

Pack (forward). A storage saved several times, or as several views, is one entry (entries.py).
Autograd gets a small holder instead of the tensor:

* KEEP: the holder holds the tensor (detached: a node that saves its own output must not form a
  reference cycle through the holder).
* SWAP: the storage is copied once into a pooled host buffer; the device copy is released when
  the copy ends.
* RECOMPUTE: the holder holds nothing; the layer call that made the tensor is replayed in
  backward.
* PACK (a kept or swapped entry the plan packs): its storage is packed first (packing.py), and
  the packed bytes are kept or swapped; the first read unpacks them (calls.materialize).

Parameters and buffers, tensors on another device than the model's (attention kernels' CPU seeds,
counted apart), tensor subclasses, and saves made in backward or in an eval-mode forward are left
to autograd; a replay's own saves are dropped (its graph is never used). A fallback from the plan
is warned once per kind.

Unpack (backward). The first unpack of an entry moves backward's position (prefetches, replays:
entries.py); a tensor not on the device yet is copied in or regenerated on the spot (calls.py).
A saved tensor changed in place since its save is autograd's own error, raised here too.
Autograd releasing a holder ends that entry's life.

Module hooks. The model's layers (regions.py) are the regions: each layer call is labelled (the
labels name the saved tensors) and recorded if the plan recomputes in it; while profiling, the
saved tensors it takes as arguments are noted (`call_arguments`, for the profile's replay deps).

Without a plan. `Executor.profiling(model, observer)` runs the step a profile is measured from
(profiler.py): saved tensors stay on the device while they fit in `keep_bytes`, the others go to
the host (blocking) and come back when backward needs them, and the observer (the tracer) hears
of every save and unpack. `Executor.shelter(model)` is the same without an observer: a step that
fits any budget without being measured (a pipeline's micro-batches while another is profiled).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Callable, ContextManager, Hashable, Protocol

import torch
from torch import nn
from torch.compiler import is_compiling
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import PlanError
from ..logs import SayOnce
from ..plan import Decision, Plan, Schedule, lower
from ..step_profile import StepProfile
from .aten import meta_of, no_dispatch
from .calls import LayerCalls
from .compiled import CompiledLayers
from .device import Device
from .entries import Entries
from .flat import flatten_call
from .host_pool import HostPool
from .program import Program
from .records import DROPPED, Entry, Holder, Step
from .regions import RegionTracker, find_layers
from .replay import ReplayError, replaying
from .residency import Residency
from .stats import HostClock, RunStats
from .steps import Steps
from .swaps import Swaps
from .timeline import Timeline
from .tracing import StepTracer
from .verify import Replan, Verifier

__all__ = ["Executor", "Observer", "PLAIN_TENSOR_TYPES", "executor_for"]

# tensor subclasses (FakeTensor, DTensor, ...) are left to autograd
PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


class Observer(Protocol):
    """What hears of a profiling step's saves and unpacks (tracing.StepTracer)."""

    timeline: Timeline | None  # set by the executor while it records a timeline

    def saved(self, key: str, t: torch.Tensor) -> None: ...

    def unpacked(self, key: str) -> None: ...

    def step_closed(self) -> None: ...

    def opaque_begin(self, args: tuple, kwargs: dict) -> None: ...

    def opaque_end(self, output) -> None: ...


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one, also when ZeRO-3 swapped in a gathered storage (`ds_id`).
    (Parameters are leaves that require grad: the cheap test first, the isinstance only then.)"""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad and (isinstance(base, nn.Parameter) or hasattr(base, "ds_id"))


def _parameter_storages(model: nn.Module) -> dict[int, StorageWeakRef]:
    """A fast pre-check: parameters and buffers are never activations (_is_parameter is the full test,
    for parameters replaced later and ZeRO-3's gathered ones). The weak references keep a storage that
    ZeRO-3 replaces from handing its address to an activation."""
    return {st._cdata: StorageWeakRef(st) for st in
            (t.untyped_storage() for t in (*model.parameters(), *model.buffers()))}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_dispatch_modes = torch._C._len_torch_dispatch_stack  # dispatch modes active now (a profiler's tracer, a recording)


def _device_type(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return p.device.type if p is not None else "cpu"


def _modified(key: str, saved: int, now: int):
    raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                       f"operation: saved tensor {key!r} is at version {now}; expected version {saved} instead "
                       f"(slackswap detected it; without SlackSwap autograd raises this error too)")


class Executor:
    """The context behind `executor_for` (see the module docstring). ``with executor as stats:``.

    `Executor(model, schedule, profile, ...)` runs a lowered plan; without a plan, say which mode
    with `Executor.profiling` or `Executor.shelter`."""

    def __init__(self, model: nn.Module, schedule: Schedule | None = None, profile: StepProfile | None = None, *,
                 pool: HostPool | None = None, device: Device | None = None, **options):
        self._setup(model, pool, device, **options)  # (options: record, verify, verify_every, replan, ...: _setup)
        if schedule is not None:
            self._steps.set_program(Program(schedule, profile))

    @classmethod
    def profiling(cls, model: nn.Module, observer: Observer | None, *, keep_bytes: int = 0,
                  pool: HostPool | None = None, device: Device | None = None) -> Executor:
        """No plan: saves kept on the device up to `keep_bytes`, the rest to host and back; `observer` hears of each."""
        return cls(model, pool=pool, device=device, observer=observer, keep_bytes=keep_bytes)

    @classmethod
    def shelter(cls, model: nn.Module, *, pool: HostPool | None = None, device: Device | None = None) -> Executor:
        """No plan and no observer: every saved tensor to host, so that the step fits any budget."""
        return cls(model, pool=pool, device=device)

    def _setup(self, model: nn.Module, pool: HostPool | None, device: Device | None, *, record: bool = False,
               verify: bool = True, replan: Replan | None = None, takeover: bool = True,
               observer: Observer | None = None, keep_bytes: int = 0, verify_every: int = 0,
               said: SayOnce | None = None, around_replay: Callable[[nn.Module], ContextManager] | None = None):
        self.model, self.record = model, record  # record: a measured timeline of each step (stats.last_timeline)
        self.takeover, self.observer = takeover, observer
        self.layers, self.regions = find_layers(model), RegionTracker()
        self.compiled = CompiledLayers(model, self.layers, (self._pack, self._unpack))  # (or CompiledCodeError)
        self.call_arguments: dict[str, list[str]] = {}  # without a plan: saved tensors each layer call takes
        self._lock = threading.RLock()
        released: collections.deque[Entry] = collections.deque()  # entries whose holders died
        self._residency = residency = Residency()
        self._swaps = swaps = Swaps(residency, pool, device)
        self._verifier = verifier = Verifier(residency, replan, device)
        self._clock = clock = HostClock()
        hooks = clock.timed(self._pack), clock.timed(self._unpack)
        self._calls = LayerCalls(residency, swaps, verifier, released, takeover, hooks, clock, around_replay)
        self._entries = Entries(residency, swaps, verifier, self._calls, released, keep_bytes)
        self._steps = Steps(self._entries, swaps, verifier, residency, verify=verify, opened=self._step_opened,
                            closed=self._step_closed, verify_every=verify_every, said=said)
        self.stats, self._released = self._steps.stats, released
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*hooks)
        self._stack: contextlib.ExitStack | None = None
        self._params: dict[int, StorageWeakRef] = {}
        self._device_type = device.torch_device.type if device is not None else "cpu"
        self._call_args: list[int] = []  # without a plan: storages of the running call's arguments
        self._eval_depth = 0  # inside a model forward in eval mode (with grad): not planned
        self._tracer: StepTracer | None = None  # record=True: times every op of recorded steps

    # ---- what it runs -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        return self._steps.program.plan if self._steps.program else None

    @property
    def profile(self) -> StepProfile | None:
        return self._steps.program.profile if self._steps.program else None

    @property
    def pool(self) -> HostPool:
        return self._swaps.pool

    def abandoned(self) -> bool:
        """The step running now is a forward whose graph autograd let go of before any backward (steps.py)."""
        with self._lock:
            return self._steps.abandoned()

    def verify_again(self) -> bool:
        """Check the plan's recomputes again on the next step (steps.py); whether it will."""
        with self._lock:
            return self._steps.verify_again()

    @property
    def replan(self) -> Replan:
        """How this executor plans again after a verifying step demoted tensors (verify.py)."""
        return self._verifier.replan

    @property
    def device(self) -> Device | None:
        """Where the copies run (the model's device, known from the first entry on)."""
        return self._swaps.device

    @property
    def resident_bytes(self) -> int:
        """Device bytes of the saved storages this executor holds now (residency.py)."""
        return self._residency.bytes

    # ---- context ------------------------------------------------------------------------------
    def __enter__(self) -> RunStats:
        from .takeover import takeover

        if not self._params:  # first entry (the engine enters once per step)
            if self._swaps.device is None:
                self._device_type = _device_type(self.model)
                self._swaps.device = self._verifier.device = Device.of(torch.device(self._device_type))
            self._params = _parameter_storages(self.model)
        self.compiled.check_unchanged(self.model)
        stack = contextlib.ExitStack()
        try:
            if self.takeover:
                stack.enter_context(takeover(self.model))
            self._handles.append(self.model.register_forward_pre_hook(self._model_called))
            self._handles.append(self.model.register_forward_hook(self._model_returned, always_call=True))
            for path, layer in self.layers:
                self._handles.append(layer.register_forward_pre_hook(self._call_hook(path), with_kwargs=True))
                self._handles += self.compiled.hooks(path, layer, lambda: self.observer or self._tracer)
                self._handles.append(layer.register_forward_hook(self._return_hook(path), always_call=True))
            stack.enter_context(self._hooks)
            if self.record and self.observer is None:
                self._tracer = StepTracer(lambda: self.regions.label)
                stack.enter_context(self._tracer)
        except BaseException:
            stack.close()
            self._remove_hooks()
            raise
        self._stack = stack
        return self.stats

    def __exit__(self, *exc):
        self.compiled.say_if_around(self.model)
        try:
            self._calls.stop_all()  # an exception left a layer call open
            if self._stack is not None:
                self._stack.close()
                self._stack = None
        finally:
            self._remove_hooks()
            self._tracer = None
            self._eval_depth = 0
            with self._lock:
                self._steps.leave()
        return False

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    # ---- steps (steps.py) -------------------------------------------------------------------------
    def _step_opened(self, step: Step) -> None:
        self.regions.reset()
        if self.record:
            timeline = self._residency.timeline = Timeline()
            tracer = self.observer if self.observer is not None else self._tracer
            if tracer is not None:
                tracer.timeline = timeline

    def _step_closed(self, step: Step) -> None:  # (a profiling step is the profile; accumulation runs several)
        step.stats.hooks_host_s = self._clock.take()
        if self.observer is not None:
            self.observer.step_closed()

    def start(self, tag: Hashable) -> None:
        """The forward of pipeline micro-batch `tag` begins: a step of its own (see steps.py)."""
        with self._lock:
            self._steps.start(tag)

    def resume(self, tag: Hashable) -> None:
        """The backward of micro-batch `tag` begins (its step is the current one)."""
        with self._lock:
            self._steps.resume(tag)

    def finish(self, tag: Hashable) -> None:
        """The backward of micro-batch `tag` has ended: its step closes."""
        with self._lock:
            self._steps.finish(tag)

    @property
    def open_micro_batches(self) -> int:
        return self._steps.open_micro_batches

    # ---- module hooks --------------------------------------------------------------------------
    def _tracking(self) -> bool:
        """Module calls that belong to the step: grad on, not in backward, not a replay, not eval."""
        return torch.is_grad_enabled() and not _in_backward() and not replaying() and not self._eval_depth

    def _model_called(self, module, args):
        self.compiled.model_called()  # (compiled code around the model: said at exit)
        if not self._tracking():
            return
        if not module.training:  # an eval-mode forward with grad: left to autograd (not planned)
            self._eval_depth += 1
            return
        with self._lock:
            if self._steps.abandoned():
                self._steps.leave()  # the last forward had no backward: its step is over
            self._steps.forward()

    def _model_returned(self, module, args, output):
        if self._eval_depth and not module.training and not _in_backward() and not replaying():
            self._eval_depth -= 1

    def _call_hook(self, path: str):
        def hook(module, args, kwargs):
            if not self._tracking() or self.regions.in_call:
                return
            with self._lock:
                step = self._steps.forward()
                label = self.regions.enter(path)
                if self.observer is not None:
                    self._call_args = [t.untyped_storage()._cdata for t in flatten_call((args, kwargs))[0]
                                       if isinstance(t, torch.Tensor)]
                program = step.program
                if program is None or label not in program.rerun:
                    return
                rec = self._calls.record(step, label, module, args, kwargs, self._device_type)
            rec.__enter__()
        return hook

    def _return_hook(self, path: str):
        def hook(module, args, output):
            if self.regions.path != path or _in_backward() or replaying():
                return
            label = self.regions.label
            self._calls.stop_recording(label)
            with self._lock:
                step = self._steps.current
                if step is not None:
                    if self.observer is not None:
                        keys = [step.by_storage[c].key for c in self._call_args if c in step.by_storage]
                        self.call_arguments[label] = list(dict.fromkeys(keys))
                    call = step.calls.get(label)
                    if call is not None:
                        self._calls.hold_arguments(step, call)
                self.regions.leave()
        return hook

    # ---- saved-tensor hooks --------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        # the hot path of every step: keep it lean (see benchmarks/overhead_cpu.py). Dynamo tracing
        # through this hook (a frame compiled while it is active) sees the identity: no side effects
        if replaying():
            return DROPPED
        if _in_backward() or self._eval_depth or type(t) not in PLAIN_TENSOR_TYPES or t.is_meta or is_compiling():
            return t
        st = t.untyped_storage()
        if (cdata := st._cdata) in self._params:
            return t
        with self._lock:
            if self._released:
                self._entries.drain()
            step = self._steps.current
            if step is None or step.backward:
                step = self._steps.forward()
            if not _dispatch_modes():  # (usually none to hide our own tensor work from)
                return self._hold(step, t, st, cdata)
            with no_dispatch():
                return self._hold(step, t, st, cdata)

    def _hold(self, step: Step, t: torch.Tensor, st: torch.UntypedStorage, cdata: int):
        """The holder autograd keeps for `t` (storage `st`), its entry made on its storage's first save."""
        entry, held = step.by_storage.get(cdata), None
        if entry is None or entry.holders <= 0:  # (a released entry's address may hold a new storage)
            if t.is_cpu is not (self._device_type == "cpu"):
                step.stats.other_device_bytes += st.nbytes()
                return t
            if _is_parameter(t):
                return t
            before, entry = entry, self._entries.new(step, self.regions.label, t, st, entry)
            step.by_storage[cdata] = entry
            if self.observer is not None and (before is None or before.key != entry.key):
                self.observer.saved(entry.key, t)
            held = entry.storage  # a new KEEP entry holds `t` detached: the same tensor serves the holder
        entry.holders += 1
        if entry.decision is Decision.KEEP and entry.packed is None:
            return Holder(self._released, entry, held if held is not None else t.detach(), (), t._version, None)
        return Holder(self._released, entry, None, meta_of(t), t._version, weakref.ref(t))

    def _unpack(self, holder):
        if type(holder) is not Holder:
            if holder is DROPPED:
                raise ReplayError("a replay's own autograd graph was used for a gradient; replays only "
                                  "regenerate saved tensors")
            return holder
        entry = holder.entry
        if self.observer is not None:
            self.observer.unpacked(entry.key)
        if not entry.reached:
            with self._lock:
                if self._released:
                    self._entries.drain()  # what backward released so far leaves before anything arrives
                self._entries.reached(entry)
        t = holder.tensor
        if t is not None:  # KEEP
            if t._version != holder.version:
                _modified(entry.key, holder.version, t._version)
            return t
        with self._lock:
            if self._released:
                self._entries.drain()
            t = self._calls.materialize(entry, holder.meta)
        if t is None:
            raise ReplayError(f"saved tensor {entry.key!r} was needed after it was released")
        now = holder.changed()
        if now is not None:
            _modified(entry.key, holder.version, now)
        return t


# ---- the entry point ------------------------------------------------------------------------------
def executor_for(model: nn.Module, plan: Plan, profile: StepProfile, *, schedule: Schedule | None = None,
                 pool: HostPool | None = None, record: bool = False, verify: bool = True, verify_every: int = 0,
                 replan: Replan | None = None, device: Device | None = None, takeover: bool = True,
                 said: SayOnce | None = None,
                 around_replay: Callable[[nn.Module], ContextManager] | None = None) -> Executor:
    """Context manager: every step run inside follows `plan`, made for `profile` of this model.
    ``with executor_for(model, plan, profile) as stats: ...``; ``stats.last_step`` has the counters.

    `schedule`: the plan's lowering, if the caller has it (else lowered here); `pool` (HostPool;
    default: an unbounded one); `record` (measured timelines); `verify` (check recomputes on the
    first step); `verify_every` (and again every this many steps: steps.py; 0: never again); `said` (a
    SayOnce the executors of one job share: each kind of fallback warned once); `replan` (how to re-plan after a demotion; default: the failed tensors swapped,
    verify.swap_instead; the plain-PyTorch API's is api.replan_without); `device` (default: the
    Device of the model's parameters); `takeover` (checkpoint calls inline, caches off: takeover.py);
    `around_replay` (a context entered around each layer's replay, given the layer: ZeRO-3's, in
    deepspeed_api.ZeroLayers)."""
    if plan.profile_digest != profile.digest:
        raise PlanError(f"plan {plan.digest[:12]} was made for profile {plan.profile_digest[:12]}, not for "
                        f"{profile.name!r} ({profile.digest[:12]}); plan again for this profile")
    plan.check(profile)
    if schedule is None:
        schedule = lower(profile, plan)
    elif schedule.plan != plan:
        raise PlanError("the schedule passed to executor_for() executes another plan")
    return Executor(model, schedule, profile, pool=pool, record=record, verify=verify, replan=replan,
                    takeover=takeover, device=device, verify_every=verify_every, said=said,
                    around_replay=around_replay)

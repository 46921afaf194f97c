"""Run training steps under a Plan: keep, swap or recompute each saved tensor, exactly.

`apply(model, plan, profile)` lowers the plan to its Schedule (plan.py) and returns an `Executor`,
a context manager: every step run inside follows the Schedule. Saved-tensor hooks are the whole
steady-state mechanism; no dispatch mode watches a step, except inside the layer calls whose
tensors the plan recomputes (replay.py), as torch's selective checkpointing does.

Pack (forward). The executor names each saved tensor the way the profiler did (naming.py: its
region label, the rank of its storage among the region's saved storages, its autograd node) and
looks its decision up in the Schedule's plan. A storage saved several times, or as several views,
is one entry. Autograd gets a small holder instead of the tensor:

* KEEP: the holder holds the tensor (detached: a node that saves its own output must not form a
  reference cycle through the holder).
* SWAP: the storage is copied once into a pooled host buffer (Device.copy_out, see the "Stream
  protocol" in device.py); the device copy is released when the copy ends. A blocking plan waits
  for it right there (torch's save_on_cpu semantics; the Schedule's FWD waits).
* RECOMPUTE: the holder holds nothing; the layer call that made the tensor is replayed in
  backward (replay.py).

Anything that does not match the Schedule (a tensor the profile did not see, another size, a
recompute outside its layer call, a full host pool) is kept, counted in `stats.fallbacks` and
warned once per kind of fallback: a plan can cost memory, never correctness.

Unpack (backward). Backward's position is the first reader (profile op index) of the entries it
unpacks; when it passes a COPY_IN's trigger op the prefetch is issued, and when it enters a layer
call that recomputes, the call is replayed first (the Schedule's RECOMPUTE at the region's first
backward op). A swapped tensor that is not back yet is copied in on the spot (`copy_waits`). Compute
waits on a prefetch's event before reading it (device-side). Autograd releasing a holder ends
that entry's life on the device.

Verification. The first step under each plan also copies every RECOMPUTE tensor to the host in
forward, and compares the replay's result with it bit for bit (dtype, shape, values). A replay that
fails or differs hands backward the original instead, so the step stays exact; afterwards the
failing tensors are demoted (never recomputed again), the profile is re-planned within the budget
and one log line names the keys and the reason.

Accounting (`stats.last_step.peak_device_bytes`, DESIGN.md's budget): bytes of saved storages
that this executor holds on the device, from save (or copy-in start, or regeneration) until the
last holder is released, counting a swap until its copy-out ends. Tensors on another device than
the model's (attention kernels' CPU seeds) are left alone and counted apart.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import PlanError
from ..plan import Decision, Kind, Plan, Schedule, lower
from ..profile import StepProfile
from .device import Device
from .host_pool import HostPool
from .naming import activation_key, maker_of
from .regions import RegionTracker, find_layers
from .replay import CallRecord, Recorder, ReplayError, autocast_state, meta_of, rebuild, replaying, run_replay
from .timeline import MeasuredStep, Timeline

log = logging.getLogger("slackswap_ds")

__all__ = ["Executor", "ReplayError", "RunStats", "StepStats", "apply"]


@dataclass
class StepStats:
    """Counters of one step."""

    kept_bytes: int = 0
    swapped_bytes: int = 0
    recomputed_bytes: int = 0
    ops_recomputed: int = 0
    recomputed_ops: list[str] = field(default_factory=list)  # op keys re-run by replays, in order
    unplanned_reruns: int = 0  # ops a replay had to re-run that the Schedule did not list
    peak_device_bytes: int = 0
    host_pool_bytes: int = 0
    copy_waits: int = 0  # swapped tensors backward needed before their prefetch had run
    other_device_bytes: int = 0  # saved tensors on another device than the model's (left alone)
    resized: int = 0  # saved tensors whose size differs from the profile's (MoE routing): planned anyway
    resized_bytes: int = 0  # their bytes minus the profile's
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count
    verified: bool | None = None  # this step checked the plan's recomputes: True = all equal
    demoted: dict[str, str] = field(default_factory=dict)  # key -> why it failed verification

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


@dataclass
class RunStats:
    steps: int = 0
    last_step: StepStats = field(default_factory=StepStats)
    last_timeline: MeasuredStep | None = None  # with record=True: the last step, for report.chrome_trace
    plan: Plan | None = None  # the plan steps run under now (re-planning after a demotion changes it)
    demotions: list[dict[str, str]] = field(default_factory=list)  # each re-plan: key -> reason


# ---- the Schedule as the executor reads it -------------------------------------------------------
@dataclass(frozen=True)
class _Planned:
    decision: Decision
    nbytes: int
    first_read: int  # profile op whose backward reads it first
    writer: int | None  # the op of its layer call (index within the call) that makes it; None: not recomputable


class Program:
    """What the executor needs from a lowered Schedule, indexed for hooks (built once per plan)."""

    def __init__(self, schedule: Schedule, profile: StepProfile):
        plan = schedule.plan
        self.plan, self.profile, self.blocking = plan, profile, plan.blocking
        ops = profile.ops
        op_index = {o.key: i for i, o in enumerate(ops)}
        self.n_ops = len(ops)
        first: dict[str, int] = {}
        for i, o in enumerate(ops):
            first.setdefault(o.region, i)

        def writer(a) -> int | None:  # a replay's last op is the one that writes the tensor
            return max(a.producers) - first[ops[max(a.producers)].region] if a.producers else None

        self.acts = {a.key: _Planned(plan.decision[a.key], a.bytes, a.first_read, writer(a))
                     for a in profile.activations}
        self.region_of_op = [o.region for o in ops]
        self.op_keys = {(o.region, i - first[o.region]): o.key for i, o in enumerate(ops)}
        # RECOMPUTE instructions: the ops each region's replay re-runs (indices within the region)
        rerun: dict[str, set[int]] = {}
        triggers: dict[int, list[str]] = {}
        instrs = schedule.instrs
        # ops only a baseline's whole-block replay re-runs rebuild nothing: skipped (Plan.replay)
        needed = {p for a in profile.activations if plan.decision[a.key] is Decision.RECOMPUTE for p in a.producers}
        for ins in instrs:
            if ins.kind is Kind.RECOMPUTE and op_index[ins.name] in needed:
                i = op_index[ins.name]
                rerun.setdefault(ops[i].region, set()).add(i - first[ops[i].region])
            elif ins.kind is Kind.COPY_IN:
                trigger = instrs[ins.waits[1]]  # waits = (its copy-out, its trigger)
                # FWD(last op): at the end of forward, i.e. as soon as backward starts
                at = self.n_ops if trigger.kind is Kind.FWD else op_index[trigger.name]
                triggers.setdefault(at, []).append(ins.name)
        self.rerun = {r: frozenset(s) for r, s in rerun.items()}
        self.triggers = sorted(triggers.items(), reverse=True)  # fire while backward passes them
        self.any_backward_work = bool(self.triggers or self.rerun)


# ---- entries ---------------------------------------------------------------------------------------
class _Entry:
    """One saved storage in one step."""

    __slots__ = ("key", "decision", "nbytes", "first_read", "storage", "buffer", "holders", "resident",
                 "out_handle", "in_handle", "reached", "original", "ref", "step", "call")

    def __init__(self, key: str, decision: Decision, nbytes: int, first_read: int | None, ref, step: "_Step"):
        self.key, self.decision, self.nbytes, self.first_read, self.ref, self.step = \
            key, decision, nbytes, first_read, ref, step
        self.storage: torch.Tensor | None = None  # a tensor over the device storage (no autograd history)
        self.buffer = None  # HostBuffer of a swapped storage
        self.holders = 0  # holders autograd keeps, plus pins of a pending replay
        self.resident = False
        self.out_handle = None  # CopyHandle of its D2H copy (swaps)
        self.in_handle = None  # CopyHandle of its H2D copy
        self.reached = False  # backward has unpacked it
        self.original = None  # HostBuffer with forward's bytes (verification of a RECOMPUTE entry)
        self.call: CallRecord | None = None  # the layer call whose replay makes it (RECOMPUTE)


class _Holder:
    """What autograd keeps for one saved tensor. Its death releases the entry through a queue the
    executor drains under its lock (finalizers run on any thread, at any point)."""

    __slots__ = ("entry", "tensor", "meta", "version", "alive", "queue")

    def __init__(self, queue, entry: _Entry, tensor: torch.Tensor | None, meta: tuple, version: int, alive):
        self.queue, self.entry, self.tensor, self.meta, self.version, self.alive = \
            queue, entry, tensor, meta, version, alive

    def __del__(self):
        try:
            self.queue.append(self.entry)
        except Exception:  # interpreter shutdown
            pass


_DROPPED = object()  # what a replay's own saves become (never unpacked)


class _Step:
    """One step: the forwards since the last backward, and the backward that follows them."""

    def __init__(self, program: "Program | None", verifying: bool):
        self.program = program  # the plan it runs under (a re-plan changes the executor's, not an open step's)
        self.stats = StepStats()
        self.backward = False  # backward has started (a new forward then starts a new step)
        self.verifying = verifying
        self.by_storage: dict[int, _Entry] = {}  # storage cdata -> entry (entry.ref pins the cdata)
        self.by_key: dict[str, _Entry] = {}
        self.ordinals: dict[str, int] = {}
        self.calls: dict[str, CallRecord] = {}  # recorded layer calls by label
        self.writers: dict[int, tuple] = {}  # storage cdata -> (call, op, output, weak ref), recorded calls
        self.position = 0  # smallest first-read op backward has reached
        self.triggers: list = []  # pending (op, keys), descending
        self.failures: dict[str, str] = {}  # verification: key -> reason
        self.live = 0  # entries not yet released
        self.closed = False

    def clear(self) -> None:
        """Drop every record of a closed step whose entries are all released: no reference cycle
        (entries <-> step <-> layer calls) is left for the garbage collector to find."""
        self.by_storage.clear()
        self.by_key.clear()
        self.calls.clear()
        self.writers.clear()
        self.triggers = []


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one, also when ZeRO-3 swapped in a gathered storage (`ds_id`).
    (Parameters are leaves that require grad: the cheap test first, the isinstance only then.)"""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad and (isinstance(base, nn.Parameter) or hasattr(base, "ds_id"))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _device_type(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return p.device.type if p is not None else "cpu"


_internal = torch._C._DisableTorchDispatch  # our own tensor work: invisible to every dispatch mode
_PLAIN = (torch.Tensor, nn.Parameter)  # tensor subclasses (FakeTensor, DTensor, ...) are left to autograd


class Executor:
    """The context behind `apply` (see the module docstring). ``with executor as stats:``.

    Without a schedule it runs in profiling mode: saved tensors stay on the device while they fit
    in `profile_keep_bytes` (default 0), the others go to host (blocking) and come back when
    backward needs them; `observer` (the tracer) hears of every save and unpack."""

    def __init__(self, model: nn.Module, schedule: Schedule | None, profile: StepProfile | None, *,
                 pool: HostPool | None = None, record: bool = False, verify: bool = True,
                 replan: Callable[[StepProfile, Plan, dict[str, str]], tuple[StepProfile, Plan]] | None = None,
                 observer: Any = None, takeover: bool = True, device: Device | None = None,
                 profile_keep_bytes: int = 0):
        self.model = model
        self.profile_keep_bytes = profile_keep_bytes  # profiling: saves kept on the device up to this
        self.record = record  # keep a measured timeline of each step (stats.last_timeline)
        self.verify = verify
        self.replan = replan or replan_without
        self.observer = observer
        self.takeover = takeover
        self.stats = RunStats()
        self.layers = find_layers(model)
        self.regions = RegionTracker()
        self.call_arguments: dict[str, list[str]] = {}  # profiling: saved tensors each layer call takes
        self._pool = pool
        self._verify_pool: HostPool | None = None
        self._program: Program | None = None
        self._verify_next = False
        if schedule is not None:
            self._set_program(Program(schedule, profile))
        self._lock = threading.RLock()
        self._dropped: collections.deque = collections.deque()
        self._in_flight: collections.deque = collections.deque()  # swaps whose copy-out may not have ended
        self._resident = 0
        self._step: _Step | None = None  # the step whose forward or backward runs now
        self._micro_batches: dict[Any, _Step] = {}  # pipeline schedules: open steps by micro-batch (start())
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._stack: contextlib.ExitStack | None = None
        self._params: dict[int, StorageWeakRef] = {}
        self._device: Device | None = device  # default: from the model's parameters (Device.of)
        self._device_type = device.torch_device.type if device is not None else "cpu"
        self._timeline: Timeline | None = None
        self._recorders: dict[str, Recorder] = {}
        self._call_args: list[int] = []  # profiling: storages of the running call's arguments
        self._eval_depth = 0  # inside a model forward in eval mode (with grad): not planned
        self._replay_step: _Step | None = None
        self._warned: set[str] = set()
        self._tracer = None  # record=True: times every op of recorded steps

    # ---- plan ---------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        return self._program.plan if self._program else None

    @property
    def profile(self) -> StepProfile | None:
        return self._program.profile if self._program else None

    def _set_program(self, program: Program) -> None:
        self._program = program
        self.stats.plan = program.plan
        self._verify_next = self.verify and bool(program.rerun)

    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            self._pool = self._unbounded_pool()
        return self._pool

    @property
    def verify_pool(self) -> HostPool:
        """Host memory for a verifying step's originals: apart from the plan's pool, whose budget is
        sized for its swaps (trimmed after that step)."""
        if self._verify_pool is None:
            self._verify_pool = self._unbounded_pool()
        return self._verify_pool

    def _unbounded_pool(self) -> HostPool:
        return HostPool(None, self._device or Device.of(torch.device(self._device_type)))

    # ---- context ------------------------------------------------------------------------------
    def __enter__(self) -> RunStats:
        from .takeover import takeover
        from .tracing import StepTracer

        if not self._params:  # first entry (the engine enters once per step)
            if self._device is None:
                self._device_type = _device_type(self.model)
                self._device = Device.of(torch.device(self._device_type))
            # a fast pre-check: parameters and buffers are never activations (_is_parameter is the
            # full test, for parameters replaced later and ZeRO-3's gathered ones). The weak
            # references keep a storage that ZeRO-3 replaces from handing its address to an activation.
            self._params = {st._cdata: StorageWeakRef(st) for st in
                            (t.untyped_storage() for t in (*self.model.parameters(), *self.model.buffers()))}
        stack = contextlib.ExitStack()
        try:
            if self.takeover:
                stack.enter_context(takeover(self.model))
            self._handles.append(self.model.register_forward_pre_hook(self._model_called))
            self._handles.append(self.model.register_forward_hook(self._model_returned, always_call=True))
            for path, layer in self.layers:
                self._handles.append(layer.register_forward_pre_hook(self._call_hook(path), with_kwargs=True))
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
        try:
            for rec in list(self._recorders.values()):  # an exception left a layer call open
                rec.__exit__(None, None, None)
            self._recorders.clear()
            if self._stack is not None:
                self._stack.close()
                self._stack = None
        finally:
            self._remove_hooks()
            self._tracer = None
            self._eval_depth = 0
            with self._lock:
                self._close_step()
        return False

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- steps --------------------------------------------------------------------------------
    def _forward_step(self) -> _Step:
        step = self._step
        if step is None or step.backward:
            self._close_step()
            step = self._step = self._new_step()
        return step

    def _new_step(self) -> _Step:
        step = _Step(self._program, self._verify_next and self._program is not None)
        self._verify_next = self._verify_next and not step.verifying  # one step checks the plan's recomputes
        self.regions.reset()
        if self.record:
            self._timeline = Timeline()
            tracer = self.observer if self.observer is not None else self._tracer
            if tracer is not None:
                tracer.timeline = self._timeline
        return step

    # ---- micro-batches of a pipeline schedule ---------------------------------------------------
    # Under 1F1B a stage runs the forwards of several micro-batches before the backward of the
    # first: each micro-batch is a step of its own, open from its forward to the end of its
    # backward, several at once. The schedule says which is which (the executor cannot tell a
    # micro-batch's forward from a second forward of gradient accumulation): start(tag) before its
    # forward, resume(tag) before its backward, finish(tag) after it, each inside the context.
    # Device bytes are counted over every open step, so a step's peak is the stage's.
    def start(self, tag) -> None:
        """The forward of micro-batch `tag` begins: a step of its own."""
        with self._lock:
            if tag in self._micro_batches:
                raise RuntimeError(f"micro-batch {tag!r} started twice before its backward")
            self._close_step()
            self._step = self._micro_batches[tag] = self._new_step()

    def resume(self, tag) -> None:
        """The backward of micro-batch `tag` begins (its step is the current one)."""
        with self._lock:
            self._close_step()
            self._step = self._micro_batches[tag]

    def finish(self, tag) -> None:
        """The backward of micro-batch `tag` has ended: its step closes."""
        with self._lock:
            step = self._micro_batches.pop(tag)
            if self._step is step:
                self._step = None
            self._close(step)

    @property
    def open_micro_batches(self) -> int:
        return len(self._micro_batches)

    def _close_step(self) -> None:
        """Leave the current step: closed, unless it is a micro-batch's (which stays open)."""
        step = self._step
        if step is None:
            return
        self._step = None
        if step in self._micro_batches.values():
            return  # a micro-batch between its forward and its backward: finish() closes it
        self._close(step)

    def _close(self, step: _Step) -> None:
        self._drain()
        step.closed = True
        if step.live == 0:
            step.clear()
        if self.observer is not None and step.program is None:
            self.observer.step_closed()  # profiling: one step is the profile (accumulation runs several)
        stats = step.stats
        stats.host_pool_bytes = self._pool.stats().bytes_in_use if self._pool is not None else 0
        self.stats.steps += 1
        self.stats.last_step = stats
        if self._timeline is not None:
            self.stats.last_timeline = self._timeline.close(stats.peak_device_bytes)
            self._timeline = None
        if step.verifying:
            stats.verified = not step.failures
            stats.demoted = dict(step.failures)
            if self._verify_pool is not None:
                self._verify_pool.trim()  # the originals' host memory is not needed again
            if step.failures:
                self._demote(step.program, step.failures)
        for why, n in stats.fallbacks.items():
            if why not in self._warned:
                self._warned.add(why)
                log.warning("slackswap: %d saved tensor(s) in step %d (%s); counted in stats.fallbacks, "
                            "warned once", n, self.stats.steps, why)

    def _demote(self, program: Program, failures: dict[str, str]) -> None:
        try:
            profile, plan = self.replan(program.profile, program.plan, failures)
        except Exception as e:  # noqa: BLE001 - a failed re-plan must not lose the step: demote by hand
            log.warning("slackswap: re-planning after a failed verification did not work (%s: %s); the failed "
                        "tensors are swapped instead", type(e).__name__, e)
            profile, plan = swap_instead(program.profile, program.plan, failures)
        self._set_program(Program(lower(profile, plan), profile))
        self.stats.demotions.append(dict(failures))
        reasons = sorted(set(failures.values()))
        log.warning("slackswap: %d recomputed tensor(s) did not replay exactly on the first step under plan %s "
                    "(%s; e.g. %s); they are never recomputed now; re-planned: plan %s (%s)", len(failures),
                    program.plan.digest[:12], "; ".join(reasons[:3]), ", ".join(sorted(failures)[:4]),
                    plan.digest[:12], plan.planner)

    # ---- module hooks --------------------------------------------------------------------------
    def _tracking(self) -> bool:
        """Module calls that belong to the step: grad on, not in backward, not a replay, not eval."""
        return torch.is_grad_enabled() and not _in_backward() and not replaying() and not self._eval_depth

    def _model_called(self, module, args):
        if not self._tracking():
            return
        if not module.training:  # an eval-mode forward with grad: left to autograd (not planned)
            self._eval_depth += 1
            return
        with self._lock:
            self._forward_step()

    def _model_returned(self, module, args, output):
        if self._eval_depth and not module.training and not _in_backward() and not replaying():
            self._eval_depth -= 1

    def _call_hook(self, path: str):
        def hook(module, args, kwargs):
            if not self._tracking() or self.regions.in_call:
                return
            with self._lock:
                step = self._forward_step()
                label = self.regions.enter(path)
                if self.observer is not None:
                    self._call_args = [t.untyped_storage()._cdata for t in _flatten_call((args, kwargs))[0]
                                       if isinstance(t, torch.Tensor)]
                program = step.program
                if program is None or label not in program.rerun:
                    return
                call = CallRecord(label, module, autocast=autocast_state(self._device_type))
                flat, spec = _flatten_call((args, kwargs))
                with _internal():  # held without autograd history: no cycle through the graph
                    flat = [_Detached(t) if isinstance(t, torch.Tensor) else t for t in flat]
                call.args = (flat, spec)
                call.versions = [(a.tensor, a.tensor._version) for a in flat if isinstance(a, _Detached)]
                step.calls[label] = call
                rec = self._recorders[label] = Recorder(call, self._recorded_output, self._device_type)
            rec.__enter__()
        return hook

    def _return_hook(self, path: str):
        def hook(module, args, output):
            if self.regions.path != path or _in_backward() or replaying():
                return
            label = self.regions.label
            rec = self._recorders.pop(label, None)
            if rec is not None:
                rec.__exit__(None, None, None)
            with self._lock:
                step = self._step
                if step is not None:
                    if self.observer is not None:
                        keys = [step.by_storage[c].key for c in self._call_args if c in step.by_storage]
                        self.call_arguments[label] = list(dict.fromkeys(keys))
                    call = step.calls.get(label)
                    if call is not None:
                        self._hold_arguments(step, call)
                self.regions.leave()
        return hook

    def _hold_arguments(self, step: _Step, call: CallRecord) -> None:
        """A replay calls the layer again with its arguments: those the step saved are held through
        their entries (pinned until the replay; a swapped input must not stay on the device)."""
        live = len(call.targets)  # (only RECOMPUTE entries are targets)
        if not live:  # nothing to replay: nothing to hold
            call.args, call.versions, call.done = None, [], True
            return
        flat, spec = call.args
        held = []
        for a in flat:
            entry = step.by_storage.get(a.tensor.untyped_storage()._cdata) if isinstance(a, _Detached) else None
            if entry is not None and entry.holders > 0:
                entry.holders += 1
                call.pins.append(entry)
                held.append(_Arg(entry, meta_of(a.tensor), a.requires_grad))
            else:
                held.append(a)
        call.args = (held, spec)
        call.live = live

    def _recorded_output(self, call: CallRecord, k: int, n: int, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        step = self._step
        if step is not None:
            step.writers[st._cdata] = (call, k, n, StorageWeakRef(st))

    # ---- pack ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        # the hot path of every step: keep it lean (see benchmarks/overhead_cpu.py)
        if replaying():
            return _DROPPED
        if _in_backward() or self._eval_depth or type(t) not in _PLAIN or t.is_meta:
            return t
        st = t.untyped_storage()
        cdata = st._cdata
        if cdata in self._params:
            return t
        with self._lock:
            if self._dropped:
                self._drain()
            step = self._step
            if step is None or step.backward:
                step = self._forward_step()
            entry = step.by_storage.get(cdata)
            if entry is None or entry.holders <= 0:  # (a released entry's address may hold a new storage)
                if t.device.type != self._device_type:
                    step.stats.other_device_bytes += st.nbytes()
                    return t
                if _is_parameter(t):
                    return t
                with _internal():
                    entry = self._new_entry(step, t, st)
                step.by_storage[cdata] = entry
                if self.observer is not None:
                    self.observer.saved(entry.key, t)
            entry.holders += 1
            if entry.decision is Decision.KEEP:
                with _internal():
                    return _Holder(self._dropped, entry, t.detach(), (), t._version, None)
            return _Holder(self._dropped, entry, None, meta_of(t), t._version, weakref.ref(t))

    def _new_entry(self, step: _Step, t: torch.Tensor, st) -> _Entry:
        label = self.regions.label
        n = step.ordinals.get(label, 0)
        step.ordinals[label] = n + 1
        key = activation_key(label, n, maker_of(t))
        nbytes = st.nbytes()
        program, stats = step.program, step.stats
        planned = program.acts.get(key) if program is not None else None
        if program is None:  # profiling: to host (blocking), so the step fits any budget above the kept bytes
            decision = Decision.KEEP if self._resident + nbytes <= self.profile_keep_bytes else Decision.SWAP
        elif planned is None:
            decision = self._fallback(step, "not in the plan's profile")
        else:
            decision = planned.decision
            if planned.nbytes != nbytes:
                # data-dependent shapes (a mixture of experts routes other token counts every step):
                # the decision still applies, exactly; only the plan's byte counts are off
                stats.resized += 1
                stats.resized_bytes += nbytes - planned.nbytes
        writer = step.writers.get(st._cdata)
        mine = writer is not None and writer[0].label == label
        if decision is Decision.RECOMPUTE and not mine:
            decision = self._fallback(step, "recompute of a tensor its layer call did not make")
        elif decision is Decision.RECOMPUTE and writer[1] != planned.writer:
            # same name, same size, made by another op of the call: the layer took another code path
            # than when profiled (data-dependent control flow; e.g. an attention mask of all ones that
            # a model drops), and the plan's replay would stop before the op that makes it now
            decision = self._fallback(step, "recompute of a tensor its layer call made with other ops than profiled")
        # A SWAP or RECOMPUTE entry outlives its device storage: the weak reference keeps the
        # storage's address (its cdata, the by_storage key) from going to a new storage meanwhile.
        ref = StorageWeakRef(st) if decision is not Decision.KEEP else None
        entry = _Entry(key, decision, nbytes, planned.first_read if planned else None, ref, step)
        step.live += 1
        if decision is Decision.SWAP:
            step.by_key[key] = entry
        if mine:
            call, k, out, _ = writer
            call.available[k, out] = entry
            if decision is Decision.RECOMPUTE:
                call.targets[k, out] = entry
                entry.call = call
        if decision is Decision.RECOMPUTE:
            if step.verifying:
                entry.original = self._copy_to_host(st, step)
            return entry
        if decision is Decision.SWAP:
            buf = self.pool.acquire(nbytes)
            if buf is not None:
                entry.buffer = buf
                self._arrive(entry)
                start = self._timeline.now() if self._timeline else 0.0
                entry.out_handle = self._device.copy_out(_bytes_of(st), buf.view(torch.uint8, (nbytes,)))
                if self._timeline is not None:
                    self._timeline.span("d2h", "copy_out", key, start, self._timeline.now(), nbytes)
                if program is None or program.blocking:
                    entry.out_handle.wait()  # forward waits for it (plan.blocking; Stream protocol rule 4)
                self._in_flight.append(entry)
                self._poll_copies()
                stats.swapped_bytes += nbytes
                return entry
            entry.decision = self._fallback(step, "host pool exhausted")
        entry.storage = t.detach()
        self._arrive(entry)
        stats.kept_bytes += nbytes
        return entry

    def _fallback(self, step: _Step, why: str) -> Decision:
        step.stats.fallback(f"{why}: kept")
        return Decision.KEEP

    def _copy_to_host(self, st, step: _Step):
        buf = self.verify_pool.acquire(st.nbytes())
        if buf is None:
            step.stats.fallback("not verified: host pool full")
            return None
        self._device.copy_out(_bytes_of(st), buf.view(torch.uint8, (st.nbytes(),))).wait()
        return buf

    # ---- unpack --------------------------------------------------------------------------------
    def _unpack(self, holder):
        if type(holder) is not _Holder:
            if holder is _DROPPED:
                raise ReplayError("a replay's own autograd graph was used for a gradient; replays only "
                                  "regenerate saved tensors")
            return holder
        entry = holder.entry
        if self.observer is not None:
            self.observer.unpacked(entry.key)
        if not entry.reached:
            with self._lock:
                if self._dropped:
                    self._drain()  # what backward released so far leaves before anything arrives
                self._reached(entry)
        t = holder.tensor
        if t is not None:  # KEEP
            if t._version != holder.version:
                _modified(entry.key, holder.version, t._version)
            return t
        with self._lock:
            if self._dropped:
                self._drain()
            t = self.materialize(entry, holder.meta)
        if t is None:
            raise ReplayError(f"saved tensor {entry.key!r} was needed after it was released")
        alive = holder.alive()
        if alive is not None and alive._version != holder.version:
            _modified(entry.key, holder.version, alive._version)
        return t

    def _reached(self, entry: _Entry) -> None:
        """Backward unpacks `entry` for the first time: it has reached the entry's first reader.
        Prefetches whose trigger op it has passed are issued; a layer call it enters that
        recomputes is replayed first (the Schedule's RECOMPUTE at the region's first backward op)."""
        entry.reached = True
        step = entry.step
        program = step.program
        if program is not None and not program.any_backward_work and step.backward:
            return  # nothing to prefetch or replay (keep-only plans)
        if not step.backward:
            step.backward = True
            if program is not None:
                step.triggers = list(program.triggers)
                step.position = program.n_ops
        self._poll_copies()
        p = entry.first_read
        if p is None or p >= step.position or program is None:
            return
        step.position = p
        with _internal():
            while step.triggers and step.triggers[0][0] > p:
                for key in step.triggers.pop(0)[1]:
                    other = step.by_key.get(key)
                    if other is not None and other.decision is Decision.SWAP and other.storage is None \
                            and other.buffer is not None and other.holders > 0:
                        self._copy_in(other)
        call = step.calls.get(program.region_of_op[p])
        if call is not None and not call.done:
            self._replay(step, call)

    def materialize(self, entry: _Entry, meta: tuple) -> torch.Tensor | None:
        """`entry` on the device viewed as `meta`: copied in or regenerated if need be (None if
        the entry is gone)."""
        if entry.storage is None:
            if entry.holders <= 0:
                return None
            if entry.decision is Decision.SWAP and entry.buffer is not None:
                with _internal():
                    self._copy_in(entry)
                entry.step.stats.copy_waits += 1
            elif entry.call is not None and not entry.call.done:
                self._replay(entry.step, entry.call)
            if entry.storage is None:
                raise ReplayError(f"the replay of {entry.call.label if entry.call else '?'!r} did not "
                                  f"regenerate saved tensor {entry.key!r}")
        with _internal():
            if entry.in_handle is not None:  # compute waits on the copy's event (no host sync)
                entry.in_handle.wait_on_current()
            return rebuild(entry.storage, meta)

    def _copy_in(self, entry: _Entry) -> None:
        """Issue the H2D copy (side stream, ordered after its copy-out); the bytes count from now."""
        self._arrive(entry)
        start = self._timeline.now() if self._timeline else 0.0
        entry.in_handle = self._device.copy_in(entry.buffer.view(torch.uint8, (entry.nbytes,)),
                                               after=entry.out_handle)
        if self._timeline is not None:
            self._timeline.span("h2d", "copy_in", entry.key, start, self._timeline.now(), entry.nbytes)
        entry.storage = entry.in_handle.tensor

    # ---- replay ---------------------------------------------------------------------------------
    def _replay(self, step: _Step, call: CallRecord) -> None:
        call.done = True
        start = self._timeline.now() if self._timeline else 0.0
        self._replay_step = step
        try:
            args, kwargs = self._arguments(call)
            run_replay(self, call, step.program.rerun.get(call.label, frozenset()), args, kwargs,
                       self._replay_context)
        except Exception as e:  # noqa: BLE001 - any failure of the model's code in a replay
            if not step.verifying:
                missing = sum(1 for t in call.targets.values() if t.storage is None and t.holders > 0)
                raise ReplayError(f"replaying layer call {call.label!r} to regenerate {missing} saved tensor(s) "
                                  f"failed: {e}. The layer is not replayable as its plan assumed (state it "
                                  f"mutates, a nondeterministic op, or another code path than when it was "
                                  f"profiled); plan with its tensors kept or swapped") from e
            why = f"replay failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            for entry in call.targets.values():
                if entry.holders > 0:
                    step.failures.setdefault(entry.key, why)
                    if entry.storage is None and entry.original is not None:
                        self._restore_original(entry)
        finally:
            self._replay_step = None
            self._unpin(call)
            if self._timeline is not None:
                self._timeline.span("compute", "recompute", call.label, start, self._timeline.now())

    def _unpin(self, call: CallRecord) -> None:
        self._dropped.extend(call.pins)
        call.pins, call.args, call.versions = [], None, []

    def _replay_context(self):
        from .takeover import inline_checkpoints

        return inline_checkpoints() if self.takeover else contextlib.nullcontext()

    def _arguments(self, call: CallRecord) -> tuple[tuple, dict]:
        for t, version in call.versions:
            if t._version != version:
                raise ReplayError(f"an argument of layer call {call.label!r} was modified in place after the "
                                  f"call (version {version} -> {t._version}); a replay would see other inputs")
        held, spec = call.args
        flat = []
        with _internal():
            for a in held:
                if isinstance(a, _Arg):
                    t = self.materialize(a.entry, a.meta)
                    if t is None:
                        raise ReplayError(f"argument {a.entry.key!r} of {call.label!r} was released before "
                                          f"the replay")
                    flat.append(t.requires_grad_() if a.requires_grad else t)
                elif isinstance(a, _Detached):
                    flat.append(a.get())
                else:
                    flat.append(a)
        return _unflatten_call(flat, spec)

    def ran(self, call: CallRecord, k: int) -> None:
        """A replay ran op k of `call` for real (counted; the Schedule says which it should)."""
        step = self._replay_step or self._step
        stats, program = step.stats, step.program
        stats.ops_recomputed += 1
        stats.recomputed_ops.append(program.op_keys.get((call.label, k), f"{call.label}:{k}:?"))
        if k not in program.rerun.get(call.label, ()):
            stats.unplanned_reruns += 1

    def captured(self, entry: _Entry, t: torch.Tensor) -> None:
        """The replay made RECOMPUTE `entry` again (`t`: the op's output over its storage)."""
        with _internal():
            st = t.untyped_storage()
            if st.nbytes() != entry.nbytes:
                raise ReplayError(f"the replay made {entry.key!r} in a storage of {st.nbytes()} B; forward's had "
                                  f"{entry.nbytes} B")
            entry.storage = t.detach()
            self._arrive(entry)
            entry.step.stats.recomputed_bytes += entry.nbytes
            if entry.original is not None:
                self._check_against_original(entry, st)

    def _check_against_original(self, entry: _Entry, st) -> None:
        """Verification: the regenerated bytes against forward's; if they differ, backward gets
        forward's bytes (the step stays exact) and the key is demoted after the step."""
        step = entry.step
        fresh = self.verify_pool.acquire(entry.nbytes)
        if fresh is None:
            step.stats.fallback("not verified: host pool full")
            return
        try:
            self._device.copy_out(_bytes_of(st), fresh.view(torch.uint8, (entry.nbytes,))).wait()
            same = torch.equal(fresh.view(torch.uint8, (entry.nbytes,)),
                               entry.original.view(torch.uint8, (entry.nbytes,)))
        finally:
            self.verify_pool.release(fresh)
        if not same:
            step.failures[entry.key] = "values differ from forward's"
            self._leave(entry)
            self._restore_original(entry)

    def _restore_original(self, entry: _Entry) -> None:
        with _internal():
            handle = self._device.copy_in(entry.original.view(torch.uint8, (entry.nbytes,)))
            handle.wait()
        entry.storage = handle.tensor
        self._arrive(entry)

    # ---- lifetimes ------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Release the entries whose last holder died (queued by _Holder.__del__)."""
        dropped = self._dropped
        while dropped:
            entry = dropped.popleft()
            entry.holders -= 1
            if entry.holders == 0:
                self._release(entry)

    def _release(self, entry: _Entry) -> None:
        self._leave(entry)
        entry.storage = None
        with _internal():
            if entry.buffer is not None:  # reusable once no copy reads or writes it any more
                self.pool.release(entry.buffer, after=entry.in_handle or entry.out_handle)
                entry.buffer = None
            if entry.original is not None:
                self.verify_pool.release(entry.original)
                entry.original = None
        entry.in_handle = None
        call, entry.call = entry.call, None
        if call is not None and not call.done:  # a replay nobody needs any more: unpin its arguments
            call.live -= 1
            if call.live <= 0:
                call.done = True
                self._unpin(call)
        step = entry.step
        step.live -= 1
        if step.live == 0 and step.closed:
            step.clear()

    def _poll_copies(self) -> None:
        """Swaps whose copy-out has ended leave the device. Copies on one stream end in order, so
        only the oldest is polled (never blocks)."""
        q = self._in_flight
        while q and q[0].out_handle.done():
            self._leave(q.popleft())

    def _arrive(self, entry: _Entry) -> None:
        if not entry.resident:
            entry.resident = True
            self._resident += entry.nbytes
            stats = entry.step.stats
            if self._resident > stats.peak_device_bytes:
                stats.peak_device_bytes = self._resident
            if self._timeline is not None:
                self._timeline.resident(self._resident)

    def _leave(self, entry: _Entry) -> None:
        if entry.resident:
            entry.resident = False
            self._resident -= entry.nbytes
            if self._timeline is not None:
                self._timeline.resident(self._resident)


class _Detached:
    """A layer-call argument held without its autograd history (shares its version counter)."""

    __slots__ = ("tensor", "requires_grad")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.requires_grad = t.detach(), t.requires_grad

    def get(self) -> torch.Tensor:
        t = self.tensor.detach()
        return t.requires_grad_() if self.requires_grad else t


@dataclass(frozen=True)
class _Arg:
    """A layer-call argument held through its saved entry."""

    entry: _Entry
    meta: tuple
    requires_grad: bool


def _flatten_call(obj) -> tuple[list, object]:
    """(leaves, spec) of a layer call's (args, kwargs): tuples, lists and dicts are opened, anything
    else (a tensor, a cache object, a flag) is a leaf. (torch's general pytree leaves a reference
    cycle behind on every call.)"""
    leaves: list = []
    return leaves, _flatten_into(obj, leaves)


def _flatten_into(obj, leaves: list):
    if type(obj) in (tuple, list):
        return (type(obj), tuple(_flatten_into(v, leaves) for v in obj))
    if type(obj) is dict:
        return (dict, tuple((k, _flatten_into(v, leaves)) for k, v in obj.items()))
    leaves.append(obj)
    return None


def _unflatten_call(leaves: list, spec):
    return _build(iter(leaves), spec)


def _build(leaves, spec):
    if spec is None:
        return next(leaves)
    kind, parts = spec
    if kind is dict:
        return {k: _build(leaves, p) for k, p in parts}
    return kind([_build(leaves, p) for p in parts])


def _bytes_of(st) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))


def _modified(key: str, saved: int, now: int):
    raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                       f"operation: saved tensor {key!r} is at version {now}; expected version {saved} instead "
                       f"(slackswap detected it; without SlackSwap autograd raises this error too)")


# ---- public entry points ---------------------------------------------------------------------------
def apply(model: nn.Module, plan: Plan, profile: StepProfile, *, schedule: Schedule | None = None, **kw) -> Executor:
    """Context manager: every step run inside follows `plan`, made for `profile` of this model.
    ``with apply(model, plan, profile) as stats: ...``; ``stats.last_step`` has the counters.

    Keywords: `pool` (HostPool), `record` (measured timelines), `verify` (check recomputes on the
    first step, default True), `replan` (how to re-plan after a demotion; default `replan_without`),
    `device` (default: the Device of the model's parameters)."""
    if plan.profile_digest != profile.digest:
        raise PlanError(f"plan {plan.digest[:12]} was made for profile {plan.profile_digest[:12]}, not for "
                        f"{profile.name!r} ({profile.digest[:12]}); plan again for this profile")
    plan.check(profile)
    if schedule is None:
        schedule = lower(profile, plan)
    elif schedule.plan != plan:
        raise PlanError("the schedule passed to apply() executes another plan")
    return Executor(model, schedule, profile, **kw)


def replan_without(profile: StepProfile, plan: Plan, failures: dict[str, str]) -> tuple[StepProfile, Plan]:
    """The default re-plan after a demotion: the profile with the failed activations made
    unrecomputable, planned again by the plan's planner on its hardware (a preset recognised by
    its digest) within the same budget; for a planner or hardware it does not know, the failed
    keys are swapped instead (logged)."""
    from ..hardware import preset_by_digest
    from ..planners import PLANNERS, PRIVATE

    hw = preset_by_digest(plan.hardware_digest)
    planner = PLANNERS.get(plan.planner)
    if hw is None or planner is None:
        log.info("slackswap: no planner %r on known hardware to re-plan with; the failed tensors are swapped",
                 plan.planner)
        return swap_instead(profile, plan, failures)
    pinned = profile.without_recompute(failures)
    return pinned, planner(pinned, hw, plan.budget_bytes, PRIVATE).plan


def swap_instead(profile: StepProfile, plan: Plan, failures: dict[str, str]) -> tuple[StepProfile, Plan]:
    """The plan with the failed tensors swapped (prefetched when backward starts), every other
    decision and trigger kept; the budget is not re-checked."""
    pinned = profile.without_recompute(failures)
    decisions = dict(plan.decision)
    for key in failures:
        decisions[key] = Decision.SWAP
    return pinned, plan.rebuilt(pinned, decisions)

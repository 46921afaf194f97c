"""Run training steps under a Plan: keep, swap or recompute each saved tensor, exactly.

`apply(model, plan, profile)` is a context manager; every step run inside it follows the plan.
It names each saved tensor the way the profiler did (it *is* a StepTracer), and returns to
autograd a small holder instead of the tensor:

* KEEP: the holder holds the tensor.
* SWAP: the whole storage is copied once into a pooled host buffer (Device.copy_out; see the
  "Stream protocol" in device.py) and the device copy is dropped; backward copies it back in once
  and rebuilds each saved view over it. If the pool is exhausted the tensor is kept (counted).
* RECOMPUTE: the holder holds nothing. The first time backward unpacks a recomputed tensor of a
  layer, the layer's forward is replayed (`_Replay`): with the RNG state each random op saw in
  forward, re-running only the plan's producer ops and handing every other op its kept, swapped
  or (if nothing reads it) empty output, stopping after the last producer.

Own accounting: bytes of saved storages held on the device by this executor, from save (or copy
in, or recompute) until autograd drops the last holder of that storage.

Backward follows the Schedule: when autograd reaches the node of forward op j, the prefetch of every
swapped tensor whose trigger op comes after j is issued, and j's layer is replayed first if it
recomputes anything. With streams the copies overlap compute (device.py's "Stream protocol"); on
the CPU accelerator they are real synchronous copies, so the accounting equals the simulator's
prediction on `Hardware.instant_copies()`.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import PlanError
from ..plan import END_OF_FORWARD, Decision, Plan
from ..profile import StepProfile
from .device import Device
from .host_pool import HostPool
from .timeline import MeasuredStep, Timeline
from .tracing import _FREE_OPS, StepTracer, _in_backward, _storage_ptr

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Counters of one step."""

    kept_bytes: int = 0
    swapped_bytes: int = 0
    recomputed_bytes: int = 0
    ops_recomputed: int = 0
    recomputed_ops: list[str] = field(default_factory=list)
    peak_device_bytes: int = 0
    host_pool_bytes: int = 0
    copy_waits: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


@dataclass
class RunStats:
    steps: int = 0
    last_step: StepStats = field(default_factory=StepStats)
    last_timeline: MeasuredStep | None = None  # with record=True: the last step, for report.chrome_trace


class _Entry:
    """One saved storage in one step."""

    __slots__ = ("key", "decision", "nbytes", "region", "storage", "buffer", "holders", "resident",
                 "out_handle", "in_handle")

    def __init__(self, key: str, decision: Decision, nbytes: int, region: str):
        self.key, self.decision, self.nbytes, self.region = key, decision, nbytes, region
        self.storage: torch.Tensor | None = None  # uint8 tensor over the device storage
        self.buffer = None  # HostBuffer of a swapped storage
        self.holders = 0
        self.resident = False
        self.out_handle = None  # CopyHandle of its D2H copy (swaps)
        self.in_handle = None  # CopyHandle of its H2D copy, until the compute stream has waited on it


class _Holder:
    __slots__ = ("entry", "tensor", "meta", "__weakref__")

    def __init__(self, entry: _Entry, tensor: torch.Tensor | None, meta: tuple):
        self.entry, self.tensor, self.meta = entry, tensor, meta


def _meta(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device, t.requires_grad)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over t's whole storage."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _rebuild(storage: torch.Tensor, meta: tuple) -> torch.Tensor:
    dtype, shape, stride, offset, device, _ = meta
    with torch.no_grad():
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage.untyped_storage(), offset, shape, stride)


class Executor(StepTracer):
    """The mode behind `apply` (see the module docstring)."""

    def __init__(self, model: nn.Module, plan: Plan, profile: StepProfile, *, device: Device | None = None,
                 pool: HostPool | None = None, record: bool = False):
        super().__init__(model)
        self.record = record  # keep a measured timeline of each step (stats.last_timeline)
        self.plan, self.profile = plan, profile
        self.device = device or Device.current()
        self.pool = pool or HostPool(None, self.device)
        self.stats = RunStats()
        self._layer_by_path = dict(self.layers)
        # per layer region: the local indices of ops to re-run, and the keys recomputed there
        self._rerun: dict[str, set[int]] = {}
        # saved tensors a replay reads: held (pinned) until their region's replay has run, even
        # if autograd is done with them sooner
        self._replay_deps: set[str] = set()
        for a in profile.activations:
            if plan.decision.get(a.key) is Decision.RECOMPUTE:
                region = profile.region_of(a)
                self._rerun.setdefault(region, set()).update(
                    int(profile.ops[p].key.rsplit(":", 2)[1]) for p in a.producers)
                self._replay_deps.update(d for d in a.deps if plan.decision.get(d) is not Decision.RECOMPUTE)
        # prefetch: op index -> swapped keys to copy in once that op's backward has run
        op_index = {o.key: i for i, o in enumerate(profile.ops)}
        self._triggers: dict[int, list[str]] = {}
        for key, trig in plan.prefetch:
            at = len(profile.ops) if trig == END_OF_FORWARD else op_index[trig]
            self._triggers.setdefault(at, []).append(key)
        self._reset_step()

    # ---- step lifecycle ----------------------------------------------------------------------
    def _reset_step(self) -> None:
        self.ops, self.storages, self._ptr_to_sid = [], {}, {}
        self._region, self._layers_done, self._region_counts = "pre", 0, {}
        self._pending_saves, self._fallback_saver, self._pack_order = [], {}, {}
        self._last_outputs, self._node_to_op, self._nodes = [], {}, []
        self._backward_started = self._collected = False
        self._entries: dict[str, _Entry] = {}
        self._by_sid: dict[int, _Entry] = {}
        self._inputs_seen: dict[str, int] = {}
        self._layer_call: dict[str, tuple] = {}  # region -> (args, kwargs, rng state)
        self._rng_before: dict[tuple[str, int], torch.Tensor] = {}
        self._out_meta: dict[tuple[str, int], list[tuple]] = {}
        self._replayed: set[str] = set()
        self._pins: dict[str, list[_Entry]] = {}
        self._in_flight: list[_Entry] = []
        self._pending_triggers = sorted(self._triggers, reverse=True)
        self._replaying = False
        self._internal = False
        self._resident = 0
        self._step = StepStats()
        self._timeline: Timeline | None = None

    def _enter_model(self, module, args):
        if _in_backward() or self._replaying:
            return
        if self._started:  # a new step: close the last one
            self._close_step()
        self._started = True
        if self.record:
            self._timeline = Timeline()

    def _close_step(self) -> None:
        self.stats.steps += 1
        self._step.host_pool_bytes = self.pool.stats().bytes_in_use
        self.stats.last_step = self._step
        if self._timeline is not None:
            self.stats.last_timeline = self._timeline.close(self._step.peak_device_bytes)
        self._reset_step()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._started:
            self._close_step()
        return out

    # ---- forward: capture what a replay needs --------------------------------------------------
    def _enter_layer(self, path: str):
        def hook(module, args, kwargs):
            if _in_backward() or self._replaying or self._backward_started or not self._started:
                return
            self._region = path
            if path in self._rerun:
                self._layer_call[path] = (args, kwargs, torch.get_rng_state(), self._device_rng())
        return hook

    def __enter__(self):
        self._param_ptrs = {_storage_ptr(p) for p in self.model.parameters()}
        self._param_ptrs |= {_storage_ptr(b) for b in self.model.buffers()}
        self._handles.append(self.model.register_forward_pre_hook(self._enter_model))
        for path, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(path), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._leave_layer))
        self._hooks.__enter__()
        TorchDispatchMode.__enter__(self)
        return self.stats

    def _finish_forward(self) -> None:
        # Only bind autograd nodes: asking nodes for their saved tensors would unpack (and so
        # replay) recomputed ones. Savers are not needed here; the plan names tensors by key.
        if not self._collected:
            self._collected = True
            self._bind_last_node()

    def _leave_layer(self, module, args, output):
        if self._replaying:
            return
        super()._leave_layer(module, args, output)

    def _device_rng(self):
        return torch.cuda.get_rng_state() if self.device.name == "cuda" else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._internal:  # our own copies and views: not the model's ops
            return func(*args, **(kwargs or {}))
        if _in_backward() and not self._replaying:
            self._backward_reached()
        tl = self._timeline
        if tl is not None and not self._replaying and (_in_backward() or self._started and not self._backward_started):
            return self._timed(func, types, args, kwargs, tl)
        return self._dispatch(func, types, args, kwargs)

    def _timed(self, func, types, args, kwargs, tl: Timeline):
        """The op, with its span on the timeline: forward ops by key, backward ops by the forward
        op whose autograd node runs them."""
        backward = _in_backward()
        start = tl.now()
        n_ops = len(self.ops)
        out = self._dispatch(func, types, args, kwargs)
        if backward:
            node = torch._C._current_autograd_node()
            j = self._node_to_op.get(id(node)) if node is not None else None
            if j is not None:
                tl.span("compute", "bwd", self.ops[j].key, start, tl.now())
        elif len(self.ops) > n_ops:
            tl.span("compute", "fwd", self.ops[-1].key, start, tl.now())
        return out

    def _dispatch(self, func, types, args=(), kwargs=None):
        if self._replaying or not self._started or self._backward_started or _in_backward():
            return super().__torch_dispatch__(func, types, args, kwargs)
        if self._in_flight:
            self._poll_copies()
        region = self._region
        compute = not (func.is_view or func.overloadpacket.__name__ in _FREE_OPS)
        if compute and region in self._rerun:
            local = self._region_counts.get(region, 0)
            if torch.Tag.nondeterministic_seeded in func.tags:
                self._rng_before[region, local] = torch.get_rng_state()
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._out_meta[region, local] = [_meta(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)

    # ---- pack / unpack -----------------------------------------------------------------------
    def _key_for(self, t: torch.Tensor, sid: int) -> tuple[str, str]:
        region = self._region
        st = self.storages[sid]
        writer = self.ops[st.producer] if st.producer is not None else None
        if writer is not None and writer.region == region:
            n = writer.writes.index(sid)
            return writer.key + (f".{n}" if n else ""), region
        n = self._inputs_seen.get(region, 0)
        self._inputs_seen[region] = n + 1
        return f"{region}:input.{n}", region

    def _pack(self, t: torch.Tensor):
        sid = self._note_save(t)
        if sid is None:
            return t
        # by storage id, not address: a swapped or recomputed storage dies in forward, and the
        # allocator hands its address to the next one
        entry = self._by_sid.get(sid)
        if entry is None:
            key, region = self._key_for(t, sid)
            self._internal = True
            try:
                entry = self._new_entry(key, region, t)
            finally:
                self._internal = False
            self._by_sid[sid] = entry
        return self._hold(entry, t)

    def _new_entry(self, key: str, region: str, t: torch.Tensor) -> _Entry:
        decision = self.plan.decision.get(key)
        if decision is None:
            self._step.fallback("unplanned tensor kept")
            decision = Decision.KEEP
        if decision is Decision.RECOMPUTE and region not in self._layer_call:
            self._step.fallback("recompute outside a replayable layer: kept")
            decision = Decision.KEEP
        entry = _Entry(key, decision, t.untyped_storage().nbytes(), region)
        self._entries[key] = entry
        if key in self._replay_deps and region in self._layer_call:
            entry.holders += 1
            self._pins.setdefault(region, []).append(entry)
        if decision is Decision.SWAP:
            buf = self.pool.acquire(entry.nbytes)
            if buf is None:
                self._step.fallback("host pool exhausted: kept")
                entry.decision = Decision.KEEP
            else:
                # Stream protocol (device.py): D2H on the side stream after the compute stream; the
                # handle keeps the device source alive, and it counts as resident, until the copy ends.
                self._arrive(entry)
                entry.buffer = buf
                start = self._timeline.now() if self._timeline else 0.0
                entry.out_handle = self.device.copy_out(_bytes_view(t), buf.view(torch.uint8, (entry.nbytes,)))
                if self._timeline is not None:
                    self._timeline.span("d2h", "copy_out", key, start, self._timeline.now(), entry.nbytes)
                self._in_flight.append(entry)
                self._poll_copies()
                self._step.swapped_bytes += entry.nbytes
        if entry.decision is Decision.KEEP:
            entry.storage = _bytes_view(t)
            self._arrive(entry)
            self._step.kept_bytes += entry.nbytes
        return entry

    def _poll_copies(self) -> None:
        """Swapped storages whose D2H copy has ended leave the device (never blocks)."""
        still = []
        for entry in self._in_flight:
            if entry.out_handle.done():
                self._leave(entry)
            else:
                still.append(entry)
        self._in_flight = still

    def _hold(self, entry: _Entry, t: torch.Tensor) -> _Holder:
        holder = _Holder(entry, t if entry.decision is Decision.KEEP else None, _meta(t))
        entry.holders += 1
        weakref.finalize(holder, self._drop_holder, entry)
        return holder

    def _drop_holder(self, entry: _Entry) -> None:
        entry.holders -= 1
        if entry.holders == 0:
            self._leave(entry)
            entry.storage = None
            if entry.buffer is not None:  # reusable once no copy reads or writes it any more
                self.pool.release(entry.buffer, after=entry.in_handle or entry.out_handle)
                entry.buffer = None
            entry.in_handle = None

    def _arrive(self, entry: _Entry) -> None:
        if not entry.resident:
            entry.resident = True
            self._resident += entry.nbytes
            self._step.peak_device_bytes = max(self._step.peak_device_bytes, self._resident)
            if self._timeline is not None:
                self._timeline.resident(self._resident)

    def _leave(self, entry: _Entry) -> None:
        if entry.resident:
            entry.resident = False
            self._resident -= entry.nbytes
            if self._timeline is not None:
                self._timeline.resident(self._resident)

    def _backward_reached(self) -> None:
        """Backward is running the node of some forward op j: the backward of every op after j
        is done (autograd walks the chain in reverse), so their prefetch triggers fire now; then
        j's layer is replayed if it recomputes anything, at the region's start as the schedule
        does, not later at the first read of a recomputed tensor."""
        node = torch._C._current_autograd_node()
        j = self._node_to_op.get(id(node)) if node is not None else None
        if j is None:
            j = len(self.profile.ops)  # not a traced op (the loss's own nodes): forward has ended
        while self._pending_triggers and self._pending_triggers[0] > j:
            for key in self._triggers[self._pending_triggers.pop(0)]:
                entry = self._entries.get(key)
                if entry is not None and entry.decision is Decision.SWAP and entry.storage is None \
                        and entry.buffer is not None:
                    self._copy_in(entry)
        if j < len(self.ops) and self.ops[j].region in self._layer_call:
            self._replay(self.ops[j].region)

    def _copy_in(self, entry: _Entry) -> None:
        """Issue the H2D copy (side stream); the device bytes count from now (see plan.py)."""
        self._internal = True
        try:
            if not entry.out_handle.done():  # backward caught up with its copy-out: wait for it
                entry.out_handle.wait()
                self._poll_copies()
            self._arrive(entry)
            start = self._timeline.now() if self._timeline else 0.0
            entry.in_handle = self.device.copy_in(entry.buffer.view(torch.uint8, (entry.nbytes,)))
            if self._timeline is not None:
                self._timeline.span("h2d", "copy_in", entry.key, start, self._timeline.now(), entry.nbytes)
            entry.storage = entry.in_handle.tensor
        finally:
            self._internal = False

    def _unpack(self, holder):
        if not isinstance(holder, _Holder):
            return holder
        if _in_backward() and not self._replaying:
            self._backward_reached()
        entry = holder.entry
        if holder.tensor is not None:
            return holder.tensor
        if entry.storage is None:
            if entry.decision is Decision.SWAP:  # its prefetch has not run: backward waits
                self._copy_in(entry)
                self._step.copy_waits += 1
            else:
                self._replay(entry.region)
        if entry.storage is None:
            raise RuntimeError(f"slackswap: replay of {entry.region!r} did not regenerate {entry.key!r}")
        if entry.in_handle is not None:  # compute waits on the copy's event (no host sync)
            self._internal = True
            try:
                entry.in_handle.wait_on_current()
            finally:
                self._internal = False
        return _rebuild(entry.storage, holder.meta)

    # ---- recompute ---------------------------------------------------------------------------
    def _replay(self, region: str) -> None:
        if region in self._replayed:
            return
        self._replayed.add(region)
        args, kwargs, cpu_rng, dev_rng = self._layer_call.pop(region)
        layer = self._layer_by_path[region]
        saved_cpu, saved_dev = torch.get_rng_state(), self._device_rng()
        torch.set_rng_state(cpu_rng)
        if dev_rng is not None:
            torch.cuda.set_rng_state(dev_rng)
        self._replaying = True
        try:
            # With grad on, as in forward, so every op takes the same kernel path (and so the same
            # op sequence); the replay's own graph is dropped with its outputs.
            with torch.enable_grad(), _Replay(self, region):
                layer(*args, **kwargs)
        except _StopReplay:
            pass
        finally:
            self._replaying = False
            for entry in self._pins.pop(region, ()):
                self._drop_holder(entry)
            torch.set_rng_state(saved_cpu)
            if saved_dev is not None:
                torch.cuda.set_rng_state(saved_dev)


class _StopReplay(Exception):
    pass


class _Replay(TorchDispatchMode):
    """Replays one layer's forward: only the plan's producer ops run (see module docstring)."""

    def __init__(self, ex: Executor, region: str):
        super().__init__()
        self.ex, self.region = ex, region
        self.rerun = ex._rerun[region]
        self.last = max(self.rerun)
        self.local = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func.overloadpacket.__name__ in _FREE_OPS:
            return func(*args, **kwargs)
        k = self.local
        self.local += 1
        ex, region = self.ex, self.region
        name = func.overloadpacket.__name__.strip("_")
        key = f"{region}:{k}:{name}"
        if k in self.rerun:
            rng = ex._rng_before.get((region, k))
            if rng is not None:
                torch.set_rng_state(rng)
            start = ex._timeline.now() if ex._timeline else 0.0
            out = func(*args, **kwargs)
            if ex._timeline is not None:
                ex._timeline.span("compute", "recompute", key, start, ex._timeline.now())
            ex._step.ops_recomputed += 1
            ex._step.recomputed_ops.append(key)
            for n, t in enumerate(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
                entry = ex._entries.get(key + (f".{n}" if n else ""))
                if entry is not None and entry.decision is Decision.RECOMPUTE and entry.storage is None:
                    entry.storage = _bytes_view(t)
                    ex._arrive(entry)
                    ex._step.recomputed_bytes += entry.nbytes
            if k == self.last:
                raise _StopReplay
            return out
        # Not re-run: hand back its saved output if it has one, else an unread placeholder.
        metas = ex._out_meta.get((region, k), [])
        outs = []
        for n, meta in enumerate(metas):
            entry = ex._entries.get(key + (f".{n}" if n else ""))
            if entry is not None and entry.key in ex._replay_deps:  # read by a re-run op: real
                outs.append(ex._unpack(_Holder(entry, None, meta)) if entry.storage is None
                            else _rebuild(entry.storage, meta))
            else:
                dtype, shape, stride, _, device, _ = meta
                outs.append(torch.empty_strided(shape, stride, dtype=dtype, device=device))
        # Kernels choose their path by requires_grad (SDPA does): give substitutes the original's.
        for t, meta in zip(outs, metas):
            if meta[5] and t.is_leaf and t.is_floating_point():
                t.requires_grad_(True)
        if func.overloadpacket.__name__.endswith("_") and args and isinstance(args[0], torch.Tensor):
            return args[0]  # an in-place op that is not re-run: its target, as it would return
        if len(outs) == 1:
            return outs[0]
        return tuple(outs)


def apply(model: nn.Module, plan: Plan, profile: StepProfile, **kw) -> Executor:
    """Context manager: every step run inside follows `plan`, made for `profile` of this model.
    ``with apply(model, plan, profile) as stats: ...``; ``stats.last_step`` has the counters."""
    if plan.profile_digest != profile.digest:
        raise PlanError(f"plan {plan.digest[:12]} was made for profile {plan.profile_digest[:12]}, not for "
                        f"{profile.name!r} ({profile.digest[:12]}); plan again for this profile")
    plan.check(profile)
    return Executor(model, plan, profile, **kw)

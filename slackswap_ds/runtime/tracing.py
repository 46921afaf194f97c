"""Trace one real step: every op's name, region and time, and how storages flow between ops.

`StepTracer` is a TorchDispatchMode that runs beside an `Executor` (composition: the executor
owns the saved-tensor hooks and the regions, and tells the tracer about saves and unpacks). While
a step runs under it, it

* numbers every *compute* op (views and aliases are free and skipped) within its region, giving
  the op keys of naming.py, e.g. ``transformer.h.3:7:gelu``, and times it (forward ops on their
  own, backward ops against the forward op whose autograd node runs them);
* follows storages (by their StorageImpl, so zero-size tensors stay apart): which op made each
  one, which ops wrote into it in place, which ops read it;
* learns who reads each saved tensor in backward: the executor reports every unpack, and the
  autograd node running at that moment names the forward op (exact, with no guessing about
  whether a pack came before or after its op ran). A saved tensor that backward never reads is
  attributed to the op that saved it at pack time.

It also watches the forward's Python calls (`sys.setprofile`) for compiled code that an eager
layer calls (a `torch.compile`d function): `compiled_in` are those layers' regions. A replay cannot
see inside such code (its fused kernels write into buffers whose allocation alone is dispatched), so
their saved tensors are never recomputed (profiler.build_profile).

Only the profiled step pays for this (a Python call per op); steps under a plan run without it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..logs import log
from ..step_profile import COMPILED
from .aten import RuntimeMode, by_value, is_compute, mutated_args, tensors_in
from .flat import flatten
from .naming import op_key
from .op_clock import EventClock, WallClock
from .packing import pack, packable_width, unpack
from .timeline import Timeline

__all__ = ["StepTracer", "TracedOp", "TracedSave", "TracedStorage"]


@dataclass
class TracedOp:
    index: int
    region: str
    local: int
    name: str
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    reads: list[int] = field(default_factory=list)  # storage ids
    writes: list[int] = field(default_factory=list)  # storage ids, one per tensor output
    inplace: bool = False
    overload: str = ""  # e.g. "Scalar" for div_.Scalar
    opaque: bool = False  # a compiled layer's call: timed whole, its inside unseen (compiled.py)

    @property
    def key(self) -> str:
        return op_key(self.region, self.local, self.name)


@dataclass
class TracedStorage:
    sid: int
    nbytes: int
    producer: int | None  # op that created it; None: made outside the traced ops (inputs, constants)
    writers: list[int] = field(default_factory=list)  # the producer, then any in-place writers
    by_value: bool = False  # a tiny result a replay record keeps by value (aten.by_value)
    partial: bool = False  # an in-place writer wrote only part of it


@dataclass
class TracedSave:
    """One saved storage, in the order the executor first saw it (its key's ordinal order)."""

    key: str
    region: str
    sid: int
    ops_before: int  # ops traced when it was first packed
    shape: tuple[int, ...] = ()  # the tensor's, as first packed
    users: set[int] = field(default_factory=set)  # ops whose backward unpacked it
    packed_bytes: int | None = None  # PACK: its bytes packed, if it is two-valued by construction
    pack_s: float = 0.0  # the packing and unpacking kernels' mean time, measured on it
    read: bool = False  # backward unpacked it (whether or not its reader was bound to an op)


_DYNAMO_WRAPPERS = os.path.join("_dynamo", "eval_frame.py")  # where compile_wrapper is defined


_FRESH = ("empty_like", "empty", "new_empty", "empty_strided")  # new storages, every element unset


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _reads_only_shapes(name: str) -> bool:
    """empty_like, zeros_like, new_empty, ...: their tensor inputs give only shape and dtype."""
    return name.endswith("_like") or name.startswith("new_")


class StepTracer(RuntimeMode):
    """Trace steps run by an executor (see the module docstring).

    `region` returns the label of the region running now (the executor's RegionTracker);
    `device_type` is the model's (where its activations live); `clock` times each op (op_clock.py:
    CUDA events on a GPU; tests pass a fake host clock so that plans made from the trace do not
    depend on measured times); its durations are final after `settle()`."""

    def __init__(self, region: Callable[[], str], clock: WallClock | EventClock | None = None,
                 device_type: str = "cpu"):
        super().__init__()
        self.region, self.device_type = region, device_type
        self.clock = clock if clock is not None else WallClock()
        self.timeline: Timeline | None = None  # the executor's while it records one (spans of every op)
        self.closed = False  # the traced step has ended (gradient accumulation runs more: not traced)
        self.forward_done = False  # ops run outside backward from now on are not the model's
        self.ops: list[TracedOp] = []
        self.storages: dict[int, TracedStorage] = {}
        self.saves: list[TracedSave] = []
        self._save_of: dict[str, TracedSave] = {}
        # storage cdata -> sid; the weak reference keeps a dead storage's address from going to a new
        # one (a tensor made outside the traced ops, `torch.tensor(3)` say, would inherit its sid)
        self._sid: dict[int, tuple[int, StorageWeakRef]] = {}
        self._counts: dict[str, int] = {}
        self._node_op: dict[int, int] = {}
        self._nodes: list = []  # keep nodes alive so that their ids stay unique
        self._last_outputs: list[torch.Tensor] = []
        self._opaque: tuple[TracedOp, float, object, set[int]] | None = None  # the compiled call running now
        self._opaque_bwd_start: object | None = None  # (a mark of the clock)
        self.compiled_in: set[str] = set()  # regions whose eager code called compiled code (_watch_calls)
        self._watching = False

    # ---- compiled code inside eager layers ----------------------------------------------------------
    def __enter__(self):
        if sys.getprofile() is None:
            sys.setprofile(self._watch_calls)
            self._watching = True
        else:  # another Python profiler keeps its hook (it cannot be chained to)
            log.warning("slackswap: a Python profiler (sys.setprofile) is active during the profiled step, so "
                        "SlackSwap cannot see whether eager layers call compiled code (their saves must not be "
                        "recomputed): profile without it if any layer calls a torch.compile'd function")
        return super().__enter__()

    def __exit__(self, *exc):
        if self._watching:
            sys.setprofile(None)
            self._watching = False
        return super().__exit__(*exc)

    def _watch_calls(self, frame, event: str, arg) -> None:
        """A call of a torch.compile'd function (Dynamo's compile_wrapper) in forward, outside a
        compiled layer's call (those are run again whole), marks the region it runs in."""
        if event != "call" or frame.f_code.co_name != "compile_wrapper":
            return
        if (frame.f_code.co_filename.endswith(_DYNAMO_WRAPPERS) and self._opaque is None and not self.closed
                and not self.forward_done and not _in_backward()):
            self.compiled_in.add(self.region())

    # ---- the executor's reports -------------------------------------------------------------------
    def step_closed(self) -> None:
        self.closed = True

    def saved(self, key: str, t: torch.Tensor) -> None:
        if self.closed:
            return
        # a storage first seen inside a compiled call was made by it: running the call again makes it again
        made_by = self._opaque[0].index if self._opaque is not None else None
        save = TracedSave(key, self.region(), self._sid_of(t, made_by), len(self.ops), tuple(t.shape))
        if self._two_valued(t, save.sid):
            save.packed_bytes, save.pack_s = self._time_packing(t)
        self.saves.append(save)
        self._save_of[key] = save

    def unpacked(self, key: str) -> None:
        if self.closed:
            return
        save = self._save_of.get(key)
        if save is not None:
            save.read = True
        node = torch._C._current_autograd_node()
        if save is not None and node is not None:
            self._bind_last_node()
            op = self._node_op.get(id(node))
            if op is not None:
                save.users.add(op)

    # ---- PACK (packing.py) ----------------------------------------------------------------------------
    def _two_valued(self, t: torch.Tensor, sid: int) -> bool:
        """Whether the saved storage holds at most two bit patterns by the ops that made it: a bool
        tensor, or dropout's noise on the CPU (a fresh tensor filled by `bernoulli_`, then scaled
        in place by scalars: every element 0 or 1/(1-p))."""
        if not packable_width(t.dtype) or t.is_meta:
            return False
        if t.dtype is torch.bool:
            return True
        st = self.storages[sid]
        ops = [self.ops[w] for w in st.writers]
        return (not st.partial and len(ops) >= 2 and ops[0].name in _FRESH and ops[1].name == "bernoulli"
                and ops[1].inplace and all(o.inplace and o.name in ("mul", "div") and o.overload == "Scalar"
                                           for o in ops[2:]))

    def _time_packing(self, t: torch.Tensor) -> tuple[int, float]:
        """(packed bytes, mean seconds of the packing and unpacking kernels) on the saved storage."""
        st = t.untyped_storage()
        unpack(pack(st, t.dtype))  # (once untimed: a first call's costs are not the kernels')
        start = self.clock.mark()
        unpack(packed := pack(st, t.dtype))
        return packed.buffer.numel(), self.clock.elapsed(start) / 2

    # ---- compiled layers (compiled.py): one opaque op per call ----------------------------------------
    def opaque_begin(self, args, kwargs) -> None:
        """A compiled layer's call starts (its region entered; dispatch modes about to be
        suspended): one op of its own, reading the call's tensor arguments, timed until
        `opaque_end`. The storages first seen in its saves are made inside, unseen: this op makes
        them (`saved`), so running the call again makes them again."""
        if self.closed or self.forward_done or not torch.is_grad_enabled() or _in_backward():
            return  # (not the step's: an evaluation, a call in backward)
        self._bind_last_node()
        region = self.region()
        local = self._counts.get(region, 0)
        self._counts[region] = local + 1
        op = TracedOp(len(self.ops), region, local, COMPILED, opaque=True)
        inputs = [t for t in tensors_in(args, kwargs) if not t.is_meta]
        op.reads = [self._sid_of(t) for t in inputs]
        self.ops.append(op)
        before = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}  # where its own autograd nodes end
        self._opaque = (op, self.timeline.now() if self.timeline is not None else 0.0, self.clock.mark(), before)

    def opaque_end(self, output) -> None:
        """The compiled call returned `output`: its time, the storages it made, and its backward:
        every autograd node the call made is this op's (a graph break makes several: compiled
        graphs and the eager code between them), so that a save unpacked by any of them is read by
        this op, and its backward is timed by hooks on them (the compiled backward's kernels are as
        unseen as its forward's)."""
        opaque, self._opaque = self._opaque, None
        if opaque is None:
            return
        op, span, start, before = opaque
        self.clock.add(op, "fwd_s", start)
        if self.timeline is not None:
            self.timeline.span("compute", "fwd", op.key, span, self.timeline.now())
        nodes = {}
        for t in flatten(output)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            st = t.untyped_storage()
            sid = len(self.storages)
            self.storages[sid] = TracedStorage(sid, st.nbytes(), op.index, [op.index])
            self._sid[st._cdata] = (sid, StorageWeakRef(st))
            op.writes.append(sid)
            if t.grad_fn is not None:
                nodes[id(t.grad_fn)] = t.grad_fn
        for node in self._made_inside(list(nodes.values()), before):
            self._node_op[id(node)] = op.index
            self._nodes.append(node)
            node.register_prehook(lambda grads, op=op: self._opaque_backward(op, True))
            node.register_hook(lambda grads_in, grads_out, op=op: self._opaque_backward(op, False))

    def _made_inside(self, roots: list, before: set[int]) -> list:
        """The autograd nodes reachable from `roots` back to those that existed before the call (its
        inputs' nodes `before`, nodes of earlier ops, leaves' AccumulateGrad)."""
        found, seen, stack = [], set(), list(roots)
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or id(node) in before or id(node) in self._node_op:
                continue
            seen.add(id(node))
            if type(node).__name__ == "AccumulateGrad":
                continue
            found.append(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
        return found

    def _opaque_backward(self, op: TracedOp, starts: bool) -> None:
        if starts:
            self._opaque_bwd_start = self.clock.mark()
        elif self._opaque_bwd_start is not None:
            self.clock.add(op, "bwd_s", self._opaque_bwd_start)
            self._opaque_bwd_start = None

    # ---- storages ---------------------------------------------------------------------------------
    def _sid_of(self, t: torch.Tensor, made_by: int | None = None) -> int:
        st = t.untyped_storage()
        known = self._sid.get(st._cdata)
        if known is not None:
            return known[0]
        sid = len(self.storages)
        self.storages[sid] = TracedStorage(sid, st.nbytes(), made_by, [] if made_by is None else [made_by])
        self._sid[st._cdata] = (sid, StorageWeakRef(st))
        return sid

    def _bind_last_node(self) -> None:
        """Outputs of the last op now carry their autograd node: map node -> forward op."""
        for out in self._last_outputs:
            node = out.grad_fn
            if node is not None and id(node) not in self._node_op:
                self._node_op[id(node)] = len(self.ops) - 1
                self._nodes.append(node)
        self._last_outputs = []

    # ---- dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.closed:
            return func(*args, **kwargs)
        if _in_backward():
            self._bind_last_node()
            tl = self.timeline
            span = tl.now() if tl is not None else 0.0
            start = self.clock.mark()
            out = func(*args, **kwargs)
            end = self.clock.mark()
            node = torch._C._current_autograd_node()
            op = self._node_op.get(id(node)) if node is not None else None
            if op is not None and not self.ops[op].opaque:  # (an opaque op's backward is timed whole)
                self.clock.add(self.ops[op], "bwd_s", start, end)
                if tl is not None:
                    tl.span("compute", "bwd", self.ops[op].key, span, tl.now())
            return out
        if not is_compute(func) or self.forward_done:
            return func(*args, **kwargs)
        self._bind_last_node()
        region = self.region()
        local = self._counts.get(region, 0)
        self._counts[region] = local + 1
        op = TracedOp(len(self.ops), region, local, func.overloadpacket.__name__.strip("_"),
                      inplace=bool(mutated_args(func)), overload=func._overloadname)
        inputs = [t for t in tensors_in(args, kwargs) if not t.is_meta]
        if not _reads_only_shapes(op.name):
            op.reads = [self._sid_of(t) for t in inputs]
        tl = self.timeline
        span = tl.now() if tl is not None else 0.0
        start = self.clock.mark()
        out = func(*args, **kwargs)
        self.clock.add(op, "fwd_s", start)
        if tl is not None:
            tl.span("compute", "fwd", op.key, span, tl.now())
        in_storages = {t.untyped_storage()._cdata for t in inputs}
        for t in flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            st = t.untyped_storage()
            if st._cdata in in_storages:  # in place (or out=): the storage keeps its id, this op rewrote it
                sid = self._sid_of(t)
                self.storages[sid].writers.append(op.index)
                if t.numel() * t.element_size() != st.nbytes():
                    self.storages[sid].partial = True
            else:
                sid = len(self.storages)
                self.storages[sid] = TracedStorage(sid, st.nbytes(), op.index, [op.index],
                                                   by_value(t, self.device_type))
                self._sid[st._cdata] = (sid, StorageWeakRef(st))
            op.writes.append(sid)
            self._last_outputs.append(t)
        self.ops.append(op)
        return out

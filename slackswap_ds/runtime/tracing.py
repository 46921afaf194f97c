"""Name what a real training step does: regions, compute ops, and the storages they read and write.

`StepTracer` is a TorchDispatchMode plus saved-tensor hooks. While a step runs under it, it

* numbers every forward *compute* op (view ops are free and skipped) within its region, giving the
  stable keys of DESIGN.md section 4: ``<region>:<index>:<op>``, e.g. ``transformer.h.3:7:gelu``;
* follows storages: which op produced each one (in-place ops take over), which ops read it;
* records every tensor saved for backward (parameters and buffers excluded), attributing it to
  the op that saved it, counting a storage once however many views of it are saved;
* times each forward op, and each backward op against the forward op whose autograd node ran it.

Regions are the repeated blocks of the model (the children of its longest ``nn.ModuleList``, as
in every Hugging Face transformer); ops before the first block are region ``pre``, after the last
``post``, and between blocks ``between.<i>``.

Who saved what: the dispatch mode sits below autograd, so an op's inputs are packed before the
mode sees the op and its outputs right after; the order of packs cannot tell the two apart. So the
pack hook only notes *that* a storage was saved; when forward ends, every autograd node of a traced
op is asked for its saved tensors (``node._saved_*``), which names the saving op exactly. Saves
that no node reports (custom autograd Functions) fall back to the op that ran next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: the children of its longest ModuleList (ties: the first)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [(f"{prefix}{i}", m) for i, m in enumerate(best[1])]


def _tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one, also when ZeRO-3 has swapped in a gathered storage that the
    address check cannot know (`ds_id` marks DeepSpeed's partitioned parameters)."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or hasattr(base, "ds_id")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class TracedOp:
    index: int
    region: str
    local: int
    name: str
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    reads: list[int] = field(default_factory=list)  # storage ids
    writes: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.region}:{self.local}:{self.name}"


@dataclass
class TracedStorage:
    sid: int
    nbytes: int
    producer: int | None  # op that created it; None: made outside the traced forward (inputs, constants)
    writers: list[int] = field(default_factory=list)  # the producer, then any in-place writers
    saved_by: list[int] = field(default_factory=list)  # op indices, in the order of their saves


class StepTracer(TorchDispatchMode):
    """Trace one step; see the module docstring. Use as a context manager around the step."""

    def __init__(self, model: nn.Module, timer=time.perf_counter):
        super().__init__()
        self.model = model
        self.timer = timer
        self.layers = find_layers(model)
        self.layer_paths = {path for path, _ in self.layers}
        self.ops: list[TracedOp] = []
        self.storages: dict[int, TracedStorage] = {}
        self._ptr_to_sid: dict[int, int] = {}
        self._region = "pre"
        self._layers_done = 0
        self._region_counts: dict[str, int] = {}
        self._pending_saves: list[int] = []
        self._fallback_saver: dict[int, int] = {}
        self._last_outputs: list[torch.Tensor] = []
        self._node_to_op: dict[int, int] = {}
        self._nodes: list[object] = []  # keep nodes alive so their ids stay unique
        self._param_ptrs: set[int] = set()
        self._backward_started = False
        self._collected = False
        self._handles: list = []
        self._pack_order: dict[int, int] = {}  # storage id -> order of its first pack
        self._started = False  # forward ops count from the model's own forward on
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ---- context ---------------------------------------------------------------------------
    def __enter__(self):
        self._param_ptrs = {_storage_ptr(p) for p in self.model.parameters()}
        self._param_ptrs |= {_storage_ptr(b) for b in self.model.buffers()}
        self._handles.append(self.model.register_forward_pre_hook(self._enter_model))
        for path, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(path)))
            self._handles.append(layer.register_forward_hook(self._leave_layer))
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._finish_forward()

    def _finish_forward(self) -> None:
        if not self._collected:
            self._collected = True
            self._resolve_pending(None)
            self._bind_last_node()
            self._collect_saves()

    def _enter_model(self, module, args):
        if not _in_backward():
            self._started = True

    def _enter_layer(self, path: str):
        def hook(module, args):
            if not _in_backward() and not self._backward_started:
                self._region = path
        return hook

    def _leave_layer(self, module, args, output):
        if not _in_backward() and not self._backward_started:
            self._layers_done += 1
            self._region = "post" if self._layers_done >= len(self.layers) else f"between.{self._layers_done}"

    # ---- storages ----------------------------------------------------------------------------
    def _sid_of(self, t: torch.Tensor) -> int:
        ptr = _storage_ptr(t)
        sid = self._ptr_to_sid.get(ptr)
        if sid is None:
            sid = len(self.storages)
            self.storages[sid] = TracedStorage(sid, t.untyped_storage().nbytes(), None)
            self._ptr_to_sid[ptr] = sid
        return sid

    def _new_storage(self, t: torch.Tensor, producer: int) -> int:
        sid = len(self.storages)
        self.storages[sid] = TracedStorage(sid, t.untyped_storage().nbytes(), producer, [producer])
        self._ptr_to_sid[_storage_ptr(t)] = sid
        return sid

    # ---- saved tensors -----------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        self._note_save(t)
        return t

    def _unpack(self, packed):
        return packed

    def _note_save(self, t: torch.Tensor) -> int | None:
        """Record a save of `t` by this step's forward; its storage id, or None if not an activation."""
        if _in_backward() or self._backward_started or not self._started or t.device.type == "meta":
            return None
        ptr = _storage_ptr(t)
        if ptr in self._param_ptrs or _is_parameter(t):
            return None
        sid = self._sid_of(t)
        self._pending_saves.append(sid)
        self._pack_order.setdefault(sid, len(self._pack_order))
        return sid

    def _resolve_pending(self, next_op: TracedOp | None) -> None:
        """Remember the op that ran after each pack, for saves no autograd node reports."""
        for sid in self._pending_saves:
            saver = next_op.index if next_op is not None else (len(self.ops) - 1)
            self._fallback_saver.setdefault(sid, saver)
        self._pending_saves.clear()

    def _collect_saves(self) -> None:
        """Attribute every saved storage to the ops whose autograd nodes hold it (see docstring)."""
        found: set[int] = set()
        for node in self._nodes:
            op = self._node_to_op[id(node)]
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # already freed
                    continue
                for t in _tensors(value):
                    ptr = _storage_ptr(t)
                    if ptr in self._param_ptrs or ptr not in self._ptr_to_sid:
                        continue
                    sid = self._ptr_to_sid[ptr]
                    if sid not in self._fallback_saver:
                        continue  # not packed by this step's forward (e.g. a constant)
                    st = self.storages[sid]
                    if op not in st.saved_by:
                        st.saved_by.append(op)
                    found.add(sid)
        for sid, op in self._fallback_saver.items():
            if sid not in found:
                self.storages[sid].saved_by.append(op)
        for st in self.storages.values():
            st.saved_by.sort()

    def _bind_last_node(self) -> None:
        """Outputs of the previous op now carry their autograd node: map node -> forward op."""
        for out in self._last_outputs:
            node = out.grad_fn
            if node is not None and id(node) not in self._node_to_op:
                self._node_to_op[id(node)] = self.ops[-1].index
                self._nodes.append(node)
        self._last_outputs = []

    # ---- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _in_backward():
            if not self._backward_started:
                self._backward_started = True
                self._finish_forward()
            start = self.timer()
            out = func(*args, **kwargs)
            node = torch._C._current_autograd_node()
            op = self._node_to_op.get(id(node)) if node is not None else None
            if op is not None:
                self.ops[op].bwd_s += self.timer() - start
            return out
        if not self._started or self._backward_started or func.is_view or func.overloadpacket.__name__ in _FREE_OPS:
            return func(*args, **kwargs)
        self._bind_last_node()
        region = self._region
        local = self._region_counts.get(region, 0)
        self._region_counts[region] = local + 1
        op = TracedOp(len(self.ops), region, local, func.overloadpacket.__name__.strip("_"))
        inputs = _tensors((args, kwargs))
        if not _reads_only_shapes(op.name):
            op.reads = [self._sid_of(t) for t in inputs if t.device.type != "meta"]
        self._resolve_pending(op)
        # Under another saved-tensor hook (a checkpoint inside the model) this op's saves are not
        # ours: never ask its autograd node for them (that would unpack through the other hook).
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        foreign = top is None or getattr(top[0], "__func__", top[0]) is not getattr(self._pack, "__func__", None)
        start = self.timer()
        out = func(*args, **kwargs)
        op.fwd_s = self.timer() - start
        in_ptrs = {_storage_ptr(t) for t in inputs}
        for t in _tensors(out):
            if t.device.type == "meta":
                continue
            ptr = _storage_ptr(t)
            if ptr in in_ptrs:  # in-place (or out=): the storage keeps its id, this op rewrote it
                sid = self._ptr_to_sid[ptr]
                self.storages[sid].writers.append(op.index)
            else:
                sid = self._new_storage(t, op.index)
            op.writes.append(sid)
            if not foreign:
                self._last_outputs.append(t)
        self.ops.append(op)
        return out


def _reads_only_shapes(name: str) -> bool:
    """empty_like, zeros_like, new_empty, ...: their tensor inputs give only shape and dtype."""
    return name.endswith("_like") or name.startswith("new_")


# Ops that move no data or only describe tensors: not compute ops.
_FREE_OPS = {"detach", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "is_same_size",
             "_unsafe_view", "_reshape_alias"}  # the last two alias their input: views in all but name

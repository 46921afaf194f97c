"""Recompute by replay: re-run a layer call's forward in backward, exactly, and check it as it goes.

Forward. A layer call that holds RECOMPUTE tensors runs under a `Recorder` (a dispatch mode active
only inside that call). It numbers the call's compute ops (views and aliases are free and not
numbered, as in the tracer), and for each op records what a replay needs and nothing it would have
to keep alive: the aten function (to check the replay runs the same sequence), the structure of its
outputs with their non-tensor values (ints, None, a flag), each tensor output's metadata, and, for a
random op, the state of the generator it draws from (an explicit ``generator=`` argument, or the
default generator of its device: CPU, CUDA, ...). The call's arguments are held like a checkpoint
holds them, except that an argument the step saved anyway is held through its saved entry, so that
a swapped layer input does not stay on the device.

Backward. `ReplayMode` re-runs the call (`module(*args, **kwargs)`, so module hooks such as
ZeRO-3's parameter gathering run again) with the autocast state of forward. Op k of the replay
must be op k of forward (else `ReplayError`). Then, in the spirit of torch's selective
checkpointing:

* an op the Schedule re-runs, an in-place op, or an op whose outputs the step did not save runs
  for real, with its generator set to the state it had in forward (so dropout draws the same mask
  even when an earlier random op was skipped); its outputs must have forward's shapes and dtypes;
* any other op is skipped: it returns its forward outputs, read from the saved entries (kept,
  swapped back in, or regenerated earlier in this replay), and its recorded non-tensor values.
  A replay never fabricates a tensor: everything Python sees is a real value.
* a real run never changes state outside the replay: an op that writes into a tensor the replay
  did not create (a BatchNorm running mean, a buffer, an argument) gets that tensor's old values
  back after it ran.

When the op that finally writes a RECOMPUTE tensor has run, the tensor is handed to the executor;
after the last one the replay stops (`_StopReplay`, a BaseException so that a model's
``except Exception`` cannot swallow it). The replay's own saved tensors are dropped at pack time:
its autograd graph is never used, and keeping a node's own output alive through it would leak.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import SlackSwapError

_tls = threading.local()


def replaying() -> bool:
    """True on a thread that is running a replay (its region hooks and saves are not the step's)."""
    return getattr(_tls, "replaying", False)


class ReplayError(SlackSwapError, RuntimeError):
    """A replay could not regenerate what forward saved (different ops, shapes or values)."""


class _StopReplay(BaseException):
    pass


# ---- what an op is ---------------------------------------------------------------------------
# Ops that move no data or only describe tensors: not compute ops (the tracer skips them too).
FREE_OPS = frozenset({"detach", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "is_same_size",
                      "_unsafe_view", "_reshape_alias"})  # the last two alias their input: views in all but name


_COMPUTE: dict[Any, bool] = {}
_RANDOM: dict[Any, bool] = {}


def is_compute(func) -> bool:
    out = _COMPUTE.get(func)
    if out is None:
        out = _COMPUTE[func] = not (func.is_view or func.overloadpacket.__name__ in FREE_OPS)
    return out


_MUTATED: dict[Any, tuple[int, ...]] = {}
_WRITES: dict[Any, tuple[int, ...]] = {}
# Ops that write into arguments their schema does not mark (``Tensor?`` running statistics of
# batch norm, updated in place by the kernel): argument positions, by op name.
_UNMARKED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


def mutated_args(func) -> tuple[int, ...]:
    """Positions (in the schema) of the arguments `func` marks as written (``Tensor(a!)``): an
    in-place or out= op, whose result is its argument."""
    out = _MUTATED.get(func)
    if out is None:
        out = tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        _MUTATED[func] = out
    return out


def written_args(func) -> tuple[int, ...]:
    """Every argument `func` writes into: the marked ones and the unmarked ones we know of."""
    out = _WRITES.get(func)
    if out is None:
        out = tuple(sorted(set(mutated_args(func)) | set(_UNMARKED_WRITES.get(func.overloadpacket.__name__, ()))))
        _WRITES[func] = out
    return out


def _arg(func, i: int, args: tuple, kwargs: dict):
    if i < len(args):
        return args[i]
    return kwargs.get(func._schema.arguments[i].name)


# ---- an aten op's values, flat --------------------------------------------------------------
# An aten op takes and returns a tensor, a scalar, None, or a list/tuple of those (one level deep,
# as in ``Tensor[]`` arguments). These two helpers flatten and rebuild that without torch's
# general pytree, whose tree_flatten leaves a reference cycle behind on every call.
def flatten(value) -> tuple[list, object]:
    """(leaves, spec) of an op's result (or argument)."""
    if isinstance(value, (tuple, list)):
        leaves, spec = [], []
        for v in value:
            if isinstance(v, (tuple, list)):
                spec.append((type(v), len(v)))
                leaves.extend(v)
            else:
                spec.append(None)
                leaves.append(v)
        return leaves, (type(value), tuple(spec))
    return [value], None


def unflatten(leaves: list, spec) -> object:
    if spec is None:
        return leaves[0]
    kind, parts = spec
    out, i = [], 0
    for part in parts:
        if part is None:
            out.append(leaves[i])
            i += 1
        else:
            sub_kind, n = part
            out.append(sub_kind(leaves[i:i + n]))
            i += n
    return kind(out)


def tensors_in(args: tuple, kwargs: dict):
    """The tensors among an op's arguments (lists of tensors included)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    yield w


def is_random(func) -> bool:
    out = _RANDOM.get(func)
    if out is None:
        out = _RANDOM[func] = torch.Tag.nondeterministic_seeded in func.tags
    return out


def generator_of(func, args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a random op draws from: its ``generator=`` argument, else its device's default."""
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    device = kwargs.get("device")
    if device is None:
        device = next((t.device for t in tensors_in(args, kwargs)), None)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if not gens:
        return None
    return gens[device.index if device.index is not None else module.current_device()]


def meta_of(t: torch.Tensor) -> tuple:
    """(dtype, shape, stride, storage offset): how to view a storage as `t` again."""
    return (t.dtype, t.size(), t.stride(), t.storage_offset())


def rebuild(storage_owner: torch.Tensor, meta: tuple) -> torch.Tensor:
    """A tensor with `meta` (dtype, shape, stride, offset) over the storage of `storage_owner`."""
    dtype, shape, stride, offset = meta
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        return torch.empty(0, dtype=dtype, device=storage_owner.device).set_(
            storage_owner.untyped_storage(), offset, shape, stride)


# ---- forward: the record of one layer call ----------------------------------------------------
class OpRecord:
    """One compute op of a recorded call: what a replay returns or checks in its place."""

    __slots__ = ("func", "spec", "leaves", "at", "metas", "kept", "rng", "inplace")

    def __init__(self, func, spec, leaves: list, at: tuple, metas: list, kept: dict, rng: tuple | None,
                 inplace: bool):
        self.func = func
        self.spec = spec  # structure of the result (see flatten)
        self.leaves = leaves  # the result's values, flat; tensors replaced by None
        self.at = at  # positions of the tensors in `leaves`, in order (tensor n is at leaves[at[n]])
        self.metas = metas  # per tensor result, in order: meta_of
        self.kept = kept  # tensor n -> its value, for tiny results kept by value (seeds, empty tensors)
        self.rng = rng  # (generator, state) of a random op
        self.inplace = inplace


def by_value(t: torch.Tensor, device_type: str) -> bool:
    """A result a record keeps by value: empty, or a few numbers on another device than the model's
    (fused attention's philox seed and offset on the CPU): no saved entry will ever hold it."""
    return t.numel() == 0 or (t.numel() <= 16 and t.device.type != device_type)


@dataclass(eq=False)
class CallRecord:
    """One call of a layer whose step holds RECOMPUTE tensors: all a replay needs."""

    label: str
    module: Any
    args: Any = None  # (args, kwargs) with saved entries swapped in for their tensors
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # held tensors, version at the call
    autocast: list[tuple[str, bool, Any]] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    available: dict[tuple[int, int], Any] = field(default_factory=dict)  # (op, output) -> entry saved in this call
    targets: dict[tuple[int, int], Any] = field(default_factory=dict)  # (op, output) -> RECOMPUTE entry
    pins: list = field(default_factory=list)  # entries held for the replay (arguments)
    live: int = 0  # RECOMPUTE entries of the call still held by autograd
    done: bool = False


def autocast_state(device_type: str) -> list[tuple[str, bool, Any]]:
    out = []
    for kind in dict.fromkeys(("cpu", device_type)):
        try:
            out.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))
        except (RuntimeError, TypeError):  # an autocast-less device type
            continue
    return out


class Recorder(TorchDispatchMode):
    """Active inside one recorded layer call in forward (see the module docstring)."""

    def __init__(self, call: CallRecord, on_output: Callable[[CallRecord, int, int, torch.Tensor], None],
                 device_type: str):
        super().__init__()
        self.call, self.on_output, self.device_type = call, on_output, device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_compute(func):
            return func(*args, **kwargs)
        call = self.call
        k = len(call.ops)
        rng = None
        if is_random(func):
            gen = generator_of(func, args, kwargs)
            rng = (gen, gen.get_state()) if gen is not None else None
        out = func(*args, **kwargs)
        leaves, spec = flatten(out)
        at, metas, kept = [], [], {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                n = len(at)
                at.append(i)
                metas.append(meta_of(leaf))
                self.on_output(call, k, n, leaf)
                if by_value(leaf, self.device_type):
                    with torch._C._DisableTorchDispatch(), torch.no_grad():
                        kept[n] = leaf.clone()
                leaves[i] = None
        call.ops.append(OpRecord(func, spec, leaves, tuple(at), metas, kept, rng, bool(mutated_args(func))))
        return out


# ---- backward: the replay ----------------------------------------------------------------------
class ReplayMode(TorchDispatchMode):
    """Re-runs a recorded call in backward (see the module docstring).

    `ex` supplies: ``materialize(entry, meta) -> tensor | None`` (a saved entry as a device
    tensor; None if the entry is gone), ``captured(entry, tensor)`` (a regenerated RECOMPUTE
    tensor), ``ran(call, k)`` (an op ran for real). `rerun` are the op indices the Schedule
    re-runs."""

    def __init__(self, ex, call: CallRecord, rerun: frozenset[int]):
        super().__init__()
        self.ex, self.call, self.rerun = ex, call, rerun
        self.k = 0
        self.local: set[int] = set()  # storages (cdata) made by ops run in this replay
        self.remaining = sum(1 for e in call.targets.values() if e.storage is None)
        self.generators: dict[torch.Generator, torch.Tensor] = {}  # state before the replay, restored after

    def restore_generators(self) -> None:
        for gen, state in self.generators.items():
            gen.set_state(state)
        self.generators.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_compute(func):
            return func(*args, **kwargs)
        call, k = self.call, self.k
        self.k += 1
        if k >= len(call.ops) or call.ops[k].func is not func:
            was = call.ops[k].func if k < len(call.ops) else "the end of the layer call"
            raise ReplayError(f"replay of {call.label!r} diverged from forward at op {k}: forward ran {was}, "
                              f"the replay runs {func}")
        rec = call.ops[k]
        if k not in self.rerun and not rec.inplace:
            outs = self._saved_outputs(k, rec)
            if outs is not None:
                return unflatten(outs, rec.spec)
        return self._run(func, args, kwargs, k, rec)

    def _saved_outputs(self, k: int, rec: OpRecord) -> list | None:
        """Forward's result of op k from what the step saved, or None if some tensor of it is not at hand."""
        leaves = list(rec.leaves)
        for n, i in enumerate(rec.at):
            t = rec.kept.get(n)
            if t is None:
                entry = self.call.available.get((k, n))
                t = None if entry is None else self.ex.materialize(entry, rec.metas[n])
                if t is None:
                    return None
            leaves[i] = t
        return leaves

    def _run(self, func, args, kwargs, k: int, rec: OpRecord):
        if rec.rng is not None:
            gen, state = rec.rng
            if gen not in self.generators:
                self.generators[gen] = gen.get_state()
            gen.set_state(state)
        undo = []
        for i in written_args(func):
            for target in flatten(_arg(func, i, args, kwargs))[0]:
                if isinstance(target, torch.Tensor) and target.untyped_storage()._cdata not in self.local:
                    with torch._C._DisableTorchDispatch(), torch.no_grad():
                        undo.append((target, target.clone()))
        out = func(*args, **kwargs)
        if undo:
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                for target, old in undo:
                    target.copy_(old)
        self.ex.ran(self.call, k)
        n = 0
        for leaf in flatten(out)[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            want = rec.metas[n] if n < len(rec.metas) else None
            if want is None or leaf.dtype != want[0] or leaf.size() != want[1]:
                raise ReplayError(f"replay of {self.call.label!r}: op {k} ({func}) output {n} is "
                                  f"{leaf.dtype} {tuple(leaf.shape)}; forward made "
                                  f"{'nothing there' if want is None else f'{want[0]} {want[1]}'}")
            if not undo:
                self.local.add(leaf.untyped_storage()._cdata)
            entry = self.call.targets.get((k, n))
            if entry is not None and entry.storage is None:
                self.ex.captured(entry, leaf)
                self.remaining -= 1
            n += 1
        if self.remaining <= 0:
            raise _StopReplay
        return out


def run_replay(ex, call: CallRecord, rerun: frozenset[int], args: tuple, kwargs: dict, enter_extra) -> None:
    """Run the replay of `call` (see the module docstring); `enter_extra` is a context manager
    factory entered around it (checkpoint takeover). Raises ReplayError if it cannot finish."""
    import contextlib

    mode = ReplayMode(ex, call, rerun)
    if mode.remaining <= 0:
        return
    _tls.replaying = True
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for kind, enabled, dtype in call.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(enter_extra())
            stack.enter_context(mode)
            call.module(*args, **kwargs)
        raise ReplayError(f"replay of {call.label!r} ended after {mode.k} ops without regenerating "
                          f"{mode.remaining} saved tensor(s) that forward made there")
    except _StopReplay:
        pass
    finally:
        _tls.replaying = False
        mode.restore_generators()

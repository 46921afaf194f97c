"""Recompute by replay: re-run a layer call's forward in backward, exactly, and check it as it goes.

Forward. A layer call that holds RECOMPUTE tensors runs under a `Recorder` (a dispatch mode active
only inside that call). It numbers the call's compute ops (views and aliases are free and not
numbered, as in the tracer), and for each op records what a replay needs and nothing it would have
to keep alive: the aten function (to check the replay runs the same sequence), the structure of its
outputs with their non-tensor values (ints, None, a flag), each tensor output's metadata, and, for a
random op, the state of the generator it draws from (an explicit ``generator=`` argument, or the
default generator of its device: CPU, CUDA, ...): an `OpRecord` in the call's `CallRecord`
(records.py; what an op is: aten.py). The call's arguments are held like a checkpoint holds them,
except that an argument the step saved anyway is held through its saved entry, so that a swapped
layer input does not stay on the device (calls.py).

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

The replay reads saved entries and hands back what it regenerates through a `ReplaySource` (the
executor's layer calls, calls.py): when the op that finally writes a RECOMPUTE tensor has run, the
tensor is handed to it; after the last one the replay stops (`_StopReplay`, a BaseException so
that a model's ``except Exception`` cannot swallow it). The replay's own saved tensors are dropped
at pack time: its autograd graph is never used, and keeping a node's own output alive through it
would leak.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from typing import Callable, ContextManager, Protocol

import torch
from torch._ops import OpOverload

from ..errors import SlackSwapError
from .aten import (RuntimeMode, arg_at, by_value, generator_of, is_compute, is_random, meta_of, mutated_args,
                   no_dispatch, written_args)
from .compiled import dynamo_never_compiles
from .flat import flatten, unflatten
from .records import CallRecord, Entry, OpRecord

__all__ = ["Recorder", "ReplayError", "ReplayMode", "ReplaySource", "autocast_state", "host_rng_states", "replaying",
           "rng_states", "run_replay", "run_whole_replay"]

class _Replaying(threading.local):
    replaying = False  # (a class default: asked at every save, and a missing attribute is slow to ask for)


_tls = _Replaying()


def replaying() -> bool:
    """True on a thread that is running a replay (its region hooks and saves are not the step's)."""
    return _tls.replaying


class ReplayError(SlackSwapError, RuntimeError):
    """A replay could not regenerate what forward saved (different ops, shapes or values)."""


class _StopReplay(BaseException):
    pass


# ---- forward: the record of one layer call ----------------------------------------------------
def autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    out = []
    for kind in dict.fromkeys(("cpu", device_type)):
        try:
            out.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))
        except (RuntimeError, TypeError):  # an autocast-less device type
            continue
    return out


class Recorder(RuntimeMode):
    """Active inside one recorded layer call in forward (see the module docstring). `on_output`
    hears of every tensor output: (call, op, output index, tensor). It also finds whether the call
    could be replayed whole (`CallRecord.replayable_whole`, `run_whole_replay`)."""

    def __init__(self, call: CallRecord, on_output: Callable[[CallRecord, int, int, torch.Tensor], None],
                 device_type: str):
        super().__init__()
        self.call, self.on_output, self.device_type = call, on_output, device_type
        self.local: set[int] = set()  # storages (cdata) made by the call's ops

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
            if gen is None or gen not in _restored_generators(self.device_type):
                call.replayable_whole = False
        if call.replayable_whole and written_args(func) and self._writes_outside(func, args, kwargs):
            call.replayable_whole = False
        out = func(*args, **kwargs)
        leaves, spec = flatten(out)
        at, metas, kept = [], [], {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                n = len(at)
                at.append(i)
                metas.append(meta_of(leaf))
                self.local.add(leaf.untyped_storage()._cdata)
                self.on_output(call, k, n, leaf)
                if by_value(leaf, self.device_type):
                    with no_dispatch(), torch.no_grad():
                        kept[n] = leaf.clone()
                leaves[i] = None
        call.ops.append(OpRecord(func, spec, leaves, tuple(at), metas, kept, rng, bool(mutated_args(func))))
        return out

    def _writes_outside(self, func: OpOverload, args: tuple, kwargs: dict) -> bool:
        """`func` writes into a tensor the call did not make (an argument, a buffer, running statistics)."""
        return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.local
                   for i in written_args(func) for t in flatten(arg_at(func, i, args, kwargs))[0])


def _restored_generators(device_type: str) -> tuple[torch.Generator, ...]:
    """The generators a whole replay starts again from their states at the call (`rng_states`)."""
    if device_type == "cuda":
        return torch.default_generator, torch.cuda.default_generators[torch.cuda.current_device()]
    return (torch.default_generator,)


# ---- backward: the replay ----------------------------------------------------------------------
class ReplaySource(Protocol):
    """What a replay reads from and hands back to (the executor's layer calls, calls.py)."""

    def materialize(self, entry: Entry, meta: tuple) -> torch.Tensor | None:
        """A saved entry as a device tensor viewed as `meta`; None if the entry is gone."""

    def captured(self, entry: Entry, tensor: torch.Tensor) -> None:
        """The replay regenerated RECOMPUTE `entry` (`tensor`: the op's output over its storage)."""

    def ran(self, call: CallRecord, k: int) -> None:
        """Op k of `call` ran for real (not handed back from saved entries)."""


class ReplayMode(RuntimeMode):
    """Re-runs a recorded call in backward (see the module docstring).

    `source` hands it the saved entries and takes what it regenerates; `rerun` are the op indices
    the Schedule re-runs."""

    def __init__(self, source: ReplaySource, call: CallRecord, rerun: frozenset[int]):
        super().__init__()
        self.source, self.call, self.rerun = source, call, rerun
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
                t = None if entry is None else self.source.materialize(entry, rec.metas[n])
                if t is None:
                    return None
            leaves[i] = t
        return leaves

    def _run(self, func: OpOverload, args: tuple, kwargs: dict, k: int, rec: OpRecord):
        if rec.rng is not None:
            gen, state = rec.rng
            if gen not in self.generators:
                self.generators[gen] = gen.get_state()
            gen.set_state(state)
        undo = []
        for i in written_args(func):
            for target in flatten(arg_at(func, i, args, kwargs))[0]:
                if isinstance(target, torch.Tensor) and target.untyped_storage()._cdata not in self.local:
                    with no_dispatch(), torch.no_grad():
                        undo.append((target, target.clone()))
        out = func(*args, **kwargs)
        if undo:
            with no_dispatch(), torch.no_grad():
                for target, old in undo:
                    target.copy_(old)
        self.source.ran(self.call, k)
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
                self.source.captured(entry, leaf)
                self.remaining -= 1
            n += 1
        if self.remaining <= 0:
            raise _StopReplay
        return out


@contextlib.contextmanager
def _as_in_forward(call: CallRecord, enter_extra: Callable[[], ContextManager], *inner: ContextManager):
    """What every replay of `call` runs under, eager or compiled: `replaying()` true on this thread,
    grad on, forward's autocast state, Python's and NumPy's global generators as they were at the
    call (given back after), `enter_extra()` (checkpoint takeover), then `inner`."""
    _tls.replaying = True
    try:
        with contextlib.ExitStack() as stack:
            if call.host_rng is not None:
                stack.enter_context(_host_rng_as(call.host_rng))
            stack.enter_context(torch.enable_grad())
            for kind, enabled, dtype in call.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(enter_extra())
            for cm in inner:
                stack.enter_context(cm)
            yield
    finally:
        _tls.replaying = False


def run_replay(source: ReplaySource, call: CallRecord, rerun: frozenset[int], args: tuple, kwargs: dict,
               enter_extra: Callable[[], ContextManager]) -> None:
    """Run the replay of `call` (see the module docstring); `enter_extra` is a context manager
    factory entered around it (checkpoint takeover). Raises ReplayError if it cannot finish."""
    mode = ReplayMode(source, call, rerun)
    if mode.remaining <= 0:
        return
    try:
        with _as_in_forward(call, enter_extra, mode):
            call.module(*args, **kwargs)
        raise ReplayError(f"replay of {call.label!r} ended after {mode.k} ops without regenerating "
                          f"{mode.remaining} saved tensor(s) that forward made there")
    except _StopReplay:
        pass
    finally:
        mode.restore_generators()


def host_rng_states() -> tuple:
    """The states of Python's `random` and NumPy's global generator (if NumPy is loaded): a layer's
    own Python code may draw from them (augmentation, stochastic depth). A replay runs the layer
    again from the states of its call and gives the job's back after, so that the replay draws what
    forward drew and the job's later draws are those of a run without SlackSwap. A generator the
    model made itself (`random.Random()`, `numpy.random.default_rng()`) is not seen: a layer drawing
    from one fails verification (verify.py) and its replay has advanced it."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state() if np is not None else None)


@contextlib.contextmanager
def _host_rng_as(states: tuple):
    now = host_rng_states()
    _set_host_rng(states)
    try:
        yield
    finally:
        _set_host_rng(now)


def _set_host_rng(states: tuple) -> None:
    python, numpy_state = states
    random.setstate(python)
    np = sys.modules.get("numpy")
    if numpy_state is not None and np is not None:
        np.random.set_state(numpy_state)


# ---- a call replayed whole: a compiled layer's, or an eager one proven replayable whole -----------
def rng_states(device_type: str) -> tuple:
    """The default generators' states (CPU, and the device's where it has one): a compiled graph
    draws its random seeds from them when it starts, and an eager call replayed whole draws only
    from them (`Recorder`), so a call run again from these states draws the same (as
    torch.utils.checkpoint restores them)."""
    device = torch.cuda.get_rng_state() if device_type == "cuda" else None
    return torch.get_rng_state(), device


def run_whole_replay(source: ReplaySource, call: CallRecord, args: tuple, kwargs: dict,
                     enter_extra: Callable[[], ContextManager], stop_early: bool) -> None:
    """Run a layer's call again, whole, from the random states it started from, under no dispatch
    mode: it saves the same tensors in the same order as in forward, and the one it saves n-th is
    RECOMPUTE target (0, n) if forward's n-th save was one (`captured`: checked against forward's
    bytes on a verifying step). Its own graph is never used (saves dropped); the random states are
    restored after. A compiled call runs to its end (`call.packs` saves, checked); an eager one
    (`stop_early`) stops once its last target is saved, as a replay op by op does."""
    cpu, device = call.rng
    count = [0]
    remaining = [sum(1 for e in call.targets.values() if e.storage is None and e.holders > 0)]
    if stop_early and remaining[0] == 0:
        return

    def pack(t: torch.Tensor):
        n, count[0] = count[0], count[0] + 1
        entry = call.targets.get((0, n))
        if entry is not None and entry.storage is None and entry.holders > 0:
            source.captured(entry, t)
            remaining[0] -= 1
            if stop_early and remaining[0] == 0:
                raise _StopReplay
        return None

    def unpack(_):
        raise ReplayError("a replay's own autograd graph was used for a gradient; replays only regenerate "
                          "saved tensors")

    dynamo_never_compiles(pack, unpack)  # (called from the compiled call's eager parts)
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device is not None else []):
            torch.set_rng_state(cpu)
            if device is not None:
                torch.cuda.set_rng_state(device)
            with _as_in_forward(call, enter_extra, torch.autograd.graph.saved_tensors_hooks(pack, unpack)):
                call.module(*args, **kwargs)
    except _StopReplay:
        return
    if count[0] != call.packs:
        raise ReplayError(f"the call {call.label!r} saved {count[0]} tensors when run again, {call.packs} "
                          f"in forward")

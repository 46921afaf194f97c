"""The state of one step, as small slotted records the executor, its parts and replays share.

* `Step`: the forwards since the last backward and the backward that follows them (a pipeline
  micro-batch is a step of its own); it indexes its entries by storage and by key.
* `Entry`: one saved storage in one step, however many tensors autograd saved over it. Its
  `holders` count the `Holder`s autograd keeps (plus pins of a pending replay); the last one
  gone ends the entry's life on the device.
* `Holder`: what autograd keeps instead of a saved tensor. Its death queues the entry for release
  (finalizers run on any thread, at any point: the executor drains the queue under its lock).
* `CallRecord` / `OpRecord`: one recorded layer call whose step holds RECOMPUTE tensors, and its
  compute ops (replay.py); `Writer`: which op of which recorded call made a storage;
  `Detached` / `HeldArgument`: how a recorded call holds its arguments.

Plain records with ``__slots__`` rather than id-keyed dicts: an entry is reached from its holder,
its step and its layer call without a lookup, and dies with them.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch._ops import OpOverload
from torch.multiprocessing.reductions import StorageWeakRef

from ..plan import Decision
from .device import CopyHandle
from .host_pool import HostBuffer
from .packing import Packed
from .program import Program
from .stats import StepStats

__all__ = ["DROPPED", "CallRecord", "Detached", "Entry", "HeldArgument", "Holder", "OpRecord", "Step", "Writer"]

DROPPED = object()  # what a replay's own saves become (never unpacked)


class Entry:
    """One saved storage in one step."""

    __slots__ = ("key", "decision", "nbytes", "first_read", "storage", "buffer", "holders", "resident",
                 "out_handle", "in_handle", "reached", "original", "ref", "step", "call", "watch", "changed", "packed")

    def __init__(self, key: str, decision: Decision, nbytes: int, first_read: int | None,
                 ref: StorageWeakRef | None, step: Step):
        self.key, self.decision, self.nbytes, self.first_read, self.ref, self.step = \
            key, decision, nbytes, first_read, ref, step
        self.storage: torch.Tensor | None = None  # a tensor over the device storage (no autograd history)
        self.buffer: HostBuffer | None = None  # the host copy of a swapped storage
        self.holders = 0  # holders autograd keeps, plus pins of a pending replay
        self.resident = False  # counted in the device bytes (residency.py)
        self.out_handle: CopyHandle | None = None  # its D2H copy (swaps)
        self.in_handle: CopyHandle | None = None  # its H2D copy
        self.reached = False  # backward has unpacked it
        self.original: HostBuffer | None = None  # forward's bytes (verification of a RECOMPUTE entry)
        self.call: CallRecord | None = None  # the layer call whose replay makes it (RECOMPUTE)
        self.watch: tuple[torch.Tensor, int] | None = None  # (saved tensor, its version) while its copy-out runs
        self.changed: int | None = None  # the version it had when found changed in place during its copy-out
        # PACK: how to unpack its storage (packing.py; `storage` / `buffer` and `nbytes` are the packed
        # bytes until backward first reads it: calls.materialize)
        self.packed: Packed | None = None

    def copied_out(self) -> None:
        """Its asynchronous copy-out has ended (or backward needs it): a saved tensor changed in place
        since its save may have been read before or after the change (the copy ran beside compute),
        so backward gets autograd's in-place error for it instead of either value."""
        if self.watch is not None:
            t, version = self.watch
            self.watch = None
            if t._version != version:
                self.changed = t._version


class Holder:
    """What autograd keeps for one saved tensor (see the module docstring): the tensor itself for
    a KEEP entry; else how to view the entry's storage (`meta`) and a weak reference to the
    saved tensor, to catch in-place changes after the save (`version`)."""

    __slots__ = ("entry", "tensor", "meta", "version", "alive", "queue")

    def __init__(self, queue: collections.deque[Entry], entry: Entry, tensor: torch.Tensor | None, meta: tuple,
                 version: int, alive: weakref.ref | None):
        self.queue, self.entry, self.tensor, self.meta, self.version, self.alive = \
            queue, entry, tensor, meta, version, alive

    def changed(self) -> int | None:
        """The saved tensor's version if it was changed in place since its save (then backward gets
        autograd's error): seen on the tensor while it lives, or when its copy-out ended
        (`Entry.copied_out`)."""
        if self.entry.changed is not None:
            return self.entry.changed
        alive = self.alive() if self.alive is not None else None
        return alive._version if alive is not None and alive._version != self.version else None

    def __del__(self):
        try:
            self.queue.append(self.entry)
        except Exception:  # interpreter shutdown
            pass


class Writer(NamedTuple):
    """Op `op` of recorded layer call `call` made a storage, as its tensor output `output`."""

    call: CallRecord
    op: int
    output: int
    ref: StorageWeakRef | None  # keeps the storage's address from going to a new storage meanwhile (in step.writers)


class Step:
    """One step: the forwards since the last backward, and the backward that follows them."""

    def __init__(self, program: Program | None, verifying: bool):
        self.program = program  # the plan it runs under (a re-plan changes the executor's, not an open step's)
        self.stats = StepStats()
        self.backward = False  # backward has started (a new forward then starts a new step)
        self.verifying = verifying
        self.by_storage: dict[int, Entry] = {}  # storage cdata -> entry (entry.ref pins the cdata)
        self.by_key: dict[str, Entry] = {}  # SWAP entries, for the prefetches
        self.ordinals: dict[str, int] = {}  # region label -> storages saved there so far
        self.calls: dict[str, CallRecord] = {}  # recorded layer calls by label
        self.writers: dict[int, Writer] = {}  # storage cdata -> what made it, in recorded calls
        self.position = 0  # smallest first-read op backward has reached
        self.triggers: list[tuple[int, list[str]]] = []  # pending (op, keys), descending
        self.failures: dict[str, str] = {}  # verification: key -> reason
        self.checked = 0  # verification: recomputed tensors compared with forward's
        self.live = 0  # entries not yet released
        self.lingering: list[Entry] = []  # let go by autograd in forward, held to their first read (entries.py)
        self.closed = False
        # the budget held at run time (keeps and prefetches over it go to host or wait for their
        # read): a derived plan's from the start (program.py), any plan's once the step saves a
        # tensor its profile does not have (it is not the step the plan was made for)
        self.cap: int | None = program.cap if program is not None else None

    def clear(self) -> None:
        """Drop every record of a closed step whose entries are all released: no reference cycle
        (entries <-> step <-> layer calls) is left for the garbage collector to find."""
        self.by_storage.clear()
        self.by_key.clear()
        self.calls.clear()
        self.writers.clear()
        self.triggers = []


# ---- recorded layer calls (replay.py) -------------------------------------------------------------
class OpRecord:
    """One compute op of a recorded call: what a replay returns or checks in its place."""

    __slots__ = ("func", "spec", "leaves", "at", "metas", "kept", "rng", "inplace")

    def __init__(self, func: OpOverload, spec: object, leaves: list, at: tuple[int, ...], metas: list[tuple],
                 kept: dict[int, torch.Tensor], rng: tuple[torch.Generator, torch.Tensor] | None, inplace: bool):
        self.func = func
        self.spec = spec  # structure of the result (flat.flatten)
        self.leaves = leaves  # the result's values, flat; tensors replaced by None
        self.at = at  # positions of the tensors in `leaves`, in order (tensor n is at leaves[at[n]])
        self.metas = metas  # per tensor result, in order: aten.meta_of
        self.kept = kept  # tensor n -> its value, for tiny results kept by value (seeds, empty tensors)
        self.rng = rng  # (generator, state) of a random op
        self.inplace = inplace


@dataclass(eq=False)
class CallRecord:
    """One call of a layer whose step holds RECOMPUTE tensors: all a replay needs."""

    label: str
    module: nn.Module
    # (leaves, spec) of the call's (args, kwargs) (flat.flatten_call); tensors held as Detached, or
    # as HeldArgument where the step saved them; None once nothing is left to replay
    args: tuple[list, object] | None = None
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # held tensors, version at the call
    autocast: list[tuple[str, bool, torch.dtype]] = field(default_factory=list)  # (device type, enabled, dtype)
    ops: list[OpRecord] = field(default_factory=list)
    available: dict[tuple[int, int], Entry] = field(default_factory=dict)  # (op, output) -> entry saved in this call
    targets: dict[tuple[int, int], Entry] = field(default_factory=dict)  # (op, output) -> RECOMPUTE entry
    pins: list[Entry] = field(default_factory=list)  # entries held for the replay (arguments)
    host_rng: tuple | None = None  # Python's and NumPy's global generators at the call (replay.host_rng_states)
    live: int = 0  # RECOMPUTE entries of the call still held by autograd (counted when the call returns)
    returned: bool = False  # the layer call has returned (calls.hold_arguments)
    done: bool = False
    # a call replayed whole (a compiled layer's, or an eager one proven replayable whole: calls.py):
    # the random states at its start, the storages of its arguments, how many saves it packed so
    # far, and the one being packed now
    rng: tuple | None = None
    inputs: frozenset[int] = frozenset()
    packs: int = 0
    packing: int | None = None
    # a recorded (eager) call: every random op drew from a generator a whole replay restores, and no
    # op wrote into a tensor the call did not make (a whole replay could not give its old values back)
    replayable_whole: bool = True


class Detached:
    """A layer-call argument held without its autograd history (shares its version counter)."""

    __slots__ = ("tensor", "requires_grad")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.requires_grad = t.detach(), t.requires_grad

    def get(self) -> torch.Tensor:
        t = self.tensor.detach()
        return t.requires_grad_() if self.requires_grad else t


@dataclass(frozen=True)
class HeldArgument:
    """A layer-call argument held through its saved entry (a swapped input leaves the device)."""

    entry: Entry
    meta: tuple
    requires_grad: bool

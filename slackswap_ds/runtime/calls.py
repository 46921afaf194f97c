"""RECOMPUTE: the layer calls of a step, recorded in forward and replayed in backward (replay.py).

Forward. A layer call whose region the Program re-runs is recorded (`record`): its arguments are
held without autograd history (`Detached`), its compute ops by a `Recorder`, and which op made
each storage (`Writer`, so that the executor can tell a tensor its call made from one it only
saved). When the call returns (`hold_arguments`), the arguments the step saved anyway are held
through their entries instead (`HeldArgument`, pinning them until the replay), so that a swapped
layer input does not stay on the device; a call that made no RECOMPUTE tensor drops its record.

A call is replayed whole, without a dispatch mode (replay.run_whole_replay, as torch's checkpoint
runs a block again), when it is a compiled layer's, or when the Program re-runs every op of its
region up to the last one its replay needs (`Program.whole`: a full recompute) and a recording of
that layer showed that a whole run is exact (`CallRecord.replayable_whole`: it draws only from the
default generators and writes only into tensors it makes; `proven`, from the first replay of each
layer on). Such a call is not recorded op by op: its saves are counted (`_count`), so that each is
known by the order it was packed in, and its random states are kept. The first step of a plan thus
records and replays op by op, and checks; later steps pay no dispatch mode for full recomputes.

Backward. `replay` re-runs a call once, the first time backward needs one of its tensors (the
Schedule's RECOMPUTE at the region's first backward op) or another replay needs one as an input.
`LayerCalls` is the replay's `ReplaySource`: `materialize` gives it a saved entry on the device
(copied in if swapped, regenerated first if recomputed), `captured` takes a regenerated tensor
(checked against forward's bytes on a verifying step, verify.py), `ran` counts an op that ran for
real. A replay that fails or differs on a verifying step hands backward the originals and names
the keys for demotion; on any other step it names them too, and raises a `ReplayError` (a plan's
replay must not guess, and forward's bytes are gone).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..plan import Decision
from .aten import meta_of, no_dispatch, rebuild
from .flat import flatten_call, unflatten_call
from .packing import unpack
from .records import CallRecord, Detached, Entry, HeldArgument, Step, Writer
from .compiled import dynamo_never_compiles, is_compiled
from .replay import (Recorder, ReplayError, autocast_state, host_rng_states, rng_states, run_replay,
                     run_whole_replay)
from .residency import Residency
from .stats import HostClock
from .stream_sanitizer import StreamProtocolError
from .swaps import Swaps
from .verify import Verifier

__all__ = ["LayerCalls"]


class LayerCalls:
    """The recorded layer calls of an executor's steps (see the module docstring)."""

    def __init__(self, residency: Residency, swaps: Swaps, verifier: Verifier, released: collections.deque[Entry],
                 takeover: bool, saved: tuple[Callable, Callable], clock: HostClock,
                 around_replay: Callable[[nn.Module], ContextManager] | None = None):
        self.residency, self.swaps, self.verifier = residency, swaps, verifier
        self.around_replay = around_replay  # entered around each layer's replay (ZeRO-3: deepspeed_api.ZeroLayers)
        self.released = released  # the executor's queue of holders gone: a replay's pins end there
        self.takeover = takeover  # checkpoint calls run inline in replays too (takeover.py)
        self._saved = saved  # the executor's (pack, unpack): a call replayed whole counts its saves on the way
        self.clock = clock  # the executor's hook time: a replay's is compute, not counted there
        dynamo_never_compiles(self._count, *saved)  # (called from compiled blocks' eager parts)
        self._recorders: dict[str, ContextManager] = {}  # open recorded calls by label: Recorder or counting hooks
        self._replaying: list[Step] = []  # steps of the replays running now (one replay may need another)
        self.whole_call: CallRecord | None = None  # the recorded call running now that will be replayed whole
        self.proven: set[str] = set()  # layer calls (labels) a recording showed replayable whole

    # ---- forward ------------------------------------------------------------------------------
    def record(self, step: Step, label: str, module: nn.Module, args: tuple, kwargs: dict,
               device_type: str) -> ContextManager:
        """Layer call `label` starts: its record, and the Recorder the caller enters (outside its lock).
        A call to be replayed whole (a compiled layer's: no dispatch mode may see compiled code; or one
        `proven`, see the module docstring) is recorded without one: its random states and its
        arguments, and the hooks that count its saves."""
        call = CallRecord(label, module, autocast=autocast_state(device_type))
        flat, spec = flatten_call((args, kwargs))
        with no_dispatch():  # held without autograd history: no cycle through the graph
            flat = [Detached(t) if isinstance(t, torch.Tensor) else t for t in flat]
        call.args = (flat, spec)
        call.versions = [(a.tensor, a.tensor._version) for a in flat if isinstance(a, Detached)]
        call.host_rng = host_rng_states()
        step.calls[label] = call
        if is_compiled(module) or (label in self.proven and label in step.program.whole):
            call.rng = rng_states(device_type)
            call.inputs = frozenset(a.tensor.untyped_storage()._cdata for a in flat if isinstance(a, Detached))
            self.whole_call = call
            rec = torch.autograd.graph.saved_tensors_hooks(self._count, self._saved[1])
        else:
            rec = Recorder(call, functools.partial(self._made, step), device_type)
        self._recorders[label] = rec
        return rec

    def _count(self, t: torch.Tensor):
        """The pack hook inside a call to be replayed whole: the executor's, knowing the save's number."""
        call = self.whole_call
        call.packing, call.packs = call.packs, call.packs + 1
        try:
            return self._saved[0](t)
        finally:
            call.packing = None

    def _made(self, step: Step, call: CallRecord, k: int, n: int, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        step.writers[st._cdata] = Writer(call, k, n, StorageWeakRef(st))

    def stop_recording(self, label: str) -> None:
        """Layer call `label` has returned: its recorder stops."""
        self.whole_call = None
        rec = self._recorders.pop(label, None)
        if rec is not None:
            rec.__exit__(None, None, None)

    def stop_all(self) -> None:
        """Stop every recorder (an exception left layer calls open)."""
        self.whole_call = None
        for rec in list(self._recorders.values()):
            rec.__exit__(None, None, None)
        self._recorders.clear()

    def hold_arguments(self, step: Step, call: CallRecord) -> None:
        """A replay calls the layer again with its arguments: those the step saved are held through
        their entries (pinned until the replay; a swapped input must not stay on the device)."""
        call.returned = True
        live = len(call.targets)  # (only RECOMPUTE entries still held are targets: `target_released`)
        if not live:  # nothing to replay: nothing to hold
            call.args, call.versions, call.done = None, [], True
            return
        flat, spec = call.args
        held = []
        for a in flat:
            entry = step.by_storage.get(a.tensor.untyped_storage()._cdata) if isinstance(a, Detached) else None
            if entry is not None and entry.holders > 0:
                entry.holders += 1
                call.pins.append(entry)
                held.append(HeldArgument(entry, meta_of(a.tensor), a.requires_grad))
            else:
                held.append(a)
        call.args = (held, spec)
        call.live = live

    # ---- lifetimes ----------------------------------------------------------------------------
    def target_released(self, call: CallRecord, entry: Entry) -> None:
        """RECOMPUTE `entry` of `call` was released before its replay: no replay makes it any more;
        once none is left, nobody needs the replay, and its arguments are unpinned. (One released
        while the call still runs, its node dead in forward, leaves `hold_arguments` less to count.)"""
        for at, target in list(call.targets.items()):
            if target is entry:
                del call.targets[at]
        if call.returned and not call.done:
            call.live -= 1
            if call.live <= 0:
                call.done = True
                self.unpin(call)

    def unpin(self, call: CallRecord) -> None:
        self.released.extend(call.pins)
        call.pins, call.args, call.versions = [], None, []

    # ---- backward -----------------------------------------------------------------------------
    def replay(self, step: Step, call: CallRecord) -> None:
        """Regenerate `call`'s RECOMPUTE tensors (once; see the module docstring)."""
        call.done = True
        timeline = self.residency.timeline
        start, began = timeline.now() if timeline else 0.0, time.perf_counter()
        self._replaying.append(step)
        try:
            args, kwargs = self._arguments(call)
            context = functools.partial(self._replay_context, call.module)
            rerun = step.program.rerun.get(call.label, frozenset())
            if call.rng is not None:  # run again whole
                compiled = is_compiled(call.module)
                run_whole_replay(self, call, args, kwargs, context, stop_early=not compiled)
                for k in (0,) if compiled else sorted(rerun):  # (a compiled call is one op; see Program.whole)
                    self.ran(call, k)
                step.stats.whole_replays += not compiled
            else:
                run_replay(self, call, rerun, args, kwargs, context)
                if call.replayable_whole:
                    self.proven.add(call.label)
        except StreamProtocolError:  # the runtime's own copies broke the protocol: never a layer's failure
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the model's code in a replay
            why = f"replay failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            needed = [entry for entry in call.targets.values() if entry.holders > 0]
            for entry in needed:  # demoted as the step closes (steps.py): never recomputed again
                step.failures.setdefault(entry.key, why)
            if not step.verifying:  # forward's bytes are gone: no exact value to hand backward
                missing = sum(1 for t in needed if t.storage is None)
                raise ReplayError(f"replaying layer call {call.label!r} to regenerate {missing} saved tensor(s) "
                                  f"failed: {e}. The layer is not replayable as its plan assumed (state it "
                                  f"mutates, a nondeterministic op, or another code path than when it was "
                                  f"profiled): this step's gradients cannot be computed exactly, and its "
                                  f"tensors are kept or swapped from the next step on") from e
            for entry in needed:
                if entry.storage is None and entry.original is not None:
                    self.verifier.restore(entry)
        finally:
            self._replaying.pop()
            if not self._replaying:  # (the outermost replay: the time of any it needed is in its own)
                self.clock.seconds -= time.perf_counter() - began
            self.unpin(call)
            if timeline is not None:
                timeline.span("compute", "recompute", call.label, start, timeline.now())

    @contextlib.contextmanager
    def _replay_context(self, module: nn.Module) -> Iterator[None]:
        from .takeover import inline_checkpoints

        with (self.around_replay(module) if self.around_replay is not None else contextlib.nullcontext()), \
                (inline_checkpoints() if self.takeover else contextlib.nullcontext()):
            yield

    def _arguments(self, call: CallRecord) -> tuple[tuple, dict]:
        for t, version in call.versions:
            if t._version != version:
                raise ReplayError(f"an argument of layer call {call.label!r} was modified in place after the "
                                  f"call (version {version} -> {t._version}); a replay would see other inputs")
        held, spec = call.args
        flat = []
        with no_dispatch():
            for a in held:
                if isinstance(a, HeldArgument):
                    t = self.materialize(a.entry, a.meta)
                    if t is None:
                        raise ReplayError(f"argument {a.entry.key!r} of {call.label!r} was released before "
                                          f"the replay")
                    flat.append(t.requires_grad_() if a.requires_grad else t)
                elif isinstance(a, Detached):
                    flat.append(a.get())
                else:
                    flat.append(a)
        return unflatten_call(flat, spec)

    # ---- the replay's ReplaySource ------------------------------------------------------------
    def materialize(self, entry: Entry, meta: tuple) -> torch.Tensor | None:
        """`entry` on the device viewed as `meta`: copied in or regenerated if need be (None if
        the entry is gone)."""
        if entry.storage is None:
            if entry.holders <= 0:
                return None
            if entry.decision is Decision.SWAP and entry.buffer is not None:
                with no_dispatch():
                    self.swaps.copy_in(entry)
                entry.step.stats.copy_waits += 1
            elif entry.call is not None and not entry.call.done:
                self.replay(entry.step, entry.call)
            if entry.storage is None:
                raise ReplayError(f"the replay of {entry.call.label if entry.call else '?'!r} did not "
                                  f"regenerate saved tensor {entry.key!r}")
        with no_dispatch():
            if entry.in_handle is not None:  # compute waits on the copy's event (no host sync)
                entry.in_handle.wait_on_current()
                entry.in_handle.check_read()
            if entry.packed is not None:
                self._unpacked(entry)
            return rebuild(entry.storage, meta)

    def _unpacked(self, entry: Entry) -> None:
        """PACK: the entry's storage unpacked on its first read; its device bytes are the whole
        storage's from now on (the Schedule's UNPACKED bytes)."""
        full = unpack(entry.packed, entry.storage)
        self.residency.drop_resident(entry)
        entry.nbytes, entry.storage, entry.packed = entry.packed.nbytes, full, None
        self.residency.count_resident(entry)

    def captured(self, entry: Entry, tensor: torch.Tensor) -> None:
        """The replay made RECOMPUTE `entry` again (`tensor`: the op's output over its storage)."""
        with no_dispatch():
            st = tensor.untyped_storage()
            if st.nbytes() != entry.nbytes:
                raise ReplayError(f"the replay made {entry.key!r} in a storage of {st.nbytes()} B; forward's had "
                                  f"{entry.nbytes} B")
            entry.storage = tensor.detach()
            self.residency.count_resident(entry)
            entry.step.stats.recomputed_bytes += entry.nbytes
            if entry.original is not None:
                self.verifier.check(entry, st)

    def ran(self, call: CallRecord, k: int) -> None:
        """A replay ran op k of `call` for real (counted; the Schedule says which it should)."""
        step = self._replaying[-1]
        stats, program = step.stats, step.program
        stats.ops_recomputed += 1
        stats.recomputed_ops.append(program.op_keys.get((call.label, k), f"{call.label}:{k}:?"))
        if k not in program.rerun.get(call.label, ()):
            stats.unplanned_reruns += 1

"""A saved storage's entry, from its save to its release: named, decided, placed, reached, let go.

* Save (`new`, from the executor's pack hook). The entry is named the way the profiler named it
  (naming.py: its region label, the rank of its storage among the region's saved storages, its
  autograd node), and its decision looked up in the step's Program. Anything that does not match
  the Schedule (a tensor the profile did not see, a recompute outside its layer call or made by
  other ops than profiled) goes to host instead, so that the budget holds, and is counted in
  `stats.fallbacks`; a swap the full host pool cannot take is kept. A plan can cost time, or
  memory when the pool is full, never correctness. Then the decision is carried out: KEEP holds the storage,
  SWAP copies it out (swaps.py), RECOMPUTE lets it go (calls.py; a verifying step keeps
  forward's bytes on the host, verify.py). Without a plan, saves stay on the device while they
  fit in `keep_bytes` and go to host (blocking) otherwise.
* Backward (`reached`): its position is the first reader (profile op index) of the entries it
  unpacks. When it passes a COPY_IN's trigger op the prefetch is issued, and when it enters a
  layer call that recomputes, the call is replayed first (the Schedule's RECOMPUTE at the
  region's first backward op).
* Release (`drain`): a `Holder` that dies queues its entry (`released`); the last holder gone
  ends the entry's life on the device, gives its host buffers back, and unpins a replay nobody
  needs any more.
"""

from __future__ import annotations

import collections

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..plan import Decision
from .aten import bytes_of, no_dispatch
from .calls import LayerCalls
from .naming import activation_key, maker_of, region_of
from .packing import pack, packable_width, unpack
from .program import PlannedTensor
from .records import Entry, Step, Writer
from .residency import Residency
from .swaps import Swaps
from .verify import Verifier

__all__ = ["Entries"]


def _fallback(step: Step, why: str) -> Decision:
    step.stats.fallback(f"{why}: kept")
    return Decision.KEEP


def _to_host(step: Step, why: str) -> Decision:
    """A save the plan cannot carry out goes to host instead, so that the budget holds (kept after
    all if the host pool is full: `_place`)."""
    step.stats.fallback(f"{why}: swapped")
    return Decision.SWAP


class Entries:
    """The entries of an executor's steps (see the module docstring)."""

    def __init__(self, residency: Residency, swaps: Swaps, verifier: Verifier, calls: LayerCalls,
                 released: collections.deque[Entry], keep_bytes: int = 0):
        self.residency, self.swaps, self.verifier, self.calls = residency, swaps, verifier, calls
        self.released = released  # entries whose holders died, oldest first
        self.keep_bytes = keep_bytes  # without a plan: saves kept on the device up to this
        self.two_valued: dict[str, bool] = {}  # key -> whether its first packing's round trip gave its bytes back

    # ---- save ---------------------------------------------------------------------------------
    def new(self, step: Step, label: str, t: torch.Tensor, st: torch.UntypedStorage,
            before: Entry | None = None) -> Entry:
        """The entry of storage `st`, saved (as `t`) in region `label` of `step`. `before`: the
        released entry found at st's address in this step, if any. If it was this very storage
        (its weak reference alive: autograd let go of an earlier save, a node that died in
        forward, while the model still holds the storage), the new entry takes its key: a key
        names a storage of the step (naming.py), whenever autograd released its earlier saves.
        (Under the profiler's tracer, which keeps forward's nodes alive, the first entry lives on.)"""
        if before is not None and before.ref is not None and not before.ref.expired():
            key = before.key
            label = region_of(key)
        else:
            n = step.ordinals.get(label, 0)
            step.ordinals[label] = n + 1
            key = activation_key(label, n, maker_of(t))
        nbytes = st.nbytes()
        program = step.program
        planned = program.acts.get(key) if program is not None else None
        if program is not None and program.guarded:  # a derived plan: its sizes are checked
            step.stats.sizes.setdefault(key, (tuple(t.shape), nbytes))
        writer = step.writers.get(st._cdata)
        if writer is not None and writer.call.label != label:
            writer = None  # made in another layer call: no replay of this one makes it
        whole = self.calls.whole_call
        if writer is None and whole is not None and whole.label == label and whole.packing is not None \
                and st._cdata not in whole.inputs:  # saved n-th by a call replayed whole: its run again saves it n-th
            writer = Writer(whole, 0, whole.packing, None)
        decision = self._decision(step, planned, nbytes, writer)
        packs = planned is not None and planned.packed and decision is not Decision.RECOMPUTE \
            and planned.nbytes == nbytes and packable_width(t.dtype)
        if packs and self.two_valued.get(key) is False:
            packs = False
            step.stats.fallback("packed before and found more than two-valued: stored unpacked")
        # A SWAP, RECOMPUTE or packed entry outlives its device storage: the weak reference keeps the
        # storage's address (its cdata, the by_storage key) from going to a new storage meanwhile.
        ref = StorageWeakRef(st) if decision is not Decision.KEEP or packs else None
        entry = Entry(key, decision, nbytes, planned.first_read if planned else None, ref, step)
        step.live += 1
        if decision is Decision.SWAP:
            step.by_key[key] = entry
        if writer is not None:
            call = writer.call
            call.available[writer.op, writer.output] = entry
            if decision is Decision.RECOMPUTE:
                call.targets[writer.op, writer.output] = entry
                entry.call = call
                call.live += call.returned  # saved again after the call (see `before`)
        if packs:
            t, st = self._pack(step, entry, t, st)
        self._place(step, entry, t, st)
        return entry

    def _decision(self, step: Step, planned: PlannedTensor | None, nbytes: int, writer: Writer | None) -> Decision:
        """The plan's decision for a new entry, or KEEP (counted) where it cannot be carried out."""
        if planned is not None and planned.decision is Decision.KEEP and planned.nbytes == nbytes and step.cap is None:
            return Decision.KEEP  # (the common case, asked at every save: none of the checks below can object)
        if step.program is None:  # no plan: to host (blocking), so the step fits any budget above the kept bytes
            return Decision.KEEP if self.residency.bytes + nbytes <= self.keep_bytes else Decision.SWAP
        if planned is None:  # another code path than profiled (an attention mask of all ones that a model drops)
            step.cap = step.program.plan.budget_bytes  # not the step planned for: its budget held from now on
            step.stats.unplanned += 1
            return _to_host(step, "not in the plan's profile")
        if planned.nbytes != nbytes:
            # data-dependent shapes (a mixture of experts routes other token counts every step):
            # the decision still applies, exactly; only the plan's byte counts are off
            step.stats.resized += 1
            step.stats.resized_bytes += nbytes - planned.nbytes
            # not the step planned for (or a compiled block recompiled since the profile, saving in
            # another order: its n-th save is another tensor): its budget held from now on
            step.cap = step.program.plan.budget_bytes
            if nbytes > planned.nbytes and planned.decision is not Decision.SWAP and step.program.guarded:
                # a derived plan's prediction fell short: kept or regenerated in backward, the tensor
                # could push the step over its budget; on the host it cannot
                return _to_host(step, "larger than its derived size")
        if planned.decision is Decision.KEEP and self.residency.over(step.cap, nbytes):
            return _to_host(step, "over the budget if kept")
        if planned.decision is Decision.RECOMPUTE and writer is None:
            return _to_host(step, "recompute of a tensor its layer call did not make")
        if planned.decision is Decision.RECOMPUTE and writer.call.rng is None and writer.op != planned.writer:
            # same name, same size, made by another op of the call: the layer took another code path
            # than when profiled (data-dependent control flow; e.g. an attention mask of all ones that
            # a model drops), and the plan's replay would stop before the op that makes it now
            return _to_host(step, "recompute of a tensor its layer call made with other ops than profiled")
        if planned.decision is Decision.RECOMPUTE and writer.call.done:
            # saved again after autograd let go of its earlier saves, and after its layer call's
            # replay was dropped (nothing of the call was left to regenerate)
            return _to_host(step, "recompute of a tensor saved again after its layer call's replay was dropped")
        return planned.decision

    def _pack(self, step: Step, entry: Entry, t: torch.Tensor, st: torch.UntypedStorage
              ) -> tuple[torch.Tensor, torch.UntypedStorage]:
        """PACK: the entry's storage packed (what `_place` keeps or swaps from now on). The first
        packing of each key is checked: where the round trip would not give its bytes back (a
        tensor the profile marked two-valued that is not), it is kept or swapped unpacked, counted,
        and never packed again by this executor."""
        packed = pack(st, t.dtype)
        if entry.key not in self.two_valued:
            self.two_valued[entry.key] = torch.equal(unpack(packed), bytes_of(st))
            if not self.two_valued[entry.key]:
                step.stats.fallback("packing would change it (more than two values): stored unpacked")
                return t, st
        buffer, packed.buffer = packed.buffer, None  # (the entry holds it as its storage or copies it out)
        entry.packed, entry.nbytes = packed, buffer.numel()
        step.stats.packed_bytes += packed.nbytes
        return buffer, buffer.untyped_storage()

    def _place(self, step: Step, entry: Entry, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        """Carry out a new entry's decision: its bytes stay, go to host, or are let go."""
        if entry.decision is Decision.RECOMPUTE:
            if step.verifying:
                entry.original = self.verifier.keep_original(st, step)
            return
        if entry.decision is Decision.SWAP:
            program = step.program
            if self.swaps.swap_out(entry, t, st, blocking=program is None or program.blocking):
                step.stats.swapped_bytes += entry.nbytes
                return
            entry.decision = _fallback(step, "host pool exhausted")
        entry.storage = t.detach()
        self.residency.count_resident(entry)
        step.stats.kept_bytes += entry.nbytes

    # ---- backward -----------------------------------------------------------------------------
    def reached(self, entry: Entry) -> None:
        """Backward unpacks `entry` for the first time: it has reached the entry's first reader.
        Prefetches whose trigger op it has passed are issued; a layer call it enters that
        recomputes is replayed first (the Schedule's RECOMPUTE at the region's first backward op)."""
        entry.reached = True
        step = entry.step
        if step.lingering and entry.first_read is not None:
            self.let_go(step, entry.first_read)
        program = step.program
        if program is not None and not program.any_backward_work and step.backward:
            return  # nothing to prefetch or replay (keep-only plans)
        if not step.backward:
            step.backward = True
            if program is not None:
                step.triggers = list(program.triggers)
                step.position = program.n_ops
        self.residency.poll()
        p = entry.first_read
        if p is None or p >= step.position or program is None:
            return
        step.position = p
        self.swaps.prefetch(step, p)
        call = step.calls.get(program.region_of_op[p])
        if call is not None and not call.done:
            self.calls.replay(step, call)

    # ---- release ------------------------------------------------------------------------------
    def drain(self) -> None:
        """Release the entries whose last holder died (queued by Holder.__del__)."""
        released = self.released
        while released:
            entry = released.popleft()
            entry.holders -= 1
            if entry.holders == 0 and not self._linger(entry):
                self._release(entry)

    @staticmethod
    def _linger(entry: Entry) -> bool:
        """An entry of the plan that autograd let go of in forward (the node that saved it died:
        `topk`'s, say, when only its indices are used) stays until backward reaches its first read,
        as the profile has it (the profiler's tracer keeps every node alive) and as the Schedule
        counts on: its bytes are in the plan, a replay takes it instead of re-running its op, and
        the same storage saved again is the same entry."""
        step = entry.step
        if step.backward or step.closed or entry.first_read is None:
            return False
        entry.holders = 1
        step.lingering.append(entry)
        return True

    def let_go(self, step: Step, position: int | None = None) -> None:
        """Release the lingering entries of `step` whose first read backward has reached
        (`position`: the op backward reaches now; None: all, the step closes)."""
        keep = []
        for entry in step.lingering:
            if position is None or entry.first_read >= position:
                entry.holders -= 1
                if entry.holders == 0:
                    self._release(entry)
            else:
                keep.append(entry)
        step.lingering = keep

    def _release(self, entry: Entry) -> None:
        self.residency.drop_resident(entry)
        step = entry.step
        if entry.ref is None and entry.storage is not None and not step.backward:
            # a kept storage that outlives its entry (the model still holds it) may be saved again
            # in this step's forward: the weak reference keeps its address for it (see `new`)
            ref = StorageWeakRef(entry.storage.untyped_storage())
            entry.storage = None
            entry.ref = None if ref.expired() else ref
        entry.storage = None
        if entry.buffer is not None or entry.original is not None:
            with no_dispatch():
                self.swaps.release(entry)
                self.verifier.release(entry)
        entry.in_handle = None
        call, entry.call = entry.call, None
        if call is not None:
            self.calls.target_released(call, entry)
        step.live -= 1
        if step.live == 0 and step.closed:
            step.clear()

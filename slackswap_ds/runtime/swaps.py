"""SWAP: a saved storage out to a pooled host buffer when it is saved, and back when backward nears it.

* Out (`swap_out`, at pack time): the storage is copied once into a buffer of the host pool
  (`Device.copy_out`, the "Stream protocol" of device.py); its device bytes count until the copy
  has ended (residency.py). A blocking plan, and the profiling mode, wait for the copy right
  there (torch's save_on_cpu semantics; the Schedule's FWD waits; rule 4). A full pool is the
  caller's fallback: the tensor is kept.
* In (`prefetch`): when backward passes a COPY_IN's trigger op, the copy back is issued on the H2D
  side stream, ordered after the copy-out; compute waits on its event before reading it (device
  side). A swapped tensor backward needs before its prefetch ran is copied in on the spot
  (`copy_in`, counted as a copy wait by the caller).
* The buffer goes back to the pool when the entry is released, once no copy reads or writes it.
"""

from __future__ import annotations

import torch

from ..plan import Decision
from .aten import bytes_of, no_dispatch
from .device import Device
from .host_pool import HostPool
from .records import Entry, Step
from .residency import Residency

__all__ = ["Swaps", "unbounded_pool"]


def unbounded_pool(device: Device | None) -> HostPool:
    """A host pool without a budget, on `device` (the CPU's before the executor knows its device)."""
    return HostPool(None, device or Device.of(torch.device("cpu")))


class Swaps:
    """The SWAP entries' copies and host buffers (see the module docstring)."""

    def __init__(self, residency: Residency, pool: HostPool | None, device: Device | None):
        self.residency = residency
        self.device = device  # None until the executor is first entered (then the model's)
        self._pool = pool

    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            self._pool = unbounded_pool(self.device)
        return self._pool

    def bytes_in_use(self) -> int:
        """Host bytes the pool has handed out (0 before any swap made one)."""
        return self._pool.stats().bytes_in_use if self._pool is not None else 0

    def swap_out(self, entry: Entry, t: torch.Tensor, st: torch.UntypedStorage, blocking: bool) -> bool:
        """Copy `entry`'s storage `st` (saved as `t`) to a host buffer; False if the pool has none to give."""
        nbytes = entry.nbytes
        buf = self.pool.acquire(nbytes)
        if buf is None:
            return False
        entry.buffer = buf
        residency, timeline = self.residency, self.residency.timeline
        residency.count_resident(entry)
        start = timeline.now() if timeline else 0.0
        entry.out_handle = self.device.copy_out(bytes_of(st), buf.view(torch.uint8, (nbytes,)))
        if timeline is not None:
            timeline.span("d2h", "copy_out", entry.key, start, timeline.now(), nbytes)
        if blocking:
            entry.out_handle.wait()  # forward waits for it (plan.blocking; Stream protocol rule 4)
        elif self.device.has_streams:  # an in-place change of `t` while the copy runs: said in backward
            entry.watch = (t.detach(), t._version)  # (detach: the same version counter, no autograd graph)
        residency.copying_out(entry)
        residency.poll()
        return True

    def prefetch(self, step: Step, position: int) -> None:
        """Backward has reached profile op `position`: issue the copy-ins whose trigger it passed."""
        with no_dispatch():
            while step.triggers and step.triggers[0][0] > position:
                for key in step.triggers.pop(0)[1]:
                    entry = step.by_key.get(key)
                    if entry is not None and entry.decision is Decision.SWAP and entry.storage is None \
                            and entry.buffer is not None and entry.holders > 0:
                        if self.residency.over(step.cap, entry.nbytes):
                            step.stats.fallback("a prefetch over the budget: copied in when read")
                            continue
                        self.copy_in(entry)

    def copy_in(self, entry: Entry) -> None:
        """Issue the H2D copy (side stream, ordered after its copy-out); the bytes count from now."""
        entry.copied_out()
        self.residency.count_resident(entry)
        timeline = self.residency.timeline
        start = timeline.now() if timeline else 0.0
        entry.in_handle = self.device.copy_in(entry.buffer.view(torch.uint8, (entry.nbytes,)),
                                              after=entry.out_handle)
        if timeline is not None:
            timeline.span("h2d", "copy_in", entry.key, start, timeline.now(), entry.nbytes)
        entry.storage = entry.in_handle.tensor

    def release(self, entry: Entry) -> None:
        """The entry's host buffer back to the pool, reusable once no copy reads or writes it."""
        if entry.buffer is not None:
            self.pool.release(entry.buffer, after=entry.in_handle or entry.out_handle)
            entry.buffer = None

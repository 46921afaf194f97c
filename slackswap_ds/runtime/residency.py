"""Device bytes of saved storages an executor holds: the number a plan's budget bounds.

An entry (records.py) counts from its save (or the start of its copy-in, or its regeneration by
a replay) until the last holder is released, and a swap counts until its copy-out has ended
(rule 3 of the "Stream protocol" in device.py: the device storage lives until then; a save that would
pass the plan's budget meanwhile waits for the oldest copy-outs, `budget_waits`). The bytes
are counted over every open step at once (the micro-batches a pipeline stage holds), so a step's
peak is the executor's while that step was open. Tensors on another device than the model's are
not counted here (stats.other_device_bytes).

With record=True the step's measured timeline follows the counter; the copies and replays of the
step add their spans to the same `timeline`.
"""

from __future__ import annotations

import collections

from .records import Entry
from .timeline import Timeline

__all__ = ["Residency"]


class Residency:
    """Resident bytes, each step's peak, and the swaps whose copy-out may not have ended."""

    __slots__ = ("bytes", "timeline", "_in_flight")

    def __init__(self) -> None:
        self.bytes = 0
        self.timeline: Timeline | None = None  # the running step's, while one is recorded
        self._in_flight: collections.deque[Entry] = collections.deque()  # copy-outs, oldest first

    def count_resident(self, entry: Entry) -> None:
        """`entry`'s storage is on the device now (counted once however often it is said). Where it
        would pass its plan's budget while copy-outs are still in flight (copies slower than the plan
        timed them), the host first waits for the oldest of them: time for memory, never the budget."""
        if not entry.resident:
            if self._in_flight:
                self._make_room(entry)
            entry.resident = True
            self.bytes += entry.nbytes
            stats = entry.step.stats
            if self.bytes > stats.peak_device_bytes:
                stats.peak_device_bytes = self.bytes
            if self.timeline is not None:
                self.timeline.resident(self.bytes)

    def over(self, cap: int | None, nbytes: int) -> bool:
        """Whether `nbytes` more on the device would pass `cap` (None: no cap: a derived plan's budget,
        held at run time, program.py)."""
        return cap is not None and self.bytes + nbytes > cap

    def drop_resident(self, entry: Entry) -> None:
        """`entry`'s storage has left the device."""
        if entry.resident:
            entry.resident = False
            self.bytes -= entry.nbytes
            if self.timeline is not None:
                self.timeline.resident(self.bytes)

    def copying_out(self, entry: Entry) -> None:
        """`entry`'s copy-out was issued: it leaves the device when `poll` sees the copy ended."""
        self._in_flight.append(entry)

    def _make_room(self, entry: Entry) -> None:
        program = entry.step.program
        if program is None:  # no plan (a profiled or sheltered step): its swaps are blocking anyway
            return
        q = self._in_flight
        while q and self.bytes + entry.nbytes > program.plan.budget_bytes:
            oldest = q.popleft()
            oldest.out_handle.wait()
            oldest.copied_out()
            self.drop_resident(oldest)
            entry.step.stats.budget_waits += 1

    def poll(self) -> None:
        """Swaps whose copy-out has ended leave the device. Copies on one stream end in order, so
        only the oldest is polled (never blocks)."""
        q = self._in_flight
        while q and q[0].out_handle.done():
            entry = q.popleft()
            entry.copied_out()
            self.drop_resident(entry)

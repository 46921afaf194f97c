"""The numbered rules of device.py's "Stream protocol", checked while an emulated device runs.

The emulated device (emulation.py) tells the sanitizer what the host issues: copies (with the host
bytes they read or write), events recorded, waits. The sanitizer keeps which work each stream is
ordered after (a vector clock: for every other stream, the last of its operations known to be done
before this stream's next one) and raises `StreamProtocolError`, naming the rule, where a GPU could
race:

* rule 1 / 5: a copy on a side stream that did not wait for the compute stream since its last copy
  (the kernels that made a D2H source, or last used an H2D destination's block, may not have run);
* rule 2: a copy whose host side is not pinned memory (the copy would be synchronous);
* rule 3: a D2H source let go before its copy landed (reported by the worker that found it gone);
* rule 4: host bytes an unfinished D2H copy writes, written by another copy not ordered after it;
* rule 6: host bytes an unfinished D2H copy writes, read by an H2D copy not ordered after it;
* rule 7: compute about to read a prefetched tensor (`CopyHandle.check_read`, called where the
  executor hands it to backward) without having waited for its copy; a read the executor does not
  announce is still caught by poison (the destination holds it until the copy lands);
* rule 8: host bytes an unfinished H2D copy reads, overwritten by a D2H copy not ordered after it.

"Ordered after" is what a GPU guarantees: the same stream (in order), a `wait_event` / `wait_stream`
on an event recorded after the copy, or the host having seen the copy complete before it issued
the new work (`query()` true, `synchronize()`). A copy that merely happened to finish is not enough.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import SlackSwapError

__all__ = ["Clock", "HostAccess", "Sanitizer", "StreamProtocolError"]

COMPUTE = 0  # the compute stream's id (the host thread); side streams are numbered from 1

RULES = {
    1: "a D2H copy was issued on its side stream without that stream waiting for the compute stream "
       "first (side.wait_stream(current)): the kernels that produce its source may not have run",
    2: "a copy's host side is not pinned memory: a non_blocking copy from or to pageable memory is "
       "synchronous, and nothing overlaps",
    3: "a D2H copy's source was let go before the copy completed: the caching allocator can hand its "
       "block to the next compute allocation while the copy still reads it",
    4: "host bytes an unfinished D2H copy writes were handed to another copy before that copy's event "
       "completed (HostPool.release(buf, after=handle) defers it)",
    5: "an H2D copy was issued on its side stream without that stream waiting for the compute stream "
       "first: its destination's block may still be in use by queued compute work",
    6: "an H2D copy reads host bytes whose D2H copy is not ordered before it (the H2D stream must "
       "wait on the copy-out's event: copy_in(..., after=handle))",
    7: "compute read a prefetched tensor before waiting for its copy's event (handle.wait_on_current()): "
       "it can read the bytes before they land",
    8: "host bytes an unfinished H2D copy still reads were overwritten by a D2H copy before the H2D "
       "copy's event completed (HostPool.release(buf, after=handle) defers it)",
}


class StreamProtocolError(SlackSwapError, RuntimeError):
    """A run broke a numbered rule of the Stream protocol (device.py); `rule` is its number."""

    def __init__(self, rule: int, detail: str):
        self.rule = rule
        super().__init__(f"Stream protocol rule {rule} broken: {RULES[rule]}. {detail} "
                         f"(see the \"Stream protocol\" block in slackswap_ds/runtime/device.py)")


class Clock(dict):
    """For each stream id, the sequence number of its last operation known to be done (a vector clock)."""

    def merge(self, other: "Clock") -> None:
        for stream, seq in other.items():
            if seq > self.get(stream, 0):
                self[stream] = seq

    def covers(self, stream: int, seq: int) -> bool:
        return self.get(stream, 0) >= seq


@dataclass(frozen=True)
class HostAccess:
    """Host bytes [lo, hi) that copy `seq` of side stream `stream` writes (a D2H) or reads (an H2D)."""

    stream: int
    seq: int
    lo: int
    hi: int
    writes: bool


class Sanitizer:
    """What the host has issued and seen, and the rules it checks (module docstring). Thread-safe:
    a violation found on a worker thread (rule 3) waits in `pending` until the host next calls in."""

    def __init__(self) -> None:
        self.host = Clock()                          # what the host has seen complete
        self.clocks: dict[int, Clock] = {}           # per side stream: what its next operation is ordered after
        self.fenced: dict[int, bool] = {}            # per side stream: waited for compute since its last copy
        self.pinned: list[tuple[int, int]] = []      # host ranges the device pinned
        self.in_flight: list[HostAccess] = []        # host accesses of copies the host has not seen complete
        self.pending: list[SlackSwapError] = []      # found on a worker thread, raised at the host's next call
        self.violations: list[StreamProtocolError] = []  # every one raised, for tests and the summary
        self._lock = threading.Lock()

    # -- what the emulated device reports -------------------------------------------------------
    def pinned_range(self, lo: int, nbytes: int) -> None:
        with self._lock:
            self.pinned.append((lo, lo + nbytes))

    def is_pinned(self, lo: int, nbytes: int) -> bool:
        with self._lock:
            return nbytes > 0 and any(a <= lo and lo + nbytes <= b for a, b in self.pinned)

    def waited(self, stream: int, clock: Clock, on_compute: bool) -> None:
        """Side stream `stream`'s later work is ordered after `clock` (an event it waits on)."""
        with self._lock:
            self.clocks.setdefault(stream, Clock()).merge(clock)
            if on_compute:
                self.fenced[stream] = True

    def seen(self, clock: Clock) -> None:
        """The host saw an event complete: everything before it is done, for all later work."""
        with self._lock:
            self.host.merge(clock)
            self.in_flight = [a for a in self.in_flight if not self.host.covers(a.stream, a.seq)]

    def copy(self, stream: int, seq: int, direction: str, host_lo: int, nbytes: int) -> None:
        """Copy `seq` of side stream `stream` is issued; its host side is [host_lo, host_lo + nbytes)."""
        self.raise_pending()
        with self._lock:
            if not self.fenced.get(stream, False):
                self._violate(1 if direction == "d2h" else 5, f"copy #{seq} of side stream {stream}")
            self.fenced[stream] = False
            hi = host_lo + nbytes
            if nbytes and not any(lo <= host_lo and hi <= top for lo, top in self.pinned):
                self._violate(2, f"the host side of {direction} copy #{seq} ({nbytes} B at {host_lo:#x})")
            writes = direction == "d2h"
            ordered = Clock(self.host)
            ordered.merge(self.clocks.get(stream, Clock()))
            for a in self.in_flight:
                if a.hi <= host_lo or hi <= a.lo or a.stream == stream or ordered.covers(a.stream, a.seq):
                    continue
                if a.writes or writes:
                    rule = (4 if a.writes else 8) if writes else 6
                    self._violate(rule, f"{direction} copy #{seq} of side stream {stream} overlaps the host "
                                        f"bytes of copy #{a.seq} of side stream {a.stream}")
            self.in_flight.append(HostAccess(stream, seq, host_lo, hi, writes))

    def read(self, clock: Clock) -> None:
        """Compute (the host) reads what the copies up to `clock` wrote: it must have waited for them."""
        self.raise_pending()
        with self._lock:
            late = [(s, q) for s, q in clock.items() if s != COMPUTE and not self.host.covers(s, q)]
            if late:
                self._violate(7, f"copy #{late[0][1]} of side stream {late[0][0]} had not been waited for")

    def source_lost(self, stream: int, seq: int) -> None:
        """Called by a worker: the source of its copy `seq` was gone when the copy ran (rule 3)."""
        with self._lock:
            error = StreamProtocolError(3, f"copy #{seq} of side stream {stream}")
            self.pending.append(error)
            self.violations.append(error)

    def failed(self, detail: str) -> None:
        """Called by a worker whose operation raised: the host hears of it at its next call."""
        with self._lock:
            self.pending.append(SlackSwapError(f"an emulated copy failed: {detail}"))

    def raise_pending(self) -> None:
        with self._lock:
            if self.pending:
                error, self.pending = self.pending[0], []
                raise error

    def _violate(self, rule: int, detail: str) -> None:
        error = StreamProtocolError(rule, detail)
        self.violations.append(error)
        raise error

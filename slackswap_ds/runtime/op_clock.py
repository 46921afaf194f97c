"""How the profiler times each op of a traced step.

A GPU runs kernels asynchronously: the host returns from an op long before its kernels end. Timing
an op by draining the queue before and after it (`torch.cuda.synchronize`, then `perf_counter`)
adds the synchronization's own round trip and the launch to every op: on the 2026-12-04 H200 run
(`benchmarks/gpu_validate.py`, GPT-2 medium, 478 ops) the profile said 175 ms for a keep-all step
that ran in 87-102 ms, and a plan made from it counted on slack that was not there. So on CUDA each
op is timed by a pair of events recorded on the stream it runs on (`EventClock`), read once at the
end of the step: the device's own time between them, with no synchronization inside the step.
Elsewhere the host clock is the op's time (`WallClock`): the CPU computes while the host waits.

A clock's durations are added to an op's field (`add`), possibly later (`settle`, before the
profile is read). `elapsed` is immediate (the packing kernels' one-off timing).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["EventClock", "WallClock", "clock_for"]


class WallClock:
    """Host time: `timer()` before and after (perf_counter; tests pass a fake clock so that plans
    made from the trace do not depend on measured times)."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter):
        self.timer = timer

    def mark(self) -> float:
        return self.timer()

    def add(self, op, field: str, start: float, end: float | None = None) -> None:
        """op.<field> += the time from `start` to `end` (default: now)."""
        setattr(op, field, getattr(op, field) + (self.timer() if end is None else end) - start)

    def elapsed(self, start: float) -> float:
        return self.timer() - start

    def settle(self) -> None:
        """Nothing is pending on a host clock."""


class EventClock:
    """Device time between timing events on the current stream (`new_event`: the accelerator's
    `Event(enable_timing=True)`; `synchronize`: the device's). Durations are read in `settle`."""

    def __init__(self, new_event: Callable[[], object], synchronize: Callable[[], None]):
        self._new_event, self._synchronize = new_event, synchronize
        self._pending: list[tuple[object, str, object, object]] = []

    @classmethod
    def cuda(cls, device: torch.device) -> "EventClock":
        return cls(lambda: torch.cuda.Event(enable_timing=True), lambda: torch.cuda.synchronize(device))

    def mark(self):
        event = self._new_event()
        event.record()
        return event

    def add(self, op, field: str, start, end=None) -> None:
        self._pending.append((op, field, start, self.mark() if end is None else end))

    def elapsed(self, start) -> float:
        end = self.mark()
        self._synchronize()
        return start.elapsed_time(end) / 1e3

    def settle(self) -> None:
        """Add every pending duration to its op (one synchronization)."""
        if not self._pending:
            return
        self._synchronize()
        pending, self._pending = self._pending, []
        for op, field, start, end in pending:
            setattr(op, field, getattr(op, field) + start.elapsed_time(end) / 1e3)  # (ms)


def clock_for(device: torch.device, timer: Callable[[], float] | None = None) -> WallClock | EventClock:
    """`timer`'s host clock if given; else CUDA events on a CUDA device, perf_counter elsewhere."""
    if timer is None and device.type == "cuda":
        return EventClock.cuda(device)
    return WallClock(timer or time.perf_counter)

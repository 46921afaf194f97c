"""A measured step as a timeline: the same events and memory counter a SimResult has, so that
`report.chrome_trace` draws measured and simulated steps alike (compute, d2h and h2d tracks and
the device activation bytes counter).

Times are host wall-clock from the step's first forward op. On the CPU accelerator that is when
the work ran; with CUDA streams a copy's span is when it was issued (the device runs it later).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..simulator import SimEvent


@dataclass
class MeasuredStep:
    events: list[SimEvent] = field(default_factory=list)
    memory: list[tuple[int, float, int]] = field(default_factory=list)  # (gpu, time, device bytes)
    step_s: float = 0.0
    peak_bytes: int = 0


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.step = MeasuredStep(memory=[(0, 0.0, 0)])

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def span(self, stream: str, kind: str, name: str, start: float, end: float, nbytes: int = 0) -> None:
        """Record [start, end]; a span that continues the last one of the same op is merged into it
        (the several aten ops of one autograd node's backward, say)."""
        events = self.step.events
        last = events[-1] if events else None
        if last is not None and (last.stream, last.kind, last.name) == (stream, kind, name) and nbytes == 0:
            events[-1] = SimEvent(0, stream, kind, name, last.start, end, last.nbytes)
        else:
            events.append(SimEvent(0, stream, kind, name, start, end, nbytes))

    def resident(self, nbytes: int) -> None:
        self.step.memory.append((0, self.now(), nbytes))

    def close(self, peak_bytes: int) -> MeasuredStep:
        self.step.step_s = self.now()
        self.step.peak_bytes = peak_bytes
        return self.step

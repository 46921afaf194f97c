"""What a job reports while it trains: measured steps against the plan's prediction, every
`log_every` planned steps (rank 0: the logger filters the others), and Chrome traces of the
predicted and the first measured step (`trace_file`)."""

from __future__ import annotations

import collections
import os
import time
from typing import Mapping

from .config import SlackSwapConfig
from .hardware import Hardware
from .logs import log
from .plan import Plan
from .shapes import Prediction


class StepReports:
    """Counts planned steps since the last report; every `log_every` of them, one line measured
    against predicted, and a warning if saved tensors were not placed as planned (to host, or kept)."""

    def __init__(self, cfg: SlackSwapConfig, hw: Hardware):
        self.cfg, self.hw = cfg, hw
        self.last: float | None = None  # when the previous planned step's backward ended
        self._start()

    def _start(self) -> None:
        self.elapsed, self.timed = 0.0, 0  # wall clock from one planned step's end to the next's
        self.steps = 0
        self.peak = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()

    def step(self, plan: Plan, prediction: Prediction, peak_bytes: int, fallbacks: Mapping[str, int]) -> None:
        now = time.perf_counter()
        if self.last is not None:  # a step is timed from the end of the one before (the job's first is not)
            self.elapsed += now - self.last
            self.timed += 1
        self.last = now
        self.steps += 1
        self.peak = max(self.peak, peak_bytes)
        self.fallbacks.update(fallbacks)
        if not self.cfg.log_every or self.steps < self.cfg.log_every:
            return
        per_step = f"{1e3 * self.elapsed / self.timed:.1f} ms" if self.timed else "(not yet timed)"
        log.info("slackswap: last %d planned steps: %s per step (wall clock, optimizer included; the plan "
                 "predicts %.1f ms for forward and backward on %s), peak of saved activations %s B (predicted %s B, "
                 "budget %s B)", self.steps, per_step, 1e3 * prediction.step_s, self.hw.name,
                 f"{self.peak:,}", f"{prediction.peak_bytes:,}", f"{plan.budget_bytes:,}")
        if self.fallbacks:
            log.warning("slackswap: in the last %d steps, saved tensors not placed as planned: %s", self.steps,
                        ", ".join(f"{n} x {why}" for why, n in sorted(self.fallbacks.items())))
        self._start()


def trace_path(trace_file: str, kind: str) -> str:
    """`trace_file` for the measured step; <stem>.<kind><suffix> beside it for the prediction."""
    if kind == "measured":
        return trace_file
    root, ext = os.path.splitext(trace_file)
    return f"{root}.{kind}{ext or '.json'}"


def write_trace(result, trace_file: str, kind: str, **kw) -> bool:
    """The `kind` ("predicted", "measured") trace of `result` at its path beside `trace_file`;
    whether it was written. A trace that cannot be written (a full disk, a read-only folder, a path
    that is not a regular file) is a warning: the job trains on without it."""
    from .report import ReportError, write_trace as write

    try:
        write(result, trace_path(trace_file, kind), **kw)
    except ReportError as e:
        log.warning("slackswap: %s; training goes on without the trace", e)
        return False
    return True


__all__ = ["StepReports", "trace_path", "write_trace"]

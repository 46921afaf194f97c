"""What an executor counts: per step (`StepStats`) and over its life (`RunStats`).

``with executor_for(model, plan, profile) as stats:`` hands out the `RunStats`; `stats.last_step` is the
last closed step's `StepStats`. Device bytes are those of residency.py (what a budget bounds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..plan import Plan
from .timeline import MeasuredStep

__all__ = ["HostClock", "RunStats", "StepStats"]


@dataclass
class StepStats:
    """Counters of one step."""

    kept_bytes: int = 0
    swapped_bytes: int = 0
    recomputed_bytes: int = 0
    packed_bytes: int = 0  # bytes of the tensors stored packed (PACK), before packing
    ops_recomputed: int = 0
    recomputed_ops: list[str] = field(default_factory=list)  # op keys re-run by replays, in order
    unplanned_reruns: int = 0  # ops a replay had to re-run that the Schedule did not list
    whole_replays: int = 0  # eager layer calls replayed whole, without a dispatch mode (calls.py)
    hooks_host_s: float = 0.0  # host seconds in the executor's saved-tensor hooks, replays excluded (HostClock)
    peak_device_bytes: int = 0
    host_pool_bytes: int = 0
    copy_waits: int = 0  # swapped tensors backward needed before their prefetch had run
    budget_waits: int = 0  # copy-outs the host waited for so that a save stayed within the budget (slow copies)
    other_device_bytes: int = 0  # saved tensors on another device than the model's (left alone)
    unplanned: int = 0  # saved tensors its plan's profile does not have (another code path): to host
    resized: int = 0  # saved tensors whose size differs from the profile's (MoE routing): planned anyway, budget held
    resized_bytes: int = 0  # their bytes minus the profile's
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count
    sizes: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)  # under a derived plan: key -> (shape, bytes)
    verified: bool | None = None  # this step checked the plan's recomputes: True = all equal
    demoted: dict[str, str] = field(default_factory=dict)  # key -> why it failed verification

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


class HostClock:
    """Host seconds an executor spends in its saved-tensor hooks, the compute of replays excluded:
    the host work a GPU would wait on if it fell behind the kernels (the job's summary compares it
    with the step's kernel time). Taken per step (`StepStats.hooks_host_s`)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, hook: Callable) -> Callable:
        """`hook`, its time counted."""
        clock, now = self, time.perf_counter

        def timed_hook(x):
            start = now()
            try:
                return hook(x)
            finally:
                clock.seconds += now() - start
        return timed_hook

    def take(self) -> float:
        """The seconds counted since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass
class RunStats:
    steps: int = 0
    last_step: StepStats = field(default_factory=StepStats)
    last_timeline: MeasuredStep | None = None  # with record=True: the last step, for report.chrome_trace
    plan: Plan | None = None  # the plan steps run under now (re-planning after a demotion changes it)
    demotions: list[dict[str, str]] = field(default_factory=list)  # each re-plan: key -> reason

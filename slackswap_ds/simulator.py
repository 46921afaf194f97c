"""Deterministic discrete-event simulation of Schedules on one GPU or on a node of GPUs.

Resources per GPU: a compute stream, a D2H and an H2D copy engine (one copy per direction at a
time, as on real GPUs). Copies pay `copy_latency_s`, then move bytes at a rate that is recomputed
whenever the set of moving copies changes (a fluid model):

1. each copy's own cap: the GPU's one-direction rate, or its duplex rate while the same GPU also
   copies the other way (A100: H2D falls to ~11 GB/s while D2H stays ~25);
2. per switch and direction, the uplink is shared max-min fairly among the copies behind it;
3. per socket, host-memory bandwidth (both directions together) scales all its copies down
   proportionally when exceeded.

Device activation memory is tracked per GPU at every event (frees at an instant before allocations
at that instant). A schedule whose peak exceeds its budget is reported as infeasible. Ties are
broken by stream order (compute, d2h, h2d) and GPU index, so every run gives the same events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import SlackSwapError
from .hardware import Hardware, Node
from .plan import Kind, STREAMS, Schedule

_COMPUTE, _D2H, _H2D = 0, 1, 2
_EPS = 1e-12


class SimulationError(SlackSwapError):
    """A schedule that cannot run to completion (a wait that can never be satisfied)."""


@dataclass(frozen=True)
class SimEvent:
    gpu: int
    stream: str
    kind: str
    name: str
    start: float
    end: float
    nbytes: int = 0


@dataclass(frozen=True)
class SimResult:
    step_s: float
    ideal_s: float  # keep-all step time with no memory limit; nan when not given
    peak_bytes: int
    budget_bytes: int | None
    stall_s: dict[str, float]  # time each stream spent waiting with work left, (GPU 0 for a node: see per_gpu)
    bytes_d2h: int
    bytes_h2d: int
    recompute_s: float
    events: tuple[SimEvent, ...] = ()
    memory: tuple[tuple[int, float, int], ...] = ()  # (gpu, time, device activation bytes)
    per_gpu: tuple["SimResult", ...] = field(default=(), repr=False)
    fwd_s: float = math.nan  # when the last forward op ended (the step's forward part, stalls included)

    @property
    def feasible(self) -> bool:
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    @property
    def throughput(self) -> float:
        """Fraction of ideal throughput (ideal_s / step_s)."""
        return self.ideal_s / self.step_s if self.step_s > 0 else 1.0


class _Transfer:
    __slots__ = ("gpu", "direction", "latency_left", "bytes_left", "rate")

    def __init__(self, gpu: int, direction: int, latency: float, nbytes: int):
        self.gpu, self.direction = gpu, direction
        self.latency_left, self.bytes_left, self.rate = latency, float(nbytes), 0.0


def simulate(schedule: Schedule, hardware: Hardware | Node, *, budget_bytes: int | None = None,
             ideal_s: float = math.nan, record: bool = True) -> SimResult:
    """Simulate one step of `schedule` on one GPU (a `Hardware`, private link) or GPU 0 of a `Node`."""
    node = hardware if isinstance(hardware, Node) else Node.single(hardware)
    return simulate_node([schedule], node, budget_bytes=budget_bytes, ideal_s=ideal_s, record=record)


def simulate_node(schedules: list[Schedule], node: Node, *, budget_bytes: int | list[int] | None = None,
                  ideal_s: float = math.nan, record: bool = True, start_s: list[float] | None = None) -> SimResult:
    """Simulate one step on the first len(schedules) GPUs of `node`, all starting together unless
    `start_s` gives each GPU a start offset (seconds >= 0; default all 0): GPU g then starts all its
    streams at start_s[g]. Step times count from 0, so they include the offset (data-parallel ranks
    synchronise at the end of the step).

    The result's step time and peak are the maxima over GPUs; `per_gpu` holds each GPU's own."""
    n = len(schedules)
    if not 1 <= n <= node.gpus:
        raise SimulationError(f"node {node.name!r} has {node.gpus} GPUs; got {n} schedules")
    step = _NodeStep(schedules, node, _start_offsets(start_s, n), record)
    while True:
        step.start_ready()
        t_next = step.next_event_s()
        if t_next == math.inf:
            step.check_finished()
            break
        step.advance_to(t_next)
    budgets = budget_bytes if isinstance(budget_bytes, list) else [budget_bytes] * n
    return step.result(budgets, ideal_s)


def _start_offsets(start_s: list[float] | None, n: int) -> list[float]:
    if start_s is None:
        return [0.0] * n
    start = [float(d) for d in start_s]
    if len(start) != n:
        raise SimulationError(f"start_s has {len(start)} offsets for {n} schedules")
    bad = [d for d in start if not (0.0 <= d < math.inf)]
    if bad:
        raise SimulationError(f"start_s offsets must be finite and >= 0; got {bad}")
    return start


class _NodeStep:
    """The state of one simulated step: per GPU and stream (compute, d2h, h2d) the queue of
    instruction ids, the head of that queue, and what is running; per GPU its memory and counters.
    `simulate_node` drives it: start what is ready, jump to the next event, finish what ends there."""

    __slots__ = ("schedules", "node", "hw", "n", "start", "record", "queues", "heads", "done", "running",
                 "started_at", "waiting_since", "stall", "mem", "peak", "moved", "rec_s", "fwd_end", "finish",
                 "events", "memory", "sizes", "t", "rates_dirty")

    def __init__(self, schedules: list[Schedule], node: Node, start: list[float], record: bool) -> None:
        n = len(schedules)
        self.schedules, self.node, self.hw, self.n = schedules, node, node.gpu, n
        self.start, self.record = start, record
        # Per GPU and stream: the instruction ids in order; per GPU, done flags over its instrs.
        self.queues = [[[], [], []] for _ in range(n)]
        for g, sch in enumerate(schedules):
            for i, ins in enumerate(sch.instrs):
                self.queues[g][STREAMS.index(ins.stream)].append(i)
        self.heads = [[0, 0, 0] for _ in range(n)]
        self.done = [bytearray(len(s.instrs)) for s in schedules]
        self.running: list[list[object]] = [[None, None, None] for _ in range(n)]  # compute: end time; copy: _Transfer
        self.started_at = [[0.0, 0.0, 0.0] for _ in range(n)]
        self.waiting_since = [[start[g]] * 3 for g in range(n)]
        self.stall = [[0.0, 0.0, 0.0] for _ in range(n)]
        self.mem = [0] * n
        self.peak = [0] * n
        self.moved = [[0, 0] for _ in range(n)]
        self.rec_s = [0.0] * n
        self.fwd_end = [0.0] * n
        self.finish = list(start)  # a GPU with nothing to do ends when it starts
        self.events: list[SimEvent] = []
        self.memory: list[tuple[int, float, int]] = [(g, 0.0, 0) for g in range(n)] if record else []
        self.sizes = [s.act_bytes for s in schedules]
        self.t = 0.0
        self.rates_dirty = True

    def start_ready(self) -> None:
        """Start the head instruction of every idle stream whose waits are done."""
        t, mem, peak, record = self.t, self.mem, self.peak, self.record
        for g in range(self.n):
            if t < self.start[g]:
                continue
            sch, q, h, run, done = (self.schedules[g].instrs, self.queues[g], self.heads[g], self.running[g],
                                    self.done[g])
            for s in (_COMPUTE, _D2H, _H2D):
                if run[s] is not None or h[s] >= len(q[s]):
                    continue
                ins = sch[q[s][h[s]]]
                if any(not done[w] for w in ins.waits):
                    continue
                self.stall[g][s] += t - self.waiting_since[g][s]
                self.started_at[g][s] = t
                if ins.alloc_start:
                    mem[g] += sum(self.sizes[g][k] for k in ins.alloc_start)
                    if mem[g] > peak[g]:
                        peak[g] = mem[g]
                    if record:
                        self.memory.append((g, t, mem[g]))
                if s == _COMPUTE:
                    run[s] = t + ins.seconds
                else:
                    run[s] = _Transfer(g, s, self.hw.copy_latency_s, ins.nbytes)
                    self.rates_dirty = True

    def next_event_s(self) -> float:
        """When the next running instruction ends or the next GPU starts (inf: nothing will)."""
        if self.rates_dirty:
            _assign_rates(self.running, self.node, self.hw)
            self.rates_dirty = False
        t, t_next = self.t, math.inf
        for run in self.running:
            for s, r in enumerate(run):
                if r is None:
                    continue
                if s == _COMPUTE:
                    te = r
                elif r.latency_left > 0:
                    te = t + r.latency_left
                else:
                    te = t + r.bytes_left / r.rate if r.rate > 0 else math.inf
                if te < t_next:
                    t_next = te
        for d in self.start:  # a GPU that has not started yet
            if t < d < t_next:
                t_next = d
        return t_next

    def check_finished(self) -> None:
        """Nothing runs and nothing will start: every queue must be empty, or the schedule deadlocks."""
        queues, heads, n = self.queues, self.heads, self.n
        if all(heads[g][s] >= len(queues[g][s]) for g in range(n) for s in range(3)):
            return
        blocked = [
            f"gpu {g} {STREAMS[s]}: {self.schedules[g].instrs[queues[g][s][heads[g][s]]].name}"
            for g in range(n) for s in range(3) if heads[g][s] < len(queues[g][s])
        ]
        raise SimulationError("schedule deadlocks; blocked heads: " + "; ".join(blocked))

    def advance_to(self, t_next: float) -> None:
        """Move time to `t_next`: copies move their bytes, and what ends by then finishes."""
        dt = t_next - self.t
        t = self.t = t_next
        tol = _EPS * max(1.0, t)
        for g in range(self.n):
            run = self.running[g]
            for s in (_COMPUTE, _D2H, _H2D):
                r = run[s]
                if r is None:
                    continue
                if s == _COMPUTE:
                    finished = r <= t + tol
                elif r.latency_left > 0:
                    r.latency_left -= dt
                    if r.latency_left <= tol:
                        r.latency_left = 0.0
                        self.rates_dirty = True
                        finished = r.bytes_left <= 0
                    else:
                        finished = False
                elif r.rate == math.inf:  # an instant copy (inf * 0 would be nan)
                    finished = True
                else:
                    r.bytes_left -= r.rate * dt
                    finished = r.bytes_left <= tol * r.rate + 1e-6
                if finished:
                    self._finish(g, s)

    def _finish(self, g: int, s: int) -> None:
        """The head instruction of GPU g's stream s ends now: count it, apply its memory changes."""
        t = self.t
        iid = self.queues[g][s][self.heads[g][s]]
        ins = self.schedules[g].instrs[iid]
        self.running[g][s] = None
        if s != _COMPUTE:
            self.rates_dirty = True
            self.moved[g][s - 1] += ins.nbytes
        elif ins.kind is Kind.RECOMPUTE:
            self.rec_s[g] += ins.seconds
        elif ins.kind is Kind.FWD:
            self.fwd_end[g] = t
        self.done[g][iid] = 1
        self.heads[g][s] += 1
        self.waiting_since[g][s] = t
        self.finish[g] = max(self.finish[g], t)
        sizes = self.sizes[g]
        delta = sum(sizes[k] for k in ins.alloc_end) - sum(sizes[k] for k in ins.free_end)
        if delta:
            self.mem[g] += delta
            self.peak[g] = max(self.peak[g], self.mem[g])
            if self.record:
                self.memory.append((g, t, self.mem[g]))
        if self.record:
            self.events.append(SimEvent(g, STREAMS[s], ins.kind.value, ins.name, self.started_at[g][s], t, ins.nbytes))

    def result(self, budgets: list[int | None], ideal_s: float) -> SimResult:
        """The node's result (step time of the slowest GPU, the peak of the first over budget or else
        the highest) with each GPU's own in `per_gpu`."""
        n, finish, peak, moved = self.n, self.finish, self.peak, self.moved
        per = tuple(
            SimResult(
                step_s=finish[g], ideal_s=ideal_s, peak_bytes=peak[g], budget_bytes=budgets[g],
                stall_s={STREAMS[s]: self.stall[g][s] for s in range(3)}, bytes_d2h=moved[g][0],
                bytes_h2d=moved[g][1], recompute_s=self.rec_s[g], fwd_s=self.fwd_end[g],
            )
            for g in range(n)
        )
        worst = max(range(n), key=lambda g: (finish[g], -g))
        over = [g for g in range(n) if budgets[g] is not None and peak[g] > budgets[g]]
        head = per[over[0] if over else max(range(n), key=lambda g: peak[g])]
        return SimResult(
            step_s=finish[worst], ideal_s=ideal_s, peak_bytes=head.peak_bytes, budget_bytes=head.budget_bytes,
            stall_s=per[worst].stall_s, bytes_d2h=sum(m[0] for m in moved), bytes_h2d=sum(m[1] for m in moved),
            recompute_s=max(self.rec_s), events=tuple(self.events), memory=tuple(self.memory),
            per_gpu=per if n > 1 else (), fwd_s=self.fwd_end[worst],
        )


def _assign_rates(running: list[list[object]], node: Node, hw: Hardware) -> None:
    """Set `rate` on every copy that is moving bytes (see the module docstring for the three rules)."""
    moving: list[_Transfer] = []
    for run in running:
        d2h, h2d = run[_D2H], run[_H2D]
        both = d2h is not None and h2d is not None and d2h.latency_left <= 0 and h2d.latency_left <= 0
        for r, alone, duplex in ((d2h, hw.d2h_bps, hw.duplex_d2h_bps), (h2d, hw.h2d_bps, hw.duplex_h2d_bps)):
            if r is not None and r.latency_left <= 0:
                r.rate = duplex if both else alone
                moving.append(r)
    if node.gpus == 1 or not moving:
        return
    groups: dict[tuple[int, int], list[_Transfer]] = {}
    for r in moving:
        groups.setdefault((node.switch_of(r.gpu), r.direction), []).append(r)
    for members in groups.values():
        _max_min_fair(members, node.switch_uplink_bps)
    sockets: dict[int, list[_Transfer]] = {}
    for r in moving:
        sockets.setdefault(node.socket_of(r.gpu), []).append(r)
    for members in sockets.values():
        total = sum(r.rate for r in members)
        if total > node.socket_mem_bps:
            scale = node.socket_mem_bps / total
            for r in members:
                r.rate *= scale


def _max_min_fair(members: list[_Transfer], capacity: float) -> None:
    """Water-fill `capacity` over members, none above its own cap (its current `rate`)."""
    if sum(r.rate for r in members) <= capacity:
        return
    left, todo = capacity, sorted(members, key=lambda r: r.rate)
    while todo:
        share = left / len(todo)
        r = todo[0]
        if r.rate <= share:
            left -= r.rate
            todo.pop(0)
        else:
            for r in todo:
                r.rate = share
            return

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
    if start_s is None:
        start = [0.0] * n
    else:
        start = [float(d) for d in start_s]
        if len(start) != n:
            raise SimulationError(f"start_s has {len(start)} offsets for {n} schedules")
        bad = [d for d in start if not (0.0 <= d < math.inf)]
        if bad:
            raise SimulationError(f"start_s offsets must be finite and >= 0; got {bad}")
    budgets = budget_bytes if isinstance(budget_bytes, list) else [budget_bytes] * n
    hw = node.gpu

    # Per GPU and stream: the instruction ids in order; per GPU, done flags over its instrs.
    queues = [[[], [], []] for _ in range(n)]
    for g, sch in enumerate(schedules):
        for i, ins in enumerate(sch.instrs):
            queues[g][STREAMS.index(ins.stream)].append(i)
    heads = [[0, 0, 0] for _ in range(n)]
    done = [bytearray(len(s.instrs)) for s in schedules]
    running: list[list[object]] = [[None, None, None] for _ in range(n)]  # compute: end time; copy: _Transfer
    started_at = [[0.0, 0.0, 0.0] for _ in range(n)]
    waiting_since = [[start[g]] * 3 for g in range(n)]
    stall = [[0.0, 0.0, 0.0] for _ in range(n)]
    mem = [0] * n
    peak = [0] * n
    moved = [[0, 0] for _ in range(n)]
    rec_s = [0.0] * n
    fwd_end = [0.0] * n
    finish = list(start)  # a GPU with nothing to do ends when it starts
    events: list[SimEvent] = []
    memory: list[tuple[int, float, int]] = [(g, 0.0, 0) for g in range(n)] if record else []
    sizes = [s.act_bytes for s in schedules]
    t = 0.0
    rates_dirty = True

    def start_ready() -> bool:
        nonlocal rates_dirty
        started = False
        for g in range(n):
            if t < start[g]:
                continue
            sch, q, h, run = schedules[g].instrs, queues[g], heads[g], running[g]
            for s in (_COMPUTE, _D2H, _H2D):
                if run[s] is not None or h[s] >= len(q[s]):
                    continue
                ins = sch[q[s][h[s]]]
                if any(not done[g][w] for w in ins.waits):
                    continue
                stall[g][s] += t - waiting_since[g][s]
                started_at[g][s] = t
                if ins.alloc_start:
                    mem[g] += sum(sizes[g][k] for k in ins.alloc_start)
                    if mem[g] > peak[g]:
                        peak[g] = mem[g]
                    if record:
                        memory.append((g, t, mem[g]))
                if s == _COMPUTE:
                    run[s] = t + ins.seconds
                else:
                    run[s] = _Transfer(g, s, hw.copy_latency_s, ins.nbytes)
                    rates_dirty = True
                started = True
        return started

    while True:
        start_ready()
        # Next completion among running instructions.
        if rates_dirty:
            _assign_rates(running, node, hw)
            rates_dirty = False
        t_next = math.inf
        for g in range(n):
            for s, r in enumerate(running[g]):
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
        for d in start:  # a GPU that has not started yet
            if t < d < t_next:
                t_next = d
        if t_next == math.inf:
            if all(heads[g][s] >= len(queues[g][s]) for g in range(n) for s in range(3)):
                break
            blocked = [
                f"gpu {g} {STREAMS[s]}: {schedules[g].instrs[queues[g][s][heads[g][s]]].name}"
                for g in range(n) for s in range(3) if heads[g][s] < len(queues[g][s])
            ]
            raise SimulationError("schedule deadlocks; blocked heads: " + "; ".join(blocked))
        dt = t_next - t
        t = t_next
        tol = _EPS * max(1.0, t)
        for g in range(n):
            run = running[g]
            for s in (_COMPUTE, _D2H, _H2D):
                r = run[s]
                if r is None:
                    continue
                if s == _COMPUTE:
                    finished = r <= t + tol
                else:
                    if r.latency_left > 0:
                        r.latency_left -= dt
                        if r.latency_left <= tol:
                            r.latency_left = 0.0
                            rates_dirty = True
                            finished = r.bytes_left <= 0
                        else:
                            finished = False
                    elif r.rate == math.inf:  # an instant copy (inf * 0 would be nan)
                        finished = True
                    else:
                        r.bytes_left -= r.rate * dt
                        finished = r.bytes_left <= tol * r.rate + 1e-6
                if not finished:
                    continue
                iid = queues[g][s][heads[g][s]]
                ins = schedules[g].instrs[iid]
                run[s] = None
                if s != _COMPUTE:
                    rates_dirty = True
                    moved[g][s - 1] += ins.nbytes
                elif ins.kind is Kind.RECOMPUTE:
                    rec_s[g] += ins.seconds
                elif ins.kind is Kind.FWD:
                    fwd_end[g] = t
                done[g][iid] = 1
                heads[g][s] += 1
                waiting_since[g][s] = t
                finish[g] = max(finish[g], t)
                delta = sum(sizes[g][k] for k in ins.alloc_end) - sum(sizes[g][k] for k in ins.free_end)
                if delta:
                    mem[g] += delta
                    peak[g] = max(peak[g], mem[g])
                    if record:
                        memory.append((g, t, mem[g]))
                if record:
                    events.append(SimEvent(g, STREAMS[s], ins.kind.value, ins.name, started_at[g][s], t, ins.nbytes))

    def result(g: int) -> SimResult:
        return SimResult(
            step_s=finish[g], ideal_s=ideal_s, peak_bytes=peak[g], budget_bytes=budgets[g],
            stall_s={STREAMS[s]: stall[g][s] for s in range(3)}, bytes_d2h=moved[g][0], bytes_h2d=moved[g][1],
            recompute_s=rec_s[g], fwd_s=fwd_end[g],
        )

    per = tuple(result(g) for g in range(n))
    worst = max(range(n), key=lambda g: (finish[g], -g))
    over = [g for g in range(n) if budgets[g] is not None and peak[g] > budgets[g]]
    head = per[over[0] if over else max(range(n), key=lambda g: peak[g])]
    return SimResult(
        step_s=finish[worst], ideal_s=ideal_s, peak_bytes=head.peak_bytes, budget_bytes=head.budget_bytes,
        stall_s=per[worst].stall_s, bytes_d2h=sum(m[0] for m in moved), bytes_h2d=sum(m[1] for m in moved),
        recompute_s=max(rec_s), events=tuple(events), memory=tuple(memory), per_gpu=per if n > 1 else (),
        fwd_s=fwd_end[worst],
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

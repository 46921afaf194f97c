"""Megatron's pipeline schedules as event times: 1F1B, and 1F1B interleaved over virtual stages.

1F1B (non-interleaved; Narayanan et al. 2021, Sec. 2.2.1): stage i runs min(p-i-1, m) warm-up
forwards, then alternates one forward and one backward, then drains its backwards.

Interleaved 1F1B (Sec. 2.2.2; Megatron-LM ``forward_backward_pipelining_with_interleaving``): each
of the p devices holds v model chunks, chunk c of device i being virtual stage s = c·p + i (layers in
order over the p·v virtual stages). A device runs its virtual micro-batches k = 0 .. m·v-1 in groups
of p: forward k is chunk (k // p) mod v of micro-batch (k // (p·v))·p + k mod p, backward k the same
with the chunks reversed. Warm-up: (p-i-1)·2 + (v-1)·p forwards (all of them when m = p), then
one forward and one backward in turn, then the remaining backwards. The bubble shrinks v-fold at
the price of v times the sends. Megatron requires m to be a multiple of p.

F(s, j) waits for F(s-1, j) and its send; B(s, j) for B(s+1, j) and its send (the last virtual
stage's backward for its own forward). Each device runs its order as soon as inputs have arrived.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .errors import SlackSwapError

Work = tuple[str, int, int]  # ("F" or "B", model chunk, micro-batch)


@dataclass(frozen=True)
class PipeEvent:
    stage: int  # the (virtual) stage: chunk * devices + device
    kind: str  # "F" or "B"
    micro_batch: int
    start: float
    end: float


def one_f_one_b(pp: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s order of forwards ("F", j) and backwards ("B", j) under 1F1B."""
    warm = min(pp - stage - 1, micro_batches)
    order = [("F", j) for j in range(warm)]
    for j in range(micro_batches - warm):
        order += [("F", warm + j), ("B", j)]
    order += [("B", j) for j in range(micro_batches - warm, micro_batches)]
    return order


def interleaved_order(pp: int, chunks: int, micro_batches: int, device: int) -> list[Work]:
    """Device `device`'s order under Megatron's interleaved 1F1B with `chunks` model chunks each."""
    total = micro_batches * chunks
    warm = total if micro_batches == pp else min((pp - device - 1) * 2 + (chunks - 1) * pp, total)

    def work(kind: str, k: int) -> Work:
        chunk = (k % (pp * chunks)) // pp
        return kind, (chunks - 1 - chunk if kind == "B" else chunk), (k // (pp * chunks)) * pp + k % pp

    order = [work("F", k) for k in range(warm)]
    for k in range(total - warm):
        order += [work("F", warm + k), work("B", k)]
    return order + [work("B", k) for k in range(total - warm, total)]


def simulate_pipeline(fwd_s: list[float], bwd_s: list[float], micro_batches: int, p2p_s: float = 0.0,
                      chunks: int = 1) -> tuple[PipeEvent, ...]:
    """Event times of one step: (virtual) stage s's forward takes fwd_s[s], its backward bwd_s[s]; a
    send between neighbouring stages takes p2p_s. `chunks` > 1: interleaved over len(fwd_s) / chunks
    devices. Deterministic: each device runs its order as soon as its inputs have arrived."""
    stages = len(fwd_s)
    p = stages // chunks
    if chunks == 1:
        orders = [[(k, 0, j) for k, j in one_f_one_b(p, micro_batches, i)] for i in range(p)]
    else:
        if micro_batches % p:
            raise SlackSwapError(f"the interleaved schedule needs micro-batches ({micro_batches}) to be a "
                                 f"multiple of the pipeline's {p} devices (as Megatron-LM does)")
        orders = [interleaved_order(p, chunks, micro_batches, i) for i in range(p)]
    done: dict[tuple[int, str, int], float] = {}
    pos, free, events = [0] * p, [0.0] * p, []
    while any(pos[i] < len(orders[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            while pos[i] < len(orders[i]):
                kind, chunk, j = orders[i][pos[i]]
                s = chunk * p + i
                if kind == "F":
                    dep = (s - 1, "F", j) if s > 0 else None
                else:
                    dep = (s + 1, "B", j) if s < stages - 1 else (s, "F", j)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p_s if dep[0] % p != i else 0.0)
                start = max(free[i], ready)
                end = start + (fwd_s[s] if kind == "F" else bwd_s[s])
                done[s, kind, j] = free[i] = end
                events.append(PipeEvent(s, kind, j, start, end))
                pos[i] += 1
                progressed = True
        if not progressed:  # cannot happen for these orders; a guard against a broken schedule
            raise SlackSwapError("pipeline schedule deadlocks")
    return tuple(sorted(events, key=lambda e: (e.start, e.stage)))


def stage_ends(events: tuple[PipeEvent, ...], stages: int) -> tuple[list[float], list[PipeEvent | None]]:
    """Per (virtual) stage, in one pass over the step's events: when its last event ends, and its
    last backward (the first of them if several end together; None if it has none)."""
    ends: list[float] = [0.0] * stages
    last_backward: list[PipeEvent | None] = [None] * stages
    for e in events:
        ends[e.stage] = max(ends[e.stage], e.end)
        last = last_backward[e.stage]
        if e.kind == "B" and (last is None or e.end > last.end):
            last_backward[e.stage] = e
    return ends, last_backward


def stage_peaks(events: tuple[PipeEvent, ...], kept: list[int], peak: list[int], chunks: int = 1) -> list[int]:
    """Each device's peak activation bytes over the step's events: every (virtual) stage s of the
    device holds `kept[s]` bytes per micro-batch whose forward ended and whose backward has not; the
    one running adds its stage's `peak`. One entry per device (per stage without interleaving)."""
    stages = len(kept)
    p = stages // chunks
    f_ends: list[list[float]] = [[] for _ in range(stages)]
    b_ends: list[list[float]] = [[] for _ in range(stages)]
    f_end, b_end = {}, {}
    for e in events:
        (f_ends if e.kind == "F" else b_ends)[e.stage].append(e.end)
        (f_end if e.kind == "F" else b_end)[e.stage, e.micro_batch] = e.end
    for ends in f_ends + b_ends:
        ends.sort()
    out = [0] * p
    for e in events:
        device = e.stage % p
        held = 0
        for s in range(device, stages, p):
            # held at t: forward ended by t and backward not (a backward ends after its forward), so
            # #(forward ends <= t) - #(backward ends <= t), counted by bisection
            held += kept[s] * (bisect.bisect_right(f_ends[s], e.start) - bisect.bisect_right(b_ends[s], e.start))
        own = (e.stage, e.micro_batch)
        if own in f_end and f_end[own] <= e.start < b_end.get(own, float("inf")):
            held -= kept[e.stage]  # (its own micro-batch is `peak`)
        out[device] = max(out[device], held + peak[e.stage])
    return out

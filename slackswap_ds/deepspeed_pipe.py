"""DeepSpeed's pipeline engine as its own schedule (beside Megatron's in `schedules`).

DeepSpeed's ``PipelineEngine`` runs ``TrainSchedule`` (deepspeed/runtime/pipe/schedule.py, 0.19.8):
``2 * (micro_batches + stages - 1)`` steps; at each step every stage does one forward or one
backward (or nothing), forwards on the steps of its own parity. Each step starts with the stage's
point-to-point transfers, with one neighbour only: a forward step sends the previous step's input
gradient to the previous stage and receives this step's activation from it; a backward step
receives this step's output gradient from the next stage and sends the previous step's activation
to it. The neighbour is in the mirror step at the same time, and the transfers are blocking
(deepspeed/runtime/pipe/p2p.py), so a pair of stages meets: both wait for the later one, then the
transfers run one after the other, then each computes. That is the lockstep that separates it from
Megatron's 1F1B, where a stage starts as soon as its input has arrived and sends overlap compute.

Transfers carry the full boundary activation (DeepSpeed sends whole tensors; no scatter-gather over
tensor-parallel ranks). After the last step the engine reduces tied weights' gradients between the
stages that share them (``ReduceTiedGrads``: the embedding table of a tied LM head, first and last
stage), then the data-parallel gradients, then steps the optimizer: all after the pipeline drains.
"""

from __future__ import annotations

from .schedules import PipeEvent


def train_schedule(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int] | None]:
    """Stage `stage`'s work at each step of DeepSpeed's ``TrainSchedule``: ("F", j), ("B", j), or
    None on a step with no valid micro-batch (``_step_to_micro_batch`` and ``_valid_micro_batch``)."""
    out: list[tuple[str, int] | None] = []
    for step in range(2 * (micro_batches + stages - 1)):
        forward = step % 2 == stage % 2
        if forward:
            j = (step if step % 2 == 0 else step - 1) // 2 - stage // 2
        elif step % 2 == 0:
            j = step // 2 - stages + (stage + 1) // 2
        else:
            j = (step - 1) // 2 - stages + 1 + stage // 2
        out.append((("F" if forward else "B"), j) if 0 <= j < micro_batches else None)
    return out


def simulate_deepspeed_pipeline(fwd_s: list[float], bwd_s: list[float], micro_batches: int,
                                p2p_s: float = 0.0) -> tuple[PipeEvent, ...]:
    """Event times of one ``TrainSchedule`` step: stage i's forward takes fwd_s[i], its backward
    bwd_s[i]; one blocking transfer between neighbours takes p2p_s. Each step, the pairs of stages
    that exchange tensors meet (both wait for the later), run their transfers in turn, then compute."""
    p = len(fwd_s)
    plans = [train_schedule(p, micro_batches, i) for i in range(p)]
    free, events = [0.0] * p, []
    for step in range(2 * (micro_batches + p - 1)):
        # the transfers of this step, per pair (i, i+1): i sends down what it computed last step
        # (an activation) and i+1 sends up what it computed last step (an input gradient)
        ready = list(free)
        for i in range(p - 1):
            if step % 2 == i % 2:  # i is on its forward parity: it exchanges with i-1, not i+1
                continue
            down = step > 0 and _did(plans[i][step - 1], "F")  # SendActivation(prev) / RecvActivation
            up = step > 0 and _did(plans[i + 1][step - 1], "B")  # SendGrad(prev) / RecvGrad
            transfers = int(down) + int(up)
            if transfers:
                meet = max(free[i], free[i + 1]) + transfers * p2p_s
                ready[i] = ready[i + 1] = meet
        for i in range(p):
            work = plans[i][step]
            free[i] = ready[i]
            if work is not None:
                kind, j = work
                end = ready[i] + (fwd_s[i] if kind == "F" else bwd_s[i])
                events.append(PipeEvent(i, kind, j, ready[i], end))
                free[i] = end
    return tuple(sorted(events, key=lambda e: (e.start, e.stage)))


def _did(work: tuple[str, int] | None, kind: str) -> bool:
    return work is not None and work[0] == kind

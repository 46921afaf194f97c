"""Megatron's pipeline schedules: the interleaved order worked by hand from Megatron-LM's rules, its
event times and per-device peaks on a toy board, and the jobs it takes."""

from __future__ import annotations

import pytest

from slackswap_ds.errors import ProfileError, SlackSwapError
from slackswap_ds.hardware import load_node
from slackswap_ds.pipeline import Job, simulate_job
from slackswap_ds.schedules import interleaved_order, simulate_pipeline, stage_ends, stage_peaks
from slackswap_ds.workloads import preset_spec


def test_the_interleaved_order_follows_megatrons_warm_up_and_chunk_rules():
    # p 2, 2 chunks, 4 micro-batches: device 0 warms up (2-0-1)*2 + (2-1)*2 = 4 forwards, device 1 two;
    # forward k is chunk (k mod 4) // 2 of micro-batch (k // 4) * 2 + k mod 2; backwards reverse the chunks
    assert interleaved_order(2, 2, 4, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
        ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1), ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1),
        ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3)]
    assert interleaved_order(2, 2, 4, 1)[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0)]
    # as many micro-batches as devices: every forward first (Megatron's all_warmup_microbatches)
    assert [w[0] for w in interleaved_order(2, 2, 2, 1)] == ["F"] * 4 + ["B"] * 4


def test_interleaved_event_times_and_device_peaks_on_a_toy_board():
    # 2 devices x 2 chunks = virtual stages 0 (dev 0), 1 (dev 1), 2 (dev 0), 3 (dev 1); forward 1 s and
    # backward 2 s each, no send time, 2 micro-batches (all warm-up). By hand: forwards of stage 0 at
    # [0,1] [1,2], stage 1 [1,2] [2,3], stage 2 [2,3] [3,4], stage 3 [3,4] [4,5]; backwards of stage 3
    # [5,7] [7,9], stage 2 [7,9] [9,11], stage 1 [9,11] [11,13], stage 0 [11,13] [13,15]
    events = simulate_pipeline([1.0] * 4, [2.0] * 4, 2, 0.0, chunks=2)
    got = {(e.stage, e.kind, e.micro_batch): (e.start, e.end) for e in events}
    assert got == {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (1, "F", 0): (1, 2), (1, "F", 1): (2, 3),
        (2, "F", 0): (2, 3), (2, "F", 1): (3, 4), (3, "F", 0): (3, 4), (3, "F", 1): (4, 5),
        (3, "B", 0): (5, 7), (3, "B", 1): (7, 9), (2, "B", 0): (7, 9), (2, "B", 1): (9, 11),
        (1, "B", 0): (9, 11), (1, "B", 1): (11, 13), (0, "B", 0): (11, 13), (0, "B", 1): (13, 15)}
    # the same model as 2 plain stages of twice the work: 18 s (the bubble is halved by interleaving)
    assert max(e.end for e in simulate_pipeline([2.0, 2.0], [4.0, 4.0], 2, 0.0)) == 18.0
    # peaks per device: 1 B kept per finished forward of each chunk, 2 B while running. Device 0 at the
    # start of stage 2's first backward (t = 7): both micro-batches' forwards of both its chunks are done
    # (4 B), less the running one's own (1 B), plus its 2 B: 5 B. Device 1 likewise at t = 5.
    assert stage_peaks(events, [1] * 4, [2] * 4, chunks=2) == [5, 5]
    with pytest.raises(SlackSwapError, match="multiple of the pipeline's 2 devices"):
        simulate_pipeline([1.0] * 4, [2.0] * 4, 3, 0.0, chunks=2)


def test_an_interleaved_job_beats_plain_1f1b_and_keeps_each_device_within_its_budget():
    node = load_node("dgx-a100")
    spec = preset_spec("gpt3-175b", layers=8, seq=512)
    plain = simulate_job(Job(spec, pp=2, micro_batches=4), node, 0.5, "full-recompute")
    inter = simulate_job(Job(spec, pp=2, micro_batches=4, chunks=2), node, 0.5, "full-recompute")
    assert len(inter.stages) == 4 and [list(st.layers) for st in inter.stages] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert inter.pipeline_s < plain.pipeline_s
    assert len(inter.peaks) == 2 and inter.worst_peak_ratio <= 1.0
    for bad, message in (({"chunks": 2, "schedule": "deepspeed"}, "needs schedule '1f1b'"),
                         ({"chunks": 3}, "divisible by pp x chunks"), ({"chunks": 2, "micro_batches": 3}, "a multiple of pp")):
        with pytest.raises(ProfileError, match=message):
            Job(spec, pp=2, **{"micro_batches": 4, **bad})


def test_stage_ends_are_each_stages_last_event_and_last_backward():
    """One pass over the events, as the whole-job step needs them (it scanned every event once per
    stage before: quadratic in the stages)."""
    for chunks, pp in ((1, 3), (2, 2)):
        events = simulate_pipeline([1.0, 2.0, 1.5, 0.5][:pp * chunks], [2.0, 4.0, 3.0, 1.0][:pp * chunks], 4, 0.25,
                                   chunks=chunks)
        ends, last_backward = stage_ends(events, pp * chunks)
        for s in range(pp * chunks):
            assert ends[s] == max(e.end for e in events if e.stage == s)
            assert last_backward[s] == max((e for e in events if e.stage == s and e.kind == "B"), key=lambda e: e.end)
    assert stage_ends((), 2) == ([0.0, 0.0], [None, None])

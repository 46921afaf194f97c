"""DeepSpeed's pipeline schedule: the order of DeepSpeed's own TrainSchedule, lockstep event times
worked by hand, and what a whole job adds (full-activation sends, the tied-embedding reduce)."""

from __future__ import annotations

import dataclasses

import pytest

from slackswap_ds.deepspeed_pipe import simulate_deepspeed_pipeline, train_schedule
from slackswap_ds.hardware import load_node
from slackswap_ds.pipeline import Job, partitioned_gathers_s, simulate_job, simulate_pipeline, tied_reduce_s
from slackswap_ds.plan import Decision
from slackswap_ds.workloads import preset_spec


@pytest.mark.parametrize("stages, micro_batches", [(2, 2), (3, 5), (4, 8), (5, 3)])
def test_the_order_is_deepspeeds_train_schedule(stages, micro_batches):
    from deepspeed.runtime.pipe import schedule as ds

    for stage in range(stages):
        theirs = []
        for cmds in ds.TrainSchedule(micro_batches, stages, stage).steps():
            work = [c for c in cmds if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
            theirs.append(None if not work else ("F" if isinstance(work[0], ds.ForwardPass) else "B"))
        mine = [None if w is None else w[0] for w in train_schedule(stages, micro_batches, stage)]
        assert mine == theirs
        # every micro-batch once each way, forwards in order
        done = [w for w in train_schedule(stages, micro_batches, stage) if w]
        assert sorted(done) == sorted([("F", j) for j in range(micro_batches)] + [("B", j) for j in range(micro_batches)])


def test_a_two_stage_step_on_a_toy_board_has_the_hand_computed_event_times():
    # forward 1 s, backward 2 s, one transfer 0.5 s; 2 stages, 2 micro-batches: 6 lockstep steps.
    # step 1: stage 0 sends activation 0 (meets stage 1 at 1.0) -> 1.5; stage 1 F0 1.5-2.5
    # step 2: stage 0 F1 1.5-2.5 (no neighbour before it); stage 1 B0 2.5-4.5
    # step 3: the pair meets at 4.5 (stage 1 busy), activation 1 and gradient 0: 5.5; B0 on 0, F1 on 1
    # step 4: stage 1 B1 6.5-8.5; step 5: gradient 1 at max(7.5, 8.5) + 0.5 = 9.0, B1 on stage 0 -> 11
    events = [(e.stage, e.kind, e.micro_batch, e.start, e.end)
              for e in simulate_deepspeed_pipeline([1.0, 1.0], [2.0, 2.0], 2, 0.5)]
    assert sorted(events) == sorted([
        (0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.5, 2.5), (0, "B", 0, 5.5, 7.5), (0, "B", 1, 9.0, 11.0),
        (1, "F", 0, 1.5, 2.5), (1, "B", 0, 2.5, 4.5), (1, "F", 1, 5.5, 6.5), (1, "B", 1, 6.5, 8.5),
    ])
    # Megatron's 1F1B on the same board: sends overlap, stages do not wait for each other's steps
    assert max(e.end for e in simulate_pipeline([1.0, 1.0], [2.0, 2.0], 2, 0.5)) == 10.0


def test_a_deepspeed_pipeline_job_sends_whole_activations_and_reduces_the_tied_embedding():
    node = load_node("dgx-a100")
    spec = preset_spec("gpt2-xl", layers=4, micro_batch=2, seq=256)
    megatron = simulate_job(Job(spec, pp=2, micro_batches=4), node, float("inf"), "keep-all")
    deepspeed = simulate_job(Job(spec, pp=2, micro_batches=4, schedule="deepspeed"), node, float("inf"), "keep-all")
    assert deepspeed.pipeline_s > megatron.pipeline_s  # lockstep: never ahead of 1F1B
    tied = tied_reduce_s(Job(spec, pp=2, schedule="deepspeed"), node.gpu, node, True)
    assert tied == pytest.approx(node.gpu.collective_s("all_reduce", spec.vocab * spec.hidden * 2, 2))
    assert deepspeed.grad_comm_s == pytest.approx(tied)  # dp 1: the tied reduce is all there is
    assert tied_reduce_s(Job(spec, pp=1), node.gpu, node, True) == 0.0



def test_partitioned_activations_gather_each_recomputed_regions_input_before_its_recompute():
    from slackswap_ds.errors import ProfileError
    from slackswap_ds.workloads import Parallel

    node = load_node("dgx-a100")
    spec = preset_spec("gpt3-175b", layers=4, micro_batch=1, seq=512)
    plain = Job(spec, Parallel(8), pp=2, micro_batches=4, schedule="deepspeed")
    split = Job(spec, Parallel(8), pp=2, micro_batches=4, schedule="deepspeed", partition_activations=True)
    a, b = (simulate_job(j, node, float("inf"), "full-recompute") for j in (plain, split))
    gather = node.gpu.collective_s("all_gather", 512 * spec.hidden * 2, 8)  # one layer's input, all 8 shards
    for st in b.stages:
        recomputed = {st.profile.region_of(x) for x in st.profile.activations
                      if st.plan.decision[x.key] is Decision.RECOMPUTE}
        assert {f"layers.{i}" for i in st.layers} <= recomputed  # full recompute: both of its layers at least
        assert partitioned_gathers_s(split, node.gpu, st) == pytest.approx(len(recomputed) * gather)
    # each micro-batch's backward waits for its gathers: the step is longer by at least the last stage's
    # gathers of every micro-batch
    assert b.pipeline_s >= a.pipeline_s + 4 * partitioned_gathers_s(split, node.gpu, b.stages[-1]) - 1e-12
    keep = simulate_job(split, node, float("inf"), "keep-all")  # nothing recomputed: nothing to gather
    assert keep.pipeline_s == simulate_job(dataclasses.replace(split, partition_activations=False), node,
                                           float("inf"), "keep-all").pipeline_s
    assert gather > 0
    with pytest.raises(ProfileError, match="needs schedule 'deepspeed'"):
        Job(spec, Parallel(8), pp=2, partition_activations=True)

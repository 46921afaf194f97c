"""ZeRO-3 / FSDP: gathers of each region's parameters per micro-batch, their overlap with compute
worked by hand, and a whole ZeRO-3 job."""

from __future__ import annotations

import pytest

from slackswap_ds.errors import ProfileError
from slackswap_ds.hardware import load_node
from slackswap_ds.pipeline import Job, simulate_job
from slackswap_ds.sharded import RegionWork, backward_with_reductions, copy_bytes, gather_bytes, micro_batch_times
from slackswap_ds.workloads import Parallel, model_params, preset_spec


def test_a_zero3_micro_batch_gathers_every_parameter_byte_each_pass():
    spec = preset_spec("llama-7b", layers=2, seq=256, micro_batch=1)
    job = Job(spec, dp=8, zero=3)
    gathered = gather_bytes(job.region_params(0))
    assert sum(gathered.values()) == model_params(spec) * 2  # 16-bit, untied: every parameter once
    assert set(gathered) == {"embed", "layers.0", "layers.1", "head"}


def test_gathers_hide_behind_the_previous_regions_compute_as_worked_by_hand():
    # three regions: compute 1 s each way (backward 2 s), gather 0.5 s, reduce-scatter 0.25 s.
    # forward: gather 0 [0, 0.5]; region 0 [0.5, 1.5] (gather 1 [0.5, 1.0]); region 1 [1.5, 2.5]
    # (gather 2 [1.5, 2.0]); region 2 [2.5, 3.5].  backward from 3.5, regions 2, 1, 0:
    # gather 2 [3.5, 4.0]; region 2 [4.0, 6.0] (gather 1 [4.0, 4.5]; its reduce-scatter [6.0, 6.25]);
    # region 1 [6.0, 8.0] (gather 0 [6.25, 6.75], behind the reduce-scatter); reduce-scatter 1
    # [8.0, 8.25]; region 0 [8.0, 10.0]; reduce-scatter 0 [10.0, 10.25].
    regions = [RegionWork(f"r{i}", 1.0, 2.0, 0.5, 0.25) for i in range(3)]
    t = micro_batch_times(regions)
    assert (t.fwd_s, t.bwd_s) == (3.5, 6.75)
    assert t.exposed_s == pytest.approx(3.5 + 6.75 - 9.0)  # two first gathers and the last reduce-scatter
    # collectives slower than compute: compute waits for each gather
    slow = micro_batch_times([RegionWork(f"r{i}", 1.0, 1.0, 2.0, 0.0) for i in range(3)])
    assert slow.fwd_s == 2.0 * 3 + 1.0


def test_a_zero3_job_reduces_its_gradients_inside_each_micro_batch():
    node = load_node("dgx-a100")
    spec = preset_spec("llama-7b", layers=4, seq=512, micro_batch=1)
    z2 = simulate_job(Job(spec, dp=8, zero=2, micro_batches=2), node, float("inf"), "keep-all")
    z3 = simulate_job(Job(spec, dp=8, zero=3, micro_batches=2), node, float("inf"), "keep-all")
    assert z3.grad_comm_s == 0.0 < z2.grad_comm_s
    assert z3.pipeline_s > z2.pipeline_s  # the first gather of each pass and the last reduce-scatter show
    assert z3.optimizer_s == z2.optimizer_s  # 1/dp of the optimizer state either way


def test_fp32_reduce_scatters_move_twice_the_gradient_bytes_and_a_network_bound_step_waits_for_them():
    """FSDP's reduce_dtype=float32 (torchtitan's and Composer's DEFAULT): each region's gradients are
    reduce-scattered in 4 bytes. Across nodes every collective runs at the network's rate (linear in
    bytes), and with next to no compute every one is on the step's critical path: the step grows by
    exactly the second half of the reduce-scatter bytes at that rate."""
    node = load_node("dgx-a100")
    spec = preset_spec("llama-7b", layers=2, seq=16, micro_batch=1)
    dp = 2 * node.gpus  # two nodes: collectives over the network
    half, full = (simulate_job(Job(spec, dp=dp, zero=3, grad_reduce_bytes=b), node, float("inf"), "keep-all")
                  for b in (2, 4))
    # the 8 ranks of the group on each node reduce over their 8 NICs: 8x one NIC's bus bandwidth (below NVLink's)
    assert Job(spec, dp=dp).dp_ranks_per_node(node.gpus) == 8
    extra = model_params(spec) * 2 * (dp - 1) / dp / (8 * node.internode_busbw)
    assert full.step_s - half.step_s == pytest.approx(extra, rel=1e-9)
    with pytest.raises(ProfileError, match="grad_reduce_bytes must be 2"):
        Job(spec, dp=dp, zero=3, grad_reduce_bytes=8)


def test_a_data_parallel_group_reduces_over_the_nics_of_its_ranks_on_each_node():
    """Ranks are laid out tensor-parallel first (Megatron, DeepSpeed): with tp 4 a node holds 2 ranks
    of each data-parallel group, with tp 8 one; a group with one rank per node reduces at one NIC's rate."""
    spec = preset_spec("llama-7b", layers=8, seq=256, micro_batch=1)
    node = load_node("dgx-a100")
    assert [Job(spec, Parallel(tp), dp=16).dp_ranks_per_node(8) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert Job(spec, dp=4).dp_ranks_per_node(8) == 4  # never more than the group has
    # a tp-t rank reduces 1/t of the gradients over a 1/t share of the node's NICs: the same time
    # whatever t (each node's 8 NICs carry the node's gradients); one NIC per group would be 8x slower
    times = [simulate_job(Job(spec, Parallel(tp), dp=16, zero=1), node, float("inf"), "keep-all").grad_comm_s
             for tp in (1, 4, 8)]
    assert times[0] > 0 and times == pytest.approx([times[0]] * 3, rel=1e-9)


def test_compute_beside_a_collective_is_slower_while_it_runs_as_worked_by_hand():
    """A region's compute runs at its beside speed while the stream's collectives run, at full speed
    after: with 1 s alone / 2 s beside and a collective for the first 0.5 s, a quarter of the work is
    done by then and the rest takes 0.75 s."""
    r = RegionWork("r", 1.0, 2.0, 0.5, 0.0, 2.0, 4.0)
    assert r.compute_s("fwd", 0.5) == 1.25 and r.compute_s("fwd", 0.0) == 1.0 and r.compute_s("fwd", 3.0) == 2.0
    assert RegionWork("r", 1.0, 2.0, 0.5, 0.0).compute_s("fwd", 0.5) == 1.0  # no beside time given: not slowed
    # two regions: forward: gather 0 [0, 0.5]; region 0 from 0.5 beside gather 1 [0.5, 1.0]: 1.25 s, to
    # 1.75; region 1 [1.75, 2.75] alone. Backward from 2.75: gather 1 [2.75, 3.25]; region 1 from 3.25
    # beside gather 0 [3.25, 3.75]: 0.5 + (1 - 0.5 / 4) x 2 = 2.25 s, to 5.5; region 0 [5.5, 7.5] alone.
    t = micro_batch_times([RegionWork(f"r{i}", 1.0, 2.0, 0.5, 0.0, 2.0, 4.0) for i in range(2)])
    assert (t.fwd_s, t.bwd_s) == (2.75, 4.75)
    assert t.exposed_s == pytest.approx(2.75 + 4.75 - 6.0)


def test_fsdp1_casts_and_pre_divides_each_gradient_in_full_as_worked_by_hand():
    # 1000 weights over 8 ranks: each gather casts the 125-element fp32 shard to bf16 (4 + 2 bytes
    # each); each fp32 reduction casts the bf16 gradient to fp32 (2 + 4) and divides it in place (4 + 4)
    assert copy_bytes("fsdp1", 1000, 8, 4) == (750.0, 14000.0)
    assert copy_bytes("fsdp1", 1000, 8, 2) == (750.0, 4000.0)  # 16-bit reduce: no cast, a 16-bit divide
    assert copy_bytes("fsdp1", 1000, 1, 4) == (0.0, 0.0) == copy_bytes("deepspeed", 1000, 8, 4)
    node = load_node("dgx-a100")
    spec = preset_spec("llama-7b", layers=2, seq=512, micro_batch=1)
    ds, fsdp = (simulate_job(Job(spec, dp=8, zero=3, grad_reduce_bytes=4, sharding=s), node, float("inf"), "keep-all")
                for s in ("deepspeed", "fsdp1"))
    assert fsdp.step_s > ds.step_s
    with pytest.raises(ProfileError, match="sharding must be one of"):
        Job(spec, dp=8, zero=3, sharding="fsdp3")
    with pytest.raises(ProfileError, match="sharding 'fsdp1' is how ZeRO-3 / FSDP FULL_SHARD shards: it needs zero 3"):
        Job(spec, dp=8, zero=1, sharding="fsdp1")  # said, not silently ignored


def test_a_zero3_step_is_slower_on_a_gpu_whose_collectives_take_sms():
    import dataclasses

    node = load_node("dgx-a100")
    plain = dataclasses.replace(node, gpu=dataclasses.replace(node.gpu, nccl_sms=0))
    spec = preset_spec("llama-7b", layers=2, seq=512, micro_batch=1)
    taken, free = (simulate_job(Job(spec, dp=8, zero=3), n, float("inf"), "keep-all") for n in (node, plain))
    assert taken.step_s > free.step_s
    one = [simulate_job(Job(spec, dp=1, zero=3), n, float("inf"), "keep-all").step_s for n in (node, plain)]
    assert one[0] == one[1]  # no collectives, nothing beside the compute


def test_reductions_during_backward_slow_the_regions_they_overlap_as_worked_by_hand():
    """DDP / ZeRO-1/2 with overlap_comm: region a (1 s alone, 2 s beside) ends at 1 and reduces for
    0.5 s; region b runs beside that reduction for 0.5 s (a quarter of its beside time, so a quarter
    of its work), then 0.75 s alone: ends at 2.25 and reduces to 2.75."""
    regions = [RegionWork(r, 0.0, 1.0, 0.0, 0.5, -1.0, 2.0) for r in ("a", "b")]
    assert backward_with_reductions(regions, 0.0) == (2.25, 2.75)
    assert backward_with_reductions([RegionWork("a", 0.0, 1.0, 0.0, 0.5)], 3.0) == (4.0, 4.5)  # no beside time


def test_an_overlapped_data_parallel_reduction_costs_compute_on_a_gpu_whose_collectives_take_sms():
    import dataclasses

    node = load_node("dgx-a100")
    plain = dataclasses.replace(node, gpu=dataclasses.replace(node.gpu, nccl_sms=0))
    spec = preset_spec("llama-7b", layers=2, seq=512, micro_batch=1)
    overlapped = Job(spec, dp=8, zero=1, overlap_grad_comm=True)
    taken, free = (simulate_job(overlapped, n, float("inf"), "keep-all").step_s for n in (node, plain))
    assert taken > free
    after = Job(spec, dp=8, zero=1)  # reduced after the backward: nothing runs beside the compute
    assert (simulate_job(after, node, float("inf"), "keep-all").step_s
            == simulate_job(after, plain, float("inf"), "keep-all").step_s)

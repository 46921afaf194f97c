"""ZeRO-3 / FSDP: gathers of each region's parameters per micro-batch, their overlap with compute
worked by hand, and a whole ZeRO-3 job."""

from __future__ import annotations

import pytest

from slackswap_ds.hardware import load_node
from slackswap_ds.pipeline import Job, simulate_job
from slackswap_ds.sharded import RegionWork, gather_bytes, micro_batch_times
from slackswap_ds.workloads import model_params, preset_spec


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

"""SlackSwap under DeepSpeed's PipelineEngine (stages.py), in real jobs started by the deepspeed
launcher on CPU (tests/pipe/worker.py): a 2-stage PipelineModule on 2 ranks, and 2 stages x 2
data-parallel on 4 ranks, dropout on, 4 micro-batches per batch under 1F1B. Against the same job
with "enabled": false: equal losses and bit-equal parameters after 4 batches; each stage's measured
peak within its budget; one plan per stage (they differ), logged once per stage, the same on a
stage's replicas. Faults during agreement are named by every surviving rank within sync_timeout_s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_loopback_port

pytest.importorskip("deepspeed")

import test_faults  # noqa: E402  (its launchers and its check that every survivor names the culprit)

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "pipe" / "worker.py"


def config(ranks: int, enabled: bool, **slackswap) -> dict:
    return {"train_batch_size": 8 * ranks // 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "slackswap": {"enabled": enabled, "activation_budget": 0.5, "hardware": "a100-80g-pcie4",
                          "profile_steps": 1, "log_level": "info", **slackswap}}


def launch(tmp: Path, ranks: int, enabled: bool) -> tuple[list[dict], str]:
    """The job through the deepspeed launcher: every rank's report, and the job's output."""
    name = f"{ranks}{'on' if enabled else 'off'}"
    out = tmp / name
    out.mkdir()
    cfg = tmp / f"{name}.json"
    cfg.write_text(json.dumps(config(ranks, enabled)))
    text = deepspeed_run(ranks, [str(WORKER), "--config", str(cfg), "--out", str(out)])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], text


def deepspeed_run(ranks: int, argv: list[str]) -> str:
    """`deepspeed --num_gpus ranks argv...` on CPU over loopback; its output (it must succeed)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_addr", "127.0.0.1",
           "--master_port", str(free_loopback_port()), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    return text


@pytest.fixture(scope="module", params=[2, 4], ids=["2-stages", "2-stages-x-2-dp"])
def jobs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"pipe{request.param}")
    return request.param, launch(tmp, request.param, True), launch(tmp, request.param, False)


def test_training_is_exact(jobs):
    _, (on, _), (off, _) = jobs
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"] and len(a["losses"]) == 4
        assert a["parameters"] == b["parameters"], f"rank {a['rank']}: parameters differ after 4 batches"


def test_each_stage_stays_within_its_budget_with_its_micro_batches_in_flight(jobs):
    _, (on, _), _ = jobs
    for r in on:
        assert r["layers"] == 4  # the PipelineModule's layers are the plan's regions (4 per stage)
        # 1F1B on 2 stages with 4 micro-batches: stage 0 holds 2 at once, stage 1 one
        assert r["holds"] == (2 if r["stage"] == 0 else 1)
        assert r["budget"] == r["keep_all"] // 2  # 50% of the stage's keep-all peak (holds x one micro-batch)
        assert 0 < r["peak"] <= r["budget"], r
        assert r["peak"] <= r["predicted_peak"]  # CPU copies are synchronous: never above the plan's peak


def test_one_plan_per_stage_logged_once_the_same_on_replicas(jobs):
    ranks, (on, text), (_, text_off) = jobs
    digests = {r["stage"]: r["digest"] for r in on}
    assert digests[0] != digests[1]
    for r in on:
        assert r["digest"] == digests[r["stage"]]  # data-parallel replicas of a stage: one plan
        assert r["stage_plans"] == {str(s): d for s, d in digests.items()}  # every rank knows every stage's
    for stage in (0, 1):
        lines = [line for line in text.splitlines() if f"slackswap stage {stage} (ranks " in line]
        assert len(lines) == 1, lines
        assert digests[stage][:12] in lines[0] and f"agreed over torch.distributed by {ranks // 2} ranks" in lines[0]
    assert text.count("slackswap: per-stage plans agreed by") == 1
    assert "slackswap" not in text_off.lower().replace("slackswap_ds", "")


def fault_job(tmp_path: Path, transport: str, scenario: str) -> test_faults.Job:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config(4, True, sync_timeout_s=test_faults.TIMEOUT_S)))
    (tmp_path / "out").mkdir()
    args = [str(WORKER), "--config", str(cfg), "--out", str(tmp_path / "out"), "--fault", scenario]
    run = test_faults.run_torch if transport == "torch" else test_faults.run_mpi
    return run(scenario, args=args)


@pytest.mark.parametrize("transport", test_faults.TRANSPORTS)
def test_a_stage_rank_stopped_at_its_stages_agreement_is_named_by_every_rank(tmp_path, transport):
    # rank 3 is stage 1's second rank: its stage's first rank (2) names it; stage 0's ranks, done
    # with their own agreement, hear it in the job-wide round
    job = fault_job(tmp_path, transport, "stop3-agree")
    test_faults.assert_named(job, [0, 1, 2], r"ranks \[3\] did not report")


def test_a_stage_rank_dead_at_its_stages_agreement_is_named_by_every_rank(tmp_path):
    # (under MPI the launcher ends the whole job when a rank exits: nothing waits on the dead rank)
    job = fault_job(tmp_path, "torch", "kill3-agree")
    test_faults.assert_named(job, [0, 1, 2], r"ranks \[3\] did not report")


def test_a_stage_rank_dead_before_the_node_facts_is_named_by_every_rank(tmp_path):
    job = fault_job(tmp_path, "torch", "kill1-facts")
    test_faults.assert_named(job, [0, 2, 3], r"ranks \[1\] did not send their node facts")


def test_launch_train_pipe_with_tensor_parallel_shards_is_exact(tmp_path):
    """launch/train_pipe.py: 2 stages x 2 Megatron-style tensor-parallel shards (column- and
    row-parallel layers, all-reduces in forward and backward) on 4 ranks. A stage's shards agree on
    one plan (their saved tensors have the same shapes); parameters bit-equal to the disabled run."""
    cfg = json.loads((ROOT / "configs" / "slackswap_pipe.json").read_text())
    reports = {}
    for enabled in (True, False):
        cfg["slackswap"]["enabled"] = enabled
        path, out = tmp_path / f"{enabled}.json", tmp_path / f"out{enabled}"
        path.write_text(json.dumps(cfg))
        out.mkdir()
        text = deepspeed_run(4, [str(ROOT / "launch" / "train_pipe.py"), "--stages", "2", "--tp", "2", "--steps", "4",
                                 "--report", str(out), "--deepspeed_config", str(path)])
        reports[enabled] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        if enabled:
            for stage in (0, 1):
                budget = re.search(rf"stage {stage}: saved activations ([\d.]+) KiB .* budget ([\d.]+) KiB", text)
                assert budget and float(budget.group(1)) <= float(budget.group(2)), text[-3000:]
    on, off = reports[True], reports[False]
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"] and a["parameters"] == b["parameters"], f"rank {a['rank']} differs"
    assert on[0]["stage"] == on[1]["stage"] == 0 and on[2]["stage"] == on[3]["stage"] == 1
    assert on[0]["digest"] == on[1]["digest"] != on[2]["digest"] == on[3]["digest"]
    assert on[0]["parameters"] != on[1]["parameters"]  # the shards hold different slices

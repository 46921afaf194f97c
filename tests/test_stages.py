"""SlackSwap under DeepSpeed's PipelineEngine (stages.py), in real jobs started by the deepspeed
launcher on CPU (tests/pipe/worker.py): a 2-stage PipelineModule on 2 ranks, and 2 stages x 2
data-parallel on 4 ranks, dropout on, 4 micro-batches per batch under 1F1B. Against the same job
with "enabled": false: equal losses and bit-equal parameters after 4 batches; each stage's measured
peak within its budget; one plan per stage (they differ), logged once per stage, the same on a
stage's replicas. Faults during agreement are named by every surviving rank within sync_timeout_s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from slackswap_ds.runtime.emulation import emulation_requested

from jobs import DEADLINES, FAULT_TIMEOUT_S, ROOT, TRANSPORTS_MPI_SLOW, Job, assert_named, launch_in_turn, run_ranks, sharing

pytest.importorskip("deepspeed")

WORKER = ROOT / "tests" / "pipe" / "worker.py"


def config(ranks: int, enabled: bool, **slackswap) -> dict:
    return {"train_batch_size": 8 * ranks // 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "slackswap": {"enabled": enabled, "activation_budget": 0.5, "hardware": "a100-80g-pcie4",
                          "profile_steps": 1, "log_level": "info", **slackswap}}


# (2 stages alone: slow, for suite time; 2 stages x 2 data-parallel run the same and more)
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.slow), 4], ids=["2-stages", "2-stages-x-2-dp"])
def pipeline_jobs(request, tmp_path_factory):
    """The job disabled, then enabled, in one launch (tests/launch/in_turn.py runs the worker's main
    once per config; the reference is trained before SlackSwap ran in these processes): the ranks,
    and for each run every rank's report and the run's output."""
    ranks, tmp = request.param, tmp_path_factory.mktemp(f"pipe{request.param}")
    runs = []
    for name in ("off", "on"):
        (tmp / f"{name}.json").write_text(json.dumps(config(ranks, name == "on", summary_file=str(tmp / "summary.json"))))
        (tmp / name).mkdir()
        runs.append([name, ["--config", str(tmp / f"{name}.json"), "--out", str(tmp / name)]])
    logs = launch_in_turn(ranks, WORKER, runs, tmp)
    reports = {name: [json.loads((tmp / name / f"rank{r}.json").read_text()) for r in range(ranks)] for name, _ in runs}
    return ranks, (reports["on"], logs["on"]), (reports["off"], logs["off"]), tmp


@sharing("pipeline_jobs")
def test_training_is_exact(pipeline_jobs):
    _, (on, _), (off, _), _ = pipeline_jobs
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"] and len(a["losses"]) == 4
        assert a["parameters"] == b["parameters"], f"rank {a['rank']}: parameters differ after 4 batches"


@sharing("pipeline_jobs")
def test_each_stage_stays_within_its_budget_with_its_micro_batches_in_flight(pipeline_jobs):
    _, (on, _), _, _ = pipeline_jobs
    for r in on:
        assert r["layers"] == 4  # the PipelineModule's layers are the plan's regions (4 per stage)
        # 1F1B on 2 stages with 4 micro-batches: stage 0 holds 2 at once, stage 1 one
        assert r["holds"] == (2 if r["stage"] == 0 else 1)
        assert r["budget"] == r["keep_all"] // 2  # 50% of the stage's keep-all peak (holds x one micro-batch)
        assert 0 < r["peak"] <= r["budget"], r
        if not emulation_requested():  # CPU copies are synchronous: never above the plan's peak
            assert r["peak"] <= r["predicted_peak"]
        # the warm-up batches (and the profiling batch's untraced micro-batches) in the shelter: within it too
        assert 0 < r["shelter_peak"] <= r["budget"], r


@sharing("pipeline_jobs")
def test_one_plan_per_stage_logged_once_the_same_on_replicas(pipeline_jobs):
    ranks, (on, text), (_, text_off), _ = pipeline_jobs
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


@sharing("pipeline_jobs")
def test_each_stage_says_its_summary_once_and_writes_it(pipeline_jobs):
    """The end-of-job summary under pipeline parallelism: each stage's first rank says its stage's
    (every batch by kind, each planned batch within its budget, its plan), stage 0's written to
    summary_file and stage 1's beside it; every rank's `end_of_job()` returns its own."""
    ranks, (on, text), _, tmp = pipeline_jobs
    for stage in (0, 1):
        lines = [line for line in text.splitlines() if f"slackswap stage {stage} summary: " in line]
        assert sum(" steps (1 warm-up, 1 profiled, 2 planned; " in line for line in lines) == 1, lines
        assert any("every planned step within its plan's budget" in line for line in lines)
        written = tmp / ("summary.json" if stage == 0 else "summary.stage1.json")
        data = json.loads(written.read_text())
        assert data["stage"] == stage and data["steps"] == {"warm-up": 1, "profiled": 1, "planned": 2, "shelter": 0}
        (shape,) = data["shapes"]
        lead = next(r for r in on if r["stage"] == stage)
        assert shape["plan"] == lead["digest"][:12] and shape["budget_bytes"] == lead["budget"]
        assert shape["keep_all_bytes"] == lead["keep_all"] and shape["peak_bytes"] <= lead["budget"]
    for r in on:
        assert r["summary"]["stage"] == r["stage"] and r["summary"]["steps"]["planned"] == 2


def fault_job(tmp_path: Path, transport: str, scenario: str) -> Job:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config(4, True, sync_timeout_s=FAULT_TIMEOUT_S)))
    (tmp_path / "out").mkdir()
    return run_ranks(transport, [str(WORKER), "--config", str(cfg), "--out", str(tmp_path / "out"), "--fault", scenario])


@DEADLINES
def test_replicas_on_their_own_lengths_derive_their_plans_and_a_model_compiled_later_is_planned_anew(tmp_path):
    """PipelineModule(dynamic_shape=True), 2 stages x 2 data-parallel, every replica its own length
    for each batch (tests/pipe/worker.py --lengths), 12 batches, every Block compiled before batch 6
    (Dynamo's eager backend, in both runs): losses and parameters equal the job without SlackSwap;
    after the job's first plan each rank plans its own shapes alone (nobody waits), most of them
    derived from a measured profile, not profiled; the compilation change drops the plans, warms up
    and plans again; every planned batch within its plan's budget."""
    runs = []
    for name in ("off", "on"):
        (tmp_path / f"{name}.json").write_text(json.dumps(config(4, name == "on")))
        (tmp_path / name).mkdir()
        runs.append([name, ["--config", str(tmp_path / f"{name}.json"), "--out", str(tmp_path / name), "--lengths",
                            "--compile-at", "6"]])
    logs = launch_in_turn(4, WORKER, runs, tmp_path)
    on, off = ([json.loads((tmp_path / n / f"rank{r}.json").read_text()) for r in range(4)] for n in ("on", "off"))
    for mine, reference in zip(on, off):
        assert mine["losses"] == reference["losses"] and mine["parameters"] == reference["parameters"]
        assert mine["shapes"] >= 2 and mine["steps"], mine
        assert all(peak <= budget for peak, budget in mine["steps"]), mine["steps"]
        events = mine["events"]
        assert events[6][:2] == ["COMPILED_ANEW", "WARM_UP"] and "COMPILED_ANEW" not in sum(events[7:], []), events
        derived = [b for b, e in enumerate(events) if "DERIVED" in e]
        assert mine["derived"] == len(derived) >= 2 and mine["profiled"] <= 4, (mine["derived"], events)
    assert "of this rank's own" in logs["on"] and not re.search(r"did not (answer|report|send)", logs["on"])
    assert "the model's compilation changed at step 7" in logs["on"]


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_a_stage_rank_stopped_at_its_stages_agreement_is_named_by_every_rank(tmp_path, transport):
    # rank 3 is stage 1's second rank: its stage's first rank (2) names it; stage 0's ranks, done
    # with their own agreement, hear it in the job-wide round
    job = fault_job(tmp_path, transport, "stop3-agree")
    assert_named(job, [0, 1, 2], r"ranks \[3\] did not report")


@DEADLINES
def test_a_stage_rank_dead_at_its_stages_agreement_is_named_by_every_rank(tmp_path):
    # (under MPI the launcher ends the whole job when a rank exits: nothing waits on the dead rank)
    job = fault_job(tmp_path, "torch", "kill3-agree")
    assert_named(job, [0, 1, 2], r"ranks \[3\] did not report")


@DEADLINES
def test_a_stage_rank_dead_before_the_node_facts_is_named_by_every_rank(tmp_path):
    job = fault_job(tmp_path, "torch", "kill1-facts")
    assert_named(job, [0, 2, 3], r"ranks \[1\] did not send their node facts")


def test_launch_train_pipe_with_tensor_parallel_shards_is_exact(tmp_path):
    """launch/train_pipe.py: 2 stages x 2 Megatron-style tensor-parallel shards (column- and
    row-parallel layers, all-reduces in forward and backward) on 4 ranks. A stage's shards agree on
    one plan (their saved tensors have the same shapes); parameters bit-equal to the disabled run."""
    runs = []
    for enabled in (False, True):  # the reference first: trained before SlackSwap ran in these processes
        cfg = json.loads((ROOT / "configs" / "slackswap_pipe.json").read_text())
        cfg["slackswap"]["enabled"] = enabled
        name = "on" if enabled else "off"
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        (tmp_path / name).mkdir()
        runs.append([name, ["--stages", "2", "--tp", "2", "--steps", "4", "--report", str(tmp_path / name),
                            "--deepspeed_config", str(tmp_path / f"{name}.json")]])
    # both runs of launch/train_pipe.py in one launch of 4 ranks (tests/launch/in_turn.py)
    text = launch_in_turn(4, ROOT / "launch" / "train_pipe.py", runs, tmp_path)["on"]
    for stage in (0, 1):
        budget = re.search(rf"stage {stage}: saved activations ([\d.]+) KiB .* budget ([\d.]+) KiB", text)
        assert budget and float(budget.group(1)) <= float(budget.group(2)), text[-3000:]
    reports = {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(4)]
               for name in ("on", "off")}
    on, off = reports["on"], reports["off"]
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"] and a["parameters"] == b["parameters"], f"rank {a['rank']} differs"
    assert on[0]["stage"] == on[1]["stage"] == 0 and on[2]["stage"] == on[3]["stage"] == 1
    assert on[0]["digest"] == on[1]["digest"] != on[2]["digest"] == on[3]["digest"]
    assert on[0]["parameters"] != on[1]["parameters"]  # the shards hold different slices

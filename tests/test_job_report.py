"""job_report.py in process: the periodic report of planned steps against their plan, the end-of-job
summary (its data, its lines, its JSON file, once), and where traces and the summary go."""

from __future__ import annotations

import json
import logging

from slackswap_ds.config import load_config
from slackswap_ds.hardware import load_hardware
from slackswap_ds.job_report import JobSummary, StepReports, measured_on, summary_path, trace_path, write_job_trace
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.shapes import Prediction

from conftest import two_region_profile


def a_plan(budget: int = 40) -> Plan:
    profile = two_region_profile()
    return Plan.build(profile, {a.key: Decision.KEEP for a in profile.activations}, budget_bytes=budget,
                      hardware_digest="hw", planner="slackswap")


def reports(**section) -> StepReports:
    cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4", **section}})
    return StepReports(cfg, load_hardware(cfg.hardware), "cpu")


def test_the_summary_counts_steps_by_kind_and_planned_steps_per_shape():
    summary = JobSummary()
    plan = a_plan()
    summary.step("warm-up", None, 10, {})
    summary.step("profiled", 0.5, 20, {"host pool exhausted: kept": 1})
    summary.step("planned", 0.2, 30, {}, plan, "[(2, 8)]", 60, (8, 4, 6))
    summary.step("planned", 0.4, 50, {}, plan, "[(2, 8)]", 60, (8, 0, 0))  # over its plan's 40 B
    data = summary.data(profiled_steps=1, derived_plans=0)
    assert data == {
        "steps": {"warm-up": 1, "profiled": 1, "planned": 2, "shelter": 0}, "profiled_steps": 1, "derived_plans": 0,
        "median_step_ms": {"profiled": 500.0, "planned": 300.0},
        "peak_saved_bytes": {"warm-up": 10, "profiled": 20, "planned": 50},
        "planned_steps_over_budget": 1, "budget_waits": 0, "fallbacks": {"host pool exhausted: kept": 1},
        "shapes": [{"shapes": "[(2, 8)]", "steps": 2, "peak_bytes": 50, "swapped_bytes": 16, "recomputed_bytes": 4,
                    "packed_bytes": 6, "plan": plan.digest[:12], "planner": "slackswap", "budget_bytes": 40,
                    "keep_all_bytes": 60, "swapped_bytes_per_step": 8, "recomputed_bytes_per_step": 2,
                    "packed_bytes_per_step": 3}]}


def test_a_shapes_row_holds_the_peak_of_its_latest_plan_against_that_plans_budget():
    """A shape planned again (a derived plan re-derived with its sizes fitted) gets a new plan and
    budget: the row's peak is of the steps under that plan, never an earlier plan's step held
    against the new budget (a job within budget at every step read as over it)."""
    summary = JobSummary()
    first, again = a_plan(50), a_plan(40)
    summary.step("planned", 0.2, 48, {}, first, "[(2, 8)]", 60)
    summary.step("planned", 0.2, 39, {}, again, "[(2, 8)]", 60)
    summary.step("planned", 0.2, 36, {}, again, "[(2, 8)]", 60)
    data = summary.data(profiled_steps=1, derived_plans=1)
    (row,) = data["shapes"]
    assert (row["plan"], row["budget_bytes"], row["peak_bytes"], row["steps"]) == (again.digest[:12], 40, 39, 3)
    assert data["planned_steps_over_budget"] == 0 and data["peak_saved_bytes"]["planned"] == 48


def test_the_first_planned_step_is_reported_then_every_log_every(caplog):
    report = reports(log_every=2)
    plan, prediction = a_plan(), Prediction(0.9, 0.012, 35)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for peak in (30, 31, 32):
            report.step(plan, prediction, peak, {}, "[(2, 8)]", 60)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("slackswap: last 1 planned steps: ")
    assert "predicts 12.0 ms for forward and backward on a100-80g-pcie4, with op times measured on this CPU" in lines[0]
    assert lines[1].startswith("slackswap: last 2 planned steps: ") and "peak of saved activations 32 B" in lines[1]
    assert "(predicted 35 B, budget 40 B)" in lines[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        report.step(plan, prediction, 30, {"host pool exhausted: kept": 2}, "[(2, 8)]", 60)
        report.step(plan, prediction, 30, {}, "[(2, 8)]", 60)
    assert [r.getMessage() for r in caplog.records] == [
        "slackswap rank 0: in the last 2 steps, saved tensors not placed as planned: 2 x host pool exhausted: kept"]


def test_the_summary_is_said_and_written_once(tmp_path, caplog):
    path = tmp_path / "summary.json"
    report = reports(summary_file=str(path))
    assert report.end_of_job() is None and not path.exists()  # no step ran
    report.unplanned("warm-up", 10, {})
    report.step(a_plan(), Prediction(0.9, 0.012, 35), 30, {}, "[(2, 8)]", 60, (8, 4, 0))
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        data = report.end_of_job(profiled_steps=1, derived_plans=0)
    assert json.loads(path.read_text()) == data and report.end_of_job() is None
    text = caplog.text
    assert "slackswap summary: 2 steps (1 warm-up, 1 planned; 0 plan(s) derived" in text
    assert "every planned step within its plan's budget" in text and f"written to {path}" in text


def test_traces_and_the_summary_go_beside_the_trace_file_and_a_failed_write_is_a_warning(tmp_path, caplog):
    assert trace_path("run/t.json", "measured") == "run/t.json"
    assert trace_path("run/t.json", "predicted") == trace_path("run/t", "predicted") == "run/t.predicted.json"
    trace = tmp_path / "t.json"
    assert summary_path(load_config({"slackswap": {"trace_file": str(trace)}})) == str(tmp_path / "t.summary.json")
    assert summary_path(load_config({"slackswap": {}})) is None
    assert measured_on("cuda") == "" and measured_on("cpu") == ", with op times measured on this CPU"
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        assert not write_job_trace(object(), str(tmp_path / "missing" / "t.json"), "measured")
    assert "training goes on without the trace" in caplog.text


def test_each_steps_peak_is_held_against_its_own_plans_budget(caplog):
    """Two plans in one report window: a 50 B peak under a 100 B budget and a 45 B peak under 40 B.
    The report names the step furthest over its own budget (45 of 40), not the window's highest
    peak beside the last plan's budget, and counts the steps over theirs."""
    report = reports(log_every=2)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        report.step(a_plan(100), Prediction(0.9, 0.012, 60), 50, {}, "[(2, 8)]", 200)  # the job's first: reported
        report.step(a_plan(100), Prediction(0.9, 0.012, 60), 50, {}, "[(2, 8)]", 200)
        report.step(a_plan(40), Prediction(0.9, 0.012, 38), 45, {}, "[(2, 4)]", 80)
    last = [r.getMessage() for r in caplog.records][-1]
    assert "peak of saved activations 45 B (predicted 38 B, budget 40 B); 1 step(s) over their plan's budget" in last


def test_copy_outs_waited_for_to_hold_the_budget_are_counted_and_said(caplog):
    """Copies slower than the plan timed them: the host waited for copy-outs so that saves stayed within
    the budget (residency.py). The report and the summary say how often; a window without any does not."""
    report = reports(log_every=2)
    plan, prediction = a_plan(), Prediction(0.9, 0.012, 35)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        report.step(plan, prediction, 30, {}, "[(2, 8)]", 60)
        report.step(plan, prediction, 30, {}, "[(2, 8)]", 60, budget_waits=3)
        report.step(plan, prediction, 30, {}, "[(2, 8)]", 60, budget_waits=2)
        report.step(plan, prediction, 30, {}, "[(2, 8)]", 60)
        report.step(plan, prediction, 30, {}, "[(2, 8)]", 60)
    waited = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert waited == ["slackswap: in the last 2 steps the host waited 5 time(s) for a copy-out to end so that a save "
                      "stayed within the budget: the copies were slower than the plan timed them"]
    assert report.summary.data()["budget_waits"] == 5


def test_repeated_lifecycle_events_are_counted_into_the_report(caplog):
    from slackswap_ds.shapes import Transition as T

    report = reports(log_every=3)
    plan, prediction = a_plan(), Prediction(0.9, 0.012, 35)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        report.step(plan, prediction, 30, {}, "a", 60)  # (the first is reported at once)
        for events in ([T.DERIVED, T.PLANNED, T.HELD], [T.DERIVED, T.PLANNED, T.REFITTED], [T.PLANNED]):
            report.step(plan, prediction, 30, {}, "b", 60, events=events)
    said = [r.getMessage() for r in caplog.records]
    assert said[-1] == ("slackswap: since the last report: 2 x a plan derived for new shapes; 1 x a derived plan's "
                        "dims fitted to its first step, derived again")


def test_every_rank_writes_its_own_summary_marked_running_until_the_job_ends(tmp_path, monkeypatch):
    """Rank 0 at summary_file, rank 1 beside it; from its first step a rank's file says the job
    runs (an earlier job's file never looks like this one's), then how it ended."""
    path = tmp_path / "summary.json"
    path.write_text('{"steps": {"planned": 99}}')  # an earlier job's
    from slackswap_ds import job_report

    for rank in (0, 1):  # (this process's rank as a job's: a process group another test left says 0)
        monkeypatch.setattr(job_report, "job_rank", lambda rank=rank: rank)
        report = reports(summary_file=str(path))
        report.started()
        mine = path if rank == 0 else tmp_path / "summary.rank1.json"
        assert json.loads(mine.read_text()) == {"state": "running", "rank": rank}
        report.unplanned("warm-up", 10, {})
        data = report.end_of_job(state="stopped by SIGTERM")
        assert json.loads(mine.read_text()) == data and data["state"] == "stopped by SIGTERM" and data["rank"] == rank


def test_a_job_stopped_by_sigterm_writes_its_summary_then_ends_by_the_signal(tmp_path):
    """A scheduler's preemption: SIGTERM ends a Python process without atexit, so no summary was
    written and the previous job's file stayed, looking current. Now the summary is written, marked
    as stopped, and then the signal acts as it would have (the process ends by SIGTERM)."""
    import signal
    import subprocess
    import sys
    import time

    from jobs import ROOT, cpu_env

    path = tmp_path / "summary.json"
    path.write_text('{"steps": {"planned": 99}}')  # the previous job's
    script = f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT / "tests")!r})
from test_lifecycle import Stack, lifecycle_of, engine_step, x_of
from slackswap_ds.job_report import at_exit
model = Stack()
lifecycle = lifecycle_of(model, summary_file={str(path)!r})
at_exit(lifecycle.end_of_job)
for _ in range(3):
    engine_step(lifecycle, model, x_of(8))
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            break
    assert proc.poll() is None, proc.stdout.read()
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM and time.monotonic() - began < 30
    data = json.loads(path.read_text())
    assert data["state"] == "stopped by SIGTERM" and data["steps"] == {"warm-up": 1, "profiled": 1, "planned": 1,
                                                                        "shelter": 0}


def test_on_a_gpu_the_summary_compares_the_hooks_host_time_with_the_predicted_kernel_time(caplog):
    """The host time in SlackSwap's hooks (replays excluded) beside the forward and backward its plan
    predicts: said on a GPU, where the kernels run asynchronously and the host only has to stay
    ahead; on a CPU the kernels are host time too, and only the JSON has the figures."""
    plan, prediction = a_plan(), Prediction(0.9, 0.012, 35)  # 12 ms of forward and backward
    for device, said in (("cuda", True), ("cpu", False)):
        cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4"}})
        report = StepReports(cfg, load_hardware(cfg.hardware), device)
        for hooks_s in (0.002, 0.003, 0.0031):
            report.step(plan, prediction, 30, {}, "[(2, 8)]", 60, hooks_host_s=hooks_s)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slackswap_ds"):
            data = report.end_of_job()
        assert (data["hooks_host_ms"], data["predicted_kernels_ms"], data["device_type"]) == (3.0, 12.0, device)
        lines = [r.getMessage() for r in caplog.records if "hooks" in r.getMessage()]
        assert lines == (["slackswap summary: host time in SlackSwap's hooks: median 3.00 ms per planned step, 25.0% "
                          "of the 12.00 ms its plan predicts for forward and backward (hidden while the host stays "
                          "ahead of the GPU)"] if said else [])

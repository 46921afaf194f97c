"""Chrome-trace export: exact events of a tiny hand-made step, generality, and the sweep plot."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from slackswap_ds.hardware import Hardware
from slackswap_ds.plan import Decision, Plan, lower
from slackswap_ds.sim_report import (
    BUDGET_COUNTER,
    MEMORY_COUNTER,
    ReportError,
    chrome_trace,
    plot_sweep,
    trace_busy_us,
    write_trace,
)
from slackswap_ds.simulator import simulate
from slackswap_ds.step_profile import Activation, Op, StepProfile

# 1 GB/s each way, also when both directions run, and no per-copy latency: 1 MB copies take 1 ms.
HW = Hardware(
    name="toy", peak_flops=1e12, matmul_efficiency=1.0, hbm_bytes=1e9, hbm_bps=1e11,
    d2h_bps=1e9, h2d_bps=1e9, duplex_d2h_bps=1e9, duplex_h2d_bps=1e9, copy_latency_s=0.0,
)


def tiny_profile() -> StepProfile:
    return StepProfile(
        name="tiny",
        ops=(
            Op("r0:0:a", 1e-3, 2e-3, "r0"),
            Op("r0:1:b", 2e-3, 4e-3, "r0"),
            Op("r1:0:c", 1e-3, 2e-3, "r1"),
        ),
        activations=(
            Activation("r0:x", 1_000_000, (0,)),
            Activation("r0:y", 2_000_000, (1,)),
            Activation("r1:z", 500_000, (2,)),
        ),
    )


def tiny_result(budget: int | None = None):
    profile = tiny_profile()
    plan = Plan.build(profile, {"r0:x": Decision.SWAP, "r0:y": Decision.KEEP, "r1:z": Decision.KEEP},
                      budget_bytes=budget or 0, hardware_digest=HW.digest, planner="hand")
    return simulate(lower(profile, plan), HW, budget_bytes=budget, ideal_s=8e-3, record=True)


def _x(trace: dict) -> set[tuple]:
    return {(e["pid"], e["tid"], e["name"], e["cat"], e["ts"], e["dur"], e["args"]["bytes"])
            for e in trace["traceEvents"] if e["ph"] == "X"}


def test_tiny_step_exact_events():
    res = tiny_result()
    tr = chrome_trace(res, title="tiny")
    assert json.loads(json.dumps(tr)) == tr  # plain JSON
    # forward a [0,1] b [1,3] c [3,4] ms; backward c [4,6] b [6,10] a [10,12] (x is back by 5 ms);
    # x copies out after a's forward [1,2] ms and back in from the end of forward [4,5] ms.
    assert _x(tr) == {
        (1, 1, "r0:0:a", "fwd", 0.0, 1000.0, 0),
        (1, 1, "r0:1:b", "fwd", 1000.0, 2000.0, 0),
        (1, 1, "r1:0:c", "fwd", 3000.0, 1000.0, 0),
        (1, 1, "r1:0:c", "bwd", 4000.0, 2000.0, 0),
        (1, 1, "r0:1:b", "bwd", 6000.0, 4000.0, 0),
        (1, 1, "r0:0:a", "bwd", 10000.0, 2000.0, 0),
        (1, 2, "r0:x", "copy_out", 1000.0, 1000.0, 1_000_000),
        (1, 3, "r0:x", "copy_in", 4000.0, 1000.0, 1_000_000),
    }
    counters = [(e["ts"], e["args"]["bytes"]) for e in tr["traceEvents"]
                if e["ph"] == "C" and e["name"] == MEMORY_COUNTER]
    assert counters == [
        (0.0, 0),
        (1000.0, 1_000_000),  # x saved
        (2000.0, 0),  # x's device copy released when its copy-out ends
        (3000.0, 2_000_000),  # y
        (4000.0, 2_500_000),  # z
        (4000.0, 3_500_000),  # x's copy-in starts
        (6000.0, 3_000_000),  # z freed
        (10000.0, 1_000_000),  # y freed
        (12000.0, 0),  # x freed
    ]
    assert max(b for _, b in counters) == res.peak_bytes == 3_500_000
    assert not any(e["name"] == BUDGET_COUNTER for e in tr["traceEvents"])
    assert trace_busy_us(tr, "compute") == pytest.approx(12000.0)
    assert tr["otherData"]["title"] == "tiny"
    assert tr["otherData"]["step_s"] == pytest.approx(12e-3)


def test_metadata_names_processes_and_tracks():
    tr = chrome_trace(tiny_result(), title="tiny")
    meta = [e for e in tr["traceEvents"] if e["ph"] == "M"]
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"} == {(1, "GPU 0")}
    assert {(e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"} == {
        (1, "compute"), (2, "d2h"), (3, "h2d")}
    # metadata first, then events in time order
    phases = [e["ph"] for e in tr["traceEvents"]]
    assert phases[: len(meta)] == ["M"] * len(meta)
    ts = [e["ts"] for e in tr["traceEvents"][len(meta):]]
    assert ts == sorted(ts)


def test_budget_series():
    res = tiny_result(budget=4_000_000)
    tr = chrome_trace(res, title="tiny", budget_bytes=4_000_000)
    budget = [(e["ts"], e["args"]["budget"]) for e in tr["traceEvents"] if e["name"] == BUDGET_COUNTER]
    assert budget == [(0.0, 4_000_000), (12000.0, 4_000_000)]
    assert tr["otherData"]["budget_bytes"] == 4_000_000


def test_any_result_like_object_and_several_gpus(tmp_path):
    ev = SimpleNamespace
    fake = SimpleNamespace(
        events=[ev(gpu=0, stream="compute", kind="fwd", name="op", start=0.0, end=0.5, nbytes=0),
                ev(gpu=1, stream="optimizer", kind="step", name="adam", start=0.25, end=0.75, nbytes=0),
                ev(gpu=1, stream="d2h", kind="copy_out", name="t", start=0.5, end=1.0, nbytes=7)],
        memory=[(0, 0.0, 0), (1, 0.5, 7)],
    )
    tr = chrome_trace(fake, title="measured")
    assert _x(tr) == {(1, 1, "op", "fwd", 0.0, 500000.0, 0), (2, 4, "adam", "step", 250000.0, 500000.0, 0),
                      (2, 2, "t", "copy_out", 500000.0, 500000.0, 7)}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert names[(2, 4)] == "optimizer"
    procs = {e["pid"]: e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "GPU 0", 2: "GPU 1"}
    assert "step_s" not in tr["otherData"]

    path = write_trace(fake, tmp_path / "m.json", title="measured")
    assert json.loads(path.read_text()) == tr


def test_empty_result_is_a_valid_trace():
    tr = chrome_trace(SimpleNamespace(events=(), memory=()), title="empty", budget_bytes=5)
    assert tr["traceEvents"] == []


def _rows():
    rows = []
    for w in ("bert-large", "gpt2-xl"):
        for b in (0.3, 0.5, 0.7):
            for p, tp in (("slackswap", 90 + 10 * b), ("full-recompute", 75.0)):
                rows.append({"workload": w, "budget": b, "hardware": "a100-80g-pcie4", "planner": p,
                             "throughput_pct": None if (p == "slackswap" and b == 0.3) else tp,
                             "step_s": 1.0, "ideal_s": 1.0, "peak_bytes": 1, "budget_bytes": int(b * 1e9),
                             "feasible": not (p == "slackswap" and b == 0.3)})
    return rows


def test_plot_sweep_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_sweep(_rows(), tmp_path / "sweep.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_sweep_byte_budgets(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows()
    for r in rows:
        r["budget"] = r["budget_bytes"] = int(r["budget"] * 40e9)
    assert plot_sweep(rows, tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_sweep_no_rows(tmp_path):
    with pytest.raises(ReportError):
        plot_sweep([], tmp_path / "x.png")

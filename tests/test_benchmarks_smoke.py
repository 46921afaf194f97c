"""Smoke tests of the benchmark scripts: each `main(["--quick", ...])` runs and writes its JSON with the
documented keys. The optimal (MILP) planner is left out here: it is slow and the benchmark rows for it
are the same code path as for any other planner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slackswap_ds.planners import Share

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import budget_sweep, node_dgx, planner_speed  # noqa: E402
from slackswap_ds.hardware import load_node  # noqa: E402
from slackswap_ds.planners import PLANNERS  # noqa: E402
from slackswap_ds.simulator import SimEvent  # noqa: E402

FAST_PLANNERS = ",".join(p for p in PLANNERS if p != "optimal")


def test_budget_sweep_quick(tmp_path, capsys):
    assert budget_sweep.main(["--quick", "--out", str(tmp_path), "--planners", FAST_PLANNERS]) == 0
    rows = json.loads((tmp_path / "budget_sweep.json").read_text())
    assert isinstance(rows, list)
    assert len(rows) == 2 * len(PLANNERS) - 2  # bert-large x {0.3, 0.6} x every planner but optimal
    required = {"workload", "budget", "hardware", "planner", "throughput_pct", "step_s", "ideal_s", "peak_bytes",
                "budget_bytes", "feasible", "error"}
    for r in rows:
        assert required <= set(r)
        assert r["workload"] == "bert-large" and r["budget"] in (0.3, 0.6)
        if r["feasible"]:
            assert r["error"] is None and 0 < r["throughput_pct"] <= 100.0 + 1e-9
            assert r["peak_bytes"] <= r["budget_bytes"]
        else:
            assert r["error"]
    # keep-all can never fit a budget below 1; slackswap must fit 0.6
    assert not any(r["feasible"] for r in rows if r["planner"] == "keep-all")
    assert any(r["feasible"] for r in rows if r["planner"] == "slackswap" and r["budget"] == 0.6)
    assert "slackswap" in capsys.readouterr().out
    assert budget_sweep.main(["--replot", "--out", str(tmp_path), "--no-plot"]) == 0  # tables from the JSON
    assert "recompute-knapsack" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "budget_sweep.png").stat().st_size > 0


def test_node_dgx_quick(tmp_path, capsys):
    assert node_dgx.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "node_dgx.json").read_text())
    assert doc["node"] == "dgx-a100" and doc["gpus"] == 8 and doc["definitions"]
    rows = doc["rows"]
    assert {(r["workload"], r["planner"], r["mode"]) for r in rows} == {
        ("gpt2-xl", "slackswap", "shared"), ("gpt2-xl", "slackswap", "private")}
    for r in rows:
        assert set(node_dgx.ROW_KEYS) <= set(r)
        if r["throughput_pct"] is not None:
            assert r["uplink_oversub_d2h"] >= 0 and r["uplink_oversub_h2d"] >= 0
            assert len(r["per_switch"]) == 2 * 4  # 4 switches x 2 directions
        assert r["bound_throughput_pct"] is None  # only the optimal planner has a proven bound
    # stagger: one entry per row with a plan; offset 0 is the row's own node simulation
    by_mode = {r["mode"]: r for r in rows if r["throughput_pct"] is not None}
    assert {e["mode"] for e in doc["stagger"]} == set(by_mode)
    for e in doc["stagger"]:
        offs = e["offsets"]
        assert [o["fraction"] for o in offs] == list(node_dgx.STAGGER_FRACTIONS) == doc["stagger_fractions"]
        assert offs[0]["d_s"] == 0 and offs[0]["throughput_pct"] == by_mode[e["mode"]]["throughput_pct"]
        assert all(o["throughput_pct"] <= o["cap_pct"] + 1e-9 for o in offs)
        assert e["best"]["throughput_pct"] == max(o["throughput_pct"] for o in offs
                                                  if o["feasible"] == e["best"]["feasible"])
    out = capsys.readouterr().out
    assert "oversubscription" in out and "Staggered starts" in out


def test_node_dgx_bound_comes_back_from_the_forked_planner_call():
    # the planner runs in a forked child (--planner-timeout): the bound must come back with the plan.
    # A small profile keeps the MILP fast.
    from benchmarks._common import call_with_timeout
    from slackswap_ds.planners import PRIVATE
    from slackswap_ds.budget import resolve_budget
    from slackswap_ds.workloads import workload

    node = load_node("dgx-a100")
    p = workload("bert-large", node.gpu, micro_batch=2, seq=128)
    budget = resolve_budget(0.5, p)
    plan, bound = call_with_timeout(node_dgx.plan_with_bound, ("optimal", p, node.gpu, budget, PRIVATE), {}, 60)
    incumbent, lower, model_budget = bound
    assert plan.planner == "optimal" and model_budget == budget
    assert 0 <= lower <= incumbent + 1e-12


def test_uplink_oversubscription_by_hand():
    node = load_node("dgx-a100")  # 2 GPUs per switch
    lat = node.gpu.copy_latency_s
    ev = [
        # switch 0, d2h: GPU 0 moves bytes on [0, 1), GPU 1 on [0.5, 2): two at once on [0.5, 1)
        SimEvent(0, "d2h", "copy_out", "a", 0.0 - lat, 1.0, 10),
        SimEvent(1, "d2h", "copy_out", "b", 0.5 - lat, 2.0, 10),
        # switch 0, h2d: back to back (end == start): never two at once
        SimEvent(0, "h2d", "copy_in", "a", 0.0 - lat, 1.0, 10),
        SimEvent(1, "h2d", "copy_in", "b", 1.0 - lat, 2.0, 10),
        # switch 1 (GPU 2), compute events are ignored
        SimEvent(2, "d2h", "copy_out", "c", 0.0 - lat, 1.0, 10),
        SimEvent(2, "compute", "fwd", "op", 0.0, 3.0, 0),
    ]
    over = node_dgx.uplink_oversubscription(tuple(ev), node)
    u = node.switch_uplink_bps
    assert over[(0, "d2h")][0] == pytest.approx(2 * node.gpu.d2h_bps / u)
    assert over[(0, "h2d")][0] == pytest.approx(node.gpu.h2d_bps / u)
    assert over[(1, "d2h")][0] == pytest.approx(node.gpu.d2h_bps / u)
    expect_over_s = 0.5 if 2 * node.gpu.d2h_bps > u else 0.0
    assert over[(0, "d2h")][1] == pytest.approx(expect_over_s)
    assert set(over) == {(0, "d2h"), (0, "h2d"), (1, "d2h")}
    # copies planned at each rank's share of the uplink ask exactly what it carries, never more
    shared = node_dgx.uplink_oversubscription(tuple(ev), node, Share.of_node(node))
    assert shared[(0, "d2h")] == (pytest.approx(1.0), 0.0)


def test_planner_speed_quick(tmp_path, capsys):
    assert planner_speed.main(["--quick", "--out", str(tmp_path)]) == 0  # a report: 0 even on FAIL
    doc = json.loads((tmp_path / "planner_speed.json").read_text())
    rows = doc["rows"]
    assert [r["name"] for r in rows] == ["plan llama-7b", "plan llama-70b", "simulate llama-70b"]
    for r in rows:
        assert set(planner_speed.ROW_KEYS) <= set(r)
        assert r["repeats"] == 2 and len(r["samples_s"]) == 2
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["passed"] == (r["median_s"] <= r["target_s"])
    out = capsys.readouterr().out
    assert "PASS" in out or "FAIL" in out


def test_gpu_validate_skips_cleanly_without_cuda(capsys):
    import torch

    from benchmarks import gpu_validate

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run the script itself")
    assert gpu_validate.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_runtime_cpu_prints_ratios(capsys):
    from benchmarks import runtime_cpu

    assert runtime_cpu.main(["--layers", "2", "--hidden", "64", "--seq", "16", "--batch", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("unmodified", "keep-all plan", "swap-all", "recompute-all", "slackswap @0.5"):
        assert row in out


def test_gpu_validate_dry_run_exercises_its_code_on_cpu(capsys):
    """The GPU script cannot run here; its code paths do, with tiny shapes (nothing measured)."""
    pytest.importorskip("transformers")
    from benchmarks import gpu_validate

    assert gpu_validate.main(["--dry-run", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "slackswap @0.5" in out and "throughput ratio" in out


def test_overhead_cpu_prints_the_comparison(capsys):
    pytest.importorskip("transformers")
    from benchmarks import overhead_cpu

    assert overhead_cpu.main(["--layers", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("slackswap keep-all", "slackswap recompute R", "torch SAC, policy R", "torch checkpoint"):
        assert row in out
    assert "target: slackswap recompute R adds <= torch SAC" in out


def test_fidelity_prints_every_row_with_its_ratio(tmp_path, capsys):
    from benchmarks import fidelity

    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 17 and all(r["ratio"] == r["predicted"] / r["measured"] for r in rows)
    assert all(r["note"] for r in rows if not r["within_target"])  # every miss says why
    assert "rows within" in capsys.readouterr().out


def test_zero_offload_compares_both_plans(capsys):
    from benchmarks import zero_offload

    assert zero_offload.main() == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if "ZeRO" in l]
    assert len(lines) == 8 and sum("knows ZeRO" in l for l in lines) == 4

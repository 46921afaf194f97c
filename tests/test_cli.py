"""The `slackswap` command: JSON rows, errors, budgets, traces, plans. Small shapes keep it fast;
no test depends on a planner's throughput number (planners keep improving)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from slackswap_ds.cli import main, parse_budget
from slackswap_ds.hardware import load_hardware, load_node, preset_names
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.planners import PLANNERS, get_planner
from slackswap_ds.sim_report import MEMORY_COUNTER, short_source, trace_busy_us
from slackswap_ds.workloads import PRESETS, workload, workload_names

SMALL = ["--workload", "bert-large", "--seq", "128", "--micro-batch", "2"]
FAST = ["slackswap", "full-recompute", "offload-all", "keep-all"]  # no MILP: keep the suite fast
REQUIRED = {
    "workload": str, "budget": (int, float), "hardware": str, "planner": str,
    "throughput_pct": (float, type(None)), "step_s": (float, type(None)), "ideal_s": float,
    "peak_bytes": (int, type(None)), "budget_bytes": int, "feasible": bool,
}


def run_json(capsys, *argv: str) -> list[dict]:
    rc = main(["simulate", *argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)  # stdout is nothing but the JSON list


def test_json_rows_keys_and_types(capsys):
    rows = run_json(capsys, *SMALL, "--planner", *FAST)
    assert [(r["workload"], r["budget"], r["hardware"], r["planner"]) for r in rows] == [
        ("bert-large", 0.5, "a100-80g-pcie4", p) for p in FAST]
    profile = workload("bert-large", "a100-80g-pcie4", seq=128, micro_batch=2)
    for r in rows:
        assert REQUIRED.keys() <= r.keys()
        for k, t in REQUIRED.items():
            assert isinstance(r[k], t), (k, r[k])
        assert not isinstance(r["budget_bytes"], bool) and not isinstance(r["peak_bytes"], bool)
        assert r["budget_bytes"] == int(0.5 * profile.total_bytes)
        assert r["ideal_s"] == pytest.approx(profile.forward_s + profile.backward_s)
        if r["feasible"]:
            assert r["peak_bytes"] <= r["budget_bytes"]
            assert 0 < r["throughput_pct"] <= 100.0 + 1e-9
            assert r["step_s"] >= r["ideal_s"] * (1 - 1e-12)
            assert r["throughput_pct"] == pytest.approx(100 * r["ideal_s"] / r["step_s"])
            # the bytes of the plan's SWAP and RECOMPUTE decisions, summed here from the same planner's plan
            plan = get_planner(r["planner"])(profile, load_hardware(r["hardware"]), r["budget_bytes"]).plan
            fate = {d: sum(a.bytes for a in profile.activations if plan.decision[a.key] is d) for d in Decision}
            assert (r["swapped_bytes"], r["recomputed_bytes"]) == (fate[Decision.SWAP], fate[Decision.RECOMPUTE])
            # what is kept stays on the device through the peak (packed, if the plan packs it): the rest leaves it
            packed_away = sum(a.bytes - a.packed_bytes for a in profile.activations
                              if a.key in plan.packed and plan.decision[a.key] is Decision.KEEP)
            assert r["swapped_bytes"] + r["recomputed_bytes"] + packed_away >= profile.total_bytes - r["budget_bytes"]
            assert r["pack_s"] == pytest.approx(sum(2 * profile.by_key[k].pack_s for k in plan.packed))
            assert set(r["stall_s"]) == {"compute", "d2h", "h2d"}
        else:
            assert isinstance(r["error"], str) and r["error"]
    keep_all = rows[FAST.index("keep-all")]  # the keep-all peak is twice a 50% budget
    assert keep_all["feasible"] is False and keep_all["throughput_pct"] is None
    full_recompute, offload_all = rows[FAST.index("full-recompute")], rows[FAST.index("offload-all")]
    assert full_recompute["feasible"] is True
    assert full_recompute["recomputed_bytes"] > 0 and full_recompute["swapped_bytes"] == 0
    assert offload_all["swapped_bytes"] > 0 and offload_all["recomputed_bytes"] == 0


def test_full_budget_fits_every_planner(capsys):
    rows = run_json(capsys, *SMALL, "--layers", "4", "--budget", "1.0",
                    "--planner", *[p for p in PLANNERS if p not in ("optimal", "recompute-knapsack", "torchtitan-ilp")])
    assert all(r["feasible"] for r in rows)  # a 100% budget fits everything


def test_table_output_and_paper_line(capsys):
    assert main(["simulate", "--workload", "bert-large", "--planner", "slackswap", "keep-all"]) == 0
    out = capsys.readouterr().out
    assert "bert-large on a100-80g-pcie4" in out and "ideal step" in out and "keep-all peak" in out
    assert "Devlin et al. 2018" in out
    lines = out.splitlines()
    assert any(line.split()[:1] == ["slackswap"] for line in lines)
    assert any(line.split()[:1] == ["keep-all"] and "infeasible" in line for line in lines)
    assert "96.3%" in out and "2610.13003" in out
    # the paper's number is for a 50% budget only
    assert main(["simulate", "--workload", "bert-large", "--planner", "slackswap", "--budget", "0.6"]) == 0
    assert "2610.13003" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, kind, valid", [
    (["--workload", "bert-huge"], "workload", workload_names()),
    (["--hardware", "a100-nope"], "gpu preset", preset_names("gpu")),
    (["--node", "dgx-nope"], "node preset", preset_names("node")),
    (["--planner", "magic"], "planner", list(PLANNERS)),
])
def test_unknown_names_exit_2_and_list_choices(capsys, argv, kind, valid):
    rc = main(["simulate", *SMALL[2:], *argv] if argv[0] == "--workload" else ["simulate", *SMALL, *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("slackswap: error: unknown " + kind)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for name in valid:
        assert name in err


def test_plan_unknown_names_exit_2(capsys, tmp_path):
    assert main(["plan", "-w", "nope", "-b", "0.5", "-o", str(tmp_path / "p.json")]) == 2
    assert "valid choices" in capsys.readouterr().err
    assert main(["plan", "-w", "bert-large", "-b", "0.5", "-p", "nope", "-o", str(tmp_path / "p.json")]) == 2
    assert "slackswap" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_budget_parsing():
    b = parse_budget("12GiB")
    assert b.value == 12 * 2**30 and not b.is_fraction
    b = parse_budget("0.5")
    assert b.value == 0.5 and b.is_fraction
    assert parse_budget("50%") == parse_budget("0.5")
    assert parse_budget("1") == parse_budget("100%")  # 1 is the whole keep-all peak, not one byte
    assert parse_budget("8e9").value == 8_000_000_000 and not parse_budget("8e9").is_fraction
    assert parse_budget("16GB").value == 16 * 10**9
    assert parse_budget("512 MiB").value == 512 * 2**20
    assert parse_budget("1.5gib").value == 3 * 2**29
    assert parse_budget("100B").value == 100
    for bad in ("abc", "0", "-1", "0.0", "12XB", "150%", "", "nan", "GiB", "1.5", "2.5e0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_budget(bad)


def test_bad_budget_is_an_argparse_error(capsys):
    assert main(["simulate", *SMALL, "--budget", "lots"]) == 2
    err = capsys.readouterr().err
    assert "invalid budget 'lots'" in err and "Traceback" not in err
    # the config's rule: a float above 1 is ambiguous (a mistaken fraction?), not 2 bytes
    assert main(["simulate", *SMALL, "--budget", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "invalid budget '1.5'" in err and "not a whole number of bytes" in err


def test_byte_budget_rows(capsys):
    rows = run_json(capsys, *SMALL, "--planner", "full-recompute", "--budget", "100MiB", "0.5")
    assert [r["budget"] for r in rows] == [100 * 2**20, 0.5]
    assert rows[0]["budget_bytes"] == 100 * 2**20 and isinstance(rows[0]["budget"], int)


def test_long_sweep_progress_goes_to_stderr(capsys):
    budgets = ["0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0"]
    assert main(["simulate", *SMALL, "--planner", "full-recompute", "--budget", *budgets, "--json"]) == 0
    cap = capsys.readouterr()
    rows = json.loads(cap.out)
    assert len(rows) == len(budgets)
    assert "[7/7]" in cap.err


def test_trace_matches_the_simulated_step(capsys, tmp_path):
    path = tmp_path / "step.json"
    rows = run_json(capsys, *SMALL, "--planner", "slackswap", "--trace", str(path))
    (row,) = rows
    assert row["feasible"]
    trace = json.loads(path.read_text())
    assert isinstance(trace["traceEvents"], list)
    # compute busy time = forward + backward (the keep-all step) + recomputation + packing kernels
    busy_us = (row["ideal_s"] + row["recompute_s"] + row["pack_s"]) * 1e6
    n_compute = sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1)
    assert trace_busy_us(trace, "compute") == pytest.approx(busy_us, abs=1e-3 * n_compute)
    mem = [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == MEMORY_COUNTER]
    assert max(mem) == row["peak_bytes"] == trace["otherData"]["peak_bytes"]
    assert trace["otherData"]["budget_bytes"] == row["budget_bytes"]
    end_us = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X")
    assert end_us == pytest.approx(row["step_s"] * 1e6, abs=1e-2)


def test_unwritable_trace_is_a_clean_error_after_the_json(capsys, tmp_path):
    rc = main(["simulate", *SMALL, "--planner", "slackswap", "--json", "--trace", str(tmp_path / "no" / "t.json")])
    cap = capsys.readouterr()
    assert rc == 2
    assert len(json.loads(cap.out)) == 1
    assert cap.err.strip().splitlines()[-1].startswith("slackswap: error: cannot write trace")


def test_trace_without_slackswap_in_the_planners(capsys, tmp_path):
    path = tmp_path / "step.json"
    assert main(["simulate", *SMALL, "--planner", "full-recompute", "--trace", str(path)]) == 0
    assert "slackswap" in json.loads(path.read_text())["otherData"]["title"]


def test_node_simulation(capsys, tmp_path):
    node = load_node("dgx-a100")
    path = tmp_path / "node.json"
    rows = run_json(capsys, *SMALL, "--node", "dgx-a100", "--planner", "slackswap", "full-recompute",
                    "--trace", str(path))
    assert {r["hardware"] for r in rows} == {"dgx-a100"}
    for r in rows:
        if r["feasible"]:
            assert r["peak_bytes"] <= r["budget_bytes"]
    trace = json.loads(path.read_text())
    procs = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(procs) == node.gpus


def test_hardware_and_node_together_is_an_error(capsys):
    assert main(["simulate", *SMALL, "--node", "dgx-a100", "--hardware", "a100-80g-pcie4"]) == 2
    assert "not both" in capsys.readouterr().err


def test_plan_writes_a_loadable_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    argv = ["plan", "--workload", "bert-large", "--seq", "128", "--micro-batch", "2", "--budget", "0.5",
            "-o", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "slackswap plan for bert-large" in out[0]
    profile = workload("bert-large", "a100-80g-pcie4", seq=128, micro_batch=2)
    plan = Plan.load(path, profile=profile)  # made for this profile, and fits it
    assert plan.planner == "slackswap"
    assert plan.budget_bytes == int(0.5 * profile.total_bytes)
    assert plan.digest[:12] in out[0]
    again = Plan.from_json(json.loads(plan.canonical_json()))
    assert again.digest == plan.digest
    # writing to stdout gives the plan, with the summary on stderr (its digest: the same plan where the
    # search was not cut by its time both times; on a loaded machine another one as fast may come first)
    assert main(argv[:-1] + ["-"]) == 0
    cap = capsys.readouterr()
    printed = Plan.from_json(json.loads(cap.out))
    assert printed.profile_digest == plan.profile_digest and printed.budget_bytes == plan.budget_bytes
    assert printed.digest[:12] in cap.err and not cap.out.startswith("slackswap")


def test_plan_infeasible_budget_is_a_clean_error(capsys, tmp_path):
    assert main(["plan", *SMALL, "--budget", "1MB", "--planner", "full-recompute",
                 "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slackswap: error: ") and "Traceback" not in err


def test_plot_option(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    run_json(capsys, *SMALL, "--planner", "full-recompute", "--budget", "0.4", "0.8", "--plot", str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_fails_first_and_names_the_extra(capsys, monkeypatch, tmp_path):
    """--plot without matplotlib (`.[test]` does not install it) printed every table and then failed
    with "plots need matplotlib: pip install matplotlib": now it fails before any work, on one line
    naming the `plot` extra."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    path = tmp_path / "sweep.png"
    assert main(["simulate", *SMALL, "--planner", "full-recompute", "--plot", str(path)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and not path.exists()
    assert cap.err.startswith("slackswap: error: --plot needs matplotlib, which cannot be imported here (")
    assert cap.err.endswith("): pip install 'slackswap_ds[plot]'\n") and len(cap.err.splitlines()) == 1


@pytest.mark.parametrize("budgets, gb_axis", [(["0.4", "0.8"], "top"), (["100MB", "auto"], "bottom")])
def test_the_sweep_plot_keeps_its_title_inside_and_shows_the_budget_in_gb(capsys, budgets, gb_axis):
    """The title of a one-workload plot ran past both edges of the figure; with fractions the x axis
    had no GB. Now the title is wrapped to the figure's width, and GB is on the top axis (of the
    workload's keep-all peak) when the bottom one is a % of it."""
    pytest.importorskip("matplotlib")
    from slackswap_ds.sim_report import sweep_figure

    rows = run_json(capsys, *SMALL, "--planner", "slackswap", "full-recompute", "--budget", *budgets)
    fig = sweep_figure(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (title,) = [t for t in fig.texts if "simulated throughput" in t.get_text()]
    box, inside = fig.bbox, title.get_window_extent(renderer)
    assert box.x0 <= inside.x0 and inside.x1 <= box.x1 and inside.y1 <= box.y1
    (ax,) = fig.axes[:1]
    if gb_axis == "top":
        assert ax.get_xlabel() == "budget (% of the keep-all peak)"
        (top,) = ax.child_axes
        keep_all = rows[0]["budget_bytes"] / rows[0]["budget"] / 1e9
        assert top.get_xlabel() == f"budget (GB; keep-all peak {keep_all:.2f} GB)"
    else:
        assert ax.get_xlabel() == "budget (GB of saved activations)"


def test_native_solver_chatter_stays_off_stdout(capfd, monkeypatch):
    """Native code (HiGHS) prints on file descriptor 1; --json output must still parse."""
    import os

    full = PLANNERS["full-recompute"]

    def noisy(profile, hw, budget_bytes, share=None):
        os.write(1, b"solver chatter\n")
        return full(profile, hw, budget_bytes, share=share)

    monkeypatch.setitem(PLANNERS, "noisy", noisy)
    assert main(["simulate", *SMALL, "--planner", "noisy", "--json"]) == 0
    cap = capfd.readouterr()
    assert [r["planner"] for r in json.loads(cap.out)] == ["noisy"]
    assert "solver chatter" in cap.err


def test_a_crashing_planner_marks_its_row(capsys, monkeypatch):
    def broken(profile, hw, budget_bytes, share=None):
        raise TypeError("boom")

    monkeypatch.setitem(PLANNERS, "broken", broken)
    assert main(["simulate", *SMALL, "--planner", "broken", "full-recompute", "--json"]) == 0
    cap = capsys.readouterr()
    rows = json.loads(cap.out)
    assert rows[0]["feasible"] is False and "boom" in rows[0]["error"]
    assert rows[1]["feasible"] is True
    assert "internal error in planner 'broken'" in cap.err and "Traceback" not in cap.err


def test_no_command_and_help(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out


def test_short_source():
    assert short_source(PRESETS["gpt2-xl"].source) == "Radford et al. 2019 + karpathy/llm.c"
    assert short_source("measured by hand") == "measured by hand"
    assert short_source("x" * 70) == "x" * 57 + "..."


def test_a_malformed_workload_preset_is_a_clean_error(capsys, tmp_path, monkeypatch):
    (tmp_path / "tiny.json").write_text("{ not json")
    monkeypatch.setenv("SLACKSWAP_WORKLOADS_DIR", str(tmp_path))
    assert main(["simulate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slackswap: error: workload file") and str(tmp_path / "tiny.json") in err


HF = str(__import__("pathlib").Path(__file__).resolve().parent / "data" / "hf_configs")


def test_simulate_a_users_hugging_face_config(capsys):
    rows = run_json(capsys, "--model", f"{HF}/gpt2-xl.json", "--seq", "128", "--micro-batch", "2",
                    "--layers", "2", "--planner", *FAST)
    preset = run_json(capsys, "--workload", "gpt2-xl", "--seq", "128", "--micro-batch", "2", "--layers", "2",
                      "--planner", *FAST)
    # the config of the preset's model gives the preset's bytes and times
    assert [r["peak_bytes"] for r in rows] == [r["peak_bytes"] for r in preset]
    assert [r["ideal_s"] for r in rows] == [r["ideal_s"] for r in preset]


@pytest.mark.parametrize("argv, message", [
    (["--model", f"{HF}/Mixtral-8x7B-v0.1.json"], "give --seq and --micro-batch too"),
    (["--workload", "gpt2-xl", "--tp", "3"], r"cannot cut 'gpt2-xl' 3 ways: heads \(25\)"),
    (["--workload", "llama-7b", "--sp"], "give --tp > 1"),
    (["--model", f"{HF}/nope.json", "--seq", "8", "--micro-batch", "1"], "nope.json"),
])
def test_model_and_parallel_errors_are_one_line(capsys, argv, message):
    import re

    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.startswith("slackswap: error:") and "Traceback" not in err


def test_tensor_parallel_rows_are_one_rank_of_the_cut(capsys):
    base = ["--workload", "llama-7b", "--seq", "256", "--micro-batch", "1", "--layers", "2", "--planner", "keep-all",
            "--budget", "1.0"]
    (whole,) = run_json(capsys, *base)
    (cut,) = run_json(capsys, *base, "--tp", "4", "--sp")
    assert cut["peak_bytes"] < whole["peak_bytes"] / 2 and cut["ideal_s"] < whole["ideal_s"]
    assert main(["simulate", *base, "--tp", "4"]) == 0
    assert "one rank of tp 4" in capsys.readouterr().out


def test_plan_from_a_model_config(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{HF}/Llama-2-7b-hf.json", "--seq", "256", "--micro-batch", "1", "--layers", "2",
                 "--budget", "0.5", "-o", str(out)]) == 0
    assert Plan.load(out).planner == "slackswap"
    assert main(["plan", "--budget", "0.5", "-o", str(out)]) == 2
    assert "give --workload W or --model" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["gpt2-xl", "bert-large-uncased", "Llama-2-7b-hf", "Mistral-7B-v0.1", "Qwen2-7B",
                                    "Mixtral-8x7B-v0.1"])
def test_every_supported_family_simulates_from_its_config(capsys, config):
    # two layers: the head's vocabulary-sized log-probs are most of the step, so a loose budget
    rows = run_json(capsys, "--model", f"{HF}/{config}.json", "--seq", "128", "--micro-batch", "1", "--layers", "2",
                    "--budget", "0.9", "--planner", "slackswap", "keep-all")
    assert [r["planner"] for r in rows] == ["slackswap", "keep-all"]
    assert rows[0]["feasible"] and rows[0]["peak_bytes"] <= rows[0]["budget_bytes"]
    assert not rows[1]["feasible"]  # keep-all is over any budget below the keep-all peak


def test_the_solver_is_silent_unless_asked(capfd, monkeypatch):
    """HiGHS prints lines of its own from C++ whatever `disp` says (97 in the README's `slackswap
    simulate`): dropped during each solve; anything else written meanwhile still reaches stderr;
    SLACKSWAP_SOLVER_OUTPUT=1 leaves them alone."""
    import os

    from slackswap_ds.planners.solver_output import SOLVER_OUTPUT_ENV, solver_output_dropped

    assert main(["simulate", "-w", "bert-large", "-p", "optimal", "recompute-knapsack"]) == 0
    cap = capfd.readouterr()
    assert "Highs" not in cap.out + cap.err and "recompute-knapsack" in cap.out
    with solver_output_dropped():
        os.write(2, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        os.write(1, b"another thread's line\n")
    assert capfd.readouterr().err == "another thread's line\n"
    monkeypatch.setenv(SOLVER_OUTPUT_ENV, "1")
    with solver_output_dropped():
        os.write(2, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
    assert "HighsMipSolverData" in capfd.readouterr().err


def test_simulate_says_whether_the_job_fits_the_gpu_and_its_tokens_per_second(capsys):
    """Hand-computed: BERT-Large has 24 layers of 4 h^2 (attention) + 8 h^2 (MLP) weights and a
    30522 x 1024 embedding table its MLM head reuses (tied: counted once), h = 1024:
    24 * 12 * 1024^2 + 30522 * 1024 = 333,244,416 parameters, 16 B each in mixed precision with
    Adam (2 + 2 + 12: ZeRO paper, no sharding) = 5,331,910,656 B. Llama-7B's 6,738,149,376
    parameters need 107.8 GB: nothing fits an 80 GB A100 without ZeRO. Tokens per second: the
    micro-batch's seq x micro_batch tokens over the step."""
    from slackswap_ds.budget import model_state_bytes

    params = 24 * 12 * 1024 ** 2 + 30522 * 1024
    assert params == 333_244_416 and model_state_bytes(params) == 5_331_910_656
    assert [model_state_bytes(10 ** 9, zero, 8) / 10 ** 9 for zero in (0, 1, 2, 3)] == [16, 5.5, 3.75, 2]
    hbm = load_hardware("a100-80g-pcie4").hbm_bytes
    rows = run_json(capsys, "-w", "bert-large", "llama-7b", "--planner", "slackswap", "full-recompute")
    for r in rows:
        assert r["device_bytes"] == int(hbm)
        assert r["tokens_per_s"] == pytest.approx(PRESETS[r["workload"]].seq * PRESETS[r["workload"]].micro_batch
                                                  / r["step_s"])
    bert = [r for r in rows if r["workload"] == "bert-large"]
    assert all(r["model_state_bytes"] == 5_331_910_656 and r["fits"] is (5_331_910_656 + r["peak_bytes"] <= hbm)
               for r in bert) and all(r["fits"] for r in bert)
    llama = [r for r in rows if r["workload"] == "llama-7b"]
    assert all(r["model_state_bytes"] == 16 * 6_738_149_376 and r["fits"] is False for r in llama)
    assert main(["simulate", "-w", "llama-7b", "--planner", "full-recompute"]) == 0
    assert "the model state alone does not fit (shard it: --dp with --zero)" in capsys.readouterr().out


def test_a_mistyped_name_gets_a_did_you_mean(capsys):
    assert main(["simulate", "-w", "llama7b"]) == 2
    assert 'unknown workload \'llama7b\'; did you mean "llama-7b"? valid choices:' in capsys.readouterr().err
    assert main(["simulate", "-w", "bert-large", "-p", "slackswp"]) == 2
    assert 'did you mean "slackswap"?' in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--micro-batches", "100000000", "--pp", "2"], "micro_batches 100000000 is over the simulator's limit of 4096"),
    (["--layers", "100000"], "layers 100000 is over the simulator's limit of 1024"),
    (["--layers", "1024", "--pp", "1024", "--micro-batches", "4096"],
     "pp x chunks x micro_batches is 4,194,304, over the simulator's limit of 131,072"),
])
def test_sizes_the_simulator_cannot_handle_are_refused_at_once(capsys, argv, said):
    """(100,000,000 micro-batches ran 54 s into a MemoryError; 100,000 layers past two minutes; 1024
    stages of 4096 micro-batches, each within its own limit, past two minutes too: 8.4 million events
    per simulated step, and each stage's end found by a scan of them all.)"""
    import time

    t0 = time.perf_counter()
    assert main(["simulate", "-w", "gpt2-xl", *argv]) == 2
    assert said in capsys.readouterr().err and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("argv", [
    ["--seq", "1e8"],  # was refused as not a whole number
    ["-w", "bert-large", "--seq", "100000000"],  # planned: an OverflowError row, then "over the target of 0 B"
    ["-w", "gpt2-xl", "--seq", "30000000"],  # "over the target of 8,192 B": byte counts wrapped in 64 bits
    ["-w", "llama-7b", "--micro-batch", "100000000"],
    ["-w", "gpt2-xl", "--seq", "100000000", "--pp", "2"],  # a traceback (OverflowError)
])
def test_a_shape_over_the_simulators_byte_limit_is_refused_before_any_table(capsys, argv):
    """A micro-batch whose saved activations pass 2^50 B (1 PiB) is refused with the limit, before
    anything is printed: beyond it the planners' 64-bit byte counts wrap and print nonsense targets."""
    assert main(["simulate", *argv, "-p", "slackswap"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "Traceback" not in cap.err
    assert "of activations for backward, over the simulator's limit of 1,125,899,906,842,624 B (2^50 B" in cap.err
    assert len(cap.err.strip().splitlines()) == 1


def test_the_readmes_simulated_table_is_what_slackswap_simulate_prints(capsys, monkeypatch):
    """docs/simulator.md (moved there from the README) quotes `slackswap simulate`; its BERT-Large
    group (every planner, the MILP included) is printed again here and must be the same, character
    for character (the simulator is deterministic): a change to the cost model or a planner shows up
    as a stale page. The default planner's exact search gets the time to finish however loaded the
    machine is (its 2 s stop it elsewhere: the page was printed with the same setting)."""
    from pathlib import Path

    monkeypatch.setenv("SLACKSWAP_PLAN_SEARCH_S", "60")
    page = (Path(__file__).resolve().parents[1] / "docs" / "simulator.md").read_text()
    block = page.split("## The simulated table", 1)[1].split("```\n", 2)[1]
    assert main(["simulate", "-w", "bert-large"]) == 0
    printed = capsys.readouterr().out
    assert block.split("\n\n")[0] == printed.split("\n\n")[0], "docs/simulator.md's table is stale: run slackswap simulate"


def test_plan_from_a_jobs_plan_file_says_what_it_cannot_do(tmp_path, capsys):
    """`slackswap plan --plan-file`: each way it cannot plan a job's steps again is one line naming
    the fix (the round trip through a job: tests/test_engine.py)."""
    from conftest import two_region_profile

    from slackswap_ds import plan_file
    from slackswap_ds.plan_file import PlanEntry, MadeFor

    profile, hw = two_region_profile(), load_hardware("a100-80g-pcie4")
    plan = Plan.build(profile, {a.key: Decision.KEEP for a in profile.activations}, budget_bytes=profile.total_bytes,
                      hardware_digest=hw.digest, planner="slackswap")
    made_for = MadeFor(inputs="(2, 16) torch.int64", structure=profile.structure_digest,
                       budget_bytes=profile.total_bytes, hardware=f"{hw.name} {hw.digest}", planner="slackswap",
                       share="d2h None h2d None pool None", world="1 ranks, 1 per node")
    job, out = tmp_path / "job.json", str(tmp_path / "out.json")

    def error(argv: list[str], entries: list[PlanEntry] | None = None) -> str:
        if entries is not None:
            plan_file.write(job, entries)
        assert main(["plan", "--plan-file", str(job), *argv, "-o", out]) == 2
        return capsys.readouterr().err

    assert "no plan file" in error([])
    assert "has no plans yet" in error([], [])
    assert "without the step's profile" in error([], [PlanEntry(made_for, plan)])
    other = dataclasses.replace(made_for, hardware="my-gpu 0123456789abcdef")
    assert "give its JSON file with --hardware" in error([], [PlanEntry(other, plan, profile)])
    entries = [PlanEntry(made_for, plan, profile)]
    assert "is not the hardware the job planned for" in error(["--hardware", "h100-pcie5"], entries)
    assert "leave -b out" in error(["-b", "auto"])
    assert "give no --workload" in error(["-w", "bert-large"])
    assert "give no --workload" in error(["--seq", "8"])
    # and a plan it can make: the job's budget and planner unless told otherwise
    assert main(["plan", "--plan-file", str(job), "-p", "full-recompute", "-o", out]) == 0
    (entry,) = plan_file.read(out)
    assert entry.made_for == dataclasses.replace(made_for, planner="full-recompute") and entry.profile == profile
    assert entry.plan.keys(Decision.RECOMPUTE) and '"planner": "full-recompute"' in capsys.readouterr().out


def test_attention_chooses_the_attention_implementation_of_a_model_or_a_preset(capsys):
    """--attention flash: one fused kernel (no s x s tensors saved, the causal blocks skipped);
    eager: the materialised scores of HF's eager path. For --model and for presets alike."""
    def keep_all_bytes(*argv):
        rows = run_json(capsys, *argv, "--seq", "256", "--micro-batch", "1", "--layers", "2", "--budget", "0.9",
                        "--planner", "slackswap")
        return rows[0]["budget_bytes"], rows[0]["ideal_s"]  # (the budget: 90% of the keep-all peak)

    model = ("--model", f"{HF}/gpt2-xl.json")
    default, eager, flash = (keep_all_bytes(*model), keep_all_bytes(*model, "--attention", "eager"),
                             keep_all_bytes(*model, "--attention", "flash"))
    assert default == eager  # GPT-2's family default: HF's eager attention
    assert flash[0] < eager[0] and flash[1] < eager[1]
    assert keep_all_bytes("-w", "gpt2-xl", "--attention", "flash") == flash  # the preset is the same model
    assert keep_all_bytes("-w", "llama-7b", "--attention", "eager")[0] > keep_all_bytes("-w", "llama-7b")[0]


def test_attention_names_the_fused_kernel_and_its_measured_speed_prices_it(capsys):
    """--attention fa-triton: the same fused attention (same memory) at FlashAttention's Triton
    kernel's measured speed, slower than FlashAttention-2's on A100; for --model and presets alike."""
    def keep_all(*argv):
        rows = run_json(capsys, *argv, "--seq", "1024", "--micro-batch", "1", "--layers", "2", "--budget", "0.9",
                        "--planner", "slackswap")
        return rows[0]["budget_bytes"], rows[0]["ideal_s"]

    for model in (("-w", "llama-7b"), ("--model", f"{HF}/gpt2-xl.json")):
        fa2, triton = keep_all(*model, "--attention", "flash"), keep_all(*model, "--attention", "fa-triton")
        assert triton[0] == fa2[0] and triton[1] > fa2[1]
    assert keep_all("-w", "llama-7b", "--attention", "fa1")[1] > keep_all("-w", "llama-7b")[1]


def test_a_fused_kernel_without_a_measured_speed_on_the_gpu_is_said_not_silently_replaced(capsys):
    argv = ["simulate", "-w", "llama-7b", "--attention", "fa-triton", "-p", "slackswap", "--layers", "2",
            "--seq", "256", "--json"]
    assert main([*argv, "--hardware", "h100-pcie5"]) == 0
    assert ("h100-pcie5 has no measured speed of the 'fa-triton' attention kernel; its speed is derived: fa1's "
            "rates on this GPU x fa-triton / fa1 on a100-80g-pcie4") in capsys.readouterr().err
    assert main([*argv[:4], "xformers", *argv[5:], "--hardware", "h100-pcie5"]) == 0  # neither measured nor derived
    assert "'xformers' attention kernel; FlashAttention-2's stands in for it" in capsys.readouterr().err
    assert main([*argv, "--hardware", "a100-80g-pcie4"]) == 0  # measured there: nothing to say
    assert "no measured speed" not in capsys.readouterr().err


def test_a_job_names_whose_code_shards_and_a_workload_its_fused_loss(capsys):
    argv = ["simulate", "-w", "llama-7b", "-p", "keep-all", "--layers", "2", "--seq", "256", "--node", "dgx-a100",
            "--zero", "3", "--dp", "8", "--reduce-dtype", "fp32", "--budget", "1.0", "--json"]
    steps = {}
    for extra in ((), ("--sharding", "fsdp1"), ("--fused-loss",)):
        assert main([*argv, *extra]) == 0
        row = json.loads(capsys.readouterr().out)[0]
        steps[extra] = row["step_s"]
    assert steps[("--sharding", "fsdp1")] > steps[()] > steps[("--fused-loss",)]
    ideal = {}
    for extra in ((), ("--fused-loss",)):  # a --model takes the same overrides as a preset
        assert main(["simulate", "--model", f"{HF}/gpt2-xl.json", "--seq", "256", "--micro-batch", "2", "--layers",
                     "2", "-p", "keep-all", "--json", *extra]) == 0
        ideal[extra] = json.loads(capsys.readouterr().out)[0]["ideal_s"]
    assert ideal[("--fused-loss",)] < ideal[()]


def test_a_job_takes_a_budget_in_bytes_or_auto_per_gpu(capsys):
    """`--budget auto` or a size with --dp/--zero was refused as "with --pp a budget is a fraction",
    though no --pp was given. Now a size is each GPU's budget and "auto" what each GPU has room for.
    By hand, Llama-7B with 2 layers (h 4096, ffn 11008, SwiGLU, vocab 32000, untied): a layer has
    4 h^2 + 3 h ffn = 202,375,168 weights, the embedding and the head 131,072,000 each: 666,894,336.
    ZeRO 3 over 8 ranks: (2 + 2 + 12) / 8 B each = 1,333,788,672 B of model state; gathered in 16
    bits, the two layers (running and prefetched): 809,500,672 B. "auto" on an 80 GB A100: 80e9 less
    both, less 10% of 80e9 = 69,856,710,656 B."""
    from slackswap_ds.budget import auto_budget_bytes

    base = ["-w", "llama-7b", "--layers", "2", "--seq", "256", "--micro-batch", "1", "--dp", "8", "--zero", "3",
            "-p", "slackswap"]
    rows = run_json(capsys, *base, "-b", "auto", "2GB", "0.5")
    assert [r["budget"] for r in rows] == ["auto", 2_000_000_000, 0.5]
    (device,) = rows[0]["devices"]
    assert device["params"] == 666_894_336
    assert (device["model_state_bytes"], device["gathered_bytes"]) == (1_333_788_672, 809_500_672)
    assert auto_budget_bytes(80e9, 1_333_788_672 + 809_500_672) == 69_856_710_656
    assert [r["stages"][0]["budget_bytes"] for r in rows[:2]] == [69_856_710_656, 2_000_000_000]
    assert rows[2]["stages"][0]["budget_bytes"] == rows[2]["stages"][0]["keep_all_bytes"] // 2
    for r in rows:
        assert r["feasible"] and r["stages"][0]["peak_bytes"] <= r["stages"][0]["budget_bytes"]
        assert r["tokens_per_s"] == pytest.approx(8 * 1 * 1 * 256 / r["step_s"])  # dp x micro-batches x mb x seq
    # what cannot work says why: the model state leaves "auto" nothing
    assert main(["simulate", "-w", "llama-7b", "--dp", "2", "-b", "auto", "-p", "slackswap"]) == 2
    err = capsys.readouterr().err
    assert "budget auto leaves no room for activations on pipeline rank 0" in err and "107.81 GB" in err
    assert "--pp" not in err.split("; ")[0]


def test_a_sharded_job_says_its_model_state_whether_it_fits_and_its_tokens_per_second(capsys):
    """"Does Llama-7B fit on 80 GB GPUs with ZeRO-3 at a 40 GB budget, and how fast?" answered by the
    table, not by hand: 6,738,149,376 parameters at 16 B / 8 ranks = 13.48 GB per GPU, beside the
    plan's peak; the job's tokens per second. Without ZeRO the model state alone (107.81 GB) does
    not fit, and no plan makes it fit."""
    argv = ["simulate", "-w", "llama-7b", "--dp", "8", "--zero", "3", "-b", "40GB", "-p", "slackswap"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "budget 40.00 GB per GPU" in out
    assert ("model state per GPU 13.48 GB (16 B per parameter: 16-bit weights and gradients, Adam's fp32 master, m "
            "and v; ZeRO 3 shards all three over dp 8) + 0.81 GB of 16-bit parameters gathered") in out
    assert "not counted: backward's temporaries, communication buffers, the allocator's fragmentation" in out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["planner"])
    row = next(line for line in out.splitlines() if line.split()[:1] == ["slackswap"])
    assert header.split()[-2:] == ["tok/s", "fits"] and row.split()[-1] == "yes"
    assert main([*argv, "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["fits"] is True and r["devices"][0]["model_state_bytes"] == 16 * 6_738_149_376 // 8
    assert r["devices"][0]["model_state_bytes"] + r["devices"][0]["gathered_bytes"] + r["devices"][0]["peak_bytes"] \
        <= r["device_bytes"] == 80e9
    assert float(row.split()[-2].replace(",", "")) == pytest.approx(r["tokens_per_s"], abs=0.5)
    assert r["tokens_per_s"] == pytest.approx(8 * 6 * 2048 / r["step_s"])
    assert main(["simulate", "-w", "llama-7b", "--dp", "2", "-p", "full-recompute", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["devices"][0]["model_state_bytes"] == 16 * 6_738_149_376 and r["fits"] is False

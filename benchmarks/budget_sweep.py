"""Budget sweep: throughput (% of the keep-all ideal) of every planner at activation budgets
0.2 ... 0.9 for BERT-Large, GPT-2 XL and Llama-7B on one A100 80GB (PCIe 4.0, private link).

For each (workload, budget, planner): plan with the planner (which lowers its plan and simulates one
step on the GPU: `Planned`) and compare with the keep-all step (no memory limit). A planner that cannot meet the budget
(BudgetInfeasibleError) gives an infeasible row with the error message; such points are left out of
the plot. The budget fraction is resolved by `slackswap_ds.budget.resolve_budget` (fraction of the
keep-all activation bytes).

Writes ``budget_sweep.json`` (a list of rows: workload, budget, hardware, planner, throughput_pct,
step_s, ideal_s, peak_bytes, budget_bytes, feasible, error, plan_s) and ``budget_sweep.png``.
Progress (with elapsed time per point) goes to stderr, the table to stdout.

    PYTHONPATH=. python benchmarks/budget_sweep.py            # full sweep (several minutes: MILPs)
    PYTHONPATH=. python benchmarks/budget_sweep.py --quick    # budgets 0.3, 0.6; bert-large only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (PlannerTimeout, Timer, call_with_timeout, fmt_s, out_dir, parse_floats, parse_names,
                                progress, table, write_json)
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import load_hardware
from slackswap_ds.planners import PLANNERS, keep_all_result
from slackswap_ds.budget import resolve_budget
from slackswap_ds.workloads import workload

WORKLOADS = ("bert-large", "gpt2-xl", "llama-7b")
BUDGETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK_WORKLOADS = ("bert-large",)
QUICK_BUDGETS = (0.3, 0.6)
HARDWARE = "a100-80g-pcie4"
STYLE = {"slackswap": {"lw": 2.4, "zorder": 3}, "optimal": {"lw": 1.3, "ls": "--", "zorder": 4}}
ROW_KEYS = ("workload", "budget", "hardware", "planner", "throughput_pct", "step_s", "ideal_s", "peak_bytes",
            "budget_bytes", "feasible", "error", "plan_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/)")
    ap.add_argument("--quick", action="store_true", help="smoke run: budgets 0.3,0.6 and bert-large only")
    ap.add_argument("--workloads", default=None, help=f"comma-separated (default: {','.join(WORKLOADS)})")
    ap.add_argument("--budgets", default=None, help="comma-separated fractions (default: 0.2,0.3,...,0.9)")
    ap.add_argument("--planners", default=None, help=f"comma-separated (default: all: {','.join(PLANNERS)})")
    ap.add_argument("--hardware", default=HARDWARE, help=f"GPU preset (default: {HARDWARE})")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--replot", action="store_true",
                    help="do not simulate: re-print the tables and redraw the PNG from OUT/budget_sweep.json")
    ap.add_argument("--planner-timeout", type=float, default=0.0, metavar="S",
                    help="give up on a planner call after S seconds; the point is then infeasible with the "
                         "reason in 'error' (default 0 = no limit)")
    args = ap.parse_args(argv)
    default_workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    args.workloads = parse_names(args.workloads) if args.workloads else list(default_workloads)
    args.budgets = parse_floats(args.budgets) if args.budgets else list(QUICK_BUDGETS if args.quick else BUDGETS)
    args.planners = parse_names(args.planners) if args.planners else list(PLANNERS)
    unknown = [p for p in args.planners if p not in PLANNERS]
    if unknown:
        ap.error(f"unknown planner(s) {unknown}; valid: {', '.join(PLANNERS)}")
    return args


def run_point(name: str, profile, hw, planner: str, budget: float, ideal_s: float,
              timeout: float | None = None) -> dict:
    """Plan (and simulate) one point; never raises for a planner failure (it is a row)."""
    budget_bytes = resolve_budget(budget, profile)
    row = dict(workload=name, budget=budget, hardware=hw.name, planner=planner,
               throughput_pct=None, step_s=None, ideal_s=ideal_s, peak_bytes=None, budget_bytes=budget_bytes,
               feasible=False, error=None, plan_s=None)
    t = Timer()
    try:
        planned = call_with_timeout(PLANNERS[planner], (profile, hw, budget_bytes), timeout=timeout)
    except BudgetInfeasibleError as e:
        row.update(error=f"BudgetInfeasibleError: {e}", plan_s=t.elapsed())
        return row
    except PlannerTimeout as e:
        row.update(error=f"planner timeout: {e} (--planner-timeout)", plan_s=t.elapsed())
        return row
    except Exception as e:  # a planner bug must not kill a long sweep; it is reported loudly
        row.update(error=f"{type(e).__name__}: {e}", plan_s=t.elapsed())
        progress(f"  WARNING: {planner} raised {type(e).__name__} (not a budget failure): {e}")
        return row
    row["plan_s"] = t.elapsed()
    res = dataclasses.replace(planned.result, ideal_s=ideal_s)  # the planner's own simulation of its plan
    row.update(throughput_pct=100.0 * res.throughput, step_s=res.step_s, peak_bytes=res.peak_bytes,
               feasible=bool(res.feasible))
    if not res.feasible:
        row["error"] = f"simulated peak {res.peak_bytes:,} B exceeds the budget of {budget_bytes:,} B"
    return row


def render_tables(rows: list[dict], workloads: list[str], budgets: list[float], planners: list[str]) -> str:
    out = []
    for w in workloads:
        wr = [r for r in rows if r["workload"] == w]
        if not wr:
            continue
        ideal = wr[0]["ideal_s"]
        out.append(f"\n{w} on {wr[0]['hardware']}: throughput, % of the keep-all ideal ({ideal:.4f} s/step), "
                   "by activation budget")
        headers = ["planner"] + [f"{b:g}" for b in budgets] + ["plan time"]
        body = []
        for p in planners:
            pr = {r["budget"]: r for r in wr if r["planner"] == p}
            cells = [p]
            for b in budgets:
                r = pr.get(b)
                cells.append(_cell(r))
            cells.append(fmt_s(sum(r["plan_s"] or 0.0 for r in pr.values())))
            body.append(cells)
        out.append(table(headers, body))
    out.append("\n'-' = cannot meet the budget (planner refused, or simulated peak over budget); 't/o' = planner "
               "timed out;\n'err' = planner raised another error (message in the JSON 'error' field); plan time = "
               "sum over the row's budgets")
    return "\n".join(out)


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["feasible"]:
        return f"{r['throughput_pct']:.1f}"
    err = r["error"] or ""
    if err.startswith("planner timeout"):
        return "t/o"
    if err.startswith("BudgetInfeasibleError") or err.startswith("simulated peak"):
        return "-"
    return "err"


def plot(rows: list[dict], workloads: list[str], planners: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib is not installed (pip install matplotlib): no PNG written")
        return False
    n = len(workloads)
    fig, axes = plt.subplots(1, n, figsize=(max(7.0, 4.8 * n), 4.6), sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, w in zip(axes[0], workloads):
        for k, p in enumerate(planners):
            mine = {r["budget"]: r for r in rows if r["workload"] == w and r["planner"] == p}
            xs = sorted(mine)
            # infeasible points are omitted: NaN breaks the line there instead of bridging the gap
            ys = [mine[x]["throughput_pct"] if mine[x]["feasible"] else math.nan for x in xs]
            if any(not math.isnan(y) for y in ys):
                ax.plot(xs, ys, marker="o", ms=3.5, label=p, color=colors[k % len(colors)],
                        **STYLE.get(p, {"lw": 1.3}))
        ax.set_title(w)
        ax.set_xlabel("activation budget (fraction of keep-all)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("throughput (% of keep-all ideal)")
    handles: dict[str, object] = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 4),
               frameon=False)
    hw = rows[0]["hardware"] if rows else ""
    fig.suptitle(f"Simulated throughput vs activation budget on {hw}\n(infeasible points omitted)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def replot(out: Path, no_plot: bool) -> int:
    json_path = out / "budget_sweep.json"
    rows = json.loads(json_path.read_text())
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    budgets = sorted({r["budget"] for r in rows})
    planners = list(dict.fromkeys(r["planner"] for r in rows))
    print(render_tables(rows, workloads, budgets, planners))
    if not no_plot and plot(rows, workloads, planners, out / "budget_sweep.png"):
        print(f"\nredrew {out / 'budget_sweep.png'} from {json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out)
    if args.replot:
        return replot(out, args.no_plot)
    hw = load_hardware(args.hardware)
    total = len(args.workloads) * len(args.budgets) * len(args.planners)
    rows: list[dict] = []
    clock = Timer()
    i = 0
    for w in args.workloads:
        profile = workload(w, hw)
        ideal_s = keep_all_result(profile, hw).step_s
        progress(f"{w}: {len(profile.ops)} ops, {len(profile.activations)} activations, "
                 f"keep-all {profile.total_bytes / 1e9:.2f} GB, ideal step {ideal_s:.4f} s")
        for b in args.budgets:
            for p in args.planners:
                i += 1
                row = run_point(w, profile, hw, p, b, ideal_s, args.planner_timeout or None)
                rows.append(row)
                what = f"{row['throughput_pct']:.1f}%" if row["feasible"] else "infeasible"
                progress(f"[{i:>3}/{total}] {w:<10} budget {b:<4g} {p:<19} {what:<10} "
                         f"plan {fmt_s(row['plan_s'])}  (elapsed {fmt_s(clock.elapsed())})")
    rows = [{k: r[k] for k in ROW_KEYS} for r in rows]
    json_path = out / "budget_sweep.json"
    write_json(json_path, rows)
    print(render_tables(rows, args.workloads, args.budgets, args.planners))
    msg = f"\nwrote {json_path}"
    if not args.no_plot and plot(rows, args.workloads, args.planners, out / "budget_sweep.png"):
        msg += f" and {out / 'budget_sweep.png'}"
    print(msg + f"  ({total} points in {fmt_s(clock.elapsed())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DGX-A100 node: plans that know the PCIe switch uplink is shared vs plans that think it is private.

Every rank of the node runs the same workload at the same activation budget. Two ways to plan:

* shared:  each rank plans with ``Share.of_node(node)`` (its equal share of the switch uplink and of
           host memory);
* private: each rank plans with ``PRIVATE`` (as if it had the GPU's whole PCIe link to itself).

Both schedules are then simulated on the whole node at once (``simulate_node([schedule] * gpus)``),
where the GPUs behind one switch really do share its uplink. The plan's single-GPU result (alone on
a private link) is shown too, to separate "the plan is bad" from "the plan is bad on a node".

Writes ``node_dgx.json`` ({"node", "hardware", "budget", "definitions", "rows"}).

    PYTHONPATH=. python benchmarks/node_dgx.py            # gpt2-xl, bert-large, llama-7b; slackswap + optimal
    PYTHONPATH=. python benchmarks/node_dgx.py --quick    # gpt2-xl, slackswap only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (PlannerTimeout, Timer, call_with_timeout, fmt_s, gb, out_dir, parse_names, progress,
                                table, write_json)
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import Node, load_node
from slackswap_ds.plan import lower
from slackswap_ds.planners import PLANNERS, PRIVATE, Share, keep_all_result, resolve_budget
from slackswap_ds.simulator import SimEvent, simulate, simulate_node
from slackswap_ds.workloads import workload

NODE = "dgx-a100"
WORKLOADS = ("gpt2-xl", "bert-large", "llama-7b")
PLANNER_NAMES = ("slackswap", "optimal")
QUICK_WORKLOADS = ("gpt2-xl",)
QUICK_PLANNERS = ("slackswap",)
PLANNER_TIMEOUT_S = 120.0
BUDGET = 0.5
MODES = ("shared", "private")
COPY_STREAMS = ("d2h", "h2d")

ROW_KEYS = (
    "workload", "planner", "mode", "budget", "budget_bytes", "ideal_s", "plan_s", "error",
    "alone_throughput_pct", "alone_peak_bytes", "alone_feasible", "throughput_pct", "slowest_step_s",
    "slowest_rank", "compute_stall_s",
    "peak_bytes", "peak_over_budget_pct", "feasible", "uplink_oversub_d2h", "uplink_oversub_h2d",
    "oversub_time_d2h_s", "oversub_time_h2d_s", "per_switch",
)

DEFINITIONS = {
    "throughput_pct": "100 * ideal_s / slowest_step_s; ideal_s = keep-all step (no memory limit) of one GPU "
                      "(keep_all_result on the node's GPU preset)",
    "alone_throughput_pct": "the same schedule simulated on one GPU with a private PCIe link",
    "alone_peak_bytes": "its peak device activation bytes there; alone_feasible = alone_peak_bytes <= budget_bytes",
    "slowest_step_s": "step time of the slowest rank in the node simulation (all ranks start together)",
    "compute_stall_s": "max over ranks of the time the compute stream waited for a prefetch (H2D copy)",
    "peak_bytes": "max over ranks of the peak device activation bytes; feasible = every rank's peak <= budget_bytes",
    "peak_over_budget_pct": "100 * (peak_bytes / budget_bytes - 1); <= 0 means within budget",
    "uplink_oversub_<dir>": (
        "peak uplink oversubscription, per PCIe switch and copy direction (d2h / h2d): "
        "max over time t of N(t) * r_gpu / U, where N(t) = number of copies in that direction, issued by the "
        "GPUs behind that switch, that are moving bytes at t (a copy event's [start + copy_latency_s, end)); "
        "r_gpu = one GPU's own copy rate in that direction with nothing else running (Hardware.d2h_bps / "
        "h2d_bps); U = Node.switch_uplink_bps. This is demand, not achieved rate: 1.0 = the copies alone "
        "would exactly fill the uplink, 2.0 = they ask for twice what it carries (the simulator then shares "
        "it max-min fairly, so each copy runs slower than planned). Reported: max over switches"
    ),
    "oversub_time_<dir>_s": "total time during which that ratio is > 1 (max over switches)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/)")
    ap.add_argument("--quick", action="store_true", help="smoke run: gpt2-xl with slackswap only")
    ap.add_argument("--workloads", default=None, help=f"comma-separated (default: {','.join(WORKLOADS)})")
    ap.add_argument("--planners", default=None, help=f"comma-separated (default: {','.join(PLANNER_NAMES)})")
    ap.add_argument("--budget", type=float, default=BUDGET, help=f"activation budget fraction (default {BUDGET})")
    ap.add_argument("--node", default=NODE, help=f"node preset (default: {NODE})")
    ap.add_argument("--planner-timeout", type=float, default=PLANNER_TIMEOUT_S, metavar="S",
                    help=f"give up on a planner call after S seconds (default {PLANNER_TIMEOUT_S:g}; 0 = no limit)")
    args = ap.parse_args(argv)
    default_workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    default_planners = QUICK_PLANNERS if args.quick else PLANNER_NAMES
    args.workloads = parse_names(args.workloads) if args.workloads else list(default_workloads)
    args.planners = parse_names(args.planners) if args.planners else list(default_planners)
    unknown = [p for p in args.planners if p not in PLANNERS]
    if unknown:
        ap.error(f"unknown planner(s) {unknown}; valid: {', '.join(PLANNERS)}")
    return args


def uplink_oversubscription(events: tuple[SimEvent, ...], node: Node) -> dict[tuple[int, str], tuple[float, float]]:
    """{(switch, direction): (peak ratio, seconds with ratio > 1)} -- see DEFINITIONS["uplink_oversub_<dir>"]."""
    hw = node.gpu
    rate = {"d2h": hw.d2h_bps, "h2d": hw.h2d_bps}
    edges: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for e in events:
        if e.stream not in rate or e.nbytes <= 0:
            continue
        begin = e.start + hw.copy_latency_s
        if e.end <= begin:
            continue
        edges.setdefault((node.switch_of(e.gpu), e.stream), []).extend([(begin, 1), (e.end, -1)])
    result = {}
    for key, pts in edges.items():
        pts.sort()  # at equal times the end (-1) comes before the start (+1): intervals are half-open
        per_copy = rate[key[1]] / node.switch_uplink_bps
        active = peak = 0
        over_s, last_t = 0.0, pts[0][0]
        for t, d in pts:
            if active * per_copy > 1.0:
                over_s += t - last_t
            active += d
            peak = max(peak, active)
            last_t = t
        result[key] = (peak * per_copy, over_s)
    return result


def run_case(name: str, profile, node: Node, planner: str, mode: str, budget: float, ideal_s: float,
             timeout: float | None = None) -> dict:
    hw = node.gpu
    share = Share.of_node(node) if mode == "shared" else PRIVATE
    budget_bytes = resolve_budget(budget, profile)
    row = {k: None for k in ROW_KEYS}
    row.update(workload=name, planner=planner, mode=mode, budget=budget, budget_bytes=budget_bytes, ideal_s=ideal_s,
               feasible=False)
    t = Timer()
    try:
        plan = call_with_timeout(PLANNERS[planner], (profile, hw, budget_bytes), {"share": share}, timeout)
    except BudgetInfeasibleError as e:
        row.update(plan_s=t.elapsed(), error=f"BudgetInfeasibleError: {e}")
        return row
    except PlannerTimeout as e:
        row.update(plan_s=t.elapsed(), error=f"planner timeout: {e} (--planner-timeout)")
        return row
    row["plan_s"] = t.elapsed()
    sched = lower(profile, plan)
    alone = simulate(sched, hw, budget_bytes=budget_bytes, ideal_s=ideal_s, record=False)
    res = simulate_node([sched] * node.gpus, node, budget_bytes=budget_bytes, ideal_s=ideal_s, record=True)
    per = res.per_gpu or (res,)
    slowest = max(range(len(per)), key=lambda g: (per[g].step_s, -g))
    peak = max(r.peak_bytes for r in per)
    over = uplink_oversubscription(res.events, node)
    row.update(
        alone_throughput_pct=100.0 * alone.throughput,
        alone_peak_bytes=alone.peak_bytes,
        alone_feasible=bool(alone.feasible),
        throughput_pct=100.0 * res.throughput,
        slowest_step_s=res.step_s,
        slowest_rank=slowest,
        compute_stall_s=max(r.stall_s["compute"] for r in per),
        peak_bytes=peak,
        peak_over_budget_pct=100.0 * (peak / budget_bytes - 1.0),
        feasible=all(r.feasible for r in per),
        per_switch=[
            {"switch": sw, "direction": d, "peak_oversub": over.get((sw, d), (0.0, 0.0))[0],
             "oversub_time_s": over.get((sw, d), (0.0, 0.0))[1]}
            for sw in range(node.gpus // node.gpus_per_switch) for d in COPY_STREAMS
        ],
    )
    for d in COPY_STREAMS:
        vals = [v for (sw, dd), v in over.items() if dd == d] or [(0.0, 0.0)]
        row[f"uplink_oversub_{d}"] = max(v[0] for v in vals)
        row[f"oversub_time_{d}_s"] = max(v[1] for v in vals)
    return row


def render(rows: list[dict], node: Node, budget: float) -> str:
    share = Share.of_node(node)
    lines = [
        f"{node.name}: {node.gpus} x {node.gpu.name}, {node.gpus_per_switch} GPUs per PCIe switch, uplink "
        f"{node.switch_uplink_bps / 1e9:.1f} GB/s per direction; budget {budget:g} of keep-all activations",
        f"shared  = each rank plans with Share.of_node: D2H {share.d2h(node.gpu) / 1e9:.1f} GB/s, "
        f"H2D {share.h2d(node.gpu) / 1e9:.1f} GB/s, host pool {gb(share.host_pool_bytes)} GB per rank",
        f"private = each rank plans with PRIVATE: the GPU's own D2H {node.gpu.d2h_bps / 1e9:.1f} / "
        f"H2D {node.gpu.h2d_bps / 1e9:.1f} GB/s",
        "",
    ]
    t1 = ["workload", "planner", "mode", "alone %", "alone mem", "node %", "slowest s", "stall s", "peak GB",
          "budget GB", "vs budget", "plan s"]
    t2 = ["workload", "planner", "mode", "oversub d2h", "oversub h2d", ">1 d2h s", ">1 h2d s", "% of step d2h/h2d"]
    b1, b2 = [], []
    for r in rows:
        key = [r["workload"], r["planner"], r["mode"]]
        if r["throughput_pct"] is None:
            b1.append(key + ["-"] * 6 + [gb(r["budget_bytes"]), "no plan", f"{r['plan_s']:.2f}"])
            b2.append(key + ["-"] * 5)
            continue
        b1.append(key + [
            f"{r['alone_throughput_pct']:.1f}", "ok" if r["alone_feasible"] else "OVER",
            f"{r['throughput_pct']:.1f}", f"{r['slowest_step_s']:.4f}",
            f"{r['compute_stall_s']:.4f}", gb(r["peak_bytes"]), gb(r["budget_bytes"]),
            ("ok " if r["feasible"] else "OVER ") + f"{r['peak_over_budget_pct']:+.1f}%", f"{r['plan_s']:.2f}",
        ])
        step = r["slowest_step_s"]
        b2.append(key + [
            f"{r['uplink_oversub_d2h']:.2f}", f"{r['uplink_oversub_h2d']:.2f}",
            f"{r['oversub_time_d2h_s']:.4f}", f"{r['oversub_time_h2d_s']:.4f}",
            f"{100 * r['oversub_time_d2h_s'] / step:.0f}% / {100 * r['oversub_time_h2d_s'] / step:.0f}%",
        ])
    lines.append("Throughput and memory (all ranks run the same plan):")
    lines.append(table(t1, b1, align="lll" + "r" * (len(t1) - 3)))
    lines.append("")
    lines.append("PCIe switch uplink demand (max over the node's switches):")
    lines.append(table(t2, b2, align="lll" + "r" * (len(t2) - 3)))
    lines += [
        "",
        "alone %  : throughput (% of keep-all ideal) of the same schedule on one GPU with a private link;",
        "           alone mem: whether its peak fits the budget there",
        "node %   : throughput of the node = ideal / slowest rank's step; stall s = max compute stall over ranks;",
        "           peak GB = max over ranks of the peak device activation bytes in the node simulation",
        "vs budget: max peak over ranks relative to the budget (OVER = the plan breaks the memory budget on the node)",
        "oversub  : peak uplink oversubscription = max over time, switches of N(t) * r_gpu / U, with N(t) the copies",
        "           in that direction moving bytes at t behind one switch (excluding the per-copy latency), r_gpu",
        "           the GPU's own copy rate alone, U the switch uplink rate; demand, not achieved rate (>1: copies",
        "           share the uplink and run slower than r_gpu). '>1 s' = time with oversubscription > 1.",
    ]
    errs = [r for r in rows if r["error"]]
    for r in errs:
        lines.append(f"note: {r['workload']} {r['planner']} {r['mode']}: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out)
    node = load_node(args.node)
    hw = node.gpu
    clock = Timer()
    rows = []
    for w in args.workloads:
        profile = workload(w, hw)
        ideal_s = keep_all_result(profile, hw).step_s
        progress(f"{w}: ideal step {ideal_s:.4f} s, keep-all activations {profile.total_bytes / 1e9:.2f} GB")
        for p in args.planners:
            for mode in MODES:
                row = run_case(w, profile, node, p, mode, args.budget, ideal_s, args.planner_timeout or None)
                rows.append(row)
                what = f"node {row['throughput_pct']:.1f}%" if row["throughput_pct"] is not None else "no plan"
                progress(f"  {p:<10} {mode:<8} {what:<12} plan {fmt_s(row['plan_s'])} "
                         f"(elapsed {fmt_s(clock.elapsed())})")
    share = Share.of_node(node)
    doc = {
        "node": node.name,
        "hardware": hw.name,
        "gpus": node.gpus,
        "gpus_per_switch": node.gpus_per_switch,
        "switch_uplink_bps": node.switch_uplink_bps,
        "budget": args.budget,
        "planner_timeout_s": args.planner_timeout or None,
        "shared_plan_rates_bps": {"d2h": share.d2h(hw), "h2d": share.h2d(hw)},
        "private_plan_rates_bps": {"d2h": hw.d2h_bps, "h2d": hw.h2d_bps},
        "definitions": DEFINITIONS,
        "rows": rows,
    }
    path = out / "node_dgx.json"
    write_json(path, doc)
    print(render(rows, node, args.budget))
    print(f"\nwrote {path}  ({fmt_s(clock.elapsed())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DGX-A100 node: plans that know the PCIe switch uplink is shared vs plans that think it is private.

Every rank of the node runs the same workload at the same activation budget. Two ways to plan:

* shared:  each rank plans with ``Share.of_node(node)`` (its equal share of the switch uplink and of
           host memory);
* private: each rank plans with ``PRIVATE`` (as if it had the GPU's whole PCIe link to itself).

The anchors a user would pick instead (planners/anchors.py: DeepCompile's offload_activation,
torchtune's OffloadActivations, a torchtitan-style ILP, Megatron's core-attention offload,
torchtitan's per-op selective checkpointing) plan only the private way, as their systems do: none
knows that the uplink is shared.

Both schedules are then simulated on the whole node at once (``simulate_node([schedule] * gpus)``),
where the GPUs behind one switch really do share its uplink. The plan's single-GPU result (alone on
a private link) is shown too, to separate "the plan is bad" from "the plan is bad on a node".

Two more questions, for the acceptance target (>= 95 % of ideal on GPT-2 XL):

* bound:   for the ``optimal`` planner (the MILP over the planners' region model), the throughput
           that HiGHS's proven lower bound on recompute time allows: no plan within the region model
           can beat it (the simulator still has the last word on any one plan);
* stagger: does delaying the other GPU(s) of each switch by d (``simulate_node(..., start_s=...)``)
           pay?  Every plan is re-simulated for d in STAGGER_FRACTIONS of the keep-all forward time.

Writes ``node_dgx.json`` ({"node", "hardware", "budget", "definitions", "rows", "stagger"}).

    PYTHONPATH=. python benchmarks/node_dgx.py            # gpt2-xl, bert-large, llama-7b; slackswap, optimal, anchors
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
from slackswap_ds.budget import resolve_budget
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import Node, load_node
from slackswap_ds.plan import lower
from slackswap_ds.planners import PLANNERS, keep_all_result
from slackswap_ds.planners.optimal import solve_optimal
from slackswap_ds.shares import PRIVATE, Share
from slackswap_ds.simulator import SimEvent, SimResult, simulate, simulate_node
from slackswap_ds.workloads import workload

NODE = "dgx-a100"
WORKLOADS = ("gpt2-xl", "bert-large", "llama-7b")
ANCHORS = ("deepcompile-offload", "torchtune-offload", "torchtitan-ilp", "megatron-offload", "torchtitan-op-sac")  # planners/anchors.py
PLANNER_NAMES = ("slackswap", "optimal", *ANCHORS)
QUICK_WORKLOADS = ("gpt2-xl",)
QUICK_PLANNERS = ("slackswap",)
PLANNER_TIMEOUT_S = 120.0
BUDGET = 0.5
MODES = ("shared", "private")
COPY_STREAMS = ("d2h", "h2d")
TARGET_PCT = 95.0  # the acceptance target for GPT-2 XL, % of ideal; only reported against
# start offset of the second GPU of each switch, in units of the keep-all forward time F = sum(op.fwd_s)
STAGGER_FRACTIONS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)

ROW_KEYS = (
    "workload", "planner", "mode", "budget", "budget_bytes", "ideal_s", "plan_s", "error",
    "alone_throughput_pct", "alone_step_s", "alone_peak_bytes", "alone_feasible", "throughput_pct",
    "slowest_step_s", "slowest_rank", "compute_stall_s",
    "peak_bytes", "peak_over_budget_pct", "feasible", "uplink_oversub_d2h", "uplink_oversub_h2d",
    "oversub_time_d2h_s", "oversub_time_h2d_s", "per_switch",
    "bound_incumbent_recompute_s", "bound_recompute_s", "bound_throughput_pct", "bound_note",
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
        "max over time t of N(t) * r_plan / U, where N(t) = number of copies in that direction, issued by the "
        "GPUs behind that switch, that are moving bytes at t (a copy event's [start + copy_latency_s, end)); "
        "r_plan = the copy rate the plan was made for in that direction (shared: the rank's share of the "
        "uplink; private: the GPU's own rate, Hardware.d2h_bps / h2d_bps); U = Node.switch_uplink_bps. This "
        "is what the plans ask of the uplink, not the achieved rate: 1.0 = together they assume exactly what "
        "it carries, 2.0 = twice that (the simulator then shares it max-min fairly, so each copy runs slower "
        "than its plan assumed). Reported: max over switches"
    ),
    "oversub_time_<dir>_s": "total time during which that ratio is > 1 (max over switches)",
    "alone_step_s": "step time of the schedule alone on one GPU with a private link",
    "bound_recompute_s": (
        "optimal planner only: HiGHS's proven lower bound on the recompute seconds of any plan in the "
        "region model (the last MILP solve of planners.optimal.solve_optimal); "
        "bound_incumbent_recompute_s = the objective of the plan it returned"
    ),
    "bound_throughput_pct": (
        "bound (region model) = 100 * ideal_s / (ideal_s + bound_recompute_s): no plan within the planners' "
        "region model (swaps fully hidden at the planning rates, recompute as the only overhead; shared = "
        "Share.of_node rates, private = the GPU's own) has a higher throughput. A bound on the model, not on "
        "the simulator: the simulator has the last word on any one plan. null (see bound_note) when the MILP "
        "had to be re-solved at a lowered budget (a repair), since its bound then belongs to that budget"
    ),
    "stagger": (
        "per (workload, planner, mode) with a plan: the same schedule re-simulated on the node with GPU i "
        "behind each switch starting i * d_s late (on dgx-a100: the second GPU of each switch, d_s late), "
        "d_s = fraction * fwd_s, fwd_s = keep-all forward seconds (sum of op.fwd_s). Per offset: "
        "throughput_pct = 100 * ideal_s / slowest step (step times count from 0, so they include the offset: "
        "data-parallel ranks synchronise at the end of the step), peak_bytes / peak_over_budget_pct / feasible "
        "as in rows, cap_pct = 100 * ideal_s / (alone_step_s + d_s). best = the offset with the highest "
        "throughput among those within budget (the highest overall, feasible false, when none is)"
    ),
    "stagger.cap_pct": (
        "why staggering cannot pay: an offset d adds at most d of uplink time for the pair (their copies "
        "can take turns for up to d longer) but the delayed rank's step ends d later, and contention only "
        "slows copies, so its step >= d + alone_step_s and throughput_pct <= cap_pct"
    ),
    "stagger.target_max_d_s": (
        "ideal_s / (target_pct / 100) - alone_step_s: the largest offset the cap allows for the target "
        "(null when the plan misses the target even alone)"
    ),
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


def uplink_oversubscription(events: tuple[SimEvent, ...], node: Node,
                            share: Share = PRIVATE) -> dict[tuple[int, str], tuple[float, float]]:
    """{(switch, direction): (peak ratio, seconds with ratio > 1)} for copies planned at `share`'s
    rates -- see DEFINITIONS["uplink_oversub_<dir>"]."""
    hw = node.gpu
    rate = {"d2h": share.d2h(hw), "h2d": share.h2d(hw)}
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


def plan_with_bound(planner: str, profile, hw, budget_bytes: int, share: Share):
    """(plan, bound): bound = (incumbent, proven lower bound, model budget of that solve) of the last
    MILP solve for the optimal planner, else None. The MILP lowers its model budget and solves again
    when the simulator finds a plan over budget (a repair); the budget tells whether the bound is ours."""
    if planner != "optimal":
        return PLANNERS[planner](profile, hw, budget_bytes, share=share).plan, None
    res = solve_optimal(profile, hw, budget_bytes, share)
    return res.plan, (res.last.objective_s, res.last.bound_s, res.last.model_budget_bytes)


def node_row(res: SimResult, budget_bytes: int) -> dict:
    """Throughput and memory of a node simulation (keys shared by rows and stagger offsets)."""
    per = res.per_gpu or (res,)
    peak = max(r.peak_bytes for r in per)
    return {
        "throughput_pct": 100.0 * res.throughput,
        "slowest_step_s": res.step_s,
        "slowest_rank": max(range(len(per)), key=lambda g: (per[g].step_s, -g)),
        "peak_bytes": peak,
        "peak_over_budget_pct": 100.0 * (peak / budget_bytes - 1.0),
        "feasible": all(r.feasible for r in per),
    }


def run_case(name: str, profile, node: Node, planner: str, mode: str, budget: float, ideal_s: float,
             timeout: float | None = None):
    """(row, schedule); schedule is None when there is no plan (row["error"] says why)."""
    hw = node.gpu
    share = Share.of_node(node) if mode == "shared" else PRIVATE
    budget_bytes = resolve_budget(budget, profile)
    row = {k: None for k in ROW_KEYS}
    row.update(workload=name, planner=planner, mode=mode, budget=budget, budget_bytes=budget_bytes, ideal_s=ideal_s,
               feasible=False)
    t = Timer()
    try:
        plan, bound = call_with_timeout(plan_with_bound, (planner, profile, hw, budget_bytes, share), {}, timeout)
    except BudgetInfeasibleError as e:
        row.update(plan_s=t.elapsed(), error=f"BudgetInfeasibleError: {e}")
        return row, None
    except PlannerTimeout as e:
        row.update(plan_s=t.elapsed(), error=f"planner timeout: {e} (--planner-timeout)")
        return row, None
    row["plan_s"] = t.elapsed()
    if bound is not None:
        incumbent, lower_bound, model_budget = bound
        row.update(bound_incumbent_recompute_s=incumbent, bound_recompute_s=lower_bound)
        if model_budget != budget_bytes:
            row["bound_note"] = (f"the last MILP solve was at a repaired model budget of {model_budget:,} B, "
                                 f"not {budget_bytes:,} B: its bound does not bound this budget")
        elif lower_bound == lower_bound:  # not nan
            row["bound_throughput_pct"] = 100.0 * ideal_s / (ideal_s + max(lower_bound, 0.0))
    sched = lower(profile, plan)
    alone = simulate(sched, hw, budget_bytes=budget_bytes, ideal_s=ideal_s, record=False)
    res = simulate_node([sched] * node.gpus, node, budget_bytes=budget_bytes, ideal_s=ideal_s, record=True)
    per = res.per_gpu or (res,)
    over = uplink_oversubscription(res.events, node, share)
    row.update(node_row(res, budget_bytes))
    row.update(
        alone_throughput_pct=100.0 * alone.throughput,
        alone_step_s=alone.step_s,
        alone_peak_bytes=alone.peak_bytes,
        alone_feasible=bool(alone.feasible),
        compute_stall_s=max(r.stall_s["compute"] for r in per),
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
    return row, sched


def stagger_starts(node: Node, d: float) -> list[float]:
    """Start offsets: GPU i behind each switch starts i * d late (2 per switch: the second one, d late)."""
    return [(g % node.gpus_per_switch) * d for g in range(node.gpus)]


def run_stagger(row: dict, sched, node: Node, fwd_s: float, target_pct: float = TARGET_PCT) -> dict:
    """The row's schedule on the node at every offset of STAGGER_FRACTIONS (see DEFINITIONS["stagger"])."""
    ideal_s, alone_s, budget_bytes = row["ideal_s"], row["alone_step_s"], row["budget_bytes"]
    offsets = []
    for f in STAGGER_FRACTIONS:
        d = f * fwd_s
        res = simulate_node([sched] * node.gpus, node, budget_bytes=budget_bytes, ideal_s=ideal_s, record=False,
                            start_s=stagger_starts(node, d))
        offsets.append({"fraction": f, "d_s": d, **node_row(res, budget_bytes),
                        "cap_pct": 100.0 * ideal_s / (alone_s + d)})
    fits = [o for o in offsets if o["feasible"]] or offsets
    best = max(fits, key=lambda o: (o["throughput_pct"], -o["d_s"]))
    max_d = ideal_s / (target_pct / 100.0) - alone_s
    return {
        "workload": row["workload"], "planner": row["planner"], "mode": row["mode"], "ideal_s": ideal_s,
        "alone_step_s": alone_s, "fwd_s": fwd_s, "budget_bytes": budget_bytes, "offsets": offsets,
        "best": {k: best[k] for k in ("fraction", "d_s", "throughput_pct", "peak_over_budget_pct", "feasible")},
        "target_pct": target_pct, "target_max_d_s": max_d if max_d >= 0 else None,
    }


def render(rows: list[dict], node: Node, budget: float, stagger: list[dict] = ()) -> str:
    share = Share.of_node(node)
    lines = [
        f"{node.name}: {node.gpus} x {node.gpu.name}, {node.gpus_per_switch} GPUs per PCIe switch, uplink "
        f"{node.switch_uplink_bps / 1e9:.1f} GB/s per direction; budget {budget:g} of keep-all activations",
        f"shared  = each rank plans with Share.of_node: D2H {share.d2h(node.gpu) / 1e9:.1f} GB/s, "
        f"H2D {share.h2d(node.gpu) / 1e9:.1f} GB/s, host pool {gb(share.host_pool_bytes)} GB per rank",
        f"private = each rank plans with PRIVATE: the GPU's own D2H {node.gpu.d2h_bps / 1e9:.1f} / "
        f"H2D {node.gpu.h2d_bps / 1e9:.1f} GB/s (the anchors {', '.join(ANCHORS)} plan only so, as their systems do)",
        "",
    ]
    t1 = ["workload", "planner", "mode", "alone %", "alone mem", "node %", "bound (region model)", "slowest s",
          "stall s", "peak GB", "budget GB", "vs budget", "plan s"]
    t2 = ["workload", "planner", "mode", "oversub d2h", "oversub h2d", ">1 d2h s", ">1 h2d s", "% of step d2h/h2d"]
    b1, b2 = [], []
    for r in rows:
        key = [r["workload"], r["planner"], r["mode"]]
        if r["throughput_pct"] is None:
            b1.append(key + ["-"] * 7 + [gb(r["budget_bytes"]), "no plan", f"{r['plan_s']:.2f}"])
            b2.append(key + ["-"] * 5)
            continue
        b1.append(key + [
            f"{r['alone_throughput_pct']:.1f}", "ok" if r["alone_feasible"] else "OVER",
            f"{r['throughput_pct']:.1f}", _pct(r["bound_throughput_pct"], 2), f"{r['slowest_step_s']:.4f}",
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
    lines += render_bounds(rows)
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
        "oversub  : peak uplink oversubscription = max over time, switches of N(t) * r_plan / U, with N(t) the copies",
        "           in that direction moving bytes at t behind one switch (excluding the per-copy latency), r_plan",
        "           the rate the plan assumed (shared: the rank's share; private: the GPU's own), U the switch",
        "           uplink rate: what the plans ask of the uplink (>1: copies run slower than their plans assumed).",
        "           '>1 s' = time with oversubscription > 1.",
    ]
    if stagger:
        lines += [""] + render_stagger(stagger, node)
    for r in rows:
        for what in ("error", "bound_note"):
            if r[what]:
                lines.append(f"note: {r['workload']} {r['planner']} {r['mode']}: {r[what]}")
    return "\n".join(lines)


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _offset(fraction: float) -> str:
    return "0" if fraction == 0 else f"{fraction:g}F"


def render_bounds(rows: list[dict]) -> list[str]:
    """Legend of the bound column and one line per workload that has a bound."""
    by_workload: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["bound_throughput_pct"] is not None:
            by_workload.setdefault(r["workload"], {})[r["mode"]] = r["bound_throughput_pct"]
    if not by_workload:
        return []
    lines = [
        "bound (region model): 100 * ideal / (ideal + HiGHS's proven lower bound on recompute s) of the optimal",
        "           planner's MILP: no plan within the planners' region model (swaps hidden at the planning rates,",
        "           recompute the only overhead) does better. A bound on the model: the simulator has the last word.",
    ]
    for w, b in by_workload.items():
        lines.append(f"{w}: no plan in the region model exceeds {_pct(b.get('shared'), 2)}% on a shared link "
                     f"({_pct(b.get('private'), 2)}% on a private link)")
    return lines


def render_stagger(stagger: list[dict], node: Node) -> list[str]:
    """Third table: node throughput per start offset of the other GPU(s) of each switch."""
    heads = ["d=" + _offset(f) for f in STAGGER_FRACTIONS]
    target = stagger[0]["target_pct"]
    t3 = ["workload", "planner", "mode", "alone %", *heads, "best d", "best %", "vs budget", f"{target:g}% needs d <"]
    body, cells, broken = [], 0, []
    for e in stagger:
        row = [e["workload"], e["planner"], e["mode"], f"{100 * e['ideal_s'] / e['alone_step_s']:.1f}"]
        for o in e["offsets"]:
            row.append(f"{o['throughput_pct']:.1f}" + (" " if o["feasible"] else "*"))
            cells += 1
            if o["throughput_pct"] > o["cap_pct"] + 1e-9:
                broken.append(f"{e['workload']} {e['planner']} {e['mode']} d={_offset(o['fraction'])}")
        b = e["best"]
        max_d = e["target_max_d_s"]
        row += [_offset(b["fraction"]), f"{b['throughput_pct']:.1f}",
                ("ok " if b["feasible"] else "OVER ") + f"{b['peak_over_budget_pct']:+.1f}%",
                "-" if max_d is None else f"{1e3 * max_d:.1f} ms = {max_d / e['fwd_s']:.3f}F"]
        body.append(row)
    fwd = {e["workload"]: e["fwd_s"] for e in stagger}
    who = ("the second GPU of each switch starts d late" if node.gpus_per_switch == 2
           else "GPU i behind each switch starts i * d late")
    lines = [
        f"Staggered starts ({who}; plans unchanged): node % at each d, * = some rank over the budget.",
        "F = keep-all forward time: " + ", ".join(f"{w} {f:.3f} s" for w, f in fwd.items()),
        table(t3, body, align="lll" + "r" * (len(t3) - 3)),
        "",
        "why it cannot pay: an offset d adds at most d of uplink time for the pair (their copies can take turns for",
        "           up to d longer) but costs d of step time on the delayed rank, and a data-parallel step waits",
        "           for its slowest rank; contention only slows copies, so node % <= cap = 100 * ideal / (alone step",
        "           + d) <= alone %. A shared plan already runs at its alone % with no stall, so any d > 0 costs;",
        "           a private plan would have to win back its whole contention loss within the "
        f"'{target:g}% needs d <'",
        "           column ('-': not even alone). "
        + (f"The cap holds in all {cells} cells." if not broken else "Cells above the cap: " + ", ".join(broken)),
    ]
    for w in fwd:
        mine = [(o["throughput_pct"], e, o)
                for e in stagger if e["workload"] == w for o in e["offsets"] if o["feasible"]]
        if not mine:
            lines.append(f"{w}: no plan at any offset fits the budget on the node")
            continue
        pct, e, o = max(mine, key=lambda m: (m[0], -m[2]["d_s"]))
        verdict = "reached" if pct >= target else "not reached"
        lines.append(f"{w}: best within budget over planners, modes and offsets: {pct:.2f}% ({e['planner']}, "
                     f"{e['mode']}, d = {_offset(o['fraction'])}); target {target:g}%: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out)
    node = load_node(args.node)
    hw = node.gpu
    clock = Timer()
    rows, stagger = [], []
    for w in args.workloads:
        profile = workload(w, hw)
        ideal_s = keep_all_result(profile, hw).step_s
        fwd_s = sum(op.fwd_s for op in profile.ops)
        progress(f"{w}: ideal step {ideal_s:.4f} s, keep-all activations {profile.total_bytes / 1e9:.2f} GB")
        for p in args.planners:
            for mode in MODES if p not in ANCHORS else ("private",):  # (an anchor plans as its system: alone)
                row, sched = run_case(w, profile, node, p, mode, args.budget, ideal_s, args.planner_timeout or None)
                rows.append(row)
                what = f"node {row['throughput_pct']:.1f}%" if row["throughput_pct"] is not None else "no plan"
                if sched is not None:
                    stagger.append(run_stagger(row, sched, node, fwd_s))
                    what += f", staggered best {stagger[-1]['best']['throughput_pct']:.1f}%"
                progress(f"  {p:<10} {mode:<8} {what:<36} plan {fmt_s(row['plan_s'])} "
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
        "stagger_fractions": list(STAGGER_FRACTIONS),
        "stagger": stagger,
    }
    path = out / "node_dgx.json"
    write_json(path, doc)
    print(render(rows, node, args.budget, stagger))
    print(f"\nwrote {path}  ({fmt_s(clock.elapsed())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

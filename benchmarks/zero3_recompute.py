"""ZeRO-3 with and without recompute: where a plan that may only keep or swap falls short.

Until issue 36, SlackSwap planned ZeRO-3 jobs without recompute (a replay re-ran ZeRO-3's parameter
gathers on one rank alone). Now a layer's replay runs inside that layer's backward, where every rank
has gathered its parameters (deepspeed_api.gather_layers_whole), so plans may recompute under ZeRO-3
as under any other stage. This prints, for each node, model and budget, the simulated step of a
data-parallel ZeRO-3 job over the node's 8 GPUs (one micro-batch per step, the model preset's) with
the default planner on both profiles:

* swap-only:  `Job(recompute=False)`: every saved tensor kept or swapped (what SlackSwap did);
* recompute:  keep, swap or recompute (what it does now).

Where the default planner finds no plan (its swaps must hide under compute: the region model's D2H
and H2D windows), the runtime falls back to offload-all, which swaps everything and stalls; the cell
says so. "infeasible": neither keeps the step within the budget (offload-all also needs every saved
byte in the rank's share of the node's pinned pool).

"% of ideal" is the job's step with every activation kept and no memory limit over the plan's step
(the gathers and reduce-scatters of `sharded` in both). The budget is a fraction of one GPU's keep-all peak.

    PYTHONPATH=. python benchmarks/zero3_recompute.py                  # the table in docs/benchmarks.md
    PYTHONPATH=. python benchmarks/zero3_recompute.py --quick          # gpt2-xl on dgx-a100 at 0.2, 0.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import out_dir, parse_floats, parse_names, progress, table, write_json
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import load_node
from slackswap_ds.pipeline import Job, ideal_step_s, simulate_job
from slackswap_ds.plan import Decision
from slackswap_ds.workloads import PRESETS

NODES = ("dgx-a100", "dgx-h100")
MODELS = ("llama-7b", "llama-13b", "gpt2-xl")
BUDGETS = (0.2, 0.3, 0.4, 0.5)
DP = 8  # one node's GPUs, data-parallel
PLANNER = "slackswap"
FALLBACK = "offload-all"  # what the runtime falls back to when the default planner finds no plan


def one(job: Job, node, budget: float, ideal: float) -> dict:
    """The simulated step of `job` within `budget` as the runtime would plan it: the default planner,
    else its fallback that never recomputes (offload-all: every tensor swapped, the step stalling on
    the link where the copies outlast compute); `{"infeasible": reasons}` if neither fits."""
    reasons = []
    for planner in (PLANNER, FALLBACK):
        try:
            res = simulate_job(job, node, budget, planner)
            break
        except BudgetInfeasibleError as e:
            reasons.append(str(e).split(";")[0][:160])
    else:
        return {"infeasible": "; ".join(reasons)}
    st = res.stages[0]
    split = st.plan.bytes_by_decision(st.profile)
    return {"planner": planner, "pct": 100 * ideal / res.step_s, "step_s": res.step_s, "peak": res.peaks[0],
            "recompute_bytes": split[Decision.RECOMPUTE], "swap_bytes": split[Decision.SWAP]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=parse_names, default=list(NODES))
    ap.add_argument("--models", type=parse_names, default=list(MODELS))
    ap.add_argument("--budgets", type=parse_floats, default=list(BUDGETS))
    ap.add_argument("--quick", action="store_true", help="gpt2-xl on dgx-a100 at budgets 0.2 and 0.5")
    ap.add_argument("--out", help="directory for zero3_recompute.json (default: benchmarks/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.models, args.budgets = ["dgx-a100"], ["gpt2-xl"], [0.2, 0.5]
    rows, printed = [], []
    for node_name in args.nodes:
        node = load_node(node_name)
        for model in args.models:
            jobs = {kind: Job(PRESETS[model], dp=DP, zero=3, recompute=kind == "recompute")
                    for kind in ("swap-only", "recompute")}
            ideal = ideal_step_s(jobs["recompute"], node)
            for budget in args.budgets:
                progress(f"{node_name} {model} {budget}")
                cells = {kind: one(job, node, budget, ideal) for kind, job in jobs.items()}
                rows.append({"node": node_name, "model": model, "budget": budget, **cells})
                printed.append([node_name, model, f"{budget:.1f}", *(_cell(cells[k]) for k in jobs),
                                _gain(cells), _gb(cells["recompute"].get("recompute_bytes"))])
    print(f"ZeRO-3, dp {DP} on one node, planner {PLANNER}: % of ideal (swap-only: keep or swap; recompute: "
          f"keep, swap or recompute)")
    print(table(["node", "model", "budget", "swap-only", "recompute", "gain (points)", "recomputed GB"], printed))
    write_json(out_dir(args.out) / "zero3_recompute.json", {"dp": DP, "planner": PLANNER, "rows": rows})
    return 0


def _cell(c: dict) -> str:
    if "infeasible" in c:
        return "infeasible"
    return f"{c['pct']:.2f}" + ("" if c["planner"] == PLANNER else f" ({c['planner']})")


def _gain(cells: dict) -> str:
    swap, both = cells["swap-only"], cells["recompute"]
    if "pct" in both and "pct" not in swap:
        return "only recompute fits"
    if "pct" in both:
        return f"{both['pct'] - swap['pct']:+.2f}"
    return "-"


def _gb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


if __name__ == "__main__":
    sys.exit(main())

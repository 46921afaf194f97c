"""Planner speed: wall-clock time of SlackSwap planning and of one simulated step, against targets.

Measured (median and min over N repeats, time.perf_counter, on this machine's CPU):

* plan llama-7b   : the greedy search alone (`slackswap-greedy`) for Llama-7B (target <= 50 ms)
* plan llama-70b  : the same for Llama-70B, 80 layers                  (target <= 500 ms)
* simulate llama-70b: simulate(lower(profile, plan), gpu, record=False) of the Llama-70B greedy
                      plan, one step                                    (target <= 200 ms)
* ... refined     : the default planner (`slackswap`: the greedy search, then the exact search for
                    at most REFINE_BUDGET_S = 2 s, planners/refine.py); target: that budget plus the
                    greedy target; the row says how the plan was found and its simulated throughput
                    beside the greedy plan's

Each planning repeat gets a freshly built profile (built outside the timer), so caches on the
profile object do not make later repeats look faster than a real first plan. One untimed warm-up
(imports, lazily loaded modules) runs first. Lowering is not timed; the simulation repeats reuse one
lowered schedule.

It is a report: the exit code is 0 whatever the result, unless --strict (1 on any FAIL).

    PYTHONPATH=. python benchmarks/planner_speed.py            # 5 repeats
    PYTHONPATH=. python benchmarks/planner_speed.py --quick    # 2 repeats
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import out_dir, progress, table, write_json
from slackswap_ds.hardware import load_hardware
from slackswap_ds.plan import lower
from slackswap_ds.planners import PLANNERS, keep_all_result
from slackswap_ds.planners.refine import REFINE_BUDGET_S
from slackswap_ds.budget import resolve_budget
from slackswap_ds.simulator import simulate
from slackswap_ds.workloads import workload

HARDWARE = "a100-80g-pcie4"
BUDGET = 0.5
GREEDY, DEFAULT = "slackswap-greedy", "slackswap"
# (name, what, workload, planner, target seconds)
CASES = (
    ("plan llama-7b", "plan", "llama-7b", GREEDY, 0.050),
    ("plan llama-70b", "plan", "llama-70b", GREEDY, 0.500),
    ("simulate llama-70b", "simulate", "llama-70b", GREEDY, 0.200),
    ("plan llama-7b, refined", "plan", "llama-7b", DEFAULT, REFINE_BUDGET_S + 0.050),
    ("plan llama-70b, refined", "plan", "llama-70b", DEFAULT, REFINE_BUDGET_S + 0.500),
)
ROW_KEYS = ("name", "what", "workload", "planner", "budget", "hardware", "repeats", "median_s", "min_s", "max_s",
            "target_s", "passed", "samples_s", "search", "throughput_pct")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 repeats")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5, --quick 2)")
    ap.add_argument("--budget", type=float, default=BUDGET, help=f"activation budget fraction (default {BUDGET})")
    ap.add_argument("--hardware", default=HARDWARE, help=f"GPU preset (default: {HARDWARE})")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any measurement misses its target")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def time_plan(name: str, planner: str, hw, budget: float, repeats: int) -> tuple[list[float], object, object]:
    """Seconds per planning call, each on a fresh profile; also returns the last profile and `Planned`."""
    fn = PLANNERS[planner]
    samples, profile, plan = [], None, None
    for _ in range(repeats):
        profile = workload(name, hw)
        budget_bytes = resolve_budget(budget, profile)
        gc.collect()  # start each sample without the garbage of the previous one (no debt carried)
        t0 = time.perf_counter()
        plan = fn(profile, hw, budget_bytes)
        samples.append(time.perf_counter() - t0)
    return samples, profile, plan


def time_simulate(profile, plan, hw, budget: float, repeats: int) -> list[float]:
    schedule = lower(profile, plan)
    budget_bytes = resolve_budget(budget, profile)
    samples = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        simulate(schedule, hw, budget_bytes=budget_bytes, record=False)
        samples.append(time.perf_counter() - t0)
    return samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_dir(args.out)
    hw = load_hardware(args.hardware)

    progress("warm-up (untimed) ...")
    warm = workload("bert-large", hw)
    for planner in (GREEDY, DEFAULT):
        wplan = PLANNERS[planner](warm, hw, resolve_budget(args.budget, warm)).plan
    simulate(lower(warm, wplan), hw, record=False)

    planned: dict[tuple[str, str], tuple[object, object]] = {}
    rows = []
    for name, what, wl, planner, target in CASES:
        progress(f"{name}: {args.repeats} repeats ...")
        if what == "plan":
            samples, profile, made = time_plan(wl, planner, hw, args.budget, args.repeats)
            planned[wl, planner] = (profile, made)
        else:
            if (wl, planner) not in planned:
                _, profile, made = time_plan(wl, planner, hw, args.budget, 1)
                planned[wl, planner] = (profile, made)
            profile, made = planned[wl, planner]
            samples = time_simulate(profile, made.plan, hw, args.budget, args.repeats)
        profile, made = planned[wl, planner]
        med = statistics.median(samples)
        rows.append(dict(name=name, what=what, workload=wl, planner=planner, budget=args.budget, hardware=hw.name,
                         repeats=args.repeats, median_s=med, min_s=min(samples), max_s=max(samples),
                         target_s=target, passed=med <= target, samples_s=samples, search=made.search,
                         throughput_pct=100 * keep_all_result(profile, hw).step_s / made.result.step_s))

    prof70 = planned.get("llama-70b", (None, None))[0]
    size = f" (llama-70b: {len(prof70.ops)} ops, {len(prof70.activations)} activations)" if prof70 else ""
    print(f"SlackSwap planner speed on {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs; {hw.name}, budget {args.budget:g}{size}")
    print(f"median and min over {args.repeats} repeats (time.perf_counter); PASS = median <= target\n")
    print(table(["measurement", "median ms", "min ms", "max ms", "target ms", "result", "thru %", "found by"],
                [[r["name"], f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['min_s']:.1f}", f"{1e3 * r['max_s']:.1f}",
                  f"{1e3 * r['target_s']:.0f}", "PASS" if r["passed"] else "FAIL", f"{r['throughput_pct']:.2f}",
                  r["search"] or "-"] for r in rows]))
    doc = {
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor(), "cpus": os.cpu_count()},
        "rows": [{k: r[k] for k in ROW_KEYS} for r in rows],
    }
    path = out / "planner_speed.json"
    write_json(path, doc)
    failed = [r["name"] for r in rows if not r["passed"]]
    print(f"\nwrote {path}" + (f"; FAIL: {', '.join(failed)}" if failed else "; all PASS"))
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every architecture of the test zoo compiled per block (or whole), under every kind of plan: exact or not.

    python benchmarks/compiled_sweep.py [--backends aot_eager inductor] [--random 10] [--models gpt2-sdpa llama ...]
                                        [--whole]

For each model of tests/runtime/zoo.py (fp32, dropout on) and each backend, every layer of every block
stack is replaced by its torch.compile (torchtitan's pattern), or with `--whole` the whole model is
compiled (`model.compile()`, what DeepSpeed's engine.compile() does; SlackSwap compiles each block on its
own instead when it takes the model: the reference is then that layout without a plan, and the row says
whether it computes the same numbers as the model compiled whole), and one training step is run: without
SlackSwap twice (the reference, and a check that the compiled model itself is deterministic), then under
the slackswap planner's plans at 0.5 and 0.75 where the compiled blocks leave one feasible (a compiled
block's backward reads all its saved tensors at once: with the zoo's 2 or 3 layers a block is a large
share of the step), full recompute, and `--random` seeded random plans, each for two steps. A row
passes when loss and every gradient are torch.equal to the reference on both steps, each step's peak
of device-resident saved bytes is within the plan's budget, and Dynamo compiled nothing after a plan's
first step. Prints one row per (model, backend) and exits 1 if any row fails. The suite runs the small
set (tests/runtime/test_compiled.py); this is the full sweep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))


def sweep_one(name: str, backend: str, random_plans: int, whole: bool = False) -> dict:
    import slackswap_ds as ss
    from slackswap_ds.errors import BudgetInfeasibleError
    from slackswap_ds.hardware import Hardware
    from slackswap_ds.plan import lower
    from slackswap_ds.simulator import simulate
    from slackswap_ds.runtime.regions import find_layers

    import zoo
    from exactness import fake_clock, random_plan, run, without_caches
    from test_compiled import compile_blocks, dynamo_compiles

    torch._dynamo.reset()  # (models share code objects, transformers' layer __call__: a fresh cache for each)
    model, batch = zoo.ZOO[name].build(torch.float32)
    model = without_caches(model)
    if whole:
        model.compile(backend=backend)
    else:
        model = compile_blocks(model, backend)
    row = {"model": name, "backend": backend, "blocks": len(find_layers(model)), "plans": 0, "failures": []}
    try:
        reference = run(model, zoo.step, batch)
        again = run(model, zoo.step, batch)
    except Exception as e:  # the compiler's own failure, before SlackSwap is involved
        row["failures"].append(f"compiled model fails without SlackSwap: {type(e).__name__}: {str(e)[:120]}")
        return row
    if not _equal(again, reference):
        row["skipped"] = "the compiled model itself gives other gradients on a second run: nothing to compare with"
        return row
    torch.manual_seed(1)
    prof = ss.profile_step(model, zoo.step, batch, warmup=0, timer=fake_clock(1e-3))
    if whole:  # now in SlackSwap's layout: each block compiled on its own
        per_block = run(model, zoo.step, batch)
        row["as whole"] = "the same numbers as" if _equal(per_block, reference) else \
            "the same loss, other gradient bits than" if torch.equal(per_block[0], reference[0]) else "another loss than"
        reference = per_block
    plans = {}
    for budget in (0.5, 0.75):
        try:
            plans[f"slackswap@{budget}"] = ss.plan(prof, "a100-80g-pcie4", budget)
        except BudgetInfeasibleError:
            row.setdefault("infeasible", []).append(budget)
    plans["full-recompute"] = ss.plan(prof, "a100-80g-pcie4", 1.0, planner="full-recompute")
    plans.update({f"random {seed}": random_plan(prof, seed) for seed in range(random_plans)})
    for label, plan in plans.items():
        try:
            ex = ss.apply(model, plan, prof)
            first = run(model, zoo.step, batch, ex)
            compiles = dynamo_compiles()
            second = run(model, zoo.step, batch, ex)
        except Exception as e:
            row["failures"].append(f"{label}: {type(e).__name__}: {str(e)[:160]}")
            continue
        row["plans"] += 1
        if not (_equal(first, reference) and _equal(second, reference)):
            row["failures"].append(f"{label}: not exact")
        if dynamo_compiles() != compiles:
            row["failures"].append(f"{label}: recompiled after the plan's first step")
        # on this CPU copies are synchronous: a prefetch timed for the A100 the plan was made for lands
        # at its trigger at once, earlier than there. The runtime must stay within what the simulator
        # predicts for such instant copies (the engine retimes such prefetches: plans.fit_to_device)
        peak = ex.stats.last_step.peak_device_bytes
        predicted = simulate(lower(prof, plan), Hardware.instant_copies()).peak_bytes
        if peak > max(predicted, plan.budget_bytes):
            row["failures"].append(f"{label}: peak {peak:,} B over the budget {plan.budget_bytes:,} B and over "
                                   f"the prediction for instant copies {predicted:,} B")
        elif peak > plan.budget_bytes:
            row.setdefault("early", []).append(label)
    return row


def _equal(a, b) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() and \
        all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    ap.add_argument("--random", type=int, default=10, help="seeded random plans per model (default 10)")
    ap.add_argument("--models", nargs="+", help="zoo names (default: every one)")
    ap.add_argument("--whole", action="store_true", help="compile the whole model (model.compile()), not each block")
    args = ap.parse_args(argv)
    import transformers

    import zoo

    transformers.logging.set_verbosity_error()
    names = args.models or list(zoo.ZOO)
    unknown = sorted(set(names) - set(zoo.ZOO))
    if unknown:
        ap.error(f"unknown zoo models {unknown}; known: {', '.join(zoo.ZOO)}")
    print(f"{'model':<24} {'backend':<10} {'blocks':>6} {'plans':>5}  {'seconds':>7}  result")
    failed = 0
    for backend in args.backends:
        for name in names:
            start = time.perf_counter()
            row = sweep_one(name, backend, args.random, args.whole)
            seconds = time.perf_counter() - start
            result = "; ".join(row["failures"][:3]) if row["failures"] else row.get("skipped") or \
                "exact, within budget, no recompile"
            extra = []
            if row.get("early"):
                extra.append(f"{', '.join(row['early'])}: over the budget by prefetches timed for an A100, as the "
                             f"simulator predicts for this CPU's synchronous copies")
            if "as whole" in row:
                extra.append(f"per block: {row['as whole']} compiled whole")
            if row.get("infeasible"):
                extra.append(f"slackswap infeasible at {', '.join(map(str, row['infeasible']))} (block floor)")
            print(f"{name:<24} {backend:<10} {row['blocks']:>6} {row['plans']:>5}  {seconds:7.1f}  {result}"
                  + (f" [{'; '.join(extra)}]" if extra else ""), flush=True)
            failed += bool(row["failures"])
    print(f"{failed} of {len(names) * len(args.backends)} rows failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the default planner pack the README job's dropout noise, and what it gains: the default planner on
the job's own measured profile with its packing marks removed ("without") beside the default planner on the
profile as measured ("default": its exact search may keep or swap each packable tensor packed, planners/milp.py),
both simulated.

The model is `launch/train.py`'s (GPT-2 style, 4 layers, hidden 128, sequence 64, batch 2, dropout 0.1),
profiled here on this CPU in one process (no DeepSpeed: the saved tensors are the same). For each budget: both
steps, how many tensors the default plan packs and their bytes, and how its plan was found (`Planned.found`).

    PYTHONPATH=. python benchmarks/pack_choice.py [--budgets 0.3,0.5] [--hardware a100-80g-pcie4] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def job_profile(layers: int):
    """The profile of one step of `launch/train.py`'s model, measured on this CPU."""
    import slackswap_ds as ss
    from launch.train import build_model, parse_args

    args = parse_args(["--layers", str(layers)])
    torch.manual_seed(args.seed)
    model = build_model(args).train()
    ids = torch.randint(1, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(args.seed))

    def step(m, batch):
        out = m(input_ids=batch, labels=batch, use_cache=False)
        out.loss.backward()
        return out.loss

    return ss.profile_step(model, step, ids, warmup=1, name="launch/train.py")


def rows(profile, hardware: str, budgets: list[float]) -> list[dict]:
    from slackswap_ds.budget import resolve_budget
    from slackswap_ds.errors import BudgetInfeasibleError
    from slackswap_ds.hardware import load_hardware
    from slackswap_ds.planners import get_planner, keep_all_result

    hw = load_hardware(hardware)
    ideal_ms = 1e3 * keep_all_result(profile, hw).step_s
    default = get_planner("slackswap")
    unmarked = dataclasses.replace(profile, activations=tuple(
        dataclasses.replace(a, packed_bytes=None, pack_s=0.0) for a in profile.activations))
    out = []
    for fraction in budgets:
        budget = resolve_budget(fraction, profile)

        def attempt(fn):
            try:
                return fn()
            except BudgetInfeasibleError:
                return None

        without = attempt(lambda: default(unmarked, hw, budget))
        kept = attempt(lambda: default(profile, hw, budget))
        out.append({
            "budget": fraction,
            "without_ms": None if without is None else 1e3 * without.result.step_s,
            "default_ms": None if kept is None else 1e3 * kept.result.step_s,
            "packs": 0 if kept is None else len(kept.plan.packed),
            "packed_bytes": 0 if kept is None else kept.plan.packed_bytes(profile)[0],
            "found": "none" if kept is None else kept.found,
            "ideal_ms": ideal_ms,
        })
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="0.3,0.4,0.5")
    ap.add_argument("--hardware", default="a100-80g-pcie4")
    ap.add_argument("--quick", action="store_true", help="2 layers instead of 4 (the smoke test)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    profile = job_profile(2 if args.quick else 4)
    marked = [profile.by_key[k] for k in profile.packable]
    print(f"{profile.name}: {len(profile.activations)} saved tensors, {profile.total_bytes:,} B keep-all; "
          f"{len(marked)} packable, {sum(a.bytes for a in marked):,} B ({sum(a.packed_bytes for a in marked):,} B "
          f"packed); packing kernels {1e3 * min((a.pack_s for a in marked), default=0):.3f}-"
          f"{1e3 * max((a.pack_s for a in marked), default=0):.3f} ms each way on this CPU")
    found = rows(profile, args.hardware, [float(b) for b in args.budgets.split(",")])

    def ms(v):
        return "-" if v is None else f"{v:.1f}"

    print(f"simulated step on {args.hardware} with this CPU's op times (ms; keep-all ideal "
          f"{ms(found[0]['ideal_ms'] if found else None)})")
    print("budget  without  default  packs  packed bytes  found")
    for r in found:
        print(f"{r['budget']:>6}  {ms(r['without_ms']):>7}  {ms(r['default_ms']):>7}  {r['packs']:>5}  "
              f"{r['packed_bytes']:>12,}  {r['found']}")
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What packing dropout masks could move: the region model's optimum (the bound every keep / swap /
recompute plan is under) beside the same optimum with every dropout mask stored 8 to a byte.

Issue 37 asks for a fourth fate, PACK (a saved tensor stored losslessly in fewer bytes), first for
dropout masks, and for the paper table with PACK beside the paper and the new bound. Before building
it into the profile, planners and runtime, this prints how far it can move the bound at all, on the
paper's workloads (the analytic presets of configs/workloads/, whose masks are 1 byte per element as
CUDA's `native_dropout` saves them):

* bound              `optimal` (the MILP) on the workload as it is, the three fates (keep, swap, recompute);
* bound, PACK        the MILP with PACK as a fourth fate (`allow_pack`: each mask kept or swapped packed or
                     not, its two kernels priced at the preset's elementwise rate): the new bound;
* packed, fused      every mask at 1/8 of its bytes at no cost: the most PACK of masks can give (a
                     dropout kernel writing its mask as bits; not what eager PyTorch does);
* packed, own kernel every mask packed after its dropout and unpacked before the backward that reads
                     it, each a memory-bound kernel (read 1 B, write 1/8 B per element, and back) at
                     the preset's measured elementwise rate (`Hardware.elementwise_s`), paid on every
                     mask: PACK as a planner would price it, here without the choice not to pack;
* in backward, PACK  the bound with PACK in a region model where each recomputed tensor is made again at its
                     own first read in backward (`RegionModel.replays_at_first_read`), not when its layer's
                     replay runs: what the issue's other technique (a dropout output recomputed from its input
                     and mask inside the backward that reads it) could add to PACK. The runtime replays a layer
                     once, as backward enters it, so this is a model of a runtime with one replay per tensor,
                     not a plan it runs: read from the MILP's objective (its recompute seconds beside the
                     ideal step), not simulated (docs/packing.md);
* slackswap          the default planner, which may pack each mask or not (its plan as `slackswap simulate`
                     makes it: the presets mark their masks packable, workloads.mask_packing), and the
                     bytes it packed;
* paper              the figure the SlackSwap paper reports (simulated, A100 + PCIe 4.0).

The ideal (100%) is the keep-all step of the workload as it is, in every column. A planner that may
choose PACK per tensor lies between "bound" and "packed, fused" where packing costs time, and at
"packed, fused" at best.

    PYTHONPATH=. python benchmarks/pack_bound.py            # a100-80g-pcie4, h100-pcie5, gh200 at 0.5
    PYTHONPATH=. python benchmarks/pack_bound.py --quick    # a100, bert-large, 0.5
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import out_dir, parse_floats, parse_names, progress, table, write_json
from slackswap_ds.budget import Budget
from slackswap_ds.hardware import Hardware, load_hardware
from slackswap_ds.planners import keep_all_result
from slackswap_ds.planners.milp import MilpOptions
from slackswap_ds.planners.optimal import solve_optimal
from slackswap_ds.planners.slackswap import plan_slackswap
from slackswap_ds.sim_report import PAPER_THROUGHPUT_PCT
from slackswap_ds.step_profile import StepProfile
from slackswap_ds.workloads import workload
from slackswap_ds.workloads.builder import MASK_SUFFIX

HARDWARE = ("a100-80g-pcie4", "h100-pcie5", "gh200")
WORKLOADS = ("bert-large", "gpt2-xl", "llama-7b")
BITS = 8
SOLVE = MilpOptions(time_limit_s=60.0)


def packed(profile: StepProfile, hw: Hardware, kernel_cost: bool) -> StepProfile:
    """`profile` with every dropout mask at 1/8 of its bytes; with `kernel_cost`, its producing op's
    forward pays a pack kernel and its first reader's backward an unpack kernel."""
    ops, acts = list(profile.ops), []
    for a in profile.activations:
        if a.key.endswith(MASK_SUFFIX):
            small = -(-a.bytes // BITS)
            if kernel_cost:
                moved = hw.elementwise_s(a.bytes + small)
                made = a.producers[-1] if a.producers else a.saved_at
                ops[made] = replace(ops[made], fwd_s=ops[made].fwd_s + moved)
                ops[a.first_read] = replace(ops[a.first_read], bwd_s=ops[a.first_read].bwd_s + moved)
            a = replace(a, bytes=small, packed_bytes=None, pack_s=None)  # (packed already: nothing left to pack)
        acts.append(a)
    return replace(profile, ops=tuple(ops), activations=tuple(acts))


def throughput(profile: StepProfile, hw: Hardware, budget_bytes: int, ideal_s: float, allow_pack: bool = False) -> float:
    return 100 * ideal_s / solve_optimal(profile, hw, budget_bytes, options=SOLVE,
                                         allow_pack=allow_pack).planned.result.step_s


def in_backward(profile: StepProfile, hw: Hardware, budget_bytes: int, ideal_s: float) -> float:
    """The optimum's throughput with PACK and each recomputed tensor made at its first read (the MILP's
    objective: the simulator replays a layer once, as backward enters it)."""
    solves = solve_optimal(profile, hw, budget_bytes, options=SOLVE, allow_pack=True, replays_at_first_read=True).solves
    return 100 * ideal_s / (ideal_s + solves[-1].objective_s)


def default_planner(profile: StepProfile, hw: Hardware, budget_bytes: int, ideal_s: float) -> tuple[float, int]:
    """The default planner's throughput and the bytes it packed (before packing)."""
    planned = plan_slackswap(profile, hw, budget_bytes)
    return 100 * ideal_s / planned.result.step_s, planned.plan.packed_bytes(profile)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a100-80g-pcie4, bert-large, 0.5")
    ap.add_argument("--hardware", default=None, help=f"comma-separated presets (default: {','.join(HARDWARE)})")
    ap.add_argument("--workloads", default=None, help=f"comma-separated (default: {','.join(WORKLOADS)})")
    ap.add_argument("--budgets", default="0.5", help="comma-separated fractions of keep-all (default: 0.5)")
    args = ap.parse_args(argv)
    targets = parse_names(args.hardware) if args.hardware else list(HARDWARE[:1] if args.quick else HARDWARE)
    names = parse_names(args.workloads) if args.workloads else list(WORKLOADS[:1] if args.quick else WORKLOADS)
    rows, start = [], time.perf_counter()
    for hname in targets:
        hw = load_hardware(hname)
        for name in names:
            profile = workload(name, hw)
            ideal_s = keep_all_result(profile, hw).step_s
            masks = sum(a.bytes for a in profile.activations if a.key.endswith(MASK_SUFFIX))
            for fraction in parse_floats(args.budgets):
                budget_bytes = Budget.parse(fraction).of(profile.total_bytes)
                row = dict(hardware=hname, workload=name, budget=fraction, mask_share=masks / profile.total_bytes,
                           mask_bytes=masks,
                           bound=throughput(profile, hw, budget_bytes, ideal_s),
                           bound_pack=throughput(profile, hw, budget_bytes, ideal_s, allow_pack=True),
                           fused=throughput(packed(profile, hw, False), hw, budget_bytes, ideal_s),
                           own_kernel=throughput(packed(profile, hw, True), hw, budget_bytes, ideal_s),
                           in_backward=in_backward(profile, hw, budget_bytes, ideal_s),
                           **dict(zip(("slackswap", "slackswap_packed"), default_planner(profile, hw, budget_bytes,
                                                                                      ideal_s))),
                           paper=PAPER_THROUGHPUT_PCT.get(name) if hname == "a100-80g-pcie4" else None)
                rows.append(row)
                progress(f"{hname} {name} {fraction:g}: bound {row['bound']:.2f}, with PACK {row['bound_pack']:.2f}, "
                         f"packed fused {row['fused']:.2f}, "
                         f"own kernel {row['own_kernel']:.2f}, in backward, PACK {row['in_backward']:.2f}, slackswap {row['slackswap']:.2f} "
                         f"({time.perf_counter() - start:.0f} s)")
    print("throughput, % of the keep-all ideal: the optimum without PACK, with PACK, and with every dropout mask packed, the\n"
          "default planner choosing PACK per mask (and the share of the masks it packed), the paper")
    print(table(["hardware", "workload", "budget", "masks", "bound", "bound, PACK", "packed, fused",
                 "packed, own kernel", "in backward, PACK", "slackswap", "masks packed", "paper"],
                [[r["hardware"], r["workload"], f"{r['budget']:g}", f"{100 * r['mask_share']:.1f}%", f"{r['bound']:.2f}",
                  f"{r['bound_pack']:.2f}", f"{r['fused']:.2f}", f"{r['own_kernel']:.2f}", f"{r['in_backward']:.2f}", f"{r['slackswap']:.2f}",
                  f"{100 * r['slackswap_packed'] / r['mask_bytes']:.0f}%" if r["mask_bytes"] else "-",
                  "-" if r["paper"] is None else f"{r['paper']:.1f}"]
                 for r in rows]))
    out = out_dir(args.out)
    write_json(out / "pack_bound.json", rows)
    print(f"\nwrote {out / 'pack_bound.json'} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

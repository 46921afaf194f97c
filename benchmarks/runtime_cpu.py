"""Runtime overhead on CPU: step time of a GPT-2-style model under plans, as ratios to the
unmodified model measured side by side in one run (medians over interleaved repeats).

    python benchmarks/runtime_cpu.py [--layers 6] [--hidden 256] [--seq 128] [--repeats 7]

The CPU accelerator has no streams: swaps are synchronous copies into the host pool, so the swap
rows measure copy cost, not overlap; swap-all prefetches at the triggers planned for an A100
(as late as possible). Target: a keep-all plan, which runs the hooks every plan runs and moves
nothing, costs <= 1.03x. benchmarks/overhead_cpu.py compares the machinery with torch's own
checkpointing on tiny tensors.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import slackswap_ds as ss
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.planners.common import alap_triggers, keep_all
from slackswap_ds.shares import PRIVATE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 64),
                                  n_positions=args.seq, vocab_size=1024, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(1, 1024, (args.batch, args.seq))

    def step(m, b):
        out = m(input_ids=b, labels=b, use_cache=False)
        out.loss.backward()
        return out.loss

    profile = ss.profile_step(model, step, ids)
    hw = ss.load_hardware("a100-80g-pcie4")
    swap_all = {a.key: Decision.SWAP for a in profile.activations}
    plans = {
        "keep-all plan": Plan.build(profile, keep_all(profile), budget_bytes=profile.total_bytes,
                                    hardware_digest="cpu", planner="keep-all"),
        "swap-all": Plan.build(profile, swap_all, budget_bytes=0, hardware_digest="cpu", planner="swap-all",
                               prefetch=alap_triggers(profile, swap_all, hw, PRIVATE)),
        "recompute-all": Plan.build(profile, {a.key: Decision.RECOMPUTE if a.recomputable else Decision.KEEP
                                              for a in profile.activations},
                                    budget_bytes=0, hardware_digest="cpu", planner="recompute-all"),
        "slackswap @0.5": ss.plan(profile, "a100-80g-pcie4", 0.5),
    }
    executors = {name: ss.apply(model, plan, profile) for name, plan in plans.items()}
    times: dict[str, list[float]] = {"unmodified": [], **{n: [] for n in plans}}
    peaks: dict[str, int] = {}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name in times:
            model.zero_grad(set_to_none=True)
            ex = executors.get(name)
            gc.collect()  # no run pays for the garbage of the one before
            t0 = time.perf_counter()
            if ex is None:
                step(model, ids)
            else:
                with ex:
                    step(model, ids)
            times[name].append(time.perf_counter() - t0)
            if ex is not None:
                peaks[name] = ex.stats.last_step.peak_device_bytes
    base = statistics.median(times["unmodified"][1:])
    print(f"GPT-2 style, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}; "
          f"keep-all saved bytes {profile.total_bytes:,}; medians of {args.repeats}")
    print(f"{'run':16s} {'median ms':>10s} {'ratio':>7s} {'peak saved bytes':>17s}")
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        peak = f"{peaks[name]:,}" if name in peaks else "-"
        print(f"{name:16s} {med * 1e3:10.1f} {med / base:7.3f} {peak:>17s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Check the simulator against a real GPU: a GPT-2-medium-sized model, one table.

    python benchmarks/gpu_validate.py [--seq 1024] [--batch 8] [--repeats 5] [--hardware h200-pcie5]

For keep-all, full recompute and the SlackSwap plan at 0.5 (planned for the measured profile on
`--hardware`), it prints measured step time (median) and peak allocator memory beside the
simulator's step time and peak saved bytes for the same measured profile and plan. Without CUDA it
says so and exits 0 (CI has no GPU). Meant to finish in under 5 minutes on one H100/H200.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hardware", default="h200-pcie5")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device; nothing to measure (skipped)")
        return 0

    import transformers

    import slackswap_ds as ss
    from slackswap_ds.plan import lower
    from slackswap_ds.simulator import simulate

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=args.seq,
                                  bos_token_id=0, eos_token_id=0)  # GPT-2 medium
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).train()
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.seq), device="cuda")

    def step(m, b):
        out = m(input_ids=b, labels=b, use_cache=False)
        out.loss.backward()
        return out.loss

    hw = ss.load_hardware(args.hardware)
    profile = ss.profile_step(model, step, ids)
    rows = []
    for name, budget in (("keep-all", 1.0), ("full-recompute", 0.5), ("slackswap", 0.5)):
        plan = ss.plan(profile, hw, budget, planner=name)
        sim = simulate(lower(profile, plan), hw, budget_bytes=plan.budget_bytes)
        ex = ss.apply(model, plan, profile)
        times = []
        for i in range(args.repeats + 1):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            with ex:
                step(model, ids)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        peak_alloc = torch.cuda.max_memory_allocated() - base
        rows.append((name, statistics.median(times), sim.step_s, peak_alloc,
                     ex.stats.last_step.peak_device_bytes, sim.peak_bytes, plan.budget_bytes))
    print(f"GPT-2 medium, seq {args.seq}, batch {args.batch}, bf16, on {torch.cuda.get_device_name()}; "
          f"simulated as {args.hardware}; medians of {args.repeats}")
    print(f"{'plan':16s} {'step ms':>9s} {'sim ms':>9s} {'alloc peak GB':>14s} {'saved peak GB':>14s} "
          f"{'sim peak GB':>12s} {'budget GB':>10s}")
    for name, t, st, alloc, saved, simpeak, budget in rows:
        print(f"{name:16s} {t * 1e3:9.1f} {st * 1e3:9.1f} {alloc / 1e9:14.2f} {saved / 1e9:14.2f} "
              f"{simpeak / 1e9:12.2f} {budget / 1e9:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Validate the CUDA path on one GPU, in one go (about 6 minutes on an H200).

    python benchmarks/gpu_validate.py            # on a CUDA machine
    python benchmarks/gpu_validate.py --dry-run  # tiny shapes on CPU: checks the script itself

Five parts, each printed as it finishes (a part that fails prints its error and the next runs):

1. the GPU tests: ``pytest tests/runtime/test_cuda.py tests/runtime/test_device.py`` (CUDA-only
   tests skip elsewhere), then test_cuda.py again under torch's CUDA stream sanitizer
   (``TORCH_CUDA_SANITIZER=1``: it reports unsynchronized accesses across streams);
2. GPT-2 medium (24 layers, hidden 1024, seq 1024, micro-batch 8, bf16): for keep-all, full
   activation checkpointing (DeepSpeed's, per layer) and SlackSwap at a 50% budget, the median step
   time, the allocator's peak above the model's own memory (`max_memory_allocated`, and
   `max_memory_reserved`), SlackSwap's own count of device-resident saved bytes, and beside them
   the simulator's step time and peak for the same measured profile and plan; and SlackSwap's time
   over keep-all's (recomputes and stalls) measured beside the simulator's, with its predicted stall;
3. a model whose keep-all activations do not fit the GPU (GPT-2 XL shape, seq 1024, micro-batch
   16, bf16): 5 SGD steps under SlackSwap at 50% and 5 under full checkpointing from the same
   weights and data, their losses side by side, and the throughput ratio SlackSwap / checkpointing;
4. `activation_budget: "auto"` on this GPU: the allocator's room beside GPT-2 medium's model state
   (after an Adam step), against the 16 B per parameter the CPU rule assumes;
5. compiled training side by side (benchmarks/compiled_side_by_side.py, GPT-2 small shape with each
   block compiled by inductor): exactness, saved-bytes and allocator peaks, step times, and a DeepCompile
   `offload_activation` row (DeepSpeed's engine, one rank).

What "alloc peak" includes: every allocation made during the step (activations, gradients,
workspaces, prefetched copies) above what was allocated before it (weights, optimizer state).
"saved peak" is SlackSwap's own accounting (what a budget bounds, runtime/residency.py): saved
activations only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def say(msg: str = "") -> None:
    print(msg, flush=True)


class Gpu:
    """Synchronisation and allocator statistics; no-ops in the CPU dry run."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset(self) -> int:
        if not self.cuda:
            return 0
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peaks(self, base: int) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        return torch.cuda.max_memory_allocated(self.device) - base, torch.cuda.max_memory_reserved(self.device)


def gpt2(layers: int, hidden: int, heads: int, seq: int, device, dtype, vocab: int = 50257):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, vocab_size=vocab,
                                  bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg).to(device=device, dtype=dtype).train()


def step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss


@contextlib.contextmanager
def full_checkpointing(model):
    """Every block through DeepSpeed's activation checkpointing (torch's non-reentrant one if
    DeepSpeed's cannot run here); yields the name of the one used."""
    blocks = list(model.transformer.h)
    originals = [b.forward for b in blocks]
    name = "torch.utils.checkpoint"
    fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    try:
        import deepspeed

        probe = torch.zeros(2, 2, device=next(model.parameters()).device, requires_grad=True)
        deepspeed.checkpointing.checkpoint(lambda x: x * 2, probe).sum().backward()
        fn, name = deepspeed.checkpointing.checkpoint, "deepspeed.checkpointing"
    except Exception as e:  # noqa: BLE001 - report, fall back
        say(f"  (deepspeed.checkpointing unavailable here: {type(e).__name__}: {e}; using torch's)")
    try:
        for block, forward in zip(blocks, originals):
            block.forward = functools.partial(fn, forward)
        yield name
    finally:
        for block, forward in zip(blocks, originals):
            block.forward = forward


def timed_steps(model, ids, ctx_factory, gpu: Gpu, repeats: int, optimizer=None):
    """(median step seconds, alloc peak, reserved peak, losses) over `repeats` steps after one warm-up."""
    times, losses, peak = [], [], (0, 0)
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        base = gpu.reset()
        torch.manual_seed(1000 + i)
        t0 = time.perf_counter()
        with ctx_factory():
            loss = step(model, ids)
        if optimizer is not None:
            optimizer.step()
        gpu.sync()
        if i:
            times.append(time.perf_counter() - t0)
            peak = max(peak, gpu.peaks(base))
        losses.append(loss.item())
    return statistics.median(times), peak[0], peak[1], losses


def part_tests(args) -> None:
    say("== 1. GPU tests, then the CUDA ones again under torch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1)")
    runs = [("", ["tests/runtime/test_cuda.py", "tests/runtime/test_device.py"]),
            ("TORCH_CUDA_SANITIZER=1 ", ["tests/runtime/test_cuda.py"])]
    for env, files in runs:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files]
        extra = dict(os.environ, TORCH_CUDA_SANITIZER="1") if env else None
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.test_timeout, env=extra)
        except subprocess.TimeoutExpired:
            say(f"  {env}pytest {' '.join(files)}: over {args.test_timeout} s, stopped")
            continue
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        say("\n".join(tail[-15:]))
        say(f"  {env}pytest exit {proc.returncode} in {time.perf_counter() - t0:.0f} s")


def trace_step(model, ids, ex, gpu: Gpu) -> None:
    """Where a SlackSwap step's time goes: its counters, then torch.profiler's top ops by host and by
    device time (one step, after the timed ones)."""
    from torch.profiler import ProfilerActivity, profile

    last = ex.stats.last_step
    say(f"  slackswap step counters: hooks host {last.hooks_host_s * 1e3:.1f} ms, swapped {last.swapped_bytes / 1e9:.2f} GB, "
        f"recomputed {last.recomputed_bytes / 1e9:.2f} GB ({last.ops_recomputed} ops, {last.whole_replays} whole "
        f"replays, {last.unplanned_reruns} unplanned reruns), copy waits {last.copy_waits}, budget waits "
        f"{last.budget_waits}, host pool {last.host_pool_bytes / 1e9:.2f} GB, fallbacks {last.fallbacks}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu.cuda else [])
    model.zero_grad(set_to_none=True)
    gpu.sync()
    with profile(activities=activities) as p:
        with ex:
            step(model, ids)
        gpu.sync()
    table = p.key_averages()
    say(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if gpu.cuda:
        say(table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


def part_medium(args, device, gpu: Gpu) -> None:
    import slackswap_ds as ss
    from slackswap_ds.plan import lower
    from slackswap_ds.simulator import simulate

    layers, hidden, heads, seq, batch, vocab = (24, 1024, 16, 1024, 8, 50257) if not args.dry_run else \
        (2, 64, 4, 32, 2, 128)
    say(f"== 2. GPT-2 medium shape ({layers} layers, hidden {hidden}, seq {seq}, batch {batch}, bf16) on {gpu_name()}")
    model = gpt2(layers, hidden, heads, seq, device, torch.bfloat16, vocab)
    ids = torch.randint(1, vocab, (batch, seq), device=device)
    hw = ss.load_hardware(args.hardware)
    t0 = time.perf_counter()
    prof = ss.profile_step(model, step, ids)
    say(f"  profiled in {time.perf_counter() - t0:.1f} s: {len(prof.ops)} ops, keep-all saved "
        f"{prof.total_bytes / 1e9:.2f} GB, profiled step peak {int(dict(prof.meta)['profiled_peak_bytes']) / 1e9:.3f} GB")
    rows, stalls = [], {}
    for name in ("keep-all", "full checkpointing", "slackswap @0.5"):
        try:
            if name == "full checkpointing":
                with full_checkpointing(model) as used:
                    t, alloc, reserved, _ = timed_steps(model, ids, contextlib.nullcontext, gpu, args.repeats)
                rows.append((f"full ckpt ({used.split('.')[0]})", t, alloc, reserved, None, None, None, None))
                continue
            planner, budget = ("keep-all", 1.0) if name == "keep-all" else ("slackswap", 0.5)
            plan = ss.plan(prof, hw, budget, planner=planner)
            sim = simulate(lower(prof, plan), hw, budget_bytes=plan.budget_bytes, record=False)
            ex = ss.apply(model, plan, prof)
            t, alloc, reserved, _ = timed_steps(model, ids, lambda: ex, gpu, args.repeats)
            saved = ex.stats.last_step.peak_device_bytes
            if args.trace and planner != "keep-all":
                trace_step(model, ids, ex, gpu)
            rows.append((name, t, alloc, reserved, saved, sim.step_s, sim.peak_bytes, plan.budget_bytes))
            stalls[name] = (sim.stall_s.get("compute", 0.0), ex.stats.last_step.budget_waits)
        except Exception:  # noqa: BLE001 - report and go on
            say(f"  {name}: FAILED\n{traceback.format_exc()}")
    say(f"  {'run':22s} {'step ms':>8s} {'sim ms':>8s} {'alloc GB':>9s} {'reserved GB':>12s} {'saved GB':>9s} "
        f"{'sim saved GB':>13s} {'budget GB':>10s}")
    for name, t, alloc, reserved, saved, sim_s, sim_peak, budget in rows:
        def gb(x):
            return "-" if x is None else f"{x / 1e9:.2f}"
        say(f"  {name:22s} {t * 1e3:8.1f} {'-' if sim_s is None else f'{sim_s * 1e3:8.1f}':>8s} {gb(alloc):>9s} "
            f"{gb(reserved):>12s} {gb(saved):>9s} {gb(sim_peak):>13s} {gb(budget):>10s}")
    say(f"  (simulated as {hw.name}; 'alloc' = allocator peak above the weights, 'saved' = SlackSwap's count)")
    by_name = {r[0]: r for r in rows}
    if "keep-all" in by_name and "slackswap @0.5" in by_name:
        keep, ours = by_name["keep-all"], by_name["slackswap @0.5"]
        stall, waits = stalls["slackswap @0.5"]
        say(f"  slackswap @0.5 over keep-all (recomputes and stalls): measured {(ours[1] - keep[1]) * 1e3:.1f} ms a "
            f"step, predicted {(ours[5] - keep[5]) * 1e3:.1f} ms, of which the compute stream stalls on copies "
            f"{stall * 1e3:.1f} ms; {waits} budget wait(s) in its last step")
    del model
    if gpu.cuda:
        torch.cuda.empty_cache()


def release_pinned_cache() -> None:
    """Pinned blocks freed by tensors stay in torch's host caching allocator until emptied."""
    import gc

    gc.collect()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def part_xl(args, device, gpu: Gpu) -> None:
    import slackswap_ds as ss

    layers, hidden, heads, seq, vocab = (48, 1600, 25, 1024, 50257) if not args.dry_run else (2, 64, 4, 32, 128)
    model = gpt2(layers, hidden, heads, seq, device, torch.bfloat16, vocab)
    # the micro-batch whose keep-all saved activations exceed the GPU's memory by 10% (at least 16),
    # from the bytes a 2-sample step saves (profiled with everything sent to host)
    small = ss.profile_step(model, step, torch.randint(1, vocab, (2, seq), device=device), warmup=0)
    per_sample = small.total_bytes / 2
    capacity = torch.cuda.get_device_properties(device).total_memory if gpu.cuda else 64 * per_sample
    batch = max(16, int(1.1 * capacity / per_sample) + 1) if not args.dry_run else 2
    # what leaves the GPU goes to pinned host memory: the run at 0.5 pins up to half of keep-all; on the
    # 2026-12-04 H200 (125 GiB of host memory) micro-batch 35 was killed by the host. Within 60% of it:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    while not args.dry_run and batch > 16 and 0.5 * per_sample * batch > 0.6 * host:
        batch -= 1
    say(f"== 3. GPT-2 XL shape ({layers} layers, hidden {hidden}, seq {seq}, bf16) at micro-batch {batch}: keep-all "
        f"would save {per_sample * batch / 1e9:.0f} GB, the GPU has {capacity / 1e9:.0f} GB, the host "
        f"{host / 1e9:.0f} GB; 5 SGD steps under SlackSwap @0.5 and under full checkpointing")
    model.zero_grad(set_to_none=True)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, vocab, (batch, seq), device=device)
    results = {}
    try:
        with full_checkpointing(model) as used:
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            t, alloc, reserved, losses = timed_steps(model, ids, contextlib.nullcontext, gpu, 5, optimizer)
        results["full checkpointing"] = (t, alloc, reserved, losses)
        say(f"  full checkpointing ({used}): {t * 1e3:.1f} ms/step, alloc peak {alloc / 1e9:.2f} GB")
    except Exception:  # noqa: BLE001
        say(f"  full checkpointing FAILED\n{traceback.format_exc()}")
    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    try:
        if gpu.cuda:
            torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0] if gpu.cuda else 0
        # the profiled step keeps up to 80% of the free memory on the GPU and sends the rest to pinned
        # host memory (at 55% the 2026-12-04 H200 run's host could not pin the ~90 GB left over)
        t0 = time.perf_counter()
        prof = ss.profile_step(model, step, ids, warmup=0, keep_bytes=int(0.8 * free))
        say(f"  profiled in {time.perf_counter() - t0:.1f} s: keep-all saved {prof.total_bytes / 1e9:.1f} GB "
            f"(GPU free before: {free / 1e9:.1f} GB); profiled step peak "
            f"{int(dict(prof.meta)['profiled_peak_bytes']) / 1e9:.1f} GB")
        plan = ss.plan(prof, args.hardware, 0.5)
        release_pinned_cache()  # (the profiled step's pinned buffers, back to the host for the run's pool)
        model.load_state_dict(start)
        model.zero_grad(set_to_none=True)
        ex = ss.apply(model, plan, prof)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        t, alloc, reserved, losses = timed_steps(model, ids, lambda: ex, gpu, 5, optimizer)
        results["slackswap @0.5"] = (t, alloc, reserved, losses)
        last = ex.stats.last_step
        say(f"  slackswap @0.5: {t * 1e3:.1f} ms/step, alloc peak {alloc / 1e9:.2f} GB (reserved {reserved / 1e9:.2f}), "
            f"saved peak {last.peak_device_bytes / 1e9:.2f} GB of budget {plan.budget_bytes / 1e9:.2f} GB; swapped "
            f"{last.swapped_bytes / 1e9:.1f} GB, recomputed {last.recomputed_bytes / 1e9:.1f} GB; copy waits "
            f"{last.copy_waits}; demotions {ex.stats.demotions}; fallbacks {last.fallbacks}")
    except Exception:  # noqa: BLE001
        say(f"  slackswap FAILED\n{traceback.format_exc()}")
    if len(results) == 2:
        a, b = results["slackswap @0.5"], results["full checkpointing"]
        say("  losses (step 0 is the warm-up, same weights and data for both):")
        for i, (x, y) in enumerate(zip(a[3], b[3])):
            say(f"    step {i}: slackswap {x:.6f}  checkpointing {y:.6f}  {'equal' if x == y else f'diff {x - y:+.2e}'}")
        say(f"  throughput ratio slackswap / full checkpointing: {b[0] / a[0]:.3f}")


def part_auto(args, device, gpu: Gpu) -> None:
    """An "auto" budget on this device: GPT-2 medium with Adam after one step (its state allocated),
    the room the allocator reports beside it, and what the CPU rule (16 B per parameter) would say."""
    from slackswap_ds.budget import auto_budget_bytes, model_state_bytes
    from slackswap_ds.hardware import load_hardware
    from slackswap_ds.machine import device_room

    say("\n== 4. activation_budget \"auto\" ==")
    layers, hidden, heads, seq = (24, 1024, 16, 1024) if not args.dry_run else (2, 64, 4, 32)
    model = gpt2(layers, hidden, heads, seq, device, torch.bfloat16 if gpu.cuda else torch.float32,
                 vocab=50257 if not args.dry_run else 128)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    step(model, torch.randint(1, 128, (2, seq), device=device))
    optimizer.step()
    gpu.sync()
    total, state, how = device_room(model, load_hardware(args.hardware), 0, 1)
    params = sum(p.numel() for p in model.parameters())
    say(f"  device {total:,} B; model state {state:,} B ({how}); 16 B per parameter would say "
        f"{model_state_bytes(params):,} B; auto budget {auto_budget_bytes(total, state):,} B")


def part_compiled(args, device, gpu: Gpu) -> None:
    """benchmarks/compiled_side_by_side.py on this device: SlackSwap on inductor blocks vs the
    partitioner's activation_memory_budget vs eager SlackSwap, one budget, one run."""
    if str(ROOT) not in sys.path:  # (run as a script: its folder is on the path, not the repository)
        sys.path.insert(0, str(ROOT))
    from benchmarks import compiled_side_by_side

    say("\n== 5. compiled side by side ==")
    shape = ["--layers", "12", "--hidden", "768", "--seq", "1024", "--batch", "4"] if not args.dry_run else \
        ["--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "2", "--repeats", "1"]
    compiled_side_by_side.main([*shape, "--device", device.type, *(["--deepcompile"] if device.type == "cuda" else [])])


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hardware", default="h200-pcie5")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (checks the script, measures nothing)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--test-timeout", type=int, default=150)
    ap.add_argument("--parts", default="tests,medium,xl,auto,compiled",
                    help="comma-separated: which parts to run (default: all five)")
    ap.add_argument("--trace", action="store_true",
                    help="part 2: where SlackSwap's step time goes (its counters and torch.profiler's top ops)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        say("gpu_validate: no CUDA device; nothing to measure (skipped)")
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if not args.dry_run else torch.device("cpu")
    gpu = Gpu(device)
    say(f"gpu_validate on {gpu_name()}, torch {torch.__version__}")
    t0 = time.perf_counter()
    wanted = set(args.parts.split(","))
    parts = [part for name, part in (("tests", part_tests), ("medium", part_medium), ("xl", part_xl),
                                     ("auto", part_auto), ("compiled", part_compiled))
             if name in wanted and not (part is part_tests and (args.skip_tests or args.dry_run))]
    for part in parts:
        try:
            part(args) if part is part_tests else part(args, device, gpu)
        except Exception:  # noqa: BLE001 - one part failing must not hide the others
            say(f"{part.__name__} FAILED\n{traceback.format_exc()}")
        say(f"  [{time.perf_counter() - t0:.0f} s so far]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

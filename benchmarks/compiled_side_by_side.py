"""Compiled training under one activation budget, side by side: SlackSwap on compiled blocks, the
compiler's own recompute-only answer, eager SlackSwap. Measured on this machine's CPU, in one run.

    python benchmarks/compiled_side_by_side.py [--layers 8] [--hidden 128] [--seq 128] [--budget 0.5] [--repeats 5]
                                               [--device cuda [--deepcompile]]

A GPT-2-style model (dropout on), every block compiled with inductor (torchtitan's pattern):

* compiled            the compiled model, nothing else: the reference, and keep-all's saved bytes
* slackswap compiled  the same compiled model under the slackswap planner's plan at the budget
* torch memory budget a second copy compiled with torch._functorch.config.activation_memory_budget
                      at the budget: the partitioner's own recompute-only knapsack inside each graph
* slackswap eager     the uncompiled model under its plan at the budget of *its* keep-all (compared with
                      the uncompiled model: eager saves more than the compiled graphs)

Per row: loss and every gradient torch.equal to its reference after one step from the same random
state; the peak of saved bytes on the device (SlackSwap's own accounting for its rows; for the others,
the bytes autograd holds at the end of forward, counted by a saved-tensor hook that changes nothing);
`/compiled`: against the compiled model's keep-all; the median step time over interleaved repeats (CPU: a copy to the "host" is a memcpy, no overlap); and
for the SlackSwap rows the simulator's prediction of the plan on an A100 and an H100 from the same
profile (op times measured on this CPU, so the percentages describe this CPU's op mix on those links);
for the `torch memory budget` row the prediction of a recompute-only knapsack plan (the planner
`recompute-knapsack`) on the compiled model's profile at the same budget: what the partitioner does,
at the granularity SlackSwap sees (a block's call), so marked `~`.
With `--device cuda` (benchmarks/gpu_validate.py part 5) the times are the GPU's and a last column gives
the allocator's peak during the step above what was allocated before it; `--deepcompile` adds DeepSpeed's
DeepCompile with `offload_activation` (one rank, ZeRO-1, `engine.compile()`; its own compiled program, so
`exact` is not asked and its peak is the allocator's). DeepCompile's passes need CUDA: not run on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def saved_bytes_counter():
    """(hooks, read): identity saved-tensor hooks that count the distinct storages packed (the
    bytes autograd holds for backward at the end of forward)."""
    seen: dict[int, int] = {}

    def pack(t):
        if type(t) is torch.Tensor and not (t.requires_grad and t.is_leaf):  # (not parameters)
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
        return t

    def read() -> int:
        total = sum(seen.values())
        seen.clear()
        return total
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), read


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.5, help="fraction of the keep-all saved bytes (default 0.5)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (benchmarks/gpu_validate.py part 5)")
    ap.add_argument("--deepcompile", action="store_true", help="with --device cuda: a DeepCompile offload_activation row")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    import transformers

    import slackswap_ds as ss
    from slackswap_ds.errors import BudgetInfeasibleError
    from slackswap_ds.hardware import load_hardware
    from slackswap_ds.plan import lower
    from slackswap_ds.planners import keep_all_result
    from slackswap_ds.simulator import simulate

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(1, args.hidden // 32),
                                  n_positions=args.seq, vocab_size=1024, bos_token_id=0, eos_token_id=0,
                                  use_cache=False)

    def budgeted_inductor(gm, example_inputs):
        """inductor with the partitioner's memory budget in force. (A backend of its own: Dynamo keeps
        one cache per backend, so the two compiled copies never share a graph.)"""
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=args.budget):
            return compile_fx(gm, example_inputs)

    def build(backend) -> torch.nn.Module:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).to(device).train()
        if backend is not None:
            for i, block in enumerate(model.transformer.h):
                model.transformer.h[i] = torch.compile(block, backend=backend)
        return model

    ids = torch.randint(1, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step(m, b):
        out = m(input_ids=b, labels=b)
        out.loss.backward()
        return out.loss

    def one(model, ctx=None):
        """loss, gradients, seconds of one step from a fixed random state (under `ctx`)."""
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.manual_seed(7)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        if ctx is None:
            loss = step(model, ids)
        else:
            with ctx:
                loss = step(model, ids)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        alloc_peak = torch.cuda.max_memory_allocated() - before if cuda else None
        return loss.detach(), [p.grad.clone() for p in model.parameters()], seconds, alloc_peak

    def equal(a, b) -> bool:
        return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))

    compiled, knapsack, eager = build("inductor"), build(budgeted_inductor), build(None)
    reference, eager_reference = one(compiled), one(eager)
    counter, read = saved_bytes_counter()
    one(compiled, counter)
    keep_all_bytes = read()

    rows, plans = {}, {}
    for name, model in (("slackswap compiled", compiled), ("slackswap eager", eager)):
        torch.manual_seed(7)
        profile = ss.profile_step(model, step, ids, warmup=1)
        model.zero_grad(set_to_none=True)
        plan = ss.plan(profile, "a100-80g-pcie4", args.budget)
        plans[name] = (profile, plan, ss.apply(model, plan, profile))
    runs = {"compiled": (compiled, None), "slackswap compiled": (compiled, plans["slackswap compiled"][2]),
            "torch memory budget": (knapsack, None), "slackswap eager": (eager, plans["slackswap eager"][2])}
    times = {name: [] for name in runs}
    for r in range(args.repeats + 1):  # interleaved; the first round (verifying steps, caches) is dropped
        for name, (model, ctx) in runs.items():
            hooks = None
            if ctx is None:
                hooks, read = saved_bytes_counter()
            result = one(model, ctx if ctx is not None else hooks)
            if r:
                times[name].append(result[2])
            rows[name] = result, (ctx.stats.last_step.peak_device_bytes if ctx is not None else read())
    deepcompile = deepcompile_row(args, build, step, ids) if args.deepcompile and cuda else None
    base = statistics.median(times["compiled"])
    hws = {n: load_hardware(n) for n in ("a100-80g-pcie4", "h100-pcie5")}
    print(f"GPT-2 style, {args.layers} blocks compiled with inductor, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, dropout on; budget {args.budget} of keep-all saved bytes ({keep_all_bytes:,} B compiled); "
          f"{device.type.upper()} medians of {args.repeats}")
    print(f"{'run':20s} {'exact':>6s} {'peak saved B':>14s} {'/compiled':>9s} {device.type.upper() + ' ms':>8s} "
          f"{'ratio':>6s}  {'A100 pred':>9s} {'H100 pred':>9s}" + ("  alloc peak B" if cuda else ""))
    for name, ((loss, grads, _, alloc_peak), peak) in rows.items():
        want = eager_reference if name == "slackswap eager" else reference
        exact = "yes" if equal((loss, grads), want) else "NO"
        med = statistics.median(times[name])
        preds = []
        if name in plans or name == "torch memory budget":
            profile, plan, _ = plans[name if name in plans else "slackswap compiled"]
            mark = "" if name in plans else "~"
            for hw_name, hw in hws.items():
                if name not in plans:  # (the partitioner's recompute-only knapsack, as SlackSwap's planner sees it)
                    try:
                        plan = ss.plan(profile, hw_name, args.budget, planner="recompute-knapsack")
                    except BudgetInfeasibleError:
                        preds.append("infeasible")
                        continue
                ideal = keep_all_result(profile, hw).step_s
                preds.append(f"{mark}{100 * ideal / simulate(lower(profile, plan), hw).step_s:.1f}%")
        print(f"{name:20s} {exact:>6s} {peak:>14,} {peak / keep_all_bytes:9.2f} {1e3 * med:8.1f} {med / base:6.2f}  "
              + (" ".join(f"{p:>9s}" for p in preds) if preds else f"{'-':>9s} {'-':>9s}")
              + (f"  {alloc_peak:12,}" if alloc_peak is not None else ""))
    if deepcompile is not None:
        print(deepcompile(base))
    return 0


def deepcompile_row(args, build, step, ids):
    """DeepSpeed's DeepCompile with offload_activation on one rank (CUDA): a function that, given the
    compiled row's median seconds, says its row (or why it did not run)."""
    import os

    try:
        import deepspeed

        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                            ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        deepspeed.init_distributed()
        # (SGD under ZeRO: DeepSpeed asks for the flag, as the 2026-12-04 H200 run said)
        config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": 1},
                  "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                  "compile": {"deepcompile": True, "offload_activation": True}}
        engine, *_ = deepspeed.initialize(model=build(None), config=config)
        engine.compile()
        times, peak = [], 0
        for r in range(args.repeats + 1):
            engine.zero_grad()
            torch.manual_seed(7)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() - before
    except Exception as e:  # (its own failure: said, the other rows stand)
        failure = f"{'deepcompile offload':20s} did not run: {type(e).__name__}: {str(e)[:200]}"
        return lambda base: failure
    med = statistics.median(times)
    return lambda base: (f"{'deepcompile offload':20s} {'-':>6s} {'-':>14s} {'-':>9s} {1e3 * med:8.1f} {med / base:6.2f}  "
                         f"{'-':>9s} {'-':>9s}  {peak:12,}  (DeepSpeed engine: ZeRO-1 backward and loss "
                         f"scaling in its time; its own graphs, so not compared bit for bit)")


if __name__ == "__main__":
    raise SystemExit(main())

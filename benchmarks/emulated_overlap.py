"""Overlap measured, not assumed: the stall of a step on the emulated asynchronous device beside the
stall the simulator predicts for the same Schedule, op times and copy times.

    python benchmarks/emulated_overlap.py [--rate 0.05GB/s] [--latency 20us] [--steps 9] [--json FILE]

For each case (the README's job's model, and a zoo Llama) one step is profiled with this CPU's op
times, plans are made (`--plans`: SlackSwap at 0.5 and 0.4, and every saved tensor swapped, prefetched from
the end of forward, which the slack cannot hide) for a link of `--rate` and `--latency` (the simulator's
Hardware: those copy times, no other cost), and the plan runs on the emulated device
(runtime/emulation.py) whose copies take exactly bytes / rate + latency. Per step, median of
`--steps`:

* predicted stall: the simulator's compute-stream stall for that Schedule and link (`stall_s`), and
  its step time minus the same Schedule's with instant copies; then ("x host", "stall") the same
  Schedule with every op time scaled by the measured step without copy delays over the profiled
  one: the executor's host time (hooks, issuing copies) also lengthens compute, and copies hide
  under it too;
* measured stall: the time the host blocked waiting for a copy (the emulated compute stream is the
  host thread), and the step's wall time minus the same plan's on the emulated device with zero delays.

The link is slow on purpose (0.05 GB/s: swapping every saved tensor of the README's job takes ten times
its profiled compute), so that a plan that ignores the slack stalls for all to see, and SlackSwap's
plans have little slack to hide copies in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))  # zoo.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))  # train.py

import torch  # noqa: E402

import slackswap_ds as ss  # noqa: E402
from slackswap_ds.hardware import Hardware  # noqa: E402
from slackswap_ds.plan import Decision, Plan, lower  # noqa: E402
from slackswap_ds.runtime.device import Device  # noqa: E402
from slackswap_ds.runtime.emulation import Delays, EmulatedAccelerator  # noqa: E402
from slackswap_ds.runtime.host_pool import HostPool  # noqa: E402
from slackswap_ds.simulator import simulate  # noqa: E402

from benchmarks._common import REPO_ROOT, out_dir, write_json  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "slackswap.json"


def readme_model():
    """The README job's model (launch/train.py's build_model with its defaults) and one rank's batch
    (the micro-batch of configs/slackswap.json)."""
    import train  # launch/train.py

    args = train.parse_args(["--deepspeed_config", str(CONFIG)])
    torch.manual_seed(args.seed)
    model = train.build_model(args).train()
    micro = json.loads(CONFIG.read_text())["train_micro_batch_size_per_gpu"]
    ids = torch.randint(1, args.vocab, (micro, args.seq), generator=torch.Generator().manual_seed(args.seed))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


def zoo_llama():
    import zoo

    model, batch = zoo.ZOO["llama"].build(torch.float32)
    model.config.use_cache = False
    return model, batch


def step(model, batch):
    loss = model(**batch).loss
    loss.backward()
    return loss


def link(rate_bps: float, latency_s: float) -> Hardware:
    """The simulator's view of the emulated device: copies of bytes / rate + latency each way, alone or
    both at once (two worker threads), and nothing else with a cost of its own."""
    return dataclasses.replace(Hardware.instant_copies(), name="emulated-link", d2h_bps=rate_bps, h2d_bps=rate_bps,
                               duplex_d2h_bps=rate_bps, duplex_h2d_bps=rate_bps, copy_latency_s=latency_s,
                               description="the emulated device's copies")


def measure(model, batch, plan, prof, delays: dict[str, Delays], steps: int) -> dict[str, dict]:
    """Per device (name -> its delays): median step wall time and host-blocked time of `steps` steps
    after two warm ones, the devices taking turns step by step (so that the machine's drift is shared)."""
    runs = {}
    for name, d in delays.items():
        acc = EmulatedAccelerator(d)
        device = Device(acc)
        runs[name] = (acc, device, ss.apply(model, plan, prof, device=device, pool=HostPool(None, device), verify=False),
                      {"step_s": [], "blocked_s": [], "budget_waits": []})
    for i in range(steps + 2):
        for acc, device, ex, got in runs.values():
            model.zero_grad(set_to_none=True)
            before = acc.blocked_s
            t0 = time.perf_counter()
            with ex:
                step(model, batch)
            device.synchronize()
            if i >= 2:
                got["step_s"].append(time.perf_counter() - t0)
                got["blocked_s"].append(acc.blocked_s - before)
                got["budget_waits"].append(ex.stats.last_step.budget_waits)
    out = {}
    for name, (acc, device, ex, got) in runs.items():
        assert acc.sanitizer.violations == []
        out[name] = {k: statistics.median(v) for k, v in got.items()}
        out[name]["peak_bytes"] = ex.stats.last_step.peak_device_bytes
    return out


def cases(name: str, build, rate: float, latency: float, steps: int, plans: list[tuple[str, float]]) -> list[dict]:
    model, batch = build()
    prof = ss.profile_step(model, step, batch, warmup=2)
    return [case(f"{name}: {planner} @{budget}", model, batch, prof, link(rate, latency), steps, planner, budget)
            for planner, budget in plans]


def case(name: str, model, batch, prof, hw: Hardware, steps: int, planner: str, budget: float) -> dict:
    rate, latency = hw.d2h_bps, hw.copy_latency_s
    if planner == "swap-all":  # every saved tensor out in forward and back from the end of forward on
        plan = Plan.build(prof, {a.key: Decision.SWAP for a in prof.activations},
                          budget_bytes=int(budget * prof.total_bytes), hardware_digest=hw.digest, planner="swap-all")
    else:
        plan = ss.plan(prof, hw, budget, planner=planner)
    schedule = lower(prof, plan)
    sim, sim_instant = simulate(schedule, hw), simulate(schedule, Hardware.instant_copies())
    got = measure(model, batch, plan, prof, {"link": Delays(latency_s=latency, bytes_per_s=rate), "instant": Delays()},
                  steps)
    slow, fast = got["link"], got["instant"]
    # the same Schedule with the op times scaled to the measured step without copy delays: the
    # executor's host time (hooks, issuing copies, poisoning) lengthens compute, which the profile's
    # op times do not have and which copies hide under as well
    scale = fast["step_s"] / sim_instant.step_s
    scaled = dataclasses.replace(prof, ops=tuple(dataclasses.replace(o, fwd_s=o.fwd_s * scale, bwd_s=o.bwd_s * scale)
                                                 for o in prof.ops))
    sim_scaled = simulate(lower(scaled, plan.rebuilt(scaled)), hw)
    swapped = sum(a.bytes for a in prof.activations if plan.decision[a.key] is Decision.SWAP)
    return {"case": name, "swapped_bytes": swapped, "copy_s": 2 * swapped / rate, "budget_bytes": plan.budget_bytes,
            "profiled_compute_s": sim_instant.step_s,
            "predicted_stall_s": sim.stall_s.get("compute", 0.0), "predicted_delta_s": sim.step_s - sim_instant.step_s,
            "host_scale": scale, "predicted_scaled_stall_s": sim_scaled.stall_s.get("compute", 0.0),
            "measured_blocked_s": slow["blocked_s"], "measured_delta_s": slow["step_s"] - fast["step_s"],
            "measured_step_s": slow["step_s"], "measured_step_instant_s": fast["step_s"],
            "budget_waits": slow["budget_waits"], "peak_bytes": slow["peak_bytes"],
            "predicted_peak_bytes": sim.peak_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="0.05GB/s", help="the emulated link's bandwidth each way (e.g. 0.25GB/s)")
    ap.add_argument("--latency", default="20us", help="the emulated link's fixed cost per copy")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--plans", default="slackswap@0.5,slackswap@0.4,swap-all@1",
                    help="planner@budget (a fraction of the keep-all peak), comma-separated; swap-all: every saved "
                         "tensor swapped, prefetched from the end of forward")
    ap.add_argument("--json", help="write the rows here (default benchmarks/results/emulated_overlap.json)")
    ap.add_argument("--quick", action="store_true", help="one case (the zoo Llama at 0.5), one step: a smoke run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    delays = Delays.parse(f"{args.rate}+{args.latency}")
    plans = [("slackswap", 0.5)] if args.quick else \
        [(p.split("@")[0], float(p.split("@")[1])) for p in args.plans.split(",")]
    steps = 1 if args.quick else args.steps
    rows = [] if args.quick else cases("README job", readme_model, delays.bytes_per_s, delays.latency_s, steps, plans)
    rows += cases("zoo llama", zoo_llama, delays.bytes_per_s, delays.latency_s, steps, plans)
    ms = 1e3
    print(f"emulated link: {delays}; median of {steps} steps; times per step in ms")
    print(f"{'case':38} {'swapped':>10} {'copies':>7} {'compute':>8} | {'predicted stall':>15} {'Δstep':>7} "
          f"{'x host':>6} {'stall':>6} | {'measured blocked':>16} {'Δstep':>7} | {'waits':>5} {'peak / budget':>21}")
    for r in rows:
        print(f"{r['case']:38} {r['swapped_bytes']:>10,} {ms * r['copy_s']:7.2f} {ms * r['profiled_compute_s']:8.2f} | "
              f"{ms * r['predicted_stall_s']:15.2f} {ms * r['predicted_delta_s']:7.2f} "
              f"{r['host_scale']:6.2f} {ms * r['predicted_scaled_stall_s']:6.2f} | "
              f"{ms * r['measured_blocked_s']:16.2f} {ms * r['measured_delta_s']:7.2f} | {r['budget_waits']:5.0f} "
              f"{r['peak_bytes']:>10,} / {r['budget_bytes']:,}")
    path = Path(args.json) if args.json else out_dir(None) / "emulated_overlap.json"
    write_json(path, {"rate": args.rate, "latency": args.latency, "steps": steps, "rows": rows})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

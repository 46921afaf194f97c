"""Per-stage plans on a simulated pipeline node, against one plan policy for all stages.

    python benchmarks/pipeline_node.py

A DGX-A100 node runs a Llama-13B-style job (preset llama-13b) in 4 pipeline stages x 2 data-parallel
replicas, 8 micro-batches per step, ZeRO stage 1. Every GPU has the same memory, so every stage gets
the same activation budget in bytes (a fraction of stage 0's keep-all peak, the largest: under 1F1B
stage i holds 4 - i micro-batches). "per stage": each stage plans to its own budget (the fewer
micro-batches it holds, the more of each it may keep). "one plan": every stage plans as if it held
stage 0's four micro-batches, as a job-wide plan policy would. Both on the slackswap planner.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slackswap_ds.hardware import load_node  # noqa: E402
from slackswap_ds.pipeline import Job, ideal_step_s, simulate_job, stage_profile  # noqa: E402
from slackswap_ds.plan import Decision  # noqa: E402
from slackswap_ds.workloads import PRESETS  # noqa: E402

FRACTIONS = (0.3, 0.4, 0.5)


def main() -> int:
    node = load_node("dgx-a100")
    job = Job(PRESETS["llama-13b"], pp=4, dp=2, micro_batches=8, zero=1)
    ideal = ideal_step_s(job, node)
    stage0 = job.in_flight(0) * stage_profile(job, node.gpu, 0).total_bytes
    print(f"llama-13b on dgx-a100: pp 4 x dp 2, 8 micro-batches of {job.spec.micro_batch} x {job.spec.seq}, ZeRO 1; "
          f"ideal step {ideal:.3f} s; stage 0 keep-all peak {stage0 / 1e9:.2f} GB")
    print(f"{'budget':>7} {'plans':<10} {'thru %':>7} {'step s':>7}   per stage: peak GB / recompute ms per "
          f"micro-batch / swapped GB per micro-batch")
    for frac in FRACTIONS:
        budget = int(frac * stage0)
        for one in (False, True):
            res = simulate_job(job, node, budget, "slackswap", ideal_s=ideal, one_plan=one)
            cells = []
            for peak, st in zip(res.peaks, res.stages):
                swap = st.plan.bytes_by_decision(st.profile)[Decision.SWAP]
                cells.append(f"{peak / 1e9:5.2f} / {st.result.recompute_s * 1e3:4.1f} / {swap / 1e9:4.2f}")
            print(f"{budget / 1e9:5.2f}GB {'one plan' if one else 'per stage':<10} {100 * res.throughput:>7.2f} "
                  f"{res.step_s:>7.3f}   " + "  |  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""SlackSwap under ZeRO-Offload: plans that know DeepSpeed's own PCIe traffic against plans that do not.

    python benchmarks/zero_offload.py

With ``"offload_optimizer"`` DeepSpeed copies every micro-batch's gradients to the host during
backward, on the same link SlackSwap prefetches over (A100: a host-to-device copy falls from 25 to
~11 GB/s while a device-to-host one runs), and pins the optimizer state (fp32 master, m, v, gradient:
16 B per parameter) in host memory SlackSwap's pool also comes from. A plan that knows
(`pipeline.offload_aware`: prefetches at the duplex rate, the pool net of the optimizer state) is
compared with one made as if the link were free; both are simulated with the traffic on the link.
Budget: 50% of the keep-all activation peak; ZeRO stage 2; DGX-A100 presets.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slackswap_ds.hardware import load_node  # noqa: E402
from slackswap_ds.pipeline import Job, ideal_step_s, simulate_job  # noqa: E402
from slackswap_ds.plan import Decision  # noqa: E402
from slackswap_ds.shares import Share  # noqa: E402
from slackswap_ds.workloads import PRESETS  # noqa: E402

BUDGET = 0.5


def settings(node):
    """(label, data-parallel ranks, the rank's share of its node)."""
    gpu = node.gpu
    alone = Share(gpu.d2h_bps, gpu.h2d_bps, int(node.host_bytes // node.gpus))  # its switch to itself
    return [("1 GPU, own PCIe link", 1, alone), ("8 GPUs (dp 8), 2 per switch", 8, Share.of_node(node))]


def main() -> int:
    node = load_node("dgx-a100")
    print(f"{'model':<10} {'setting':<29} {'plan':<14} {'thru %':>7} {'stall ms':>9} {'peak/budget':>12} "
          f"{'swap GB':>8} {'recomp ms':>10}")
    for name in ("gpt2-xl", "llama-7b"):
        for label, dp, share in settings(node):
            job = Job(PRESETS[name], dp=dp, zero=2, offload_optimizer=True)
            ideal = ideal_step_s(job, node, share)
            for aware in (True, False):
                res = simulate_job(job, node, BUDGET, "slackswap", share=share, ideal_s=ideal, zero_aware=aware)
                st = res.stages[0]
                swap = st.plan.bytes_by_decision(st.profile)[Decision.SWAP]
                print(f"{name:<10} {label:<29} {'knows ZeRO' if aware else 'ignores ZeRO':<14} "
                      f"{100 * res.throughput:>7.1f} {st.result.stall_s['compute'] * 1e3:>9.1f} "
                      f"{res.peaks[0] / st.budget_bytes:>12.3f} {swap / 1e9:>8.2f} {st.result.recompute_s * 1e3:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The simulator against every 8-GPU bf16 run of one published table, not a chosen few.

    python benchmarks/fidelity_sweep.py [--json FILE]

`fidelity.py` holds hand-picked rows from many sources; this takes *all* 96 rows of llm-foundry's
benchmark table (commit 061f2c7c) that ran on one node of 8 A100-80GB or H100-80GB in bf16 -- models
of 125M to 30B parameters, sequences of 512 to 65,536 tokens, with and without recompute -- and
simulates each exactly as fidelity.py simulates its MPT rows (FSDP FULL_SHARD through PyTorch FSDP's
FlatParameter, fp32 gradient reduction, Composer's two train metrics, FlashAttention's Triton
kernel; `fidelity._mpt` for the model). Nothing here was fitted to these rows: ten of them are in
fidelity.py's table, the rest were never looked at while the cost model was built.

It prints every row, then per GPU the share within +-5% and +-10% and the median ratio by sequence
length, where the misses are systematic: too slow at 16k and longer (the Triton kernel's attention
rate is held at the published figure's longest length, 16k), a little too fast at 512-1024.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fidelity import COMPOSER_TRAIN_METRICS, FP32_REDUCE, _mpt  # noqa: E402
from slackswap_ds.hardware import load_node  # noqa: E402
from slackswap_ds.pipeline import Job, simulate_job  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "llm_foundry_061f2c7c_8gpu_bf16.csv"
# scripts/train/yamls/pretrain/mpt-<size>.yaml at the same commit: d_model, n_heads, n_layers
DIMS = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
        "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
        "70b": (8192, 64, 80)}
NODES = {"a100_80gb": "dgx-a100", "h100_80gb": "dgx-h100"}
SEQ_BANDS = ((512, 1024), (2048, 8192), (16384, 65536))


def measured_rows() -> list[dict]:
    with DATA.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def simulate(row: dict) -> float:
    """Predicted tokens/s per GPU of one table row."""
    d, heads, layers = DIMS[row["model"]]
    seq, mb, ga = int(row["seq"]), int(row["micro_batch"]), int(row["grad_accum"])
    spec = _mpt(row["model"], d, heads, layers, mb, seq)
    job = Job(spec, dp=int(row["gpus"]), micro_batches=ga, zero=3, sharding="fsdp1",
              logit_metrics=COMPOSER_TRAIN_METRICS, grad_reduce_bytes=FP32_REDUCE)
    res = simulate_job(job, load_node(NODES[row["gpu"]]), float("inf"),
                       "full-recompute" if row["act_ckpt"] == "True" else "keep-all")
    return mb * ga * seq / res.step_s


def summary(results: list[dict]) -> list[str]:
    lines = []
    for gpu in NODES:
        rs = [r for r in results if r["gpu"] == gpu]
        ratios = [r["ratio"] for r in rs]
        within = [sum(abs(x - 1) <= t for x in ratios) for t in (0.05, 0.10)]
        bands = "; ".join(
            f"seq {lo}-{hi}: {statistics.median(b):.3f} ({len(b)} rows)"
            for lo, hi in SEQ_BANDS if (b := [r["ratio"] for r in rs if lo <= int(r["seq"]) <= hi]))
        lines.append(f"{gpu}: {len(rs)} rows, {within[0]} within +-5% ({within[0] / len(rs):.0%}), {within[1]} within "
                     f"+-10% ({within[1] / len(rs):.0%}), median ratio {statistics.median(ratios):.3f}; "
                     f"median by sequence length: {bands}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    results = []
    print(f"{'gpu':<10} {'model':>5} {'seq':>6} {'mb':>3} {'ga':>3} {'recompute':>9} {'measured':>9} "
          f"{'predicted':>9} {'ratio':>6}")
    for row in measured_rows():
        predicted = simulate(row)
        measured = float(row["tokens_per_s_per_gpu"])
        results.append({**row, "predicted": predicted, "ratio": predicted / measured})
        print(f"{row['gpu']:<10} {row['model']:>5} {row['seq']:>6} {row['micro_batch']:>3} {row['grad_accum']:>3} "
              f"{row['act_ckpt']:>9} {measured:>9.0f} {predicted:>9.0f} {predicted / measured:>6.3f}")
    print()
    print("\n".join(summary(results)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measured speed of fused attention kernels, by kernel, causality, head dimension and sequence length.

A fused attention kernel (FlashAttention and its kin) does not run at one speed per GPU: short
sequences and causal masks leave its tiles partly idle, head dim 128 runs faster than 64, and the
implementations differ by 2x (FlashAttention-2 against its Triton version on A100). A GPU preset's
``"attention"`` section holds published forward + backward rates for each kernel it has measurements
of, one series over sequence length per (causal, head dim):

    "attention": {"source": "...", "status": "measured", "seq": [512, 1024, ...],
                  "tflops": {"fa2": {"causal": {"64": [88, 119, ...], "128": [...]},
                                     "full": {"64": [...], "128": [...]}}, ...}}

Rates are in the convention of FlashAttention's benchmark (``benchmarks/benchmark_flash_attention.py``):
forward FLOPs ``4·b·s²·h·d``, halved for a causal kernel, backward 2.5x forward. A causal kernel's real
work is a bit more than half (the diagonal blocks are done in full, `layer.causal_fraction`), so
`seconds` converts the work back to that count: the measured rate already holds the diagonal's cost.
The one rate is used for forward and for backward (the published figures are for both together).
Between two measured head dims the rate is interpolated linearly; beyond them, and beyond the
sequence lengths, it is held flat.

A kernel with no published figure on a GPU may be *derived* from one that has one, by a rule and no
number: ``"derived": {"fa-triton": {"like": "fa1", "from": "a100-80g-pcie4", "source": "..."}}`` gives
it, at each shape, this GPU's rate of the kernel it is ``like`` times the two kernels' ratio on the
``from`` preset (`AttentionRates.with_derived`). `AttentionRates.derived` names such kernels, so
a report can say which speeds were measured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidFileError

# The kernels a workload can name (`ModelSpec.attention_kernel`) and what each is.
KERNELS = {
    "fa2": "FlashAttention-2 (flash-attn >= 2; PyTorch SDPA's flash backend since 2.2)",
    "fa1": "FlashAttention v1 (flash-attn 1.x CUDA kernels)",
    "fa-triton": "FlashAttention's Triton version (flash_attn_triton.py; llm-foundry's attn_impl: triton)",
    "xformers": "xformers' memory-efficient attention",
}
DEFAULT_KERNEL = "fa2"
_MASKS = {"causal": True, "full": False}


@dataclass(frozen=True)
class AttentionShape:
    """What sets a fused attention kernel's speed: which kernel, its head dim, sequence length and
    mask; `work_share` is the share of the full s x s work it does (1, or a causal kernel's share)."""

    kernel: str
    head_dim: int
    seq: int
    causal: bool
    work_share: float = 1.0


@dataclass(frozen=True)
class Derivation:
    """`kernel`'s rates on a GPU without a figure of it: the GPU's rates of `like` times the ratio
    kernel / like measured on the `reference` preset."""

    kernel: str
    like: str
    reference: str
    source: str

    @property
    def rule(self) -> str:
        return f"{self.like}'s rates on this GPU x {self.kernel} / {self.like} on {self.reference}"


@dataclass(frozen=True)
class AttentionRates:
    """Measured forward + backward FLOP/s of fused attention kernels on one GPU."""

    seq: tuple[int, ...]
    # (kernel, causal, head dim) -> FLOP/s at each of `seq`
    series: tuple[tuple[tuple[str, bool, int], tuple[float, ...]], ...]
    source: str = ""
    derivations: tuple[Derivation, ...] = ()  # kernels to derive (`with_derived`); derived ones stay listed

    @property
    def derived(self) -> dict[str, Derivation]:
        """The kernels with no measured figure here, and how their rates were derived."""
        return {d.kernel: d for d in self.derivations}

    def with_derived(self, reference_rates) -> "AttentionRates":
        """These rates with each `derivations` kernel added: `reference_rates(name)` gives a preset's
        rates. At each (mask, head dim) this GPU has `like` and the reference has both kernels:
        rate = like here x (kernel / like on the reference), the reference read at this GPU's lengths."""
        series = list(self.series)
        for d in self.derivations:
            ref = reference_rates(d.reference)
            if ref is None or d.kernel not in ref.kernels or d.kernel in ref.derived:
                raise InvalidFileError(f"attention: {d.kernel!r} is derived from {d.reference!r}, which has no "
                                       f"measured rates of it")
            for (k, causal, dim), like_here in self.series:
                if k != d.like:
                    continue
                pairs = [(ref.rate(d.kernel, causal, dim, s), ref.rate(d.like, causal, dim, s)) for s in self.seq]
                if any(a is None or b is None for a, b in pairs):
                    continue
                series.append(((d.kernel, causal, dim), tuple(r * a / b for r, (a, b) in zip(like_here, pairs))))
            if not any(k == d.kernel for (k, _, _), _ in series):
                raise InvalidFileError(f"attention: nothing to derive {d.kernel!r} from: {d.like!r} is not "
                                       f"measured at the same masks and head dims here and on {d.reference!r}")
        return dataclasses.replace(self, series=tuple(sorted(series)))

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(sorted({k for (k, _, _), _ in self.series}))

    def rate(self, kernel: str, causal: bool, head_dim: int, seq: int) -> float | None:
        """FLOP/s (in the benchmark's count) of `kernel` at this shape; None when not measured."""
        by_dim = sorted((d, rates) for (k, c, d), rates in self.series if k == kernel and c == causal)
        if not by_dim:
            return None
        at = [(d, _along(self.seq, rates, seq)) for d, rates in by_dim]
        if head_dim <= at[0][0]:
            return at[0][1]
        for (d0, r0), (d1, r1) in zip(at, at[1:]):
            if head_dim <= d1:
                return r0 + (head_dim - d0) / (d1 - d0) * (r1 - r0)
        return at[-1][1]

    def seconds(self, flops: float, shape: AttentionShape) -> float | None:
        """Seconds of one kernel doing `flops` of real work at `shape`; None when not measured."""
        rate = self.rate(shape.kernel, shape.causal, shape.head_dim, shape.seq)
        if rate is None:
            return None
        counted = flops / shape.work_share * (0.5 if shape.causal else 1.0)
        return counted / rate

    def to_json(self) -> dict:
        """The tables as the digest sees them."""
        return {"seq": list(self.seq), "series": [[k, c, d, list(r)] for (k, c, d), r in self.series]}


def _along(seqs: tuple[int, ...], rates: tuple[float, ...], seq: int) -> float:
    """Linear in log(seq) between measured lengths, flat beyond them (as `hardware.Curve`)."""
    if seq <= seqs[0]:
        return rates[0]
    for s0, s1, r0, r1 in zip(seqs, seqs[1:], rates, rates[1:]):
        if seq <= s1:
            return r0 + math.log(seq / s0) / math.log(s1 / s0) * (r1 - r0)
    return rates[-1]


def parse_attention(raw, path: Path, statuses: tuple[str, ...]) -> AttentionRates:
    """A preset's ``"attention"`` section, every problem named at once."""
    where = f"hardware file {str(path)!r}: \"attention\""
    if not isinstance(raw, dict) or not {"source", "status", "seq", "tflops"} <= set(raw):
        raise InvalidFileError(f"{where} must be an object with source, status, seq and tflops")
    problems: list[str] = []
    if raw["status"] not in statuses:
        problems.append(f"status must be one of {list(statuses)}, got {raw['status']!r}")
    if not str(raw["source"]).strip():
        problems.append("empty source")
    seq = raw["seq"]
    if (not isinstance(seq, list) or not seq or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in seq)
            or seq != sorted(set(seq))):
        problems.append(f"seq must be increasing positive integers, got {seq!r}")
        seq = []
    series = []
    tables = raw["tflops"] if isinstance(raw["tflops"], dict) else {}
    if not tables:
        problems.append("tflops must map kernel names to {\"causal\"|\"full\": {head dim: rates}}")
    for kernel, masks in tables.items():
        if kernel not in KERNELS:
            problems.append(f"unknown kernel {kernel!r} (valid: {list(KERNELS)})")
            continue
        for mask, dims in (masks.items() if isinstance(masks, dict) else [(None, None)]):
            if mask not in _MASKS or not isinstance(dims, dict):
                problems.append(f"{kernel}: keys must be 'causal' or 'full', each mapping head dims to rates")
                continue
            for dim, rates in dims.items():
                ok = (str(dim).isdigit() and int(dim) > 0 and isinstance(rates, list) and len(rates) == len(seq)
                      and all(not isinstance(r, bool) and isinstance(r, (int, float)) and r > 0 for r in rates))
                if not ok:
                    problems.append(f"{kernel}.{mask}.{dim}: give a head dim and {len(seq)} positive rates (one per seq)")
                    continue
                series.append(((kernel, _MASKS[mask], int(dim)), tuple(float(r) * 1e12 for r in rates)))
    derivations = _derivations(raw.get("derived", {}), set(tables), problems)
    if problems:
        raise InvalidFileError(f"{where}: " + "; ".join(problems))
    return AttentionRates(tuple(seq), tuple(sorted(series)), f"{raw['status']}: {raw['source']}", derivations)


def _derivations(raw, measured: set[str], problems: list[str]) -> tuple[Derivation, ...]:
    """The section's ``"derived"`` kernels: each names a measured kernel it is like, a reference
    preset and a source."""
    if not isinstance(raw, dict):
        problems.append("derived must map kernel names to {\"like\", \"from\", \"source\"}")
        return ()
    out = []
    for kernel, entry in raw.items():
        ok = isinstance(entry, dict) and set(entry) == {"like", "from", "source"} and all(
            isinstance(v, str) and v.strip() for v in entry.values())
        if kernel not in KERNELS or kernel in measured or not ok or entry["like"] not in measured:
            problems.append(f"derived.{kernel}: a kernel not measured here, with a measured kernel it is \"like\", "
                            f"the preset it is derived \"from\" and a \"source\"")
            continue
        out.append(Derivation(kernel, entry["like"], entry["from"], entry["source"]))
    return tuple(out)

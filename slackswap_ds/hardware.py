"""Hardware the planner and simulator reason about: one GPU (`Hardware`) and a node of them (`Node`).

Presets live in ``configs/hardware/*.json``. Every parameter there carries its value, its source and
a status (datasheet / measured / derived / unmeasured), so a reader can see which numbers are facts
and which are assumptions. Nothing in this module invents a number.

Besides scalars, a GPU preset may carry measured *curves* (``"curves"``: points read from a published
benchmark, each with its source), interpolated linearly in log(x) and held flat beyond the ends:

* ``gemm_flops``: x = FLOPs of one GEMM call, y = the FLOP/s it achieves. Small GEMMs do not fill the
  GPU; one constant efficiency would over-predict small models and cap large ones. A preset gives
  either this curve or the scalar ``matmul_efficiency``, never both. Its optional ``"shapes"`` (one
  ``[batch, m, n, k]`` per point, 2·b·m·n·k = x) with the scalar ``sm_count`` time GEMMs by shape.
* ``flash_attention_flops``: x = FLOPs of one fused attention kernel, y = FLOP/s, one speed for every
  kernel and shape. A preset gives this curve or the ``"attention"`` section (`attention_rates`: by
  kernel, mask, head dim and sequence length), never both; with neither, fused attention runs at the
  GEMM curve's speed.
* ``allreduce_busbw``: x = message bytes, y = NCCL all-reduce *bus* bandwidth among the GPUs of one
  NVLink/NVSwitch board (nccl-tests' busbw: time = bytes * 2(n-1)/n / busbw for an all-reduce,
  bytes * (n-1)/n / busbw for an all-gather or reduce-scatter of the full buffer). Needed only by
  tensor parallelism.

Optional scalars (a preset without them keeps the plain roofline): ``sm_count`` turns on the GEMM
*shape* model (`tile_efficiency`, `Hardware.gemm_s`), ``elementwise_bps`` is what memory-bound kernels achieve (a
STREAM-like copy, below the read bandwidth ``hbm_bps``), ``kernel_overhead_s`` is the fixed time each
kernel adds (launch and the gap between dependent kernels), ``sustained_clock_fraction`` is the share of
its curves' compute rates (GEMM, attention) a GPU holds once training keeps it at its power limit, when
the curves were measured in short bursts at the boost clock, ``nccl_sms`` is how many SMs a running NCCL
collective holds: compute that overlaps one runs on the rest (`Hardware.beside_collective`).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .attention_rates import AttentionRates, AttentionShape, Derivation, parse_attention
from .errors import InvalidFileError, UnknownNameError
from .files import read_json

STATUSES = ("datasheet", "measured", "derived", "unmeasured")
FORMAT = "slackswap.hardware/1"


def hardware_dir() -> Path:
    """Where presets are read from: ``$SLACKSWAP_HARDWARE_DIR`` or the repository's configs/hardware."""
    env = os.environ.get("SLACKSWAP_HARDWARE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "configs" / "hardware"


@dataclass(frozen=True)
class Curve:
    """Measured (x, y) points, interpolated linearly in log(x), flat beyond the first and last point."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if not self.points or any(x <= 0 or y <= 0 for x, y in self.points) or xs != sorted(set(xs)):
            raise ValueError("a curve needs points with x > 0 strictly increasing and y > 0")

    def at(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([p[0] for p in pts], x)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + w * (y1 - y0)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")

# The large output tiles (M x N) cuBLAS chooses among for 16-bit GEMMs: NVIDIA, "Matrix Multiplication
# Background User's Guide" (docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication),
# sections "Tile Quantization" and "Wave Quantization" (its examples use 256x128 tiles; its list of
# tile sizes starts 256x128, 128x256, 128x128). Smaller tiles reuse less data, so only these are counted.
GEMM_TILES = ((256, 128), (128, 256), (128, 128))

GemmShape = tuple[int, int, int, int]  # (batch, m, n, k): batch GEMMs of an m x k by k x n product


def tile_efficiency(batch: float, m: float, n: float, sm_count: int) -> float:
    """Useful fraction of the work a GEMM's output tiles give the SMs (NVIDIA's matmul guide), for
    the tile that quantizes best: tile quantization (the last row / column of tiles is partly empty)
    times wave quantization (the last wave of tiles leaves SMs idle)."""
    best = 0.0
    for tm, tn in GEMM_TILES:
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = batch * rows * cols
        waves = math.ceil(tiles / sm_count)
        best = max(best, (m * n) / (rows * tm * cols * tn) * tiles / (waves * sm_count))
    return best


@dataclass(frozen=True)
class Hardware:
    """One GPU and its host link. Rates are bytes/s or FLOP/s as achieved, unless a source says peak."""

    name: str
    peak_flops: float  # dense 16-bit tensor-core peak
    matmul_efficiency: float  # fraction of peak that large matmuls sustain
    hbm_bytes: float
    hbm_bps: float  # achieved HBM bandwidth (elementwise ops are bound by it)
    d2h_bps: float  # device -> pinned host, alone
    h2d_bps: float  # pinned host -> device, alone
    duplex_d2h_bps: float  # D2H while an H2D runs on the same GPU
    duplex_h2d_bps: float  # H2D while a D2H runs on the same GPU
    copy_latency_s: float  # fixed cost per copy
    description: str = ""
    sources: tuple[tuple[str, str], ...] = ()
    gemm_flops: Curve | None = None  # achieved FLOP/s by GEMM size; replaces matmul_efficiency
    allreduce_busbw: Curve | None = None  # NCCL bus bandwidth by message size on the NVLink board
    flash_attention_flops: Curve | None = None  # achieved FLOP/s of fused attention kernels, one speed
    attention_rates: AttentionRates | None = None  # ... or by kernel and shape (`attention_rates`)
    gemm_shapes: tuple[GemmShape, ...] = ()  # the (batch, m, n, k) of each gemm_flops point
    sm_count: int = 0  # streaming multiprocessors; 0: GEMM speed by FLOPs only, not by shape
    elementwise_bps: float = math.nan  # what memory-bound kernels achieve; nan: hbm_bps
    kernel_overhead_s: float = 0.0  # fixed cost of each kernel (launch, gap between dependent kernels)
    sustained_clock_fraction: float = 1.0  # of its curves' (burst-clock) compute rates a power-saturated GPU holds
    nccl_sms: int = 0  # SMs a running NCCL collective holds (0: compute beside a collective is not slowed)
    # Not preset parameters: what a collective running beside the compute takes (`beside_collective`)
    sms_taken: int = 0
    hbm_bps_taken: float = 0.0

    @classmethod
    def instant_copies(cls) -> "Hardware":
        """Copies that take no time: how the CPU accelerator's synchronous copy path looks to a
        Schedule. Simulating a plan on it predicts the runtime's own peak accounting on CPU."""
        return cls("instant-copies", 1.0, 1.0, math.inf, math.inf, math.inf, math.inf, math.inf, math.inf, 0.0,
                   description="zero-time copies (CPU accelerator, synchronous path)")

    def gemm_rate(self, flops: float) -> float:
        """FLOP/s that one GEMM call of `flops` achieves: the measured curve, else peak x efficiency."""
        if self.gemm_flops is not None:
            return self.gemm_flops.at(flops)
        return self.peak_flops * self.matmul_efficiency

    @property
    def by_shape(self) -> bool:
        """Whether GEMMs are timed by shape: an SM count and the measured curve's shapes are known."""
        return bool(self.sm_count) and self.gemm_flops is not None and bool(self.gemm_shapes)

    def tile_efficiency(self, shape: GemmShape) -> float:
        """Tile and wave quantization of `shape` on the SMs compute has (all but `sms_taken`)."""
        batch, m, n, _ = shape
        return tile_efficiency(batch, m, n, self.sm_count - self.sms_taken)

    @property
    def _compute_share(self) -> float:
        """Share of the GPU's compute rate its kernels get: the sustained clock, less the SMs a
        collective beside them holds."""
        sms = (self.sm_count - self.sms_taken) / self.sm_count if self.sms_taken else 1.0
        return self.sustained_clock_fraction * sms

    def beside_collective(self, link_bps: float) -> "Hardware":
        """This GPU as compute kernels find it while an NCCL collective at bus bandwidth `link_bps`
        runs beside them: `nccl_sms` fewer SMs (NCCL's blocks take an SM each and share it with no
        other kernel) and HBM less `NCCL_HBM_BYTES_PER_LINK_BYTE` times the link traffic. Unchanged
        on a preset without `nccl_sms` (or without more SMs than that)."""
        if not self.nccl_sms or self.nccl_sms >= self.sm_count:
            return self
        return dataclasses.replace(self, sms_taken=self.nccl_sms,
                                   hbm_bps_taken=NCCL_HBM_BYTES_PER_LINK_BYTE * link_bps)

    @cached_property
    def _unquantized_gemm_flops(self) -> Curve:
        """The GEMM curve with each measured point's own tile efficiency (on all its SMs) divided
        out: what a GEMM of that size does per useful tile."""
        return Curve(tuple((x, y / tile_efficiency(shape[0], shape[1], shape[2], self.sm_count))
                           for (x, y), shape in zip(self.gemm_flops.points, self.gemm_shapes)))

    def gemm_s(self, flops: float, shape: GemmShape | None = None) -> float:
        """Seconds of one GEMM call of `flops`. With its `shape` (and a preset that times by shape),
        the rate is the curve's, its points' tile efficiencies divided out, times this shape's: a
        measured shape runs exactly at its measured speed, a skinny or ragged one slower than a
        square of the same FLOPs."""
        if flops <= 0:
            return 0.0
        if shape is None or not self.by_shape:
            return flops / (self.gemm_rate(flops) * self._compute_share)
        rate = self._unquantized_gemm_flops.at(flops) * self.tile_efficiency(shape)
        return flops / (rate * self._compute_share)

    def elementwise_s(self, nbytes: float) -> float:
        """Seconds of memory-bound work reading and writing `nbytes` in all."""
        rate = (self.hbm_bps if math.isnan(self.elementwise_bps) else self.elementwise_bps) - self.hbm_bps_taken
        if rate <= 0:
            raise ValueError(f"hardware {self.name!r}: a collective beside the compute takes all of HBM")
        return nbytes / rate

    def attention_s(self, flops: float, shape: AttentionShape) -> float:
        """Seconds of one fused (flash) attention kernel doing `flops` at `shape`: the measured rate
        of its kernel, else FlashAttention-2's (`attention_kernel_measured` tells), else the one-speed
        curve, else GEMM speed."""
        if flops <= 0:
            return 0.0
        if self.attention_rates is not None:
            for kernel in (shape.kernel, "fa2"):
                s = self.attention_rates.seconds(flops, dataclasses.replace(shape, kernel=kernel))
                if s is not None:
                    return s / self._compute_share
        if self.flash_attention_flops is None:
            return self.gemm_s(flops)
        return flops / (self.flash_attention_flops.at(flops) * self._compute_share)

    def attention_kernel_measured(self, kernel: str) -> bool:
        """Whether this GPU's preset has measured speeds of `kernel` (else derived ones, or FA2's,
        stand in for it: `attention_kernel_derived`)."""
        return (self.attention_rates is not None and kernel in self.attention_rates.kernels
                and kernel not in self.attention_rates.derived)

    def attention_kernel_derived(self, kernel: str) -> Derivation | None:
        """How `kernel`'s speed on this GPU was derived, when it was (None: measured, or absent)."""
        return None if self.attention_rates is None else self.attention_rates.derived.get(kernel)

    def collective_s(self, kind: str, nbytes: float, ranks: int) -> float:
        """Seconds of one NCCL collective over `ranks` GPUs of the NVLink board; `nbytes` is the
        whole buffer (an all-gather's output, a reduce-scatter's input), as nccl-tests counts it."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if self.allreduce_busbw is None:
            raise ValueError(f"hardware {self.name!r} has no allreduce_busbw curve: tensor-parallel "
                             f"collectives cannot be timed on it")
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; valid: {list(COLLECTIVES)}")
        factor = (2.0 if kind == "all_reduce" else 1.0) * (ranks - 1) / ranks
        # The curve is all-reduce busbw; nccl-tests' busbw is defined so that it is the same link
        # rate for every collective, so all-gather and reduce-scatter read the same curve.
        return nbytes * factor / self.allreduce_busbw.at(nbytes)

    def params(self) -> dict[str, float]:
        """The scalars, the optional ones only where given (a preset without them keeps its digest)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _GPU_PARAMS}
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in _OPTIONAL_GPU_PARAMS}
        for k, default in defaults.items():
            v = getattr(self, k)
            if not (v == default or (isinstance(v, float) and math.isnan(v))):
                out[k] = v
        return out

    @cached_property
    def digest(self) -> str:
        curves = {k: [list(p) for p in c.points] for k, c in self.curves().items()}
        if self.gemm_shapes:
            curves["gemm_shapes"] = [list(sh) for sh in self.gemm_shapes]
        if self.attention_rates is not None:
            curves["attention"] = self.attention_rates.to_json()
        taken = {"sms_taken": self.sms_taken, "hbm_bps_taken": self.hbm_bps_taken} if self.sms_taken else {}
        return _digest({**taken, "kind": "gpu", "name": self.name, **self.params(),
                        **({"curves": curves} if curves else {})})

    def curves(self) -> dict[str, Curve]:
        return {k: getattr(self, k) for k in _CURVES if getattr(self, k) is not None}


_CURVES = ("gemm_flops", "allreduce_busbw", "flash_attention_flops")
_GPU_PARAMS = (
    "peak_flops matmul_efficiency hbm_bytes hbm_bps d2h_bps h2d_bps duplex_d2h_bps duplex_h2d_bps copy_latency_s"
).split()
_OPTIONAL_GPU_PARAMS = ("sm_count", "elementwise_bps", "kernel_overhead_s",
                        "sustained_clock_fraction", "nccl_sms")  # absent: the plain roofline
# HBM bytes an NCCL collective moves per byte on its links: what arrives is stored, then read back to be
# sent on; NVIDIA/nccl#1428, the NCCL maintainer: "at least 2x ... if you add reading from or writing to
# user data, it can be 3x". The lower bound is taken.
NCCL_HBM_BYTES_PER_LINK_BYTE = 2.0


@dataclass(frozen=True)
class Node:
    """GPUs sharing host links: `gpus_per_switch` GPUs share one switch uplink (per direction);
    `switches_per_socket` switches share one socket's host-memory bandwidth."""

    name: str
    gpu: Hardware
    gpus: int
    gpus_per_switch: int
    switches_per_socket: int
    switch_uplink_bps: float  # per direction, shared by the switch's GPUs
    socket_mem_bps: float  # host memory bandwidth of one socket, both directions together
    host_bytes: float
    internode_busbw: float = math.inf  # NCCL bus bandwidth of one GPU's own network link to other nodes
    description: str = ""
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.gpus % self.gpus_per_switch:
            raise InvalidFileError(
                f"node {self.name!r}: gpus ({self.gpus}) must be a multiple of gpus_per_switch ({self.gpus_per_switch})"
            )

    @classmethod
    def single(cls, gpu: Hardware) -> "Node":
        """One GPU with a private link: only the GPU's own copy rates apply."""
        return cls(f"{gpu.name}-single", gpu, 1, 1, 1, math.inf, math.inf, math.inf)

    def switch_of(self, rank: int) -> int:
        return rank // self.gpus_per_switch

    def socket_of(self, rank: int) -> int:
        return self.switch_of(rank) // self.switches_per_socket

    @cached_property
    def digest(self) -> str:
        return _digest(
            {
                "kind": "node",
                "name": self.name,
                "gpu": self.gpu.digest,
                **{k: getattr(self, k) for k in _NODE_PARAMS},
            }
        )


_NODE_PARAMS = ("gpus gpus_per_switch switches_per_socket switch_uplink_bps socket_mem_bps host_bytes "
                "internode_busbw").split()
_INT_NODE_PARAMS = {"gpus", "gpus_per_switch", "switches_per_socket"}


def _digest(obj: dict) -> str:
    canon = json.dumps({k: (repr(v) if isinstance(v, float) else v) for k, v in obj.items()}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


# ---- loading -----------------------------------------------------------------------------------
def preset_names(kind: str | None = None) -> list[str]:
    """Names of the presets in `hardware_dir()`, optionally only those of one kind ("gpu" / "node")."""
    names = []
    for path in sorted(hardware_dir().glob("*.json")):
        if kind is None:
            names.append(path.stem)
            continue
        try:
            if json.loads(path.read_text()).get("kind") == kind:
                names.append(path.stem)
        except (OSError, json.JSONDecodeError):
            continue
    return names


def _read(name_or_path: str | Path, kind: str) -> tuple[dict, Path]:
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.exists():
        path = hardware_dir() / f"{name_or_path}.json"
        if not path.exists():
            raise UnknownNameError(f"{kind} preset", str(name_or_path), preset_names(kind))
    data = read_json(path, "hardware file")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidFileError(f"hardware file {str(path)!r}: expected a JSON object with \"format\": \"{FORMAT}\"")
    if data.get("kind") != kind:
        raise InvalidFileError(
            f"hardware file {str(path)!r} describes a {data.get('kind')!r}, but a {kind!r} was asked for; "
            f"{kind} presets: {', '.join(preset_names(kind))}"
        )
    return data, path


def _params(data: dict, path: Path, expected: list[str], ints: set[str] = frozenset(),
            optional: tuple[str, ...] = ()) -> tuple[dict, tuple]:
    raw = data.get("params")
    if not isinstance(raw, dict):
        raise InvalidFileError(f"hardware file {str(path)!r}: missing object \"params\"")
    problems = []
    missing = [k for k in expected if k not in raw]
    unknown = [k for k in raw if k not in expected and k not in optional]
    if missing:
        problems.append(f"missing params {missing}")
    if unknown:
        problems.append(f"unknown params {unknown} (valid: {expected + list(optional)})")
    values, sources = {}, []
    for k in expected + [k for k in optional if k in raw]:
        entry = raw.get(k)
        if entry is None:
            continue
        if not isinstance(entry, dict) or not {"value", "source", "status"} <= set(entry):
            problems.append(f"param {k!r} must be an object with value, source and status")
            continue
        v = entry["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            problems.append(f"param {k!r} must be a positive finite number, got {v!r}")
            continue
        if k in ints and int(v) != v:
            problems.append(f"param {k!r} must be a whole number, got {v!r}")
        if entry["status"] not in STATUSES:
            problems.append(f"param {k!r}: status must be one of {list(STATUSES)}, got {entry['status']!r}")
        if not str(entry["source"]).strip():
            problems.append(f"param {k!r}: empty source")
        values[k] = int(v) if k in ints else float(v)
        sources.append((k, f"{entry['status']}: {entry['source']}"))
    if problems:
        raise InvalidFileError(f"hardware file {str(path)!r}: " + "; ".join(problems))
    return values, tuple(sources)


def load_hardware(name_or_path: str | Path, *, _deriving: tuple[str, ...] = ()) -> Hardware:
    """A GPU preset by name (see `preset_names("gpu")`) or a path to a hardware JSON file."""
    if str(name_or_path) in _deriving:
        raise InvalidFileError(f"hardware presets derive attention rates from each other in a circle: "
                               f"{' -> '.join(_deriving + (str(name_or_path),))}")
    data, path = _read(name_or_path, "gpu")
    curves, curve_sources = _curves(data, path)
    expected = [k for k in _GPU_PARAMS if not (k == "matmul_efficiency" and "gemm_flops" in curves)]
    if "gemm_flops" in curves and "matmul_efficiency" in (data.get("params") or {}):
        raise InvalidFileError(f"hardware file {str(path)!r}: give the gemm_flops curve or matmul_efficiency, "
                               f"not both (one owner for matmul speed)")
    values, sources = _params(data, path, expected, {"sm_count", "nccl_sms"}, _OPTIONAL_GPU_PARAMS)
    if "nccl_sms" in values and values["nccl_sms"] >= values.get("sm_count", 0):
        raise InvalidFileError(f"hardware file {str(path)!r}: nccl_sms needs sm_count, and fewer SMs than it")
    if "attention" in data:
        if "flash_attention_flops" in curves:
            raise InvalidFileError(f"hardware file {str(path)!r}: give the flash_attention_flops curve or the "
                                   f"attention section, not both (one owner for attention speed)")
        rates = parse_attention(data["attention"], path, STATUSES)
        curves["attention_rates"] = rates.with_derived(
            lambda name: load_hardware(name, _deriving=_deriving + (str(name_or_path),)).attention_rates)
        sources += (("attention", curves["attention_rates"].source),) + tuple(
            (f"attention.{k}", f"derived: {d.rule}: {d.source}") for k, d in curves["attention_rates"].derived.items())
    values.setdefault("matmul_efficiency", math.nan)  # unused: the curve gives GEMM speed
    if values["matmul_efficiency"] > 1:
        raise InvalidFileError(f"hardware file {str(path)!r}: matmul_efficiency must be in (0, 1]")
    if values.get("sustained_clock_fraction", 1.0) > 1:
        raise InvalidFileError(f"hardware file {str(path)!r}: sustained_clock_fraction must be in (0, 1]")
    return Hardware(name=str(data.get("name", path.stem)), description=str(data.get("description", "")),
                    sources=sources + curve_sources, **values, **curves)


def _curves(data: dict, path: Path) -> tuple[dict[str, Curve], tuple[tuple[str, str], ...]]:
    raw = data.get("curves", {})
    if not isinstance(raw, dict):
        raise InvalidFileError(f"hardware file {str(path)!r}: \"curves\" must be an object")
    problems, curves, sources = [], {}, []
    for k, entry in raw.items():
        if k not in _CURVES:
            problems.append(f"unknown curve {k!r} (valid: {list(_CURVES)})")
            continue
        if not isinstance(entry, dict) or not {"points", "source", "status"} <= set(entry):
            problems.append(f"curve {k!r} must be an object with points, source and status")
            continue
        try:
            curves[k] = Curve(tuple((float(x), float(y)) for x, y in entry["points"]))
        except (TypeError, ValueError) as e:
            problems.append(f"curve {k!r}: points must be [x, y] pairs, x strictly increasing, all > 0 ({e})")
            continue
        if entry["status"] not in STATUSES:
            problems.append(f"curve {k!r}: status must be one of {list(STATUSES)}, got {entry['status']!r}")
        if not str(entry["source"]).strip():
            problems.append(f"curve {k!r}: empty source")
        if "shapes" in entry:
            shapes = _gemm_shapes(k, entry["shapes"], curves[k], problems)
            if shapes:
                curves["gemm_shapes"] = shapes
        sources.append((k, f"{entry['status']}: {entry['source']}"))
    if problems:
        raise InvalidFileError(f"hardware file {str(path)!r}: " + "; ".join(problems))
    return curves, tuple(sources)


def _gemm_shapes(curve: str, raw, points: Curve, problems: list[str]) -> tuple[GemmShape, ...]:
    """The measured (batch, m, n, k) of each point of the GEMM curve: its FLOPs must be 2*b*m*n*k."""
    if curve != "gemm_flops":
        problems.append(f"curve {curve!r}: only gemm_flops has shapes")
        return ()
    ok = (isinstance(raw, list) and len(raw) == len(points.points)
          and all(isinstance(s, list) and len(s) == 4 and all(isinstance(d, int) and not isinstance(d, bool)
                                                               and d > 0 for d in s) for s in raw))
    if not ok:
        problems.append("curve 'gemm_flops': shapes must be one [batch, m, n, k] of positive integers per point")
        return ()
    for (x, _), (b, m, n, k) in zip(points.points, raw):
        if not math.isclose(x, 2.0 * b * m * n * k, rel_tol=1e-9):
            problems.append(f"curve 'gemm_flops': point x = {x:g} is not 2*b*m*n*k of its shape {[b, m, n, k]}")
    return tuple(tuple(s) for s in raw)


def load_node(name_or_path: str | Path) -> Node:
    """A node preset by name (see `preset_names("node")`) or a path to a node JSON file."""
    data, path = _read(name_or_path, "node")
    values, sources = _params(data, path, _NODE_PARAMS, _INT_NODE_PARAMS)
    if "gpu" not in data:
        raise InvalidFileError(f"hardware file {str(path)!r}: a node needs \"gpu\": the name of a GPU preset")
    return Node(name=str(data.get("name", path.stem)), gpu=load_hardware(data["gpu"]),
                description=str(data.get("description", "")), sources=sources, **values)


def preset_by_digest(digest: str) -> Hardware | None:
    """The GPU preset (or `Hardware.instant_copies()`) whose digest is `digest`, if any: a plan
    records only its hardware's digest, and re-planning it needs the hardware back."""
    candidates = [Hardware.instant_copies()] + [load_hardware(n) for n in preset_names("gpu")]
    return next((hw for hw in candidates if hw.digest == digest), None)

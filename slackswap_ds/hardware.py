"""Hardware the planner and simulator reason about: one GPU (`Hardware`) and a node of them (`Node`).

Presets live in ``configs/hardware/*.json``. Every parameter there carries its value, its source and
a status (datasheet / measured / derived / unmeasured), so a reader can see which numbers are facts
and which are assumptions. Nothing in this module invents a number.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .errors import InvalidFileError, UnknownNameError

STATUSES = ("datasheet", "measured", "derived", "unmeasured")
FORMAT = "slackswap.hardware/1"


def hardware_dir() -> Path:
    """Where presets are read from: ``$SLACKSWAP_HARDWARE_DIR`` or the repository's configs/hardware."""
    env = os.environ.get("SLACKSWAP_HARDWARE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "configs" / "hardware"


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

    @classmethod
    def instant_copies(cls) -> "Hardware":
        """Copies that take no time: how the CPU accelerator's synchronous copy path looks to a
        Schedule. Simulating a plan on it predicts the runtime's own peak accounting on CPU."""
        return cls("instant-copies", 1.0, 1.0, math.inf, math.inf, math.inf, math.inf, math.inf, math.inf, 0.0,
                   description="zero-time copies (CPU accelerator, synchronous path)")

    @property
    def matmul_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    def params(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in _GPU_PARAMS}

    @cached_property
    def digest(self) -> str:
        return _digest({"kind": "gpu", "name": self.name, **self.params()})


_GPU_PARAMS = (
    "peak_flops matmul_efficiency hbm_bytes hbm_bps d2h_bps h2d_bps duplex_d2h_bps duplex_h2d_bps copy_latency_s"
).split()


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


_NODE_PARAMS = "gpus gpus_per_switch switches_per_socket switch_uplink_bps socket_mem_bps host_bytes".split()
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
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidFileError(f"hardware file {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidFileError(f"hardware file {str(path)!r}: expected a JSON object with \"format\": \"{FORMAT}\"")
    if data.get("kind") != kind:
        raise InvalidFileError(
            f"hardware file {str(path)!r} describes a {data.get('kind')!r}, but a {kind!r} was asked for; "
            f"{kind} presets: {', '.join(preset_names(kind))}"
        )
    return data, path


def _params(data: dict, path: Path, expected: list[str], ints: set[str] = frozenset()) -> tuple[dict, tuple]:
    raw = data.get("params")
    if not isinstance(raw, dict):
        raise InvalidFileError(f"hardware file {str(path)!r}: missing object \"params\"")
    problems = []
    missing = [k for k in expected if k not in raw]
    unknown = [k for k in raw if k not in expected]
    if missing:
        problems.append(f"missing params {missing}")
    if unknown:
        problems.append(f"unknown params {unknown} (valid: {expected})")
    values, sources = {}, []
    for k in expected:
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


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A GPU preset by name (see `preset_names("gpu")`) or a path to a hardware JSON file."""
    data, path = _read(name_or_path, "gpu")
    values, sources = _params(data, path, _GPU_PARAMS)
    if values["matmul_efficiency"] > 1:
        raise InvalidFileError(f"hardware file {str(path)!r}: matmul_efficiency must be in (0, 1]")
    return Hardware(name=str(data.get("name", path.stem)), description=str(data.get("description", "")),
                    sources=sources, **values)


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

"""The measured or modelled training step that every planner works from.

A `StepProfile` is a forward sequence of `Op`s and the `Activation`s (tensors saved for backward)
they leave behind. It carries exactly what a plan needs:

* every op's forward and backward time;
* every saved activation's bytes, which ops' backward read it (`users`), which ops' forward would
  regenerate it (`producers`) from which other activations (`deps`).

Time line of one activation (its region is the region of its first user):

    forward:  fwd(min(users)) ends  -> saved (packed)
    backward: region start          -> recomputed here if RECOMPUTE (producers re-run, in order)
              bwd(max(users)) start -> first read
              bwd(min(users)) ends  -> freed

Recomputation happens per region (a transformer layer, as `torch.utils.checkpoint` does it), so
`producers` never leave the activation's region; its `deps` are saved in that region or in an
earlier one (an attention mask saved before the first layer, read by every layer's replay). An
activation with no producers (a region input, e.g. a layer's input hidden state) cannot be
recomputed inside its region: it can only be kept or swapped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .errors import InvalidFileError, ProfileError
from .files import read_json

_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=[.:]|$)")


def layer_class(key: str) -> str:
    """An op's or activation's key with its layer index replaced by ``*`` (``layers.3.attn:q`` ->
    ``layers.*.attn:q``): equal for the same op or tensor of identical layers."""
    return _LAYER_INDEX.sub("*", key, count=1)


def packed_size(nbytes: int, width: int) -> int:
    """Bytes of a storage of `nbytes` in elements of `width` bytes once packed (runtime/packing.py):
    its two bit patterns, then one bit per element."""
    return 2 * width + -(-(nbytes // width) // 8)


COMPILED = "compiled"  # the name of a compiled call's one opaque op (runtime/tracing.py)


@dataclass(frozen=True)
class Op:
    """One forward operation; `key` is stable across steps and ranks (e.g. ``layers.3.mlp:2:gelu``;
    a compiled layer's call is one opaque op named COMPILED: ``layers.3:0:compiled``)."""

    key: str
    fwd_s: float
    bwd_s: float
    region: str

    @property
    def compiled(self) -> bool:
        return self.key.endswith(":" + COMPILED)

    def __post_init__(self) -> None:
        # floats always, so that the canonical JSON (and the digest) of 1 and 1.0 agree
        object.__setattr__(self, "fwd_s", float(self.fwd_s))
        object.__setattr__(self, "bwd_s", float(self.bwd_s))

    def to_json(self) -> dict:
        return {"key": self.key, "fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "region": self.region}

    @classmethod
    def from_json(cls, d: dict) -> "Op":
        return cls(str(d["key"]), float(d["fwd_s"]), float(d["bwd_s"]), str(d["region"]))


@dataclass(frozen=True)
class Activation:
    """One tensor saved for backward, counted once however many ops save it."""

    key: str
    bytes: int
    users: tuple[int, ...]  # op indices whose backward reads it
    producers: tuple[int, ...] = ()  # op indices whose forward regenerates it; () = not recomputable
    deps: tuple[str, ...] = ()  # activations that must be present to re-run the producers
    shape: tuple[int, ...] | None = None  # as first saved (measured profiles; derive.py scales by it)
    # PACK (packing.py): its bytes stored losslessly packed, and the seconds of one packing kernel
    # (the unpacking one costs the same); None: not provably two-valued, never packed
    packed_bytes: int | None = None
    pack_s: float = 0.0

    @property
    def packable(self) -> bool:
        return self.packed_bytes is not None

    @property
    def saved_at(self) -> int:
        """Op after whose forward the tensor is saved."""
        return min(self.users)

    @property
    def first_read(self) -> int:
        """Op whose backward reads it first (backward runs ops in reverse)."""
        return max(self.users)

    @property
    def freed_after(self) -> int:
        """Op after whose backward the tensor is released."""
        return min(self.users)

    @property
    def recomputable(self) -> bool:
        return bool(self.producers)

    @property
    def layer_class(self) -> str:
        """The key with its layer index replaced by ``*``: equal for the same tensor in identical layers."""
        return layer_class(self.key)

    def to_json(self) -> dict:
        out = {
            "key": self.key,
            "bytes": self.bytes,
            "users": list(self.users),
            "producers": list(self.producers),
            "deps": list(self.deps),
        }
        if self.shape is not None:  # (absent in modelled profiles: their JSON and digests unchanged)
            out["shape"] = list(self.shape)
        if self.packed_bytes is not None:  # (likewise absent where nothing is packable)
            out["packed_bytes"] = self.packed_bytes
            out["pack_s"] = float(self.pack_s)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Activation":
        return cls(
            str(d["key"]),
            int(d["bytes"]),
            tuple(int(u) for u in d["users"]),
            tuple(int(p) for p in d.get("producers", ())),
            tuple(str(x) for x in d.get("deps", ())),
            tuple(int(n) for n in d["shape"]) if d.get("shape") is not None else None,
            int(d["packed_bytes"]) if d.get("packed_bytes") is not None else None,
            float(d.get("pack_s", 0.0)),
        )


@dataclass(frozen=True)
class StepProfile:
    """One training step: ops in forward order and the activations they save."""

    name: str
    ops: tuple[Op, ...]
    activations: tuple[Activation, ...]
    meta: tuple[tuple[str, str], ...] = field(default=())  # free-form provenance (source, model dims)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "activations", tuple(self.activations))
        object.__setattr__(self, "meta", tuple(sorted((str(k), str(v)) for k, v in dict(self.meta).items())))
        self._validate()

    def _validate(self) -> None:
        problems: list[str] = []
        n = len(self.ops)
        keys = [o.key for o in self.ops]
        if len(set(keys)) != n:
            problems.append("op keys are not unique")
        for o in self.ops:
            if not (o.fwd_s >= 0 and o.bwd_s >= 0):
                problems.append(f"op {o.key!r} has a negative or NaN time")
        by_key: dict[str, Activation] = {}
        for a in self.activations:
            if a.key in by_key:
                problems.append(f"activation key {a.key!r} appears twice")
            by_key[a.key] = a
        for a in self.activations:
            if a.bytes < 0:
                problems.append(f"activation {a.key!r} has negative bytes")
            if not a.users or any(not 0 <= u < n for u in a.users):
                problems.append(f"activation {a.key!r}: users must be op indices in [0, {n})")
                continue
            region = self.ops[a.saved_at].region
            for p in a.producers:
                if not 0 <= p < n or self.ops[p].region != region:
                    problems.append(f"activation {a.key!r}: producer {p} is not an op of region {region!r}")
                elif p > a.saved_at:
                    problems.append(f"activation {a.key!r}: producer {p} runs after the op that saves it")
            for d in a.deps:
                dep = by_key.get(d)
                if dep is None:
                    problems.append(f"activation {a.key!r}: unknown dep {d!r}")
                elif dep.saved_at > a.saved_at and self.ops[dep.saved_at].region != region:
                    problems.append(f"activation {a.key!r}: dep {d!r} is saved after region {region!r}")
            if a.deps and not a.producers:
                problems.append(f"activation {a.key!r} has deps but no producers")
            if a.packed_bytes is not None and not (0 <= a.packed_bytes <= a.bytes and a.pack_s >= 0):
                problems.append(f"activation {a.key!r}: packed_bytes must be in [0, bytes] and pack_s >= 0")
        if problems:
            raise ProfileError(f"profile {self.name!r} is inconsistent: " + "; ".join(problems))

    # ---- derived views -------------------------------------------------------------------------
    @cached_property
    def by_key(self) -> dict[str, Activation]:
        return {a.key: a for a in self.activations}

    @cached_property
    def regions(self) -> tuple[str, ...]:
        """Regions in forward order."""
        seen: dict[str, None] = {}
        for o in self.ops:
            seen.setdefault(o.region, None)
        return tuple(seen)

    @cached_property
    def region_acts(self) -> dict[str, list[Activation]]:
        """Activations of each region, in profile order."""
        out: dict[str, list[Activation]] = {r: [] for r in self.regions}
        for a in self.activations:
            out[self.region_of(a)].append(a)
        return out

    @cached_property
    def dependents(self) -> dict[str, tuple[Activation, ...]]:
        """For each activation, the activations whose recomputation reads it (their `deps`)."""
        out: dict[str, list[Activation]] = {}
        for a in self.activations:
            for d in a.deps:
                out.setdefault(d, []).append(a)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def region_last_op(self) -> dict[str, int]:
        """Index of each region's last forward op (its first backward op)."""
        return {o.region: i for i, o in enumerate(self.ops)}

    def region_of(self, a: Activation) -> str:
        return self.ops[a.saved_at].region

    def read_outside_their_call(self) -> list[str]:
        """Keys of the recomputable activations a replay of their own layer call could regenerate only
        outside that call's backward: one an op of another region reads in backward (a layer's output,
        saved by the next layer's first op), or one the replay of another region needs (a layer's
        input). Under ZeRO-3 a layer's parameters are present only inside its own forward and backward
        (deepspeed_api.gather_layers_whole), so these are kept or swapped there."""
        def own(a: Activation) -> str:
            return self.ops[a.producers[0]].region

        out = []
        for a in self.activations:
            if not a.recomputable:
                continue
            region = own(a)
            if (any(self.ops[i].region != region for i in (*a.users, *a.producers))
                    or any(own(b) != region for b in self.dependents.get(a.key, ()) if b.recomputable)):
                out.append(a.key)
        return out

    @property
    def runs_compiled_code(self) -> bool:
        """Whether a compiled call is among the ops (its saves are those of the graph Dynamo compiled)."""
        return any(o.compiled for o in self.ops)

    @property
    def forward_s(self) -> float:
        return sum(o.fwd_s for o in self.ops)

    @property
    def backward_s(self) -> float:
        return sum(o.bwd_s for o in self.ops)

    @property
    def total_bytes(self) -> int:
        return sum(a.bytes for a in self.activations)

    @cached_property
    def packable(self) -> tuple[str, ...]:
        """Keys of the activations that may be packed (PACK)."""
        return tuple(a.key for a in self.activations if a.packable)

    def without_recompute(self, keys) -> "StepProfile":
        """This profile with the activations `keys` made unrecomputable (kept or swapped only):
        what is left after they failed to replay exactly."""
        keys = set(keys)
        acts = tuple(dataclasses.replace(a, producers=(), deps=()) if a.key in keys else a for a in self.activations)
        meta = dict(self.meta)
        meta["not_recomputable"] = ",".join(sorted(keys | set(filter(None, meta.get("not_recomputable", "").split(",")))))
        return StepProfile(self.name, self.ops, acts, tuple(meta.items()))

    # ---- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": "slackswap.profile/1",
            "name": self.name,
            "meta": dict(self.meta),
            "ops": [o.to_json() for o in self.ops],
            "activations": [a.to_json() for a in self.activations],
        }

    @classmethod
    def from_json(cls, d: dict) -> "StepProfile":
        if not isinstance(d, dict) or d.get("format") != "slackswap.profile/1":
            raise InvalidFileError("not a slackswap profile: expected a JSON object with format 'slackswap.profile/1'")
        try:
            return cls(
                name=str(d["name"]),
                ops=tuple(Op.from_json(o) for o in d["ops"]),
                activations=tuple(Activation.from_json(a) for a in d["activations"]),
                meta=tuple(dict(d.get("meta", {})).items()),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ProfileError):
                raise
            raise InvalidFileError(f"malformed slackswap profile: {e!r}") from e

    def canonical_json(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @cached_property
    def structure_digest(self) -> str:
        """sha256 of everything but the times: equal on every rank that runs the same model on the
        same shapes, so ranks can check that a plan made from another rank's profile fits theirs."""
        data = self.to_json()
        data["ops"] = [{"key": o["key"], "region": o["region"]} for o in data["ops"]]
        for a in data["activations"]:
            a.pop("pack_s", None)  # (a time)
        data.pop("meta")
        data.pop("name")
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> "StepProfile":
        return cls.from_json(read_json(path, "profile"))

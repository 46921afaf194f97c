"""The `plan_file`: saved plans that say what they were made for, so none is reused where it is wrong.

One JSON file holds a plan per input shape. Each entry records what its plan was made for
(`MadeFor`): the step's input shapes and dtypes, the profile's structure digest (names, bytes and
regeneration facts of every saved tensor), the budget in bytes, the hardware, the planner, the
rank's share of its node (link rates, pinned pool) and the world layout. An entry is adopted only if
every one of these equals the running job's; otherwise the reason is given (each field that differs,
with both values) and the job plans afresh, or stops if asked to.

Writes are atomic (a temporary file in the same folder, then `os.replace`), so a reader never sees
half a file, never go through a link (files.py), and come from rank 0 only. A file that cannot be written (read-only) is used as it is
and never rewritten. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidFileError
from .files import read_json, write_atomically
from .plan import PLAN_FORMAT, Plan
from .step_profile import StepProfile

FORMAT = "slackswap.planfile/1"


@dataclass(frozen=True)
class MadeFor:
    """What a plan was made for; equal on every rank of a data-parallel job."""

    inputs: str  # the step's input shapes and dtypes, e.g. "(2, 64) torch.int64; (2, 64) torch.int64"
    structure: str  # StepProfile.structure_digest
    budget_bytes: int
    hardware: str  # "<name> <digest>"
    planner: str
    share: str  # the share the plan was made with: "d2h <B/s> h2d <B/s> pool <bytes>"
    world: str  # "<world size> ranks, <ranks on the node> per node"

    def differences(self, other: "MadeFor") -> list[str]:
        """The fields that differ, each as `name: <self> here, <other> in the file`."""
        return [f"{f.name}: {getattr(self, f.name)!r} here, {getattr(other, f.name)!r} in the file"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "MadeFor":
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or any(n not in d for n in names):
            raise InvalidFileError(f"malformed plan_file entry: \"made_for\" needs the fields {names}")
        if not isinstance(d["budget_bytes"], int) or not all(isinstance(d[n], str) for n in names if n != "budget_bytes"):
            raise InvalidFileError("malformed plan_file entry: \"made_for\" has a field of the wrong type")
        return cls(**{n: d[n] for n in names})


@dataclass(frozen=True)
class PlanEntry:
    """A plan and what it was made for, with the profile it was made from: the job's measured step
    (files written before profiles were kept have none), so that `slackswap plan --plan-file`
    can plan that step again offline, with another planner or budget."""

    made_for: MadeFor
    plan: Plan
    profile: StepProfile | None = None

    def to_json(self) -> dict:
        return {"made_for": self.made_for.to_json(), "plan": self.plan.to_json(),
                **({"profile": self.profile.to_json()} if self.profile is not None else {})}

    @classmethod
    def from_json(cls, d: dict, path: Path) -> "PlanEntry":
        if not isinstance(d, dict):
            raise InvalidFileError(f"malformed plan_file {str(path)!r}: an entry is not an object")
        made_for = MadeFor.from_json(d.get("made_for", {}))
        profile = StepProfile.from_json(d["profile"]) if d.get("profile") is not None else None
        if profile is not None and profile.structure_digest != made_for.structure:
            raise InvalidFileError(f"malformed plan_file {str(path)!r}: the entry for {made_for.inputs} holds a "
                                   f"profile of another step than the one its plan was made for")
        return cls(made_for, Plan.from_json(d.get("plan")), profile)


def read(path: str | Path) -> list[PlanEntry]:
    """Every entry of a plan file ([] if there is none); InvalidFileError if it is not one."""
    path = Path(path)
    if not path.exists():
        return []
    data = read_json(path, "plan_file", "; delete it to plan afresh")
    if isinstance(data, dict) and data.get("format") == PLAN_FORMAT:
        raise InvalidFileError(f"{str(path)!r} is one plan written by `slackswap plan` for a simulated workload (for "
                               f"`ss.apply` or to inspect), not a job's plan_file: no job's measured step matches a "
                               f"simulated profile. A job writes its own plan_file at the path you give it and reuses "
                               f"it on the next run (point plan_file at a new path); `slackswap plan --plan-file "
                               f"JOB_FILE` plans a job's measured steps again, offline")
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("plans"), list):
        raise InvalidFileError(f"{str(path)!r} is not a slackswap plan file (expected a JSON object with \"format\": "
                               f"\"{FORMAT}\" and a list of \"plans\"); delete it to plan afresh")
    return [PlanEntry.from_json(item, path) for item in data["plans"]]


def find(entries: list[PlanEntry], made_for: MadeFor) -> tuple[PlanEntry | None, list[str]]:
    """The entry made for exactly `made_for`; else (None, why the entry for the same input shapes
    does not fit), or (None, []) when the file has no entry for these shapes yet."""
    for e in entries:
        if e.made_for == made_for:
            return e, []
    same = next((e for e in entries if e.made_for.inputs == made_for.inputs), None)
    return None, made_for.differences(same.made_for) if same is not None else []


def writable(path: str | Path) -> bool:
    """Whether `path` can be (re)written: an existing file we may write, or a new file in a
    folder we may write."""
    path = Path(path)
    if path.exists():
        return os.access(path, os.W_OK)
    return os.access(path.parent if str(path.parent) else Path("."), os.W_OK)


def write(path: str | Path, entries: list[PlanEntry]) -> None:
    """Write `entries` atomically, never through a link (files.write_atomically)."""
    path = Path(path)
    data = {"format": FORMAT, "plans": [e.to_json() for e in entries]}
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def upsert(entries: list[PlanEntry], entry: PlanEntry) -> list[PlanEntry]:
    """`entries` with `entry` in place of any entry for the same input shapes."""
    return [e for e in entries if e.made_for.inputs != entry.made_for.inputs] + [entry]

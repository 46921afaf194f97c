"""Workload presets: one JSON file per model in ``configs/workloads/`` (or ``$SLACKSWAP_WORKLOADS_DIR``),
beside the hardware presets and kept the same way, every number with where it comes from.

A preset file is a JSON object with ``"format": "slackswap.workload/1"`` and every `ModelSpec` field
spelled out (none left to its default), ``name`` equal to the file's name without ``.json``, and
``source``: the paper or repository for the dims and for the sequence length and micro-batch. The
files are read and validated (`ModelSpec.__post_init__`) once per folder; a malformed file is an
`InvalidFileError` that names it. (``configs/*.json`` beside that folder are DeepSpeed configs, not
workload presets.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from ..errors import InvalidFileError, ProfileError, UnknownNameError
from .spec import ModelSpec

WORKLOAD_FORMAT = "slackswap.workload/1"


def workloads_dir() -> Path:
    """Where presets are read from: ``$SLACKSWAP_WORKLOADS_DIR`` or the repository's configs/workloads."""
    env = os.environ.get("SLACKSWAP_WORKLOADS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs" / "workloads"


def load_workload_file(path: str | Path) -> ModelSpec:
    """The `ModelSpec` of one preset file (format in the module docstring)."""
    path = Path(path)
    where = f"workload file {str(path)!r}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise InvalidFileError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != WORKLOAD_FORMAT:
        raise InvalidFileError(f"{where}: expected a JSON object with \"format\": \"{WORKLOAD_FORMAT}\"")
    given = {k: v for k, v in data.items() if k != "format"}
    fields = [f.name for f in dataclasses.fields(ModelSpec)]
    problems = []
    missing = [f for f in fields if f not in given]
    if missing:
        problems.append(f"missing field(s) {missing} (a preset spells out every ModelSpec field)")
    unknown = sorted(k for k in given if k not in fields)
    if unknown:
        problems.append(f"unknown field(s) {unknown}; valid fields: {fields}")
    if given.get("name") != path.stem:
        problems.append(f"\"name\" is {given.get('name')!r}: a preset is named after its file, "
                        f"so it must be {path.stem!r}")
    if problems:
        raise InvalidFileError(f"{where}: " + "; ".join(problems))
    try:
        return ModelSpec(**given)
    except ProfileError as e:
        raise InvalidFileError(f"{where}: {e}") from None


@functools.lru_cache(maxsize=None)
def _read_presets(directory: Path) -> Mapping[str, ModelSpec]:
    if not directory.is_dir():
        raise InvalidFileError(f"workload preset folder {str(directory)!r} does not exist; point "
                               f"$SLACKSWAP_WORKLOADS_DIR at a folder of workload JSON files")
    # read-only: every caller shares this one copy
    return MappingProxyType({p.stem: load_workload_file(p) for p in sorted(directory.glob("*.json"))})


def presets() -> Mapping[str, ModelSpec]:
    """Every preset in `workloads_dir()` by name (read once per folder)."""
    return _read_presets(workloads_dir())


def workload_names() -> list[str]:
    return sorted(presets())


def preset_spec(name: str, **overrides) -> ModelSpec:
    """Preset `name` with `overrides` replacing ModelSpec fields; a changed preset is named after
    what changed (``gpt2-xl[layers=6,seq=128]``) unless `overrides` names it."""
    if name not in presets():
        raise UnknownNameError("workload", name, workload_names())
    valid = [f.name for f in dataclasses.fields(ModelSpec)]
    unknown = sorted(k for k in overrides if k not in valid)
    if unknown:
        raise ProfileError(f"unknown ModelSpec field(s) {unknown} for workload {name!r}; valid fields: {valid}")
    spec = presets()[name]
    changed = {k: v for k, v in overrides.items() if k != "name" and getattr(spec, k) != v}
    if changed and "name" not in overrides:
        overrides = {**overrides, "name": f"{name}[" + ",".join(f"{k}={changed[k]}" for k in sorted(changed)) + "]"}
    return dataclasses.replace(spec, **overrides)

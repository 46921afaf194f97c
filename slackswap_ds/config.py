"""The ``"slackswap"`` section of a DeepSpeed JSON config.

    {
      "train_micro_batch_size_per_gpu": 2,
      ...
      "slackswap": {"activation_budget": 0.5, "hardware": "a100-80g-pcie4"}
    }

`load_config(ds_config)` takes the DeepSpeed config (a dict, the path of its file, base64 text: read
as DeepSpeed reads it, by ds_config.py) and returns a frozen `SlackSwapConfig`. No ``"slackswap"``
section gives ``enabled=False`` (plain DeepSpeed); ``{}`` turns it on with the defaults.

Every problem in the section is reported at once, one line each, in one `ConfigError`; each line names
the field (``slackswap.activation_budget``), what was found, and the fix. DeepSpeed ignores unknown
top-level keys, so this validation is the user's only guard against typos: unknown keys are errors,
with the closest valid name suggested.

Budgets and sizes are read by `budget.py` (its docstring has the rules, the same for the config, the
command line and the API).

This module imports no torch; the planner registry is imported only when a planner name is checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .budget import Budget, parse_budget_value, parse_optional_size
from .ds_config import ReadConfig, UnreadableConfig, read_config
from .errors import SlackSwapError, did_you_mean
from .files import refuse_unless_regular
from .hardware import load_hardware, load_node, preset_names

SECTION = "slackswap"
__all__ = ["SECTION", "ConfigError", "SlackSwapConfig", "field_table", "load_config", "read_deepspeed_config"]


class ConfigError(SlackSwapError, ValueError):
    """An invalid DeepSpeed config or ``"slackswap"`` section. `problems` holds one line per problem,
    each naming the field path, what was found, and the fix; the message lists them all."""

    def __init__(self, problems: list[str] | str, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        n = len(self.problems)
        head = f'invalid "{SECTION}" config{where}: {n} problem{"s" if n != 1 else ""}'
        super().__init__(head + "".join(f"\n  {p}" for p in self.problems))


# ---- the model ---------------------------------------------------------------------------------
def _path_like(s: str) -> bool:
    return "/" in s or "\\" in s or s.endswith(".json") or s.startswith("~")


def _doc(type_doc: str, example: Any) -> dict:
    """Per-field docs beyond `description`: the type as the README table shows it, and an example
    value (JSON) used in error messages."""
    return {"type_doc": type_doc, "example": example}


class SlackSwapConfig(BaseModel):
    """The validated ``"slackswap"`` section (frozen; unknown keys rejected). Build it with
    `load_config`; constructing it directly raises `ConfigError` on bad values too."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=False)

    enabled: bool = Field(
        True,
        description="Turn SlackSwap on. A DeepSpeed config without a `slackswap` section is treated as "
        "`false` (plain DeepSpeed); an empty section `{}` turns it on with these defaults.",
        json_schema_extra=_doc("boolean", True),
    )
    activation_budget: float | int | str = Field(
        0.5,
        description="Device memory allowed for saved activations at any instant. A number in (0, 1] is a "
        "fraction of the keep-all peak (`1` = the whole peak); an integer > 1 is bytes; a string is a size "
        '(`"12GiB"`, `"512MiB"`, `"8GB"`, `"1.5e9"`; KiB/MiB/GiB/TiB are powers of two, KB/MB/GB/TB powers '
        'of ten) or a percentage (`"50%"`). A float > 1 (`1.5`, or `8e9`) is rejected as ambiguous. `"auto"`: '
        "the device's free memory beside weights, gradients and optimizer state, less 10% of the device "
        "(measured by the allocator on a GPU; on a CPU the `hardware` preset's memory less 16 B per parameter).",
        json_schema_extra=_doc('fraction, integer bytes, size string or "auto"', 0.5),
    )
    hardware: str = Field(
        "auto",
        description="GPU and host-link model the planner uses: a GPU preset from `configs/hardware/` "
        "(`a100-40g-pcie4`, `a100-80g-pcie4`, `h100-pcie5`, `h200-pcie5`, `gh200`), a path to a hardware "
        "JSON file (relative to the working directory or to the DeepSpeed config file), or `\"auto\"` "
        "(the preset of the local CUDA device; `a100-80g-pcie4` when none matches).",
        json_schema_extra=_doc("preset name, path or \"auto\"", "a100-80g-pcie4"),
    )
    planner: str = Field(
        "slackswap",
        description="Planner that decides keep / swap / recompute: `slackswap` (ours: a greedy search, then the "
        "exact MILP for at most 2 s, the faster plan kept), `slackswap-greedy` (its greedy search alone, tens of "
        "ms), `optimal` (the MILP without that time budget), or a baseline: `keep-all`, `full-recompute`, `megatron-selective`, `offload-all`, "
        "`recompute-knapsack`; or what a user would pick instead (planners/anchors.py): `deepcompile-offload`, "
        "`torchtune-offload`, `torchtitan-ilp`, `megatron-offload`, `torchtitan-op-sac`.",
        json_schema_extra=_doc("planner name", "slackswap"),
    )
    profile_steps: int = Field(
        2,
        ge=1,
        description="Warm-up steps before the step that is profiled, so that lazy initialisation and allocator "
        "warm-up stay out of the profile. They run in the shelter (every saved tensor to host), so that the "
        "device holds only what an op reads at once: within any budget a plan can keep (one below that is said "
        "at the first step, with the smallest that works).",
        json_schema_extra=_doc("integer >= 1", 2),
    )
    replan: Literal["on_shape_change", "never"] = Field(
        "on_shape_change",
        description='`"on_shape_change"`: profile and plan again when the input shapes change (e.g. a new '
        'sequence length); `"never"`: plan only the first shapes, and run steps of other shapes in the shelter '
        '(every saved tensor to host: the device holds only what an op reads at once; slower).',
        json_schema_extra=_doc('"on_shape_change" or "never"', "on_shape_change"),
    )
    derive_shapes: bool = Field(
        True,
        description="A new input shape's plan is derived from a profile measured on other shapes (the changed "
        "sequence and batch dims scaled in every saved tensor; slackswap_ds/derive.py) instead of profiling a "
        "step of it: with a padding collator's own lengths per step, a job profiles once. The first step of a "
        "derived plan checks its sizes (a dim such as s - 1 is fitted then, and the shape derived again); a shape "
        "whose step saved other tensors is profiled on its next step (logged). `false`: profile every new shape.",
        json_schema_extra=_doc("true or false", True),
    )
    max_shapes: int = Field(
        32,
        ge=1,
        description="At most this many input shapes keep a plan (and its executor); a new shape beyond them "
        "drops the least recently used one (logged), which is profiled again if it comes back. Variable-length "
        "batches padded to a few lengths keep this small (`pad_to_multiple`).",
        json_schema_extra=_doc("integer >= 1", 32),
    )
    verify_every: int = Field(
        100,
        ge=0,
        description="After every this many steps under a plan (of each input shape), the next step checks the plan's recomputes again as its first step does (its recomputed tensors compared bit for bit with forward's, kept on host for that step): a layer that starts reading state which changes between its forward and its backward is demoted then. Between two checks such a layer trains with wrong gradients, as under torch.utils.checkpoint, and with 0 (only the first step checks) it does for the rest of the job: layers must replay exactly (docs/runtime.md, \"The replay contract\"). `ss.apply` takes the same `verify_every`.",
        json_schema_extra=_doc("integer >= 0", 100),
    )
    pad_to_multiple: int | None = Field(
        None,
        ge=1,
        description="Bucketing of variable-length batches: each training forward's keyword inputs are padded "
        "to the next multiple of this along the sequence dimension (`attention_mask` 0, `labels` -100, ids 0; "
        "an `attention_mask` is added if missing; any other tensor of the sequence length is refused), so that "
        "few input shapes are planned. Not bit for bit the unpadded job: without dropout the loss is the "
        "unpadded one up to rounding, with dropout the padded tensors draw other masks; outputs have the padded "
        "length. In your own collator: `slackswap_ds.pad_to_multiple`. `null`: inputs as they come.",
        json_schema_extra=_doc("integer >= 1 or null", 64),
    )
    host_pool_bytes_per_node: int | None = Field(
        None,
        description="Pinned host memory for swapped activations, per node, shared by its ranks: integer "
        "bytes or a size string (as for `activation_budget`, no fractions). `null`: no limit beyond the "
        "host's memory. A full pool makes the runtime keep a tensor instead (counted as a fallback).",
        json_schema_extra=_doc("integer bytes, size string or null", "64GiB"),
    )
    node: str | None = Field(
        None,
        description="Node topology shared by the ranks of one machine: a node preset from `configs/hardware/` "
        "(`dgx-a100`: 8 GPUs, 2 per PCIe switch) or a path to a node JSON file. Each rank then plans with its "
        "share of its switch uplink and of `host_pool_bytes_per_node`. `null`: discover which GPUs share a "
        "host uplink (NVML, then sysfs PCI paths, then `nvidia-smi topo -m`; a shared uplink is taken to be as "
        "fast as one GPU's link); where nothing can be discovered (no CUDA), every rank has its own link.",
        json_schema_extra=_doc("node preset, path or null", "dgx-a100"),
    )
    ranks_per_node: int | None = Field(
        None,
        ge=1,
        description="Group consecutive ranks into nodes of this many ranks, instead of by host (MPI "
        "`COMM_TYPE_SHARED`, or host name under torch.distributed): for tests and launchers that run several "
        "nodes' worth of ranks on one host. `null`: group by host.",
        json_schema_extra=_doc("integer >= 1 or null", 2),
    )
    plan_file: str | None = Field(
        None,
        description="A JSON file of plans, one per input shape, each with what it was made for (input shapes "
        "and dtypes, profile structure, budget, hardware, planner, node share, world layout). A plan is reused "
        "only where all of these match; otherwise the reason is logged and the shape is planned afresh (see "
        "`plan_file_mismatch`). Rank 0 writes it atomically; a read-only file is used and never rewritten. Its "
        "folder must exist. `null`: plan in memory only. Each entry keeps the step's profile too: `slackswap plan "
        "--plan-file` plans it again offline.",
        json_schema_extra=_doc("path or null", "slackswap-plan.json"),
    )
    plan_file_mismatch: Literal["replan", "error"] = Field(
        "replan",
        description='When `plan_file` has no plan made for this job: `"replan"` (log why, plan afresh) or '
        '`"error"` (stop with the reason).',
        json_schema_extra=_doc('"replan" or "error"', "replan"),
    )
    sync: Literal["auto", "mpi", "torch"] = Field(
        "auto",
        description='How the ranks of a node agree on one plan: `"mpi"` (mpi4py, the `mpi` extra: '
        '`pip install \'slackswap_ds[mpi]\'`), `"torch"` (torch.distributed), or `"auto"` (MPI when launched '
        'under MPI with mpi4py installed, else torch.distributed).',
        json_schema_extra=_doc('"auto", "mpi" or "torch"', "auto"),
    )
    sync_timeout_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds to wait for every rank at each exchange before planning and at plan agreement: "
        "ranks that have not arrived by then (dead, stopped, or planning another input shape) are named in an "
        "error (`AgreementError`) on every surviving rank, each within this + 5 s; the others hear the first "
        "rank's reason at once, and the job exits with status 1 without waiting for the missing ranks.",
        json_schema_extra=_doc("number > 0", 300),
    )
    trace_file: str | None = Field(
        None,
        description="Write a measured Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev) of a "
        "planned step to this path. `null`: no trace.",
        json_schema_extra=_doc("path or null", "slackswap-trace.json"),
    )
    summary_file: str | None = Field(
        None,
        description="When the job ends, rank 0 writes the summary it logs (steps by kind, step times, peaks "
        "against budget and keep-all, bytes moved, fallbacks, the plan of each input shape) to this path as "
        "JSON. `null`: beside `trace_file` (`<trace>.summary.json`) if that is set, else only logged.",
        json_schema_extra=_doc("path or null", "slackswap-summary.json"),
    )
    log_every: int = Field(
        100,
        ge=0,
        description="Every this many planned steps, rank 0 logs the measured step time and peak of saved "
        "activations beside the plan's prediction, and how many tensors fell back since the last report. "
        "`0`: never.",
        json_schema_extra=_doc("integer >= 0", 100),
    )
    log_level: Literal["debug", "info", "warning"] = Field(
        "info",
        description='Verbosity of the `slackswap_ds` logger: `"debug"`, `"info"` or `"warning"`.',
        json_schema_extra=_doc('"debug", "info" or "warning"', "info"),
    )

    def __init__(self, **data: Any):
        # pydantic calls this for model_validate too; there a ConfigError comes wrapped in a
        # ValidationError, so build it as SlackSwapConfig(**section) or with load_config.
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(_problems(e, data)) from None

    # -- derived ------------------------------------------------------------------------------
    @property
    def budget(self) -> Budget:
        """`activation_budget` as a Budget (`budget.of(keep_all_bytes)` gives bytes)."""
        return Budget(self.activation_budget)

    # -- validators (raise ValueError("what is wrong. Fix: what to write"); `_problems` adds the
    #    path and the value found) ------------------------------------------------------------------
    @field_validator("activation_budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> float | int | str:
        return parse_budget_value(v)

    @field_validator("host_pool_bytes_per_node", mode="before")
    @classmethod
    def _host_pool(cls, v: Any) -> int | None:
        return parse_optional_size(v)

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("hardware")
    @classmethod
    def _hardware(cls, v: str) -> str:
        if v == "auto":
            return v
        gpus = preset_names("gpu")
        if not _path_like(v):
            if v in gpus:
                return v
            if v in preset_names("node"):
                raise ValueError(
                    f'"{v}" is a node preset, not a GPU. Fix: give the GPU of that node, one of: {", ".join(gpus)}'
                )
            raise ValueError(
                f"unknown hardware preset. Fix: {did_you_mean(v, gpus)}valid presets: {', '.join(gpus)}, "
                '"auto", or a path to a hardware JSON file'
            )
        p = Path(v).expanduser()
        if not p.is_file():
            stem = p.stem
            hint = f'the preset name "{stem}", ' if stem in gpus else ""
            raise ValueError(
                f"hardware file not found (looked for '{p.resolve()}'"
                + ("" if p.is_absolute() else "; relative paths are looked up in the working directory, then next "
                   "to the DeepSpeed config file")
                + "). Fix: give an existing hardware JSON file, "
                f"{hint}or a preset name: {', '.join(gpus)}"
            )
        found = p
        try:
            load_hardware(found)
        except SlackSwapError as e:
            raise ValueError(f"not a usable GPU hardware file: {e}. Fix: give a GPU hardware JSON file or a preset "
                             f"name: {', '.join(gpus)}") from None
        return str(found.resolve())

    @field_validator("node")
    @classmethod
    def _node(cls, v: str | None) -> str | None:
        if v is None:
            return v
        nodes = preset_names("node")
        if not _path_like(v):
            if v in nodes:
                return v
            raise ValueError(f"unknown node preset. Fix: {did_you_mean(v, nodes)}valid node presets: "
                             f"{', '.join(nodes)}, a path to a node JSON file, or null")
        try:
            load_node(Path(v).expanduser())
        except SlackSwapError as e:
            raise ValueError(f"not a usable node file: {e}. Fix: give a node JSON file or a preset: "
                             f"{', '.join(nodes)}") from None
        return str(Path(v).expanduser().resolve())

    @field_validator("planner")
    @classmethod
    def _planner(cls, v: str) -> str:
        from .planners import PLANNERS  # lazy: numpy (and highspy when a MILP solves), no torch

        if v not in PLANNERS:
            names = list(PLANNERS)
            raise ValueError(f"unknown planner. Fix: {did_you_mean(v, names)}valid planners: {', '.join(names)}")
        return v

    @field_validator("plan_file", "trace_file", "summary_file")
    @classmethod
    def _path_or_none(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("an empty path. Fix: give a file path, or null to turn it off")
        if "\0" in v:
            raise ValueError("a path with a NUL character, which no file system accepts. Fix: remove it")
        folder = os.path.dirname(os.path.abspath(v))
        if not os.path.isdir(folder):
            raise ValueError(f"its folder {folder!r} does not exist. Fix: create it, or give a path in an "
                             f"existing folder")
        if os.path.isdir(v):
            raise ValueError("a folder, not a file. Fix: give a file path in it")
        try:
            refuse_unless_regular(v)
        except OSError:
            raise ValueError("it exists and is not a regular file (a device, a FIFO, ...), which SlackSwap never "
                             "replaces. Fix: give the path of a file") from None
        if info.field_name in ("trace_file", "summary_file") and not os.access(folder, os.W_OK):
            raise ValueError(f"its folder {folder!r} cannot be written (read-only, or not yours). Fix: give a "
                             f"path in a folder you can write, or null")
        return v


FIELDS = list(SlackSwapConfig.model_fields)


# ---- pydantic errors -> one line per problem -----------------------------------------------------
def _found(value: Any, kind: bool = True) -> str:
    """`value` as JSON (shortened), followed by its JSON kind."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if not kind:
        return text
    what = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{text} ({what})"


def _problems(e: ValidationError, data: Any) -> list[str]:
    """One line per field: path, what was found, the fix."""
    out: dict[str, str] = {}
    for err in e.errors(include_url=False):
        loc = err.get("loc") or ()
        name = str(loc[0]) if loc else ""
        path = f"{SECTION}.{name}" if name else SECTION
        if path in out:
            continue
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            out[path] = (
                f"{path}: unknown key; found \"{name}\": {_found(value, kind=False)}. Fix: "
                f"{did_you_mean(name, FIELDS)}valid keys: {', '.join(FIELDS)}"
            )
            continue
        if not name:
            out[path] = f"{path}: found {_found(data)}; {err['msg']}"
            continue
        if err["type"] == "value_error":
            reason = str(err.get("ctx", {}).get("error", err["msg"]))
            out[path] = f"{path}: found {_found(value)}; {reason}"
            continue
        field = SlackSwapConfig.model_fields[name]
        extra = field.json_schema_extra or {}
        why = {
            "greater_than_equal": f"must be >= {err.get('ctx', {}).get('ge', 0):g}",
            "greater_than": f"must be > {err.get('ctx', {}).get('gt', 0):g}",
            "finite_number": "must be a finite number",
        }.get(err["type"], f"expected {extra['type_doc']}")
        out[path] = (
            f"{path}: found {_found(value)}; {why}. Fix: write e.g. \"{name}\": {json.dumps(extra['example'])} "
            f"({extra['type_doc']}; default {json.dumps(field.default)})"
        )
    return list(out.values())


# ---- loading -----------------------------------------------------------------------------------
def load_config(ds_config: dict | str | os.PathLike | ReadConfig) -> SlackSwapConfig:
    """The validated ``"slackswap"`` section of a DeepSpeed config: a dict, the path of its file
    (JSON, or hjson as DeepSpeed reads it), base64 text, or a `ReadConfig` (ds_config.py, the one reader).

    A config without a ``"slackswap"`` section returns ``SlackSwapConfig(enabled=False)``: DeepSpeed
    users who did not ask for SlackSwap get plain DeepSpeed behaviour. ``"slackswap": {}`` turns it on
    with the defaults. A relative ``hardware`` path is looked up in the working directory, then next to
    the config file. Raises `ConfigError` listing every problem at once (an unreadable file or one
    DeepSpeed could not parse, a section that is not an object, unknown keys, bad values)."""
    read = read_deepspeed_config(ds_config)
    source = read.source
    base_dir = Path(source).resolve().parent if source is not None and read.again else None
    if SECTION not in read.ours:
        return SlackSwapConfig(enabled=False)
    section = read.ours[SECTION]
    if not isinstance(section, dict):
        raise ConfigError(
            f"{SECTION}: found {_found(section)}; the section must be a JSON object. Fix: write "
            f'"{SECTION}": {{"activation_budget": 0.5, ...}} ({{}} for the defaults), or remove the key for '
            "plain DeepSpeed", source
        )
    bad_keys = [k for k in section if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"{SECTION}: found non-string keys {bad_keys!r}. Fix: use the field names: {', '.join(FIELDS)}",
                          source)
    section = _resolve_hardware_path(section, base_dir)
    try:
        return SlackSwapConfig(**section)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None


def read_deepspeed_config(ds_config) -> ReadConfig:
    """`ds_config.read_config` (a config read once, as DeepSpeed reads it), its errors a ConfigError
    that names the file."""
    try:
        return read_config(ds_config)
    except UnreadableConfig as e:
        raise ConfigError(e.problem, e.source) from None


def _resolve_hardware_path(section: dict, base_dir: Path | None) -> dict:
    """A relative hardware path that is not found from the working directory but is found next to
    the config file is replaced by the latter (absolute)."""
    hw = section.get("hardware")
    if base_dir is None or not isinstance(hw, str) or not _path_like(hw):
        return section
    p = Path(hw).expanduser()
    if p.is_absolute() or p.is_file() or not (base_dir / p).is_file():
        return section
    return {**section, "hardware": str((base_dir / p).resolve())}


# ---- docs --------------------------------------------------------------------------------------
def field_table() -> str:
    """The fields as a Markdown table (field | type | default | meaning); README.md holds a copy
    (tests/test_config.py keeps them equal)."""

    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, f in SlackSwapConfig.model_fields.items():
        extra = f.json_schema_extra or {}
        rows.append(
            f"| `{name}` | {cell(extra['type_doc'])} | `{json.dumps(f.default)}` | {cell(f.description or '')} |"
        )
    return "\n".join(rows) + "\n"

"""The "slackswap" section of a DeepSpeed config: shipped configs, error messages, sizes, README table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from slackswap_ds.budget import parse_size
from slackswap_ds.config import FIELDS, ConfigError, SlackSwapConfig, field_table, load_config
from slackswap_ds.errors import SlackSwapError
from slackswap_ds.hardware import preset_names
from slackswap_ds.workloads import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.json"))  # not configs/hardware/
HW_FILE = ROOT / "configs" / "hardware" / "a100-80g-pcie4.json"


def problems_of(section) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "slackswap": section})
    return info.value.problems


def one_problem(section) -> str:
    probs = problems_of(section)
    assert len(probs) == 1, probs
    assert "\n" not in probs[0]
    return probs[0]


# ---- shipped configs -----------------------------------------------------------------------------
def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"slackswap.json", "bert-large.json", "gpt2-xl.json", "llama-7b.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    ds = json.loads(path.read_text())
    assert isinstance(ds, dict)
    # what DeepSpeed needs to derive the batch: micro-batch per GPU (and accumulation steps)
    assert isinstance(ds["train_micro_batch_size_per_gpu"], int) and ds["train_micro_batch_size_per_gpu"] >= 1
    assert isinstance(ds.get("gradient_accumulation_steps", 1), int) and ds.get("gradient_accumulation_steps", 1) >= 1
    assert "train_batch_size" not in ds  # derived from the world size, so any GPU count works
    assert ds["optimizer"]["type"] in {"Adam", "AdamW"} and 0 < ds["optimizer"]["params"]["lr"] < 1e-2
    assert "zero_optimization" in ds
    cfg = load_config(path)
    assert cfg == load_config(ds)
    assert cfg.enabled and cfg.hardware == "a100-80g-pcie4" and cfg.planner == "slackswap"
    # the README's main job at 40%, where its plan keeps, swaps, recomputes and packs (docs/packing.md)
    assert cfg.activation_budget == (0.4 if path.name == "slackswap.json" else 0.5)
    assert cfg.budget.is_fraction and cfg.profile_steps == 2


def test_cpu_config_is_plain_fp32_stage0():
    ds = json.loads((ROOT / "configs" / "slackswap.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 1
    assert ds["zero_optimization"] == {"stage": 0}
    assert not ds.get("fp16", {}).get("enabled") and not ds.get("bf16", {}).get("enabled")
    assert ds["steps_per_print"] >= 1000


@pytest.mark.parametrize("preset", ["bert-large", "gpt2-xl", "llama-7b"])
def test_gpu_presets_match_workloads(preset):
    ds = json.loads((ROOT / "configs" / f"{preset}.json").read_text())
    assert ds["train_micro_batch_size_per_gpu"] == PRESETS[preset].micro_batch
    assert ds["bf16"]["enabled"] is True and not ds.get("fp16", {}).get("enabled")
    assert ds["zero_optimization"]["stage"] in (1, 2)


def test_deepspeed_accepts_shipped_configs():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for path in CONFIGS:
        ds = json.loads(path.read_text())
        c = DeepSpeedConfig(str(path))
        assert c.train_micro_batch_size_per_gpu == ds["train_micro_batch_size_per_gpu"]
        assert c.gradient_accumulation_steps == ds["gradient_accumulation_steps"]


# ---- defaults, missing section, loading ---------------------------------------------------------
def test_missing_section_is_disabled_and_empty_section_enabled():
    off = load_config({"train_micro_batch_size_per_gpu": 1})
    assert off.enabled is False
    on = load_config({"slackswap": {}})
    assert on.enabled is True and on == SlackSwapConfig()
    assert on.activation_budget == 0.5 and on.hardware == "auto" and on.planner == "slackswap"
    assert on.profile_steps == 2 and on.replan == "on_shape_change" and on.host_pool_bytes_per_node is None
    assert on.plan_file is None and on.trace_file is None and on.sync == "auto" and on.sync_timeout_s == 300
    assert on.log_level == "info"


def test_frozen():
    cfg = load_config({"slackswap": {}})
    with pytest.raises(pydantic.ValidationError) as refused:
        cfg.enabled = False  # type: ignore[misc]
    # pydantic's own refusal of an assignment to a frozen model, for that field, and nothing changed
    assert [(e["type"], e["loc"]) for e in refused.value.errors()] == [("frozen_instance", ("enabled",))]
    assert cfg.enabled is True


def test_full_section_normalised(tmp_path):
    cfg = load_config({"slackswap": {
        "enabled": True, "activation_budget": "12GiB", "hardware": str(HW_FILE), "planner": "optimal",
        "profile_steps": 3, "replan": "never", "host_pool_bytes_per_node": "64GB", "plan_file": "p.json",
        "sync": "mpi", "sync_timeout_s": 60, "trace_file": "t.json", "log_level": "DEBUG",
    }})
    assert cfg.activation_budget == 12 * 2**30 and not cfg.budget.is_fraction
    assert cfg.hardware == str(HW_FILE.resolve())
    assert cfg.host_pool_bytes_per_node == 64 * 10**9
    assert cfg.sync_timeout_s == 60.0 and cfg.log_level == "debug" and cfg.replan == "never"


def test_relative_hardware_path_next_to_config_file(tmp_path):
    (tmp_path / "hw").mkdir()
    (tmp_path / "hw" / "mine.json").write_text(HW_FILE.read_text())
    (tmp_path / "ds.json").write_text(json.dumps({"slackswap": {"hardware": "hw/mine.json"}}))
    assert load_config(tmp_path / "ds.json").hardware == str((tmp_path / "hw" / "mine.json").resolve())
    assert load_config(str(tmp_path / "ds.json")).hardware.endswith("mine.json")


def test_import_is_light():
    code = "import sys, slackswap_ds.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- budgets and sizes ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9), ("1.5e9", 1_500_000_000),
    ("4096", 4096), ("1KiB", 1024), ("1KB", 1000), ("2TiB", 2 * 2**40), ("3TB", 3 * 10**12),
    ("100B", 100), ("1.5KiB", 1536), ("0.5GiB", 2**29), (" 12 GiB ", 12 * 2**30), ("12gib", 12 * 2**30),
    ("7e3", 7000), ("1.2e1MB", 12 * 10**6),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12 parsecs", "", "GiB", "-5GB", "0", "0GB", "1.5", "abc", "1e999", "0.0001B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("given, stored, fraction", [
    (0.5, 0.5, True), (1, 1.0, True), (1.0, 1.0, True), (0.01, 0.01, True), ("50%", 0.5, True),
    ("100%", 1.0, True), ("0.25", 0.25, True), (2, 2, False), (12884901888, 12884901888, False),
    ("12GiB", 12 * 2**30, False), ("1.5e9", 1_500_000_000, False), ("8GB", 8 * 10**9, False),
])
def test_budget_normalised(given, stored, fraction):
    cfg = load_config({"slackswap": {"activation_budget": given}})
    assert cfg.activation_budget == stored and type(cfg.activation_budget) is (float if fraction else int)
    assert cfg.budget.is_fraction is fraction


@pytest.mark.parametrize("budget, peak, expected", [
    (0.5, 15_957_032_960, 7_978_516_480),   # docs/simulator.md's BERT-Large row
    (0.5, 101, 50),                           # truncates, as planners.resolve_budget
    (1, 1000, 1000),
    (0.3, 10, 3),
    (0.5, 0, 0),
    ("12GiB", 10**15, 12 * 2**30),            # bytes ignore the peak
    (12884901888, 1, 12884901888),
])
def test_budget_of(budget, peak, expected):
    assert load_config({"slackswap": {"activation_budget": budget}}).budget.of(peak) == expected


def test_budget_of_agrees_with_resolve_budget():
    from slackswap_ds.budget import resolve_budget

    class P:
        total_bytes = 123_456_789

    for b in (0.1, 0.37, 0.5, 1, 4096):
        assert load_config({"slackswap": {"activation_budget": b}}).budget.of(P.total_bytes) == resolve_budget(b, P)


def test_budget_of_rejects_bad_peak():
    cfg = SlackSwapConfig()
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            cfg.budget.of(bad)  # type: ignore[arg-type]


# ---- one clear error per kind of mistake --------------------------------------------------------
@pytest.mark.parametrize("section, field, found, fix", [
    # unknown key, with the closest name and the list of valid ones
    ({"activation_bugdet": 0.3}, "activation_bugdet", "unknown key", 'did you mean "activation_budget"'),
    ({"profile_step": 3}, "profile_step", "unknown key", 'did you mean "profile_steps"'),
    # wrong types
    ({"enabled": "yes"}, "enabled", '"yes" (a string)', '"enabled": true'),
    ({"profile_steps": 2.5}, "profile_steps", "2.5 (a number)", '"profile_steps": 2'),
    ({"sync_timeout_s": "60"}, "sync_timeout_s", '"60" (a string)', '"sync_timeout_s": 300'),
    ({"plan_file": 3}, "plan_file", "3 (an integer)", "path or null"),
    ({"activation_budget": [0.5]}, "activation_budget", "[0.5] (a list)", "such as 0.5"),
    ({"activation_budget": True}, "activation_budget", "true (a boolean)", "such as 0.5"),
    # budget semantics
    ({"activation_budget": 0}, "activation_budget", "0 (an integer)", "in (0, 1] such as 0.5"),
    ({"activation_budget": 1.5}, "activation_budget", "1.5 (a number)", 'a quoted size ("12GiB", "8e9")'),
    ({"activation_budget": 8e9}, "activation_budget", "8000000000.0 (a number)", "an integer (12884901888)"),
    ({"activation_budget": -5}, "activation_budget", "-5 (an integer)", "must be > 0"),
    ({"activation_budget": "-5GB"}, "activation_budget", '"-5GB" (a string)', "positive"),
    ({"activation_budget": "12 parsecs"}, "activation_budget", "unknown unit 'parsecs'", "KiB, MiB, GiB"),
    ({"activation_budget": "150%"}, "activation_budget", '"150%"', '"50%"'),
    ({"activation_budget": float("nan")}, "activation_budget", "NaN", "such as 0.5"),
    # host pool sizes
    ({"host_pool_bytes_per_node": -1}, "host_pool_bytes_per_node", "-1 (an integer)", "null for no limit"),
    ({"host_pool_bytes_per_node": 0}, "host_pool_bytes_per_node", "must be > 0", "null for no limit"),
    ({"host_pool_bytes_per_node": 6.4e10}, "host_pool_bytes_per_node", "a float is not a size", '"12GiB"'),
    ({"host_pool_bytes_per_node": "lots"}, "host_pool_bytes_per_node", '"lots"', '"12GiB"'),
    # names
    ({"hardware": "a100-80g"}, "hardware", "unknown hardware preset", 'did you mean "a100-80g-pcie4"'),
    ({"hardware": "tpu-v5"}, "hardware", "unknown hardware preset", "valid presets: a100-40g-pcie4, a100-80g-pcie4"),
    ({"hardware": "dgx-a100"}, "hardware", "is a node preset, not a GPU", "a100-80g-pcie4"),
    ({"hardware": "no/such/hw.json"}, "hardware", "hardware file not found", "existing hardware JSON file"),
    ({"hardware": "a100-80g-pcie4.json"}, "hardware", "hardware file not found", 'the preset name "a100-80g-pcie4"'),
    ({"planner": "slackswp"}, "planner", "unknown planner", 'did you mean "slackswap"'),
    ({"planner": "greedy"}, "planner", "unknown planner", "valid planners: slackswap, optimal"),
    # literals and ranges
    ({"replan": "always"}, "replan", '"always" (a string)', '"on_shape_change" or "never"'),
    ({"sync": "gloo"}, "sync", '"gloo"', '"auto", "mpi" or "torch"'),
    ({"log_level": "error"}, "log_level", '"error"', '"debug", "info" or "warning"'),
    ({"profile_steps": 0}, "profile_steps", "0 (an integer); must be >= 1", '"profile_steps": 2'),
    ({"sync_timeout_s": 0}, "sync_timeout_s", "0 (an integer); must be > 0", '"sync_timeout_s": 300'),
    ({"sync_timeout_s": -1.5}, "sync_timeout_s", "must be > 0", '"sync_timeout_s": 300'),
    ({"sync_timeout_s": float("inf")}, "sync_timeout_s", "must be a finite number", "300"),
    ({"trace_file": "  "}, "trace_file", "an empty path", "null to turn it off"),
])
def test_one_clear_error(section, field, found, fix):
    msg = one_problem(section)
    assert msg.startswith(f"slackswap.{field}: "), msg
    assert found in msg, msg
    assert "Fix: " in msg and fix in msg, msg
    assert "pydantic" not in msg.lower() and "Value error" not in msg and "Input should" not in msg, msg


def test_unknown_key_lists_valid_keys():
    msg = one_problem({"activation_bugdet": 0.3})
    for name in FIELDS:
        assert name in msg


def test_bad_hardware_file_content(tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text('{"format": "nope"}')
    msg = one_problem({"hardware": str(bad)})
    assert msg.startswith("slackswap.hardware: ") and "not a usable GPU hardware file" in msg and "Fix: " in msg
    node = ROOT / "configs" / "hardware" / "dgx-a100.json"
    assert "'node'" in one_problem({"hardware": str(node)})


def test_section_not_an_object():
    for section in (True, 0.5, "on", [], None):
        with pytest.raises(ConfigError) as info:
            load_config({"slackswap": section})
        (msg,) = info.value.problems
        assert msg.startswith("slackswap: found ") and "must be a JSON object" in msg and "Fix: " in msg


def test_config_not_an_object():
    with pytest.raises(ConfigError) as info:
        load_config([1, 2])  # type: ignore[arg-type]
    (msg,) = info.value.problems
    assert "expected a JSON object" in msg and "Fix: " in msg


def test_file_not_json(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"slackswap": {"activation_budget": }}')
    with pytest.raises(ConfigError) as info:
        load_config(p)
    (msg,) = info.value.problems
    assert str(p) in msg and "not valid JSON" in msg and "line 1 column" in msg and "Fix: " in msg
    assert info.value.source == str(p) and str(p) in str(info.value)


def test_a_config_is_read_as_deepspeed_reads_it(tmp_path):
    """hjson (comments, trailing commas), base64 text and a pipe, as DeepSpeed reads them (ds_config.py);
    the section's numbers as JSON reads them where the text is JSON (8e9 a float, refused as the HF
    Trainer, which reads the file with `json`, would hand it over), as hjson reads them where it is not
    (8e9 an integer, as DeepSpeed reads it); duplicate keys refused, as DeepSpeed refuses them."""
    import base64
    import os
    import threading

    p = tmp_path / "ds.json"
    p.write_text('// hjson\n{"slackswap": {"activation_budget": 0.25, "profile_steps": 3,}, # trailing\n}')
    assert (load_config(p).activation_budget, load_config(p).profile_steps) == (0.25, 3)
    b64 = base64.urlsafe_b64encode(b'{"slackswap": {"profile_steps": 4}}').decode()
    assert load_config(b64).profile_steps == 4
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    threading.Thread(target=lambda: fifo.write_text('{"slackswap": {"profile_steps": 5}}'), daemon=True).start()
    assert load_config(fifo).profile_steps == 5
    p.write_text('{"slackswap": {"activation_budget": 8e9}}')
    with pytest.raises(ConfigError, match="a float > 1 is ambiguous"):
        load_config(p)
    p.write_text('{"slackswap": {"activation_budget": 8e9,}}')  # hjson, not JSON
    assert load_config(p).activation_budget == 8 * 10**9
    p.write_text('{"slackswap": {}, "slackswap": {"profile_steps": 2}}')
    with pytest.raises(ConfigError, match=r"Duplicate keys in DeepSpeed config: \['slackswap'\]"):
        load_config(p)


def test_file_missing_or_unreadable(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError):
        load_config(p)


def test_a_file_path_that_cannot_be_a_file_is_refused_at_once(tmp_path):
    """Before any training step: a NUL in the path, a device or a FIFO where the file would go."""
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for field in ("plan_file", "trace_file"):
        for path, why in [(str(tmp_path / "a\0b.json"), "NUL character"), ("/dev/full", "not a regular file"),
                          (str(fifo), "not a regular file")]:
            with pytest.raises(ConfigError, match=f"slackswap.{field}: .*{why}"):
                load_config({"slackswap": {field: path}})


def test_a_config_file_nested_too_deeply_or_with_a_huge_number_is_named(tmp_path):
    p = tmp_path / "ds.json"
    for text, why in [("[" * 100_000 + "]" * 100_000, "nested too deeply"), ('{"x": ' + "9" * 100_000 + "}", "digits")]:
        p.write_text(text)
        with pytest.raises(ConfigError, match=why) as info:
            load_config(p)
        assert str(p) in str(info.value)


def test_all_problems_at_once(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "slackswap": {
        "activation_bugdet": 0.3, "activation_budget": 1.5, "profile_steps": 0, "planner": "greedy",
        "sync": "gloo", "hardware": "tpu", "enabled": "true",
    }}))
    with pytest.raises(ConfigError) as info:
        load_config(p)
    e = info.value
    fields = sorted(m.split(":")[0] for m in e.problems)
    assert fields == sorted(f"slackswap.{f}" for f in (
        "activation_bugdet", "activation_budget", "profile_steps", "planner", "sync", "hardware", "enabled"))
    text = str(e)
    assert text.splitlines()[0] == f'invalid "slackswap" config in {p}: 7 problems'
    assert text.splitlines()[1:] == [f"  {m}" for m in e.problems]
    assert isinstance(e, SlackSwapError) and isinstance(e, ValueError)


def test_direct_construction_raises_config_error():
    with pytest.raises(ConfigError) as info:
        SlackSwapConfig(profile_steps=0, sync="x")
    assert len(info.value.problems) == 2


def test_disabled_section_is_still_validated():
    msg = one_problem({"enabled": False, "activation_bugdet": 0.3})
    assert "activation_budget" in msg


# ---- docs ----------------------------------------------------------------------------------------
def test_every_field_documented():
    for name, f in SlackSwapConfig.model_fields.items():
        assert f.description and len(f.description) > 20, name
        assert f.json_schema_extra and {"type_doc", "example"} <= set(f.json_schema_extra), name
        SlackSwapConfig(**{name: f.json_schema_extra["example"]})  # the example in error messages is valid


def test_docs_name_the_real_presets_and_planners():
    from slackswap_ds.planners import PLANNERS

    hw_doc = SlackSwapConfig.model_fields["hardware"].description
    assert sorted(set(re.findall(r"`([a-z0-9-]+)`", hw_doc))) == sorted(preset_names("gpu"))
    planner_doc = SlackSwapConfig.model_fields["planner"].description
    assert sorted(re.findall(r"`([a-z-]+)`", planner_doc)) == sorted(PLANNERS)


def test_readme_table_matches_model():
    readme = (ROOT / "README.md").read_text()
    head = "## The `slackswap` config section\n"
    assert head in readme
    section = readme.split(head, 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| field |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = "\n".join(lines[start:end]) + "\n"
    assert table == field_table(), "README's table is stale: paste slackswap_ds.config.field_table() into it"
    assert len(lines[start:end]) == 2 + len(FIELDS)


# One budget parser: the config, the command line and the planner API read the same text the same way.
_BUDGETS = [  # (as written, bytes for a keep-all peak of 1000 B, or None if refused)
    (0.5, 500), ("0.5", 500), ("50%", 500), (1, 1000), ("100%", 1000), (4096, 4096), ("4096", 4096),
    ("4KiB", 4096), ("1.5KiB", 1536), ("8e3", 8000), (8e3, None), (1.5, None), ("1.5", None), (0, None),
    ("0", None), (-1, None), ("half", None), ("150%", None), (True, None),
]


@pytest.mark.parametrize("written, want", _BUDGETS)
def test_one_budget_parser_for_config_command_line_and_api(written, want):
    import argparse

    from slackswap_ds.cli import parse_budget
    from slackswap_ds.budget import resolve_budget
    from slackswap_ds.step_profile import Activation, Op, StepProfile

    profile = StepProfile("p", [Op("a:0", 1, 1, "a")], [Activation("a:x", 1000, (0,))])
    if want is None:
        with pytest.raises(ConfigError):
            load_config({"slackswap": {"activation_budget": written}})
        with pytest.raises(ValueError):
            resolve_budget(written, profile)
        if isinstance(written, str):  # the command line reads text
            with pytest.raises(argparse.ArgumentTypeError):
                parse_budget(written)
        return
    assert load_config({"slackswap": {"activation_budget": written}}).budget.of(1000) == want
    assert resolve_budget(written, profile) == want
    if isinstance(written, str):
        assert parse_budget(written).of(profile.total_bytes) == want


def test_an_auto_budget_is_resolved_by_the_device_not_by_the_keep_all_peak():
    """`"auto"` (any case) parses everywhere a budget is read; it becomes bytes only with the room the
    device has (`auto_budget_bytes`: its memory less the model state and a 10% margin), never from
    the keep-all peak."""
    from slackswap_ds.budget import AUTO_MARGIN, Budget, auto_budget_bytes

    assert load_config({"slackswap": {"activation_budget": "AUTO"}}).activation_budget == "auto"
    budget = Budget.parse("auto")
    assert budget.is_auto and not budget.is_fraction and str(budget) == "auto" and budget.json_value == "auto"
    with pytest.raises(ValueError, match="auto"):
        budget.of(1000)
    assert budget.of(1000, 123) == 123
    assert AUTO_MARGIN == 0.10 and auto_budget_bytes(80e9, 24.88e9) == 47_120_000_000
    assert auto_budget_bytes(80e9, 107.8e9) == 0


def test_the_readmes_sample_error_is_what_load_config_prints(tmp_path):
    """README.md shows the ConfigError a three-mistake section gets: it must be the message the code
    prints today, line for line (it listed 14 valid keys when there were 21)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split('```\ninvalid "slackswap" config in ds.json', 1)[1].split("```", 1)[0]
    shown = ('invalid "slackswap" config in ds.json' + block).strip()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"slackswap": {"activation_budget": 1.5, "profile_steps": 0, "activation_bugdet": 0.3}}))
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value).replace(str(path), "ds.json") == shown

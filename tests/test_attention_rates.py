"""Fused attention speed by kernel and shape (slackswap_ds/attention_rates.py) and its preset section."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slackswap_ds.attention_rates import AttentionShape, parse_attention
from slackswap_ds.errors import InvalidFileError, ProfileError
from slackswap_ds.hardware import STATUSES, hardware_dir, load_hardware
from slackswap_ds.workloads import PRESETS, transformer_profile

A100 = load_hardware("a100-80g-pcie4")
H100 = load_hardware("h100-pcie5")


def section(**over) -> dict:
    raw = {"source": "a figure", "status": "measured", "seq": [1024, 4096],
           "tflops": {"fa2": {"causal": {"64": [100, 200], "128": [150, 250]}, "full": {"64": [120, 220]}}}}
    return {**raw, **over}


def test_rates_are_read_at_measured_points_and_interpolated_between_them():
    rates = parse_attention(section(), "x.json", STATUSES)
    assert rates.rate("fa2", True, 64, 1024) == 100e12 and rates.rate("fa2", True, 128, 4096) == 250e12
    assert rates.rate("fa2", True, 64, 2048) == pytest.approx(150e12)  # linear in log(seq): halfway
    assert rates.rate("fa2", True, 96, 1024) == pytest.approx(125e12)  # linear in head dim: halfway
    assert rates.rate("fa2", True, 64, 256) == 100e12 and rates.rate("fa2", True, 256, 65536) == 250e12  # held flat
    assert rates.rate("fa2", False, 128, 1024) == 120e12  # the one measured head dim of that mask
    assert rates.rate("fa1", True, 64, 1024) is None  # not measured: the caller decides


def test_a_causal_kernel_is_timed_in_the_benchmarks_count_of_half_the_full_work():
    rates = parse_attention(section(), "x.json", STATUSES)
    full = 4e12  # FLOPs of the full s x s work
    share = 9 / 16  # what a causal kernel really does: half plus half the diagonal blocks
    causal = AttentionShape("fa2", 64, 1024, True, share)
    assert rates.seconds(full * share, causal) == pytest.approx(full / 2 / 100e12)
    assert rates.seconds(full, AttentionShape("fa2", 64, 1024, False)) == pytest.approx(full / 120e12)


@pytest.mark.parametrize("bad, says", [
    ({"status": "guessed"}, "status must be one of"),
    ({"source": " "}, "empty source"),
    ({"seq": [4096, 1024]}, "seq must be increasing"),
    ({"tflops": {"fa9": {}}}, "unknown kernel 'fa9'"),
    ({"tflops": {"fa2": {"masked": {"64": [1, 2]}}}}, "keys must be 'causal' or 'full'"),
    ({"tflops": {"fa2": {"causal": {"64": [1]}}}}, "fa2.causal.64: give a head dim and 2 positive rates"),
    ({"tflops": {"fa2": {"causal": {"sixty": [1, 2]}}}}, "fa2.causal.sixty"),
])
def test_a_bad_attention_section_is_refused_naming_the_problem(bad, says):
    with pytest.raises(InvalidFileError, match=says):
        parse_attention(section(**bad), "x.json", STATUSES)


def test_a_preset_gives_the_attention_section_or_the_one_speed_curve_never_both(tmp_path):
    raw = json.loads((hardware_dir() / "a100-80g-pcie4.json").read_text())
    raw["curves"]["flash_attention_flops"] = {"points": [[1e9, 1.8e14]], "source": "s", "status": "measured"}
    path = tmp_path / "both.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidFileError, match="not both"):
        load_hardware(path)
    del raw["attention"]
    path.write_text(json.dumps(raw))
    legacy = load_hardware(path)  # the one-speed curve alone still loads, for every kernel and shape
    assert legacy.attention_s(1.8e12, AttentionShape("fa-triton", 64, 512, True, 0.6)) == pytest.approx(0.01)
    assert legacy.digest != A100.digest


def test_the_a100_preset_holds_the_published_figure_and_the_h100_derives_triton_from_fa1():
    # Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png, causal, head dim 128, seq 2k
    assert A100.attention_rates.rate("fa2", True, 128, 2048) == 155e12
    assert A100.attention_rates.rate("fa-triton", True, 128, 2048) == 68e12
    assert A100.attention_kernel_measured("fa-triton") and not H100.attention_kernel_measured("fa-triton")
    # no figure of the Triton kernel on H100: FA1's H100 bar (108) times Triton / FA1 on A100 (68 / 69)
    assert H100.attention_rates.rate("fa-triton", True, 128, 2048) == pytest.approx(108e12 * 68 / 69)
    assert H100.attention_rates.rate("fa-triton", False, 64, 16384) == pytest.approx(168e12 * 100 / 110)
    assert H100.attention_kernel_derived("fa-triton").rule == ("fa1's rates on this GPU x fa-triton / fa1 on "
                                                               "a100-80g-pcie4")
    assert A100.attention_kernel_derived("fa-triton") is None and H100.attention_kernel_derived("fa2") is None
    # a kernel with neither a figure nor a derivation runs at FlashAttention-2's speed
    shape = AttentionShape("xformers", 128, 2048, True, 0.53)
    assert H100.attention_s(1e12, shape) == H100.attention_s(1e12, dataclasses.replace(shape, kernel="fa2"))


A100_FILE = hardware_dir() / "a100-80g-pcie4.json"


def _preset(tmp_path, name: str, attention: dict) -> None:
    raw = json.loads(A100_FILE.read_text())
    raw["name"], raw["attention"] = name, attention
    (tmp_path / f"{name}.json").write_text(json.dumps(raw))


def test_a_derived_kernel_needs_a_reference_that_measured_it_and_a_kernel_it_is_like(tmp_path, monkeypatch):
    monkeypatch.setenv("SLACKSWAP_HARDWARE_DIR", str(tmp_path))
    _preset(tmp_path, "ref", section(tflops={"fa1": {"causal": {"64": [50, 100]}},
                                             "fa-triton": {"causal": {"64": [25, 100]}}}))
    derive = {"fa-triton": {"like": "fa1", "from": "ref", "source": "same kind of kernel"}}
    _preset(tmp_path, "new", section(tflops={"fa1": {"causal": {"64": [80, 160]}}}, derived=derive))
    new = load_hardware("new")
    assert new.attention_rates.rate("fa-triton", True, 64, 1024) == pytest.approx(40e12)  # 80 x 25 / 50
    assert new.attention_rates.rate("fa-triton", True, 64, 4096) == pytest.approx(160e12)
    assert new.attention_kernel_derived("fa-triton").source == "same kind of kernel"
    bad = [({"fa-triton": {"like": "fa2", "from": "ref", "source": "s"}}, "a measured kernel it is"),  # fa2 not here
           ({"fa1": {"like": "fa1", "from": "ref", "source": "s"}}, "a kernel not measured here"),
           ({"fa-triton": {"like": "fa1", "from": "ref"}}, "a \"source\"")]
    for derived, message in bad:
        _preset(tmp_path, "bad", section(tflops={"fa1": {"causal": {"64": [80, 160]}}}, derived=derived))
        with pytest.raises(InvalidFileError, match=message):
            load_hardware("bad")
    # the reference must have measured the kernel itself, not derived it
    _preset(tmp_path, "second", section(tflops={"fa1": {"causal": {"64": [80, 160]}}},
                                        derived={"fa-triton": {"like": "fa1", "from": "new", "source": "s"}}))
    with pytest.raises(InvalidFileError, match="which has no measured rates of it"):
        load_hardware("second")
    # two presets deriving from each other are named, not recursed into
    _preset(tmp_path, "a", section(tflops={"fa1": {"causal": {"64": [80, 160]}}},
                                   derived={"xformers": {"like": "fa1", "from": "b", "source": "s"}}))
    _preset(tmp_path, "b", section(tflops={"fa1": {"causal": {"64": [80, 160]}}},
                                   derived={"fa-triton": {"like": "fa1", "from": "a", "source": "s"}}))
    with pytest.raises(InvalidFileError, match="in a circle: a -> b -> a"):
        load_hardware("a")


def test_a_workload_on_flash_attentions_triton_kernel_runs_its_attention_slower_and_nothing_else():
    spec = PRESETS["llama-7b"]
    triton = dataclasses.replace(spec, attention_kernel="fa-triton")
    fast, slow = transformer_profile(spec, A100), transformer_profile(triton, A100)
    changed = {o.key for o, p in zip(fast.ops, slow.ops) if (o.fwd_s, o.bwd_s) != (p.fwd_s, p.bwd_s)}
    assert changed and all(k.endswith(":flash_attn") for k in changed)
    o = next(o for o in fast.ops if o.key == "layers.0.attn:3:flash_attn")
    p = next(p for p in slow.ops if p.key == o.key)
    launch = A100.kernel_overhead_s
    assert (p.fwd_s - launch) / (o.fwd_s - launch) == pytest.approx(155 / 68)  # the figure's two bars


def test_a_workload_names_only_a_known_kernel():
    with pytest.raises(ProfileError, match="attention_kernel must be one of"):
        dataclasses.replace(PRESETS["llama-7b"], attention_kernel="flash3")

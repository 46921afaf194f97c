import json

import pytest

from slackswap_ds.errors import InvalidFileError, ProfileError, UnknownNameError
from slackswap_ds.hardware import STATUSES, hardware_dir, load_hardware, load_node, preset_names
from slackswap_ds.step_profile import Activation, Op, StepProfile

from conftest import two_region_profile


def test_profile_json_round_trip_and_digest(tmp_path):
    p = two_region_profile()
    p.save(tmp_path / "p.json")
    q = StepProfile.load(tmp_path / "p.json")
    assert q == p and q.digest == p.digest


def test_inconsistent_profile_lists_every_problem():
    ops = [Op("a:0", 1, 1, "a"), Op("b:0", 1, 1, "b")]
    with pytest.raises(ProfileError) as err:
        StepProfile("bad", ops, [
            Activation("x", 1, (5,)),
            Activation("y", 1, (1,), (0,)),  # producer in another region
            Activation("z", 1, (0,), (0,), ("ghost",)),
        ])
    msg = str(err.value)
    assert "users must be op indices" in msg and "is not an op of region 'b'" in msg and "unknown dep 'ghost'" in msg


def test_layer_class_groups_identical_layers():
    assert Activation("layers.3.mlp:gelu.out", 1, (0,)).layer_class == "layers.*.mlp:gelu.out"
    assert Activation("head:logits", 1, (0,)).layer_class == "head:logits"


def test_every_preset_loads_and_cites_every_parameter():
    gpus = preset_names("gpu")
    assert {"a100-40g-pcie4", "a100-80g-pcie4", "h100-pcie5", "h200-pcie5", "gh200"} <= set(gpus)
    for name in gpus:
        hw = load_hardware(name)
        cited = {k for k, _ in hw.sources}
        # every scalar but matmul_efficiency, which a measured GEMM curve replaces, and every curve
        tables = ({"attention"} | {f"attention.{k}" for k in hw.attention_rates.derived}
                  if hw.attention_rates is not None else set())  # a derived kernel cites its rule and source
        assert cited == set(hw.params()) - {"matmul_efficiency"} | set(hw.curves()) | tables, name
        assert all(src.split(":")[0] in STATUSES for _, src in hw.sources)
        assert hw.gemm_flops is not None  # every preset times GEMMs by their size
    node = load_node("dgx-a100")
    assert (node.gpus, node.gpus_per_switch, node.switches_per_socket) == (8, 2, 2)
    assert [node.switch_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [node.socket_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_curves_interpolate_in_log_size_and_hold_flat_beyond_their_ends():
    from slackswap_ds.hardware import Curve

    c = Curve(((1e9, 100.0), (1e11, 300.0)))
    assert c.at(1e8) == 100.0 and c.at(1e12) == 300.0 and c.at(1e10) == pytest.approx(200.0)
    for bad in ((), ((2.0, 1.0), (1.0, 1.0)), ((1.0, 0.0),)):
        with pytest.raises(ValueError):
            Curve(bad)


def test_gemm_speed_and_collective_times_come_from_the_measured_curves():
    hw = load_hardware("a100-80g-pcie4")
    assert hw.gemm_rate(2 * 4096**3) == 228.0e12  # a measured point: cuBLASLt 4096^3 on A100-80GB
    assert hw.gemm_rate(1e6) == 119.4e12 and hw.gemm_rate(1e15) == 256.5e12  # flat beyond the ends
    S = 1 << 30  # 1 GiB all-reduce on 8 GPUs at the measured 228.10 GB/s bus bandwidth
    assert hw.collective_s("all_reduce", S, 8) == pytest.approx(S * 2 * 7 / 8 / 228.10e9)
    assert hw.collective_s("all_gather", S, 8) == pytest.approx(S * 7 / 8 / 228.10e9)
    assert hw.collective_s("all_reduce", S, 1) == 0.0
    with pytest.raises(ValueError, match="no allreduce_busbw curve"):
        load_hardware("gh200").collective_s("all_reduce", S, 2)


def test_a_gemm_by_shape_runs_as_its_flops_say_when_square_and_slower_when_skinny():
    hw = load_hardware("a100-80g-pcie4")  # 108 SMs; its curve's points are measured squares
    assert hw.by_shape
    for side, measured in ((1024, 119.4e12), (4096, 228.0e12), (16384, 256.5e12)):
        flops = 2.0 * side**3
        assert hw.gemm_s(flops, (1, side, side, side)) == pytest.approx(hw.gemm_s(flops)) == flops / measured
    # Azure's skinny cuBLASLt case 802816 x 192 x 768 (measured 157.8 TFLOP/s; the FLOP-only curve
    # gives 234.7): N = 192 fills 75% of two 128-wide tiles; 12544 tiles of 128x128 make 116.1 waves
    # of 108 (117 run): 0.75 * 12544 / (117 * 108) = 0.7445 of the SMs' work is useful. Its FLOPs lie
    # between 4096^3 (228.0 at a tile efficiency of 0.948) and 8192^3 (253.7 at 0.998).
    flops = 2.0 * 802816 * 192 * 768
    assert hw.tile_efficiency((1, 802816, 192, 768)) == pytest.approx(0.75 * 12544 / (117 * 108))
    rate = flops / hw.gemm_s(flops, (1, 802816, 192, 768))
    assert rate == pytest.approx(181.7e12, rel=1e-3)
    assert flops / hw.gemm_s(flops) == pytest.approx(234.7e12, rel=1e-3)
    # an output too small for one wave: 768 x 3072 in 128x256 tiles is 72 tiles for 108 SMs
    assert hw.tile_efficiency((1, 768, 3072, 81920)) == pytest.approx(72 / 108)
    # a preset without an SM count keeps the FLOP-only lookup
    import dataclasses
    assert dataclasses.replace(hw, sm_count=0).gemm_s(flops, (1, 802816, 192, 768)) == hw.gemm_s(flops)


def test_gemm_curve_shapes_must_match_its_points(tmp_path):
    data = json.loads((hardware_dir() / "a100-80g-pcie4.json").read_text())
    data["curves"]["gemm_flops"]["shapes"][0] = [1, 1024, 1024, 512]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidFileError, match="not 2\\*b\\*m\\*n\\*k of its shape"):
        load_hardware(path)


def test_a_preset_gives_the_gemm_curve_or_an_efficiency_not_both(tmp_path):
    data = json.loads((hardware_dir() / "a100-80g-pcie4.json").read_text())
    data["params"]["matmul_efficiency"] = {"value": 0.6, "source": "x", "status": "derived"}
    path = tmp_path / "both.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidFileError, match="not both"):
        load_hardware(path)
    del data["curves"]
    path.write_text(json.dumps(data))
    hw = load_hardware(path)  # an efficiency alone is a valid (user) preset
    assert hw.gemm_rate(1e9) == pytest.approx(0.6 * 312e12) and hw.allreduce_busbw is None


def test_a100_values_match_the_reference():
    hw = load_hardware("a100-80g-pcie4")
    assert (hw.peak_flops, hw.h2d_bps, hw.duplex_h2d_bps, hw.duplex_d2h_bps) == (312e12, 25.1e9, 11e9, 25e9)


def test_unknown_names_list_the_valid_choices():
    with pytest.raises(UnknownNameError, match="valid choices: a100-40g-pcie4, a100-80g-pcie4"):
        load_hardware("a100")
    with pytest.raises(UnknownNameError, match="valid choices: dgx-a100, dgx-h100"):
        load_node("dgx-b200")


def test_kind_mismatch_is_explained():
    with pytest.raises(InvalidFileError, match="describes a 'node'"):
        load_hardware("dgx-a100")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["params"].pop("h2d_bps"), "missing params \\['h2d_bps'\\]"),
        (lambda d: d["params"].update(warp_speed={"value": 1, "source": "x", "status": "measured"}), "unknown params"),
        (lambda d: d["params"]["d2h_bps"].update(value=-1), "positive finite number"),
        (lambda d: d["params"]["d2h_bps"].update(value="fast"), "positive finite number"),
        (lambda d: d["params"]["d2h_bps"].update(status="guessed"), "status must be one of"),
        (lambda d: d["params"]["d2h_bps"].update(source=" "), "empty source"),
        (lambda d: d.update(format="v0"), "format"),
    ],
)
def test_malformed_hardware_files(tmp_path, mutate, message):
    data = json.loads((hardware_dir() / "a100-80g-pcie4.json").read_text())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidFileError, match=message):
        load_hardware(path)


def test_hardware_file_that_is_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(InvalidFileError, match="not valid JSON"):
        load_hardware(path)


def test_a_power_saturated_gpu_runs_its_burst_measured_compute_at_the_sustained_share():
    """H100/H200 presets: the GEMM curve and FlashAttention's figure are burst-clock measurements; a GPU
    that training keeps at its 700 W limit holds 708.5 / 841.9 of them (stas00's H200 MSMF / MAMF).
    Memory-bound kernels are not slowed (the HBM clock is not the SM clock)."""
    import dataclasses

    from slackswap_ds.attention_rates import AttentionShape

    h100 = load_hardware("h100-pcie5")
    burst = dataclasses.replace(h100, sustained_clock_fraction=1.0)
    assert h100.sustained_clock_fraction == 0.8416 and load_hardware("gh200").sustained_clock_fraction == 1.0
    f, shape = 2.0 * 4096**3, (1, 4096, 4096, 4096)
    assert h100.gemm_s(f, shape) == pytest.approx(burst.gemm_s(f, shape) / 0.8416, rel=1e-12)
    assert burst.gemm_s(f, shape) == pytest.approx(f / 783.3e12, rel=1e-9)  # a measured shape, at its speed
    attn = AttentionShape("fa2", 128, 2048, True, 0.53)
    assert h100.attention_s(1e12, attn) == pytest.approx(burst.attention_s(1e12, attn) / 0.8416, rel=1e-12)
    assert h100.elementwise_s(1e9) == burst.elementwise_s(1e9)
    assert "sustained_clock_fraction" in h100.params() and "sustained_clock_fraction" not in burst.params()


def test_a_sustained_clock_fraction_above_one_is_refused(tmp_path):
    raw = json.loads((hardware_dir() / "h100-pcie5.json").read_text())
    raw["params"]["sustained_clock_fraction"]["value"] = 1.2
    path = tmp_path / "fast.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidFileError, match=r"sustained_clock_fraction must be in \(0, 1\]"):
        load_hardware(path)


def test_compute_beside_a_collective_runs_on_the_sms_and_hbm_nccl_leaves_it():
    """NCCL's blocks hold an SM each and share it with nothing (NVIDIA/nccl#689): beside a collective
    a GEMM has 108 - 16 SMs on A100 (its waves re-quantized on them), fused attention 92/108 of its
    rate, and memory-bound kernels HBM less twice the collective's link traffic (NVIDIA/nccl#1428)."""
    import dataclasses

    from slackswap_ds.attention_rates import AttentionShape
    from slackswap_ds.hardware import tile_efficiency

    a100 = load_hardware("a100-80g-pcie4")
    assert (a100.nccl_sms, a100.sm_count) == (16, 108)
    beside = a100.beside_collective(200e9)
    f, shape = 2.0 * 8192**3, (1, 8192, 8192, 8192)
    quantized = tile_efficiency(1, 8192, 8192, 108) / tile_efficiency(1, 8192, 8192, 92)
    assert beside.gemm_s(f, shape) == pytest.approx(a100.gemm_s(f, shape) * 108 / 92 * quantized, rel=1e-12)
    assert beside.gemm_s(f) == pytest.approx(a100.gemm_s(f) * 108 / 92, rel=1e-12)  # by FLOPs: the SM share only
    attn = AttentionShape("fa2", 128, 2048, True, 0.53)
    assert beside.attention_s(1e12, attn) == pytest.approx(a100.attention_s(1e12, attn) * 108 / 92, rel=1e-12)
    assert beside.elementwise_s(1e9) == pytest.approx(1e9 / (1.61e12 - 2 * 200e9), rel=1e-12)
    assert beside.digest != a100.digest and beside.params() == a100.params()
    with pytest.raises(ValueError, match="takes all of HBM"):
        a100.beside_collective(1e12).elementwise_s(1.0)
    plain = dataclasses.replace(a100, nccl_sms=0)  # a preset without the count: compute is not slowed
    assert plain.beside_collective(200e9) is plain


def test_nccl_sms_need_an_sm_count_above_them(tmp_path):
    raw = json.loads((hardware_dir() / "a100-80g-pcie4.json").read_text())
    raw["params"]["nccl_sms"]["value"] = 108
    path = tmp_path / "all.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidFileError, match="nccl_sms needs sm_count, and fewer SMs than it"):
        load_hardware(path)

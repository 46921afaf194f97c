import json

import pytest

from slackswap_ds.errors import InvalidFileError, ProfileError, UnknownNameError
from slackswap_ds.hardware import STATUSES, hardware_dir, load_hardware, load_node, preset_names
from slackswap_ds.profile import Activation, Op, StepProfile

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
        assert len(hw.sources) == 9 and all(src.split(":")[0] in STATUSES for _, src in hw.sources)
    node = load_node("dgx-a100")
    assert (node.gpus, node.gpus_per_switch, node.switches_per_socket) == (8, 2, 2)
    assert [node.switch_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [node.socket_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a100_values_match_the_reference():
    hw = load_hardware("a100-80g-pcie4")
    assert (hw.peak_flops, hw.h2d_bps, hw.duplex_h2d_bps, hw.duplex_d2h_bps) == (312e12, 25.1e9, 11e9, 25e9)


def test_unknown_names_list_the_valid_choices():
    with pytest.raises(UnknownNameError, match="valid choices: a100-40g-pcie4, a100-80g-pcie4"):
        load_hardware("a100")
    with pytest.raises(UnknownNameError, match="valid choices: dgx-a100"):
        load_node("dgx-h100")


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

"""Regions and names: every block stack is found (encoder and decoder), layer calls are labelled
per call, and names are stable and the same however the step is observed."""

import pytest
import torch
from torch import nn

from slackswap_ds.runtime.naming import activation_key, call_label, gap_label, is_gap, maker_of
from slackswap_ds.runtime.regions import RegionTracker, find_layers

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.parts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # inside a layer: not a stack of its own


def test_every_stack_not_inside_another_one_is_found():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList([Block(), Block()])
            self.decoder = nn.Sequential(Block(), Block(), Block())
            self.head = nn.Sequential(nn.Linear(2, 2), nn.ReLU())  # mixed classes: not a stack
            self.groups = nn.ModuleList([nn.ModuleList([Block()]), nn.ModuleList([Block()])])  # lists of lists

    model = Model()
    assert [p for p, _ in find_layers(model)] == ["encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2",
                                                  "groups.0.0", "groups.1.0"]
    shared = Block()
    model.encoder[1] = shared
    model.decoder[0] = shared  # one module under two paths is one layer: its first path
    paths = [p for p, _ in find_layers(model)]
    assert "decoder.0" not in paths and "encoder.1" in paths
    assert [p for p, _ in find_layers(nn.Sequential(Block(), Block()))] == ["0", "1"]  # the model is the stack


@pytest.mark.parametrize("name, stacks", [("t5", ["encoder.block", "decoder.block"]),
                                          ("bart", ["model.encoder.layers", "model.decoder.layers"]),
                                          ("albert", ["albert.encoder.albert_layer_groups"])])
def test_encoder_and_decoder_stacks_are_both_regions(name, stacks):
    model, _ = zoo.ZOO[name].build(torch.float32)
    paths = [p for p, _ in find_layers(model)]
    assert sorted({p.rsplit(".", 1)[0] for p in paths}) == sorted(stacks)


def test_calls_are_labelled_per_call_and_gaps_after_them():
    regions = RegionTracker()
    assert regions.label == "pre" and is_gap(regions.label)
    assert regions.enter("h.0") == "h.0" and regions.in_call and regions.path == "h.0"
    regions.leave()
    assert regions.label == gap_label("h.0") == "after.h.0" and is_gap(regions.label) and not regions.in_call
    assert regions.enter("h.0") == call_label("h.0", 1) == "h.0@1"  # the same layer again (a second forward)
    regions.leave()
    regions.reset()
    assert regions.label == "pre" and regions.enter("h.0") == "h.0"


def test_activation_names_come_from_what_a_pack_hook_sees():
    x = torch.randn(3, requires_grad=True)
    y = x.sigmoid()
    assert maker_of(y) == "sigmoid" and maker_of(torch.ones(2)) == "input" and maker_of(x) == "input"
    assert maker_of(y.view(3)) == "view" and maker_of(x.reshape(1, 3)) == "view"  # reshape's alias too
    assert maker_of(torch.nn.functional.layer_norm(y, (3,))) == "native_layer_norm"
    assert activation_key("h.3", 7, "gelu") == "h.3:7:gelu"

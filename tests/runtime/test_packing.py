"""PACK at run time (runtime/packing.py): the codec's round trip is bit for bit; the profiler marks
exactly the tensors that are two-valued by the ops that made them; steps under plans that pack are
exact, hold the predicted peak and count what they packed; a wrong mark is caught at its first
packing and costs memory, never correctness."""

import dataclasses

import pytest
import torch
from torch import nn

import slackswap_ds as ss
from slackswap_ds.hardware import Hardware
from slackswap_ds.plan import Decision, Plan, lower
from slackswap_ds.runtime.aten import bytes_of
from slackswap_ds.runtime.packing import pack, unpack
from slackswap_ds.simulator import simulate
from slackswap_ds.step_profile import StepProfile, packed_size

from exactness import assert_exact, assert_peak_as_predicted, loss_step, measured, random_plan, run


def _round_trip(t: torch.Tensor) -> None:
    """Bit for bit through NumPy (the CPU's path), through torch ops (CUDA's path, run here on the
    CPU) and across the two: one layout."""
    st = t.untyped_storage()
    for packing, unpacking in ((False, False), (True, True), (False, True), (True, False)):
        packed = pack(st, t.dtype, torch_ops=packing)
        assert packed.buffer.numel() == packed_size(st.nbytes(), t.element_size())
        assert torch.equal(unpack(packed, torch_ops=unpacking), bytes_of(st)), (packing, unpacking)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_bool_masks_come_back_bit_for_bit(n):
    _round_trip(torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_two_valued_tensors_come_back_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    noise = (torch.rand(37, 5, generator=g) < 0.9).to(dtype) / torch.tensor(0.9).to(dtype)  # dropout's 0 or 1/(1-p)
    _round_trip(noise)
    if dtype.is_floating_point:  # the patterns, not the values: -0.0 stays -0.0, a NaN keeps its payload
        _round_trip(torch.where(torch.rand(17, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(2.5)).to(dtype))
        _round_trip(torch.full((9,), float("nan"), dtype=dtype))
    _round_trip(torch.zeros(3, dtype=dtype))


def test_a_third_value_does_not_come_back():
    """Why a wrong mark needs the first packing's check: the codec keeps two patterns only."""
    t = torch.tensor([0.0, 1.0, 2.0])
    assert not torch.equal(unpack(pack(t.untyped_storage(), t.dtype)), bytes_of(t.untyped_storage()))


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(torch.relu(self.up(x)))
        keep = (h > 0.05)  # a bool tensor masked_fill saves
        return x + self.down(h.masked_fill(keep, 0.5))


class Net(nn.Module):
    def __init__(self, n=3, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        half = x[:, : x.shape[1] // 2]
        half.bernoulli_(0.5)  # in place on part of a storage: never two-valued by its ops
        return x.square().mean()


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return measured(Net().train(), torch.randn(8, 16))


def test_the_profile_marks_dropout_noise_and_bool_masks_only(net):
    _, _, _, prof = net
    marked = {a.key for a in prof.activations if a.packable}
    # per layer: dropout's float noise (CPU: a fresh tensor, bernoulli_, div_ by a scalar) and the bool mask
    assert len(marked) == 6, marked
    for key in marked:
        a = prof.by_key[key]
        assert a.packed_bytes < a.bytes / 8 + 16 and a.pack_s >= 0
    assert all(not a.packable for a in prof.activations if a.key.startswith("after") or a.key.startswith("pre"))


def test_the_packed_marks_round_trip_through_json_and_keep_old_digests(net):
    _, _, _, prof = net
    assert StepProfile.from_json(prof.to_json()) == prof
    plain = dataclasses.replace(prof, activations=tuple(
        dataclasses.replace(a, packed_bytes=None, pack_s=0.0) for a in prof.activations))
    assert "packed_bytes" not in plain.canonical_json()  # profiles without marks: their JSON as before


@pytest.mark.parametrize("fate", [Decision.KEEP, Decision.SWAP])
def test_every_packable_tensor_packed_is_exact_and_holds_its_predicted_peak(net, fate):
    model, x, reference, prof = net
    decisions = {a.key: fate if a.packable else Decision.KEEP for a in prof.activations}
    plan = Plan.build(prof, decisions, budget_bytes=prof.total_bytes, hardware_digest="any", planner="test",
                      packed=prof.packable)
    ex = ss.apply(model, plan, prof)
    for _ in range(3):
        assert_exact(run(model, loss_step, x, ex), reference)
        last = ex.stats.last_step
        assert last.fallbacks == {}
        assert last.packed_bytes == sum(prof.by_key[k].bytes for k in prof.packable)
    assert_peak_as_predicted(last.peak_device_bytes, prof, plan, exact=True)
    unpacked = Plan.build(prof, decisions, budget_bytes=prof.total_bytes, hardware_digest="any", planner="test")
    assert last.peak_device_bytes < simulate(lower(prof, unpacked), Hardware.instant_copies()).peak_bytes


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_that_pack_are_exact(net, seed):
    model, x, reference, prof = net
    plan = random_plan(prof, seed)
    ex = ss.apply(model, plan, prof)
    for _ in range(2):
        assert_exact(run(model, loss_step, x, ex), reference)
        assert ex.stats.last_step.fallbacks == {}
    assert_peak_as_predicted(ex.stats.last_step.peak_device_bytes, prof, plan)


def test_a_wrong_mark_is_caught_at_its_first_packing(net):
    """A tensor marked packable that is not two-valued (the mark is forged here) is stored
    unpacked, counted, and never packed again by that executor: every step stays exact."""
    model, x, reference, prof = net
    layer_input = next(a for a in prof.activations if a.key.startswith("layers.0:") and not a.packable)
    forged = dataclasses.replace(prof, activations=tuple(
        dataclasses.replace(a, packed_bytes=packed_size(a.bytes, 4)) if a.key == layer_input.key else a
        for a in prof.activations))
    plan = Plan.build(forged, {a.key: Decision.KEEP for a in forged.activations}, budget_bytes=forged.total_bytes,
                      hardware_digest="any", planner="test", packed=(layer_input.key,))
    ex = ss.apply(model, plan, forged)
    assert_exact(run(model, loss_step, x, ex), reference)
    assert ex.stats.last_step.fallbacks == {"packing would change it (more than two values): stored unpacked": 1}
    for _ in range(2):  # later steps: not packed again
        assert_exact(run(model, loss_step, x, ex), reference)
        assert ex.stats.last_step.fallbacks == {"packed before and found more than two-valued: stored unpacked": 1}

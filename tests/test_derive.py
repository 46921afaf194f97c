"""derive.py: a profile of new input shapes from a measured one; its refusals; the dims it learns."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap_ds.derive import Deriver, derive, derived, input_dims
from slackswap_ds.step_profile import Activation, Op, StepProfile

B, S, H, HEADS = 2, 31, 64, 4
INPUTS = [(B, S), (B, S)]  # input_ids, labels


def profile(seq: int = S, shapes: bool = True) -> StepProfile:
    """A layer that saves a hidden state (b, s, h), attention scores (b, heads, s, s) and a loss's
    shifted labels (b, s - 1); times as if measured."""
    def act(key, shape, itemsize, users, producers=()):
        return Activation(key, math.prod(shape) * itemsize, users, producers, (), shape if shapes else None)

    ops = (Op("l0:0:mm", 2e-3, 4e-3, "l0"), Op("l0:1:softmax", 1e-3, 1e-3, "l0"), Op("l0:2:sub", 1e-4, 1e-4, "l0"),
           Op("l0:3:nll", 1e-4, 1e-4, "l0"))
    acts = (act("l0:0:mm", (B, seq, H), 4, (0, 1), (0,)), act("l0:1:softmax", (B, HEADS, seq, seq), 4, (1,), (1,)),
            act("l0:2:sub", (B, seq - 1), 8, (3,)))
    return StepProfile("toy", ops, acts, (("source", "measured"),))


def test_input_dims_maps_what_changed_and_refuses_what_is_ambiguous():
    assert input_dims(INPUTS, [(B, 40), (B, 40)]) == {S: 40}
    assert input_dims(INPUTS, [(3, 40), (3, 40)]) == {B: 3, S: 40}
    assert "number or rank" in input_dims(INPUTS, [(B, 40)])
    assert "number or rank" in input_dims(INPUTS, [(B, 40, 1), (B, 40)])
    assert "both" in input_dims(INPUTS, [(B, 40), (B, 41)])
    assert "changes in one place and not in another" in input_dims([(4, 4)], [(4, 9)])
    assert "dim of 1" in input_dims([(1, S)], [(2, S)])
    assert "also a dim of the model's parameters" in input_dims([(B, 64)], [(B, 80)], frozenset({64, 128}))
    assert input_dims(INPUTS, INPUTS) == "the same input shapes"


def test_a_derived_profile_scales_each_tensor_by_its_own_dims_and_each_op_by_what_it_saves():
    new = derive(profile(), INPUTS, [(B, 62), (B, 62)]).profile
    base = profile()
    by = {a.key: a for a in new.activations}
    assert by["l0:0:mm"].bytes == 2 * base.by_key["l0:0:mm"].bytes  # linear in s
    assert by["l0:1:softmax"].bytes == 4 * base.by_key["l0:1:softmax"].bytes  # quadratic
    assert by["l0:1:softmax"].shape == (B, HEADS, 62, 62)
    assert new.ops[0].fwd_s == pytest.approx(2 * base.ops[0].fwd_s)
    assert new.ops[1].bwd_s == pytest.approx(4 * base.ops[1].bwd_s)
    assert new.ops[2].fwd_s == pytest.approx(2 * base.ops[2].fwd_s)  # saves nothing: scaled by tokens
    assert [a.users for a in new.activations] == [a.users for a in base.activations]
    assert derived(new) and not derived(base) and dict(new.meta)["derived_from"] == base.digest[:16]
    assert "31" in dict(new.meta)["inputs"] and "62" in dict(new.meta)["inputs"]


def test_a_dim_that_is_not_the_input_dim_is_wrong_until_learnt_then_exact():
    """The shifted labels are s - 1 long: plain substitution misses them; one measured step fits
    the dim (a * s + k) and every later derivation is exact, for longer and shorter sequences."""
    deriver = Deriver(profile(), INPUTS)
    guess = {a.key: a for a in deriver.derive([(B, 20), (B, 20)]).profile.activations}
    assert guess["l0:2:sub"].shape == (B, 30)  # 30 is not 31: left as it was (wrong)
    measured = {a.key: (a.shape, a.bytes) for a in profile(20).activations}
    assert deriver.learn([(B, 20), (B, 20)], measured) == []
    for seq in (12, 20, 57):
        got = {a.key: (a.shape, a.bytes) for a in deriver.derive([(B, seq), (B, seq)]).profile.activations}
        assert got == {a.key: (a.shape, a.bytes) for a in profile(seq).activations}, seq


def test_a_size_no_fit_explains_is_named():
    deriver = Deriver(profile(), INPUTS)
    measured = {a.key: (a.shape, a.bytes) for a in profile(20).activations}
    measured["l0:0:mm"] = ((B, 7, H), B * 7 * H * 4)  # neither constant nor a * 20 + k with the base's 31
    assert deriver.learn([(B, 20), (B, 20)], measured) == ["l0:0:mm"]


def test_profiles_without_shapes_and_ambiguous_inputs_are_refused():
    assert "no tensor shapes" in derive(profile(shapes=False), INPUTS, [(B, 40), (B, 40)]).why
    refused = derive(profile(), [(B, H)], [(B, 80)], frozenset({H}))
    assert refused.profile is None and "parameters" in refused.why


def test_shapes_survive_json_and_enter_the_structure_digest():
    p = profile()
    again = StepProfile.from_json(p.to_json())
    assert again == p and again.structure_digest == p.structure_digest
    assert profile(shapes=False).structure_digest != p.structure_digest
    assert "shape" not in profile(shapes=False).to_json()["activations"][0]  # modelled profiles: JSON unchanged


def test_a_flattened_batch_times_sequence_scales_with_the_sequence():
    """A Linear on (b, s, h) inputs saves them as (b * s, h): 2 x 31 = 62 becomes 2 x 40 = 80, found
    as the one product of a changed input dim and an unchanged one; a product that is also a dim of
    the model's parameters stays (it cannot be told apart)."""
    flat = StepProfile("toy", (Op("l0:0:mm", 1e-3, 1e-3, "l0"),),
                       (Activation("l0:0:view", B * S * H * 4, (0,), (), (), (B * S, H)),), (("source", "measured"),))
    assert derive(flat, INPUTS, [(B, 40), (B, 40)]).profile.activations[0].shape == (B * 40, H)
    assert derive(flat, INPUTS, [(B, 40), (B, 40)], frozenset({B * S})).profile.activations[0].shape == (B * S, H)


def test_a_fitted_dim_below_one_on_shorter_inputs_means_profile_them_not_a_raise():
    """A dim fitted as s - 20 (from 31 and 40) would be negative at s = 12: no derivation, and why."""
    base = StepProfile("toy", (Op("l0:0:mm", 1e-3, 1e-3, "l0"),),
                       (Activation("l0:0:cut", (S - 20) * 4, (0,), (), (), (S - 20,)),), (("source", "measured"),))
    deriver = Deriver(base, [(S,)])
    assert deriver.learn([(40,)], {"l0:0:cut": ((20,), 80)}) == []  # fitted: 1 * s - 20
    assert deriver.derive([(50,)]).profile.activations[0].shape == (30,)
    why = deriver.derive([(12,)])
    assert why.profile is None and "l0:0:cut would have shape (-8,)" in why.why


def test_a_profile_with_compiled_code_is_not_derived():
    """Dynamo may compile another graph for other shapes, saving in another order: keys would name
    other tensors, so such a profile is profiled again, not derived."""
    compiled = StepProfile("toy", (Op("l0:0:compiled", 1e-3, 1e-3, "l0"),),
                           (Activation("l0:0:input", B * S * H * 4, (0,), (), (), (B, S, H)),), (("source", "measured"),))
    why = derive(compiled, INPUTS, [(B, 40), (B, 40)])
    assert why.profile is None and "compiled code" in why.why and compiled.ops[0].compiled


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(2, 200), min_size=2, max_size=8),
       st.lists(st.tuples(st.integers(1, 3), st.integers(-40, 40)), min_size=1, max_size=3))
def test_any_sequence_of_lengths_derives_or_says_why_and_never_raises(lengths, fits):
    """Random lengths over a profile with dims a * s + k (fitted, as `learn` does from a measured
    step): each derivation is a profile whose every dim is at least 1 and whose bytes follow its
    shape, or None with a reason."""
    base_s = lengths[0]
    dims = [a * base_s + k for a, k in fits]
    if any(d < 1 for d in dims):
        return
    acts = tuple(Activation(f"l0:{i}:x", d * 4, (0,), (), (), (d,)) for i, d in enumerate(dims))
    deriver = Deriver(StepProfile("toy", (Op("l0:0:mm", 1e-3, 1e-3, "l0"),), acts, (("source", "measured"),)),
                      [(base_s,)])
    deriver.rules = {f"l0:{i}:x": ((base_s, a, k),) for i, (a, k) in enumerate(fits)}
    for s in lengths[1:]:
        got = deriver.derive([(s,)])
        if got.profile is None:
            assert got.why
            continue
        for act, (a, k) in zip(got.profile.activations, fits):
            assert act.shape == ((a * s + k),) and act.shape[0] >= 1 and act.bytes == 4 * act.shape[0]

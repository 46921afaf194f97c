"""shapes.py in process: shape keys, and the cache of shape plans (how a step of a shape runs, least
recently used first, the measured profiles new shapes are derived from)."""

from __future__ import annotations

import logging

import torch

from slackswap_ds.shapes import Run, ShapeCache, ShapeState, describe, model_dims, shape_key, shapes_of

from conftest import two_region_profile


def key(*shapes) -> tuple:
    return tuple((tuple(s), "torch.int64") for s in shapes)


def planned(cache: ShapeCache, k) -> None:
    """`k` as a planned shape: its state has an executor (any object does, for the cache)."""
    cache.states[k] = ShapeState(executor=object())


def test_a_shape_key_is_every_tensors_shape_and_dtype_in_order():
    k = shape_key((torch.zeros(2, 3),), {"labels": torch.zeros(2, 3, dtype=torch.int64), "flag": True})
    assert k == (((2, 3), "torch.float32"), ((2, 3), "torch.int64"))
    assert describe(k) == "(2, 3) torch.float32; (2, 3) torch.int64" and shapes_of(k) == [(2, 3), (2, 3)]


def test_model_dims_are_every_parameter_dim():
    assert model_dims(torch.nn.Linear(4, 6)) == frozenset({4, 6})


def test_a_new_shape_is_profiled_a_planned_one_runs_under_its_plan_and_becomes_the_most_recent():
    cache = ShapeCache(max_shapes=3, replan="on_shape_change")
    a, b = key((2, 8)), key((2, 16))
    assert cache.runner_for(a, None) is Run.PROFILE and a in cache and cache[a].executor is None
    planned(cache, a)
    planned(cache, b)
    assert list(cache) == [a, b]
    assert cache.runner_for(a, None) is Run.PLANNED and list(cache) == [b, a]


def test_a_pipeline_step_profiling_one_micro_batch_adds_no_state_for_the_others():
    cache = ShapeCache(max_shapes=3, replan="on_shape_change")
    assert cache.runner_for(key((2, 8)), None, add=False) is Run.PROFILE and len(cache) == 0


def test_shapes_without_a_plan_and_new_shapes_under_replan_never_run_in_the_shelter():
    cache = ShapeCache(max_shapes=3, replan="never")
    assert cache.runner_for(key((2, 8)), None) is Run.PROFILE  # the job's first shape is profiled
    planned(cache, key((2, 8)))
    assert cache.runner_for(key((2, 16)), None) is Run.SHELTER and len(cache) == 1
    cache.states[key((2, 8))] = ShapeState(shelter=True)  # no plan within the budget
    assert cache.runner_for(key((2, 8)), None) is Run.SHELTER


def test_the_least_recently_used_shape_makes_room_and_is_said(caplog):
    cache = ShapeCache(max_shapes=2, replan="on_shape_change")
    for seq in (8, 16):
        planned(cache, key((2, seq)))
    cache.runner_for(key((2, 8)), None)  # 8 used last: 16 goes first
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        assert cache.runner_for(key((2, 32)), None) is Run.PROFILE
    assert list(cache) == [key((2, 8)), key((2, 32))]
    assert "max_shapes=2 plans kept; dropped the least recently used (input shapes [[(2, 16)]]" in caplog.text
    cache.drop(key((2, 8)))
    assert list(cache) == [key((2, 32))]


def test_new_shapes_derive_from_the_nearest_measured_profile_of_alike_inputs():
    cache = ShapeCache(max_shapes=4, replan="on_shape_change")
    profile = two_region_profile()
    for seq in (8, 64):
        cache.add_base(key((2, seq)), profile, frozenset())
    base, deriver = cache.base_for(key((2, 20)))
    assert base == key((2, 8)) and deriver.base is profile
    assert cache.base_for(key((2, 50)))[0] == key((2, 64))
    assert cache.base_for(key((2, 8), (2, 8))) is None  # another number of inputs
    assert cache.base_for(tuple((s, "torch.float32") for s, _ in key((2, 20)))) is None  # another dtype
    cache.underivable.add(key((2, 20)))
    assert cache.base_for(key((2, 20))) is None


def test_at_most_a_few_measured_profiles_are_kept():
    cache = ShapeCache(max_shapes=8, replan="on_shape_change")
    for seq in range(1, 7):
        cache.add_base(key((2, seq)), two_region_profile(), frozenset())
    assert list(cache.bases) == [key((2, seq)) for seq in range(7 - ShapeCache.BASES, 7)]

"""Real training loops under plans: several forwards before one backward, no_grad and eval()
forwards in between, gradient accumulation, all exact under random plans; and hundreds of steps
with a recompute plan that leave host and device memory flat."""

import gc

import pytest
import torch

import slackswap_ds as ss

from exactness import (accumulate, assert_exact, eval_forward_between, no_grad_forward_between, profile, random_plan,
                       run, soak, two_forwards, without_caches)

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)

PLANS = 6


@pytest.fixture(scope="module")
def gpt2():
    transformers.logging.set_verbosity_error()
    model, batch = zoo.ZOO["gpt2-eager"].build(torch.float32)
    return without_caches(model), batch


@pytest.mark.parametrize("loop", [two_forwards, no_grad_forward_between, eval_forward_between, accumulate])
def test_loops_are_exact_under_random_plans(gpt2, loop):
    model, batch = gpt2
    reference = run(model, loop, batch)
    prof = profile(model, loop, batch)
    if loop is two_forwards:  # the second forward's layer calls are regions of their own
        assert {"transformer.h.0", "transformer.h.0@1"} <= set(prof.regions)
    for seed in range(PLANS):
        ex = ss.apply(model, random_plan(prof, seed), prof)
        assert_exact(run(model, loop, batch, ex), reference)
        assert_exact(run(model, loop, batch, ex), reference)
        last = ex.stats.last_step
        assert last.fallbacks == {} and last.unplanned_reruns == 0 and ex.stats.demotions == []
    steps_per_call = 3 if loop is accumulate else 1
    assert ex.stats.steps == 2 * steps_per_call


@pytest.mark.parametrize("loop", [two_forwards, no_grad_forward_between, eval_forward_between, accumulate])
def test_loops_are_exact_with_layer_calls_replayed_whole(gpt2, loop):
    """A full recompute: from the second step on every layer call is replayed whole, with no dispatch
    mode (calls.py); the loops stay exact (two forwards: each layer's two calls)."""
    model, batch = gpt2
    reference = run(model, loop, batch)
    prof = profile(model, loop, batch)
    ex = ss.apply(model, ss.plan(prof, "a100-80g-pcie4", 1.0, planner="full-recompute"), prof)
    for _ in range(3):
        assert_exact(run(model, loop, batch, ex), reference)
    last = ex.stats.last_step
    layers = len(model.transformer.h)
    assert last.whole_replays == (2 * layers if loop is two_forwards else layers)
    assert last.fallbacks == {} and last.unplanned_reruns == 0 and ex.stats.demotions == []


def test_eval_forward_with_grad_is_left_alone_and_does_not_shift_the_next_step(gpt2):
    model, batch = gpt2
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    ex = ss.apply(model, random_plan(prof, 0), prof)
    with ex:
        model.eval()
        model(**batch).loss.backward()  # an eval-mode step with gradients (e.g. probing)
        model.train()
    assert ex.stats.steps == 0  # not a step of the plan
    assert_exact(run(model, zoo.step, batch, ex), reference)
    assert ex.stats.last_step.fallbacks == {} and ex.stats.last_step.kept_bytes > 0


def skipped_then_step(model, batch):
    """"Skip this batch": a training forward whose loss is dropped, then a whole step."""
    model(**batch)  # no backward: autograd lets go of its graph at once
    return zoo.step(model, batch)


def test_a_forward_without_backward_ends_its_step_and_the_next_keeps_the_plan(gpt2):
    """The forward after a dropped one is a step of its own under the plan (it used to be counted
    as a second forward of the same step: its saves unknown to the plan, over the budget); exact,
    within the plan's budget."""
    model, batch = gpt2
    reference = run(model, skipped_then_step, batch)
    prof = profile(model, zoo.step, batch)
    plan = ss.plan(prof, "a100-80g-pcie4", 0.5)
    ex = ss.apply(model, plan, prof)
    assert_exact(run(model, skipped_then_step, batch, ex), reference)
    last = ex.stats.last_step
    assert ex.stats.steps == 2 and last.fallbacks == {} and 0 < last.peak_device_bytes <= plan.budget_bytes


def test_soak_500_steps_with_a_recompute_plan_leaves_memory_flat(gpt2):
    """A replay's graph is never backwarded: nothing it makes may outlive it (the leak this
    guards against: a node that saves its own output forming a cycle through C++)."""
    model, batch = gpt2
    prof = profile(model, zoo.step, batch)
    plan = ss.plan(prof, "a100-80g-pcie4", 1.0, planner="full-recompute")
    ex = ss.apply(model, plan, prof)
    def step():
        model.zero_grad(set_to_none=True)
        zoo.step(model, batch)

    with ex:  # (the allocators settle in the first ~100 steps)
        samples = soak(step, 500, (150, 499))
    assert ex.stats.last_step.ops_recomputed > 0 and ex.stats.steps == 500
    (tensors_150, rss_150, _), (tensors_499, rss_499, _) = samples
    assert tensors_499 <= tensors_150  # (nothing grows; one fewer seen: another test's object, freed late)
    # a leak of even 5% of one step's saved bytes would add 350 * 0.05 * ~0.6 MB = ~10 MB
    assert rss_499 - rss_150 < 4 << 20, (rss_150 >> 20, rss_499 >> 20)
    assert ex.resident_bytes == 0  # every saved byte the executor held has been released


@pytest.mark.parametrize("loop", [zoo.step, two_forwards, accumulate])
def test_steps_leave_no_garbage_for_the_cycle_collector(gpt2, loop):
    """Nothing of a step (entries, layer-call records, replay graphs) waits for the garbage
    collector: with it off, 10 steps leave no unreachable object (the model alone leaves none)."""
    model, batch = gpt2
    prof = profile(model, loop, batch)
    for ctx in (None, ss.apply(model, random_plan(prof, 7), prof)):
        run(model, loop, batch, ctx)
        gc.collect()
        gc.disable()
        try:
            for _ in range(10):
                run(model, loop, batch, ctx)
            assert gc.collect() == 0
        finally:
            gc.enable()

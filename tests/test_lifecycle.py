"""The shape lifecycle (lifecycle.py, shape_plans.py), in process, one test per transition.

A tiny stack of blocks with dropout, driven the way each hook class drives it: `engine_step` as the
DeepSpeed engine's forward and backward do, `stage_step` as a pipeline stage's micro-batches do. Every
test follows `lifecycle.events` (the last step's transitions) and, where a plan ran, checks the loss
and every gradient against the model without SlackSwap (`torch.equal`)."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from slackswap_ds.config import load_config
from slackswap_ds.coordination import Coordinator
from slackswap_ds.errors import BudgetInfeasibleError
from slackswap_ds.hardware import load_hardware
from slackswap_ds.job_report import StepReports
from slackswap_ds.lifecycle import ShapeLifecycle
from slackswap_ds.plan_maker import PlanMaker
from slackswap_ds.runtime.compiled import check_model
from slackswap_ds.runtime.replay import ReplayError
from slackswap_ds.shape_plans import ShapePlans
from slackswap_ds.shapes import Transition as T
from slackswap_ds.shapes import model_dims, shape_key

WIDTH = 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Stack(torch.nn.Module):
    def __init__(self, block=Block, layers: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def lifecycle_of(model: torch.nn.Module, **section) -> ShapeLifecycle:
    cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4", "profile_steps": 1, **section}})
    hw = load_hardware(cfg.hardware)
    plans = PlanMaker(cfg, hw, model, Coordinator(cfg, hw))
    return ShapeLifecycle(model, cfg, ShapePlans(cfg, plans, model_dims(model), "cpu"), StepReports(cfg, hw, "cpu"),
                          lambda: check_model(model))


def engine_step(lifecycle: ShapeLifecycle, model, x, backward: bool = True):
    """One training step as the engine's hooks run it (deepspeed_api.hook_forward_backward): forward,
    then backward (unless not `backward`), the lifecycle told of what backward raised."""
    lifecycle.forward(shape_key((x,), {}))
    loss = model(x)
    if backward:
        lifecycle.before_backward()
        try:
            loss.backward()
        except BaseException as error:
            lifecycle.after_backward(error)
            raise
        lifecycle.after_backward(None)
    return loss


def stage_step(lifecycle: ShapeLifecycle, model, xs, backward=None):
    """One pipeline step as a stage's hooks run it: every micro-batch's forward, then their backwards
    (those in `backward`, default all), in order."""
    lifecycle.begin_step()
    losses = [lifecycle.micro_batch_forward(tag, shape_key((x,), {}), lambda x=x: model(x)) for tag, x in enumerate(xs)]
    for tag in range(len(xs)) if backward is None else backward:
        lifecycle.micro_batch_backward(tag, losses[tag].backward)
    lifecycle.end_step()
    return losses


def x_of(seq: int, seed: int = 0) -> torch.Tensor:
    """A sequence of `seq` tokens (no batch dim: a Linear on 3-d inputs saves them as (b * s, h),
    which derive.py refits on the first step, test_a_derived_plan_whose_sizes_differ_is_refitted...)."""
    return torch.randn(seq, WIDTH, generator=torch.Generator().manual_seed(seed))


def twins(block=Block, layers: int = 3):
    """The same model twice: one runs under SlackSwap, the other plainly."""
    torch.manual_seed(0)
    model = Stack(block, layers)
    return model, copy.deepcopy(model)


def run_pair(lifecycle, model, reference, seqs, seed=0):
    """The same steps on both models (the same RNG state before each): losses equal, gradients equal."""
    for i, seq in enumerate(seqs):
        x = x_of(seq, seed + i)
        torch.manual_seed(100 + i)
        loss = engine_step(lifecycle, model, x)
        torch.manual_seed(100 + i)
        expected = reference(x)
        expected.backward()
        assert torch.equal(loss, expected), (i, seq, lifecycle.events)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


# ---- transitions -----------------------------------------------------------------------------------
def test_warm_up_steps_run_in_the_shelter_and_the_last_is_said():
    model, reference = twins()
    lifecycle = lifecycle_of(model, profile_steps=2)
    run_pair(lifecycle, model, reference, [8])
    assert lifecycle.events == [T.WARM_UP]
    run_pair(lifecycle, model, reference, [8])
    assert lifecycle.events == [T.WARM_UP, T.WARMED_UP]
    stats = lifecycle.last_stats  # every saved tensor went to host; backward brings back what one op reads
    assert lifecycle.active_plan is None and 0 < lifecycle.shelter_peak == stats.peak_device_bytes < stats.swapped_bytes


def test_the_first_profiled_step_is_agreed_and_later_steps_run_its_plan():
    model, reference = twins()
    lifecycle = lifecycle_of(model)
    events = []
    for seq in (8, 8, 8, 8):
        run_pair(lifecycle, model, reference, [seq])
        events.append(lifecycle.events)
    assert events == [[T.WARM_UP, T.WARMED_UP], [T.PROFILE, T.AGREED], [T.PLANNED], [T.PLANNED]]
    (state,) = lifecycle.shapes.values()
    assert lifecycle.active_plan is state.plan and lifecycle.last_stats.peak_device_bytes <= state.plan.budget_bytes
    assert lifecycle.profiled_steps == 1 and lifecycle.derived_plans == 0


def test_new_shapes_are_planned_alone_from_their_own_profile():
    model, reference = twins()
    lifecycle = lifecycle_of(model, derive_shapes=False)
    run_pair(lifecycle, model, reference, [8, 8])
    run_pair(lifecycle, model, reference, [12])
    assert lifecycle.events == [T.PROFILE, T.PLANNED_ALONE]
    run_pair(lifecycle, model, reference, [12, 8])
    assert lifecycle.events == [T.PLANNED] and len(lifecycle.shapes) == 2 and lifecycle.profiled_steps == 2


def test_new_shapes_get_a_derived_plan_that_holds_on_its_first_step():
    model, reference = twins()
    lifecycle = lifecycle_of(model)
    run_pair(lifecycle, model, reference, [8, 8])
    run_pair(lifecycle, model, reference, [12])
    assert lifecycle.events == [T.DERIVED, T.PLANNED, T.HELD]
    state = lifecycle.shapes[shape_key((x_of(12),), {})]
    assert state.derived_from is not None and lifecycle.derived_plans == 1 and lifecycle.profiled_steps == 1
    assert lifecycle.last_stats.peak_device_bytes <= state.plan.budget_bytes


class PlusOne(Block):
    """Saves a tensor one longer than the sequence (a dim `s + 1` that derive.py cannot guess)."""

    def forward(self, x):
        y = torch.cat([x, x[:1]])
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(y))))[:-1]


def test_a_derived_plan_whose_sizes_differ_is_refitted_to_the_step():
    model, reference = twins(PlusOne)
    lifecycle = lifecycle_of(model)
    run_pair(lifecycle, model, reference, [8, 8, 12])
    assert lifecycle.events == [T.DERIVED, T.PLANNED, T.REFITTED]
    run_pair(lifecycle, model, reference, [12])
    assert lifecycle.events == [T.PLANNED, T.HELD]  # the plan derived again is checked on its first step too
    state = lifecycle.shapes[shape_key((x_of(12),), {})]
    assert state.refitted and lifecycle.last_stats.resized == 0


class LongerSavesMore(Block):
    """Sequences over 10 take a branch that saves a tensor the shorter ones never do."""

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        if x.shape[0] > 10:
            h = h.sigmoid() * h
        return x + self.drop(self.down(h))


def test_a_derived_plan_that_cannot_explain_its_step_profiles_the_shapes_next():
    model, reference = twins(LongerSavesMore)
    lifecycle = lifecycle_of(model)
    run_pair(lifecycle, model, reference, [8, 8, 12])
    assert lifecycle.events == [T.DERIVED, T.PLANNED, T.UNDERIVABLE]
    run_pair(lifecycle, model, reference, [12])
    assert lifecycle.events == [T.PROFILE, T.PLANNED_ALONE]


def test_shapes_without_a_plan_within_the_budget_run_in_the_shelter():
    """6,000 B hold a plan of 8 tokens (keep-all 9,728 B), and none of 64: those run in the shelter."""
    model, reference = twins()
    lifecycle = lifecycle_of(model, derive_shapes=False, activation_budget=6000)
    run_pair(lifecycle, model, reference, [8, 8, 64])
    assert lifecycle.events == [T.PROFILE, T.NO_PLAN]
    run_pair(lifecycle, model, reference, [64, 8])
    assert lifecycle.events == [T.PLANNED]
    run_pair(lifecycle, model, reference, [64])
    assert lifecycle.events == [T.SHELTER] and lifecycle.active_plan is None
    assert lifecycle.last_stats.swapped_bytes == 8 * 9728  # every saved tensor to host (8 x the keep-all of 8 tokens)


def test_new_shapes_under_replan_never_run_in_the_shelter():
    model, reference = twins()
    lifecycle = lifecycle_of(model, replan="never")
    run_pair(lifecycle, model, reference, [8, 8, 12])
    assert lifecycle.events == [T.SHELTER] and len(lifecycle.shapes) == 1


def test_a_budget_no_plan_can_keep_is_said_at_the_first_step_and_stops_the_job_at_its_first_plan(caplog):
    """16 B is less than a warm-up step holds with every saved tensor on host (what one op reads at
    once): said at once with the smallest budget that works; the first plan then stops the job, its
    error naming the least a plan holds."""
    model, _ = twins()
    lifecycle = lifecycle_of(model, activation_budget="16B")
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        engine_step(lifecycle, model, x_of(8))
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("slackswap: activation_budget 16 (16 B) is less than this model's steps hold")
    assert said.endswith(f"the smallest budget that works is about {lifecycle.shelter_peak:,} B")
    with pytest.raises(BudgetInfeasibleError, match=r"within 16 B .*The smallest budget that works here is [\d,]+ B"):
        engine_step(lifecycle, model, x_of(8))
    assert lifecycle.events == [T.PROFILE, T.GAVE_UP]


class Noisy(Block):
    """Draws from a generator of its own: a replay differs from forward (verification demotes it)."""

    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)) * (1 + self.rng.random()))


def test_a_plan_whose_verification_fails_is_replanned_and_followed():
    torch.manual_seed(0)
    model = Stack(Noisy)
    lifecycle = lifecycle_of(model, planner="full-recompute", activation_budget=0.8)
    for _ in range(3):
        engine_step(lifecycle, model, x_of(8))
    assert lifecycle.events == [T.PLANNED, T.REPLANNED]
    (state,) = lifecycle.shapes.values()
    assert state.executor.stats.demotions and lifecycle.active_plan is not state.plan  # (the verified one ran)
    engine_step(lifecycle, model, x_of(8))
    assert lifecycle.events == [T.PLANNED] and lifecycle.active_plan is state.plan


class BreaksLater(Block):
    """Raises inside its replay from the moment `broken` is set."""

    broken = False

    def forward(self, x):
        if BreaksLater.broken and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("state changed since forward")
        return super().forward(x)


def test_a_replay_that_fails_in_backward_raises_with_its_plan_demoted():
    model, _ = twins(BreaksLater)
    lifecycle = lifecycle_of(model, planner="full-recompute", activation_budget=0.8)
    for _ in range(4):
        engine_step(lifecycle, model, x_of(8))
    BreaksLater.broken = True
    try:
        with pytest.raises(ReplayError):
            engine_step(lifecycle, model, x_of(8))
    finally:
        BreaksLater.broken = False
    assert lifecycle.events == [T.PLANNED, T.REPLAY_FAILED] and lifecycle.step is None
    engine_step(lifecycle, model, x_of(8))
    assert T.PLANNED in lifecycle.events


def test_a_forward_without_backward_ends_its_step_at_the_next_forward():
    model, reference = twins()
    lifecycle = lifecycle_of(model)
    run_pair(lifecycle, model, reference, [8, 8, 8])
    engine_step(lifecycle, model, x_of(8), backward=False)  # "skip this batch": its loss dropped
    run_pair(lifecycle, model, reference, [8])
    assert lifecycle.events == [T.PLANNED]
    assert lifecycle.last_stats.peak_device_bytes <= lifecycle.active_plan.budget_bytes


def two_forward_step(lifecycle: ShapeLifecycle, model, x, reference=None, first_backward: bool = True):
    """R-Drop: two training forwards of the same inputs, one backward of both (or, without
    `first_backward`, a first forward dropped, "skip this batch", then one that is backwarded).
    With `reference`, the same step on it, the same RNG before both: the losses must be equal."""
    torch.manual_seed(7)
    lifecycle.forward(shape_key((x,), {}))
    first = model(x)
    lifecycle.forward(shape_key((x,), {}))
    second = model(x)
    loss = first + second + (first - second).square() if first_backward else second
    if not first_backward:
        del first
    lifecycle.before_backward()
    loss.backward()
    lifecycle.after_backward(None)
    if reference is not None:
        torch.manual_seed(7)
        a, b = reference(x), reference(x)
        expected = a + b + (a - b).square()
        expected.backward()
        assert torch.equal(loss, expected)


def test_two_forwards_before_one_backward_are_profiled_and_planned_as_one_step():
    """R-Drop and contrastive losses: the profiled step sees both forwards (the second's layer calls
    labelled @1), so the plan has every tensor of the step; exact, every step within its budget."""
    model, reference = twins()
    lifecycle = lifecycle_of(model)
    events = []
    for i in range(4):
        two_forward_step(lifecycle, model, x_of(8, i), reference)
        events.append(list(lifecycle.events))
        if lifecycle.active_plan is not None:
            assert lifecycle.last_stats.peak_device_bytes <= lifecycle.active_plan.budget_bytes
            assert lifecycle.last_stats.unplanned == 0
    assert events == [[T.WARM_UP, T.WARMED_UP], [T.PROFILE, T.TWO_FORWARDS, T.AGREED], [T.PLANNED], [T.PLANNED]]
    (state,) = lifecycle.shapes.values()
    assert any("@1" in a.key for a in state.profile.activations)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_profiled_step_whose_first_forward_had_no_backward_is_profiled_again():
    """A batch skipped (its loss dropped) and the next of the same shapes: the profiler cannot tell
    that apart from R-Drop when the second forward comes; after backward it can (the first forward's
    saves were never read), and the profile is dropped."""
    model, _ = twins()
    lifecycle = lifecycle_of(model)
    engine_step(lifecycle, model, x_of(8))
    two_forward_step(lifecycle, model, x_of(8), first_backward=False)
    assert lifecycle.events == [T.PROFILE, T.TWO_FORWARDS, T.PROFILED_AGAIN] and lifecycle.active_plan is None
    engine_step(lifecycle, model, x_of(8))
    assert lifecycle.events == [T.PROFILE, T.AGREED]
    assert not any("@1" in a.key for a in next(iter(lifecycle.shapes.values())).profile.activations)


def test_a_forward_of_other_shapes_ends_a_profiled_step_unprofiled():
    model, _ = twins()
    lifecycle = lifecycle_of(model)
    engine_step(lifecycle, model, x_of(8))
    engine_step(lifecycle, model, x_of(8), backward=False)  # profiled, then its batch skipped
    engine_step(lifecycle, model, x_of(12))
    assert lifecycle.events == [T.PROFILE, T.AGREED] and len(lifecycle.shapes) == 2


def test_a_step_unlike_its_plan_holds_the_budget_and_its_shapes_are_profiled_again():
    """A plan made for one forward, then steps of two (the loop changed): the second forward's saves
    are not in the plan, go to host, and from the first of them the step holds the budget (its
    prefetches wait for their reads); the shapes are profiled again, with both forwards."""
    model, reference = twins()
    lifecycle = lifecycle_of(model, activation_budget=0.3)
    run_pair(lifecycle, model, reference, [8, 8, 8])
    two_forward_step(lifecycle, model, x_of(8))
    stats = lifecycle.last_stats
    assert lifecycle.events == [T.PLANNED, T.STALE] and stats.unplanned > 0
    assert stats.fallbacks["a prefetch over the budget: copied in when read"] > 0  # (reads still come in)
    two_forward_step(lifecycle, model, x_of(8))
    assert lifecycle.events == [T.PROFILE, T.TWO_FORWARDS, T.PLANNED_ALONE]
    two_forward_step(lifecycle, model, x_of(8))
    assert lifecycle.events == [T.PLANNED] and lifecycle.last_stats.unplanned == 0
    assert lifecycle.last_stats.peak_device_bytes <= lifecycle.active_plan.budget_bytes


def test_micro_batches_without_backward_are_closed_when_the_step_ends():
    model, _ = twins()
    lifecycle = lifecycle_of(model)
    for _ in range(3):
        stage_step(lifecycle, model, [x_of(8, 1), x_of(8, 2)])
    stage_step(lifecycle, model, [x_of(8, 1), x_of(8, 2)], backward=[0])
    assert lifecycle.events == [T.PLANNED, T.UNFINISHED]
    (state,) = lifecycle.shapes.values()
    assert state.executor.open_micro_batches == 0
    for _ in range(3):  # what the unfinished micro-batch saved is gone: nothing grows, every step within budget
        stage_step(lifecycle, model, [x_of(8, 1), x_of(8, 2)])
        assert lifecycle.events == [T.PLANNED] and state.executor.resident_bytes == 0
        assert lifecycle.last_stats.peak_device_bytes <= state.plan.budget_bytes


def test_a_stage_plan_holds_its_micro_batches_in_flight_and_derives_new_shapes():
    model, reference = twins()
    lifecycle = lifecycle_of(model)
    stage_step(lifecycle, model, [x_of(8, 1), x_of(8, 2)])
    stage_step(lifecycle, model, [x_of(8, 1), x_of(8, 2)])
    assert lifecycle.events == [T.PROFILE, T.SHELTER, T.AGREED] and lifecycle.holds == 2
    (state,) = lifecycle.shapes.values()
    assert state.plan.budget_bytes == 2 * state.profile.total_bytes // 2
    stage_step(lifecycle, model, [x_of(12, 1), x_of(12, 2)])
    assert lifecycle.events == [T.DERIVED, T.PLANNED, T.HELD]
    assert lifecycle.last_stats.peak_device_bytes <= lifecycle.active_plan.budget_bytes


def test_a_model_compiled_later_is_planned_anew_after_a_warm_up():
    model, reference = twins()
    lifecycle = lifecycle_of(model)
    run_pair(lifecycle, model, reference, [8, 8, 8])
    model.blocks[1] = torch.compile(model.blocks[1], backend="eager")
    reference.blocks[1] = torch.compile(reference.blocks[1], backend="eager")
    run_pair(lifecycle, model, reference, [8])
    assert lifecycle.events == [T.COMPILED_ANEW, T.WARM_UP, T.WARMED_UP]
    run_pair(lifecycle, model, reference, [8, 8])
    assert lifecycle.events == [T.PLANNED] and lifecycle.compiled == frozenset({"blocks.1"})


def test_what_repeats_every_step_is_said_once_and_counted_into_the_report(caplog):
    """A padding collator's new length every step: the first derived plan is said, the next ones
    are logged at DEBUG and counted in the periodic report (46 lines for 12 padded steps before)."""
    model, reference = twins()
    lifecycle = lifecycle_of(model, log_every=4)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        run_pair(lifecycle, model, reference, [8, 8, 9, 10, 11, 12, 13, 14, 15, 17])
    said = [r.getMessage() for r in caplog.records]
    assert sum("derived from the profile" in m for m in said) == 1
    assert any(m.startswith("slackswap: since the last report: 4 x a plan derived for new shapes") for m in said)
    assert len(said) <= 10, said

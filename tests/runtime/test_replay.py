"""Replays: exact on the hard cases (random ops skipped before random ops, every generator in use,
state a layer writes into, ops returning None and ints), and the safety net: the first step under a
plan verifies every recomputed tensor, and a layer that does not replay exactly is demoted and
logged while the step's gradients stay exact."""

import logging
import random
import time

import numpy as np
import pytest
import torch
from torch import nn

import slackswap_ds as ss
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.runtime.replay import ReplayError

from exactness import assert_exact, profile, random_plan, run


def loss_step(model, x):
    loss = model(x)
    loss.backward()
    return loss


def changed_in_backward(state: dict, value):
    """A step that sets state["now"] to `value` between forward and backward (as a schedule or a flag
    might) and back after: a replay then runs with other state than forward did."""
    def step(model, x):
        loss = model(x)
        before, state["now"] = state["now"], value
        try:
            loss.backward()
        finally:
            state["now"] = before
        return loss
    return step


class Stack(nn.Module):
    """Layers in a ModuleList (the regions), a sum as the loss."""

    def __init__(self, make, n=3, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([make(width) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


class Pair(nn.Module):
    """Two linear maps around what a test layer does between them; `reset()` restores its state."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.reset()

    def reset(self) -> None:
        pass


def recompute_all(prof, **kw) -> Plan:
    return Plan.build(prof, {a.key: Decision.RECOMPUTE if a.recomputable else Decision.KEEP for a in prof.activations},
                      budget_bytes=prof.total_bytes, hardware_digest="any", planner="test", **kw)


# ---- random ops ---------------------------------------------------------------------------------
class TwoGenerators(Pair):
    """Dropout from the default generator, then a mask from the layer's own generator: a replay that
    skips the first (its output kept) must still draw the second mask exactly."""

    def reset(self) -> None:
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        h = nn.functional.dropout(self.a(x).tanh(), 0.3, self.training)
        mask = torch.bernoulli(torch.full_like(h, 0.7), generator=self.gen)
        return self.b(h * mask).sigmoid()


def test_random_ops_replay_with_the_state_each_generator_had_in_forward():
    model = Stack(TwoGenerators)
    x = torch.randn(4, 16)
    states = {}

    def rng_after(tag):
        states[tag] = (torch.get_rng_state(), [layer.gen.get_state() for layer in model.layers])

    def reset():
        _reset(model)

    reset()
    reference = run(model, loss_step, x)
    rng_after("reference")
    reset()
    prof = profile(model, loss_step, x)
    for seed in range(12):
        reset()
        got = run(model, loss_step, x, ss.apply(model, random_plan(prof, seed), prof, verify=False))
        assert_exact(got, reference)
        rng_after("plan")  # the replays put every generator back: the next step draws as without them
        assert torch.equal(states["plan"][0], states["reference"][0])
        assert all(torch.equal(a, b) for a, b in zip(states["plan"][1], states["reference"][1]))


class HostRandom(nn.Module):
    """Draws from Python's and NumPy's global generators in forward (stochastic depth, augmentation
    noise), values that reach the tensors as Python numbers."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        keep = 1.0 if random.random() > 0.3 else 0.5
        noise = float(np.random.rand())
        return x + keep * self.b(self.a(x).tanh() * (1 + noise))


def test_python_and_numpy_generators_replay_as_in_forward_and_are_given_back():
    """A replay runs the layer's Python code again: it draws from the states Python's and NumPy's
    global generators had at the call, and gives the job's back after, so that every plan's step is
    exact and the job's next draws are those of a run without SlackSwap (they advanced the
    generators, and the job differed from the verifying step on)."""
    model, x = Stack(HostRandom), torch.randn(4, 16)

    def seeded_run(executor=None):
        random.seed(3)
        np.random.seed(3)
        got = run(model, loss_step, x, executor)
        return got, (random.random(), float(np.random.rand()))

    reference, after = seeded_run()
    random.seed(3)
    np.random.seed(3)
    prof = profile(model, loss_step, x)
    for seed in range(8):
        got, after_plan = seeded_run(ss.apply(model, random_plan(prof, seed), prof))
        assert_exact(got, reference)
        assert after_plan == after


# ---- state a layer writes into --------------------------------------------------------------------
class Normed(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.BatchNorm1d(width)

    def forward(self, x):
        return self.norm(self.lin(x)).relu()


def test_a_replay_never_writes_running_statistics_twice():
    model = Stack(Normed)
    x = torch.randn(8, 16)
    prof = profile(model, loss_step, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    reference = run(model, loss_step, x)
    after_reference = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    ex = ss.apply(model, recompute_all(prof), prof)
    assert_exact(run(model, loss_step, x, ex), reference)
    assert ex.stats.last_step.ops_recomputed > 0 and ex.stats.last_step.verified is True
    for k, v in model.state_dict().items():  # running_mean, running_var, num_batches_tracked: once
        assert torch.equal(v, after_reference[k]), k


# ---- calls replayed whole (calls.py) ----------------------------------------------------------------
class Noisy(Pair):
    """Dropout, and Python's and NumPy's generators: a whole run from the call's states draws the same."""

    def forward(self, x):
        h = nn.functional.dropout(self.a(x).tanh(), 0.3, self.training)
        return self.b(h * (1 + random.random()) * (1 + float(np.random.rand()))).tanh()


class Averaging(Pair):
    """Keeps an average of its activations in a buffer, in place: a whole run would add to it again."""

    def reset(self) -> None:
        self.register_buffer("mean", torch.zeros(16))

    def forward(self, x):
        h = self.a(x).tanh()
        self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return self.b(h).tanh()


def _steps(kind, x, plan_for=None, n=4):
    """n steps of a new `Stack(kind)` (seeded: the same parameters and state every time), under the
    plan `plan_for(profile)` if given: per step the loss and gradients, the model's state after it,
    and the calls replayed whole; and the executor."""
    model = Stack(kind)
    ex = None
    if plan_for is not None:
        prof = profile(Stack(kind), loss_step, x)
        ex = ss.apply(model, plan_for(prof), prof)
    random.seed(3)
    np.random.seed(3)
    _reset(model)
    out = []
    for _ in range(n):
        got = run(model, loss_step, x, ex)
        out.append((got, {k: v.clone() for k, v in model.state_dict().items()},
                    ex.stats.last_step.whole_replays if ex is not None else 0))
    return out, ex


@pytest.mark.parametrize("kind, whole", [(Noisy, True), (TwoGenerators, False), (Averaging, False), (Normed, False)],
                         ids=["default-generators", "own-generator", "writes-a-buffer", "batch-norm"])
def test_a_full_recompute_replays_a_call_whole_once_a_recording_showed_it_exact(kind, whole):
    """From the second step on, a layer whose every op its plan re-runs is replayed whole, with no
    dispatch mode (as torch's checkpoint does), if the first step's recording showed that this is
    exact: only the default generators drawn from, no tensor written that the call did not make.
    A layer drawing from its own generator or writing into a buffer is replayed op by op on every
    step. Either way every step is exact and the model's state is the plain run's."""
    x = torch.randn(8, 16)
    reference, _ = _steps(kind, x)
    got, ex = _steps(kind, x, recompute_all)
    for step, ((a, state_a, n), (b, state_b, _)) in enumerate(zip(got, reference)):
        assert_exact(a, b)
        assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a), step
        assert n == (3 if whole and step > 0 else 0), step  # (3 layers)
    assert ex.stats.demotions == [] and ex.stats.last_step.fallbacks == {}
    assert ex.stats.last_step.ops_recomputed > 0 and ex.stats.last_step.unplanned_reruns == 0


class Repeats(Pair):
    """Repeats its activations REPEATS["now"] times: a global the loop may change between forward and backward."""

    def forward(self, x):
        h = torch.cat([self.a(x).tanh()] * REPEATS["now"], 0).sigmoid()
        return self.b(h[: x.shape[0]]).tanh()


REPEATS = {"now": 1}


def test_a_call_replayed_whole_that_saves_other_sizes_is_an_error_not_a_wrong_gradient():
    """Without verification, a layer whose replay saves another size than forward did (a global changed
    between forward and backward) raises a ReplayError when replayed whole too."""
    model = Stack(Repeats)
    x = torch.randn(4, 16)
    prof = profile(model, loss_step, x)
    ex = ss.apply(model, recompute_all(prof), prof, verify=False)
    for _ in range(2):
        assert_exact(run(model, loss_step, x, ex), run(model, loss_step, x))
    assert ex.stats.last_step.whole_replays == 3
    with pytest.raises(ReplayError, match="in a storage of"):
        run(model, changed_in_backward(REPEATS, 2), x, ex)


class Slow(Pair):
    def forward(self, x):
        time.sleep(0.03)  # (forward and every replay of it)
        return self.b(self.a(x).tanh()).tanh()


def test_the_hooks_host_time_is_counted_per_step_and_replays_are_not_in_it():
    """StepStats.hooks_host_s: the host time in the executor's saved-tensor hooks, what a GPU would wait
    on if the host fell behind; the replays run inside backward's unpacks, and their compute is not in it."""
    model, x = Stack(Slow), torch.randn(4, 16)
    prof = profile(model, loss_step, x)
    ex = ss.apply(model, recompute_all(prof), prof)
    for _ in range(2):  # (op by op, then whole)
        run(model, loss_step, x, ex)
        last = ex.stats.last_step
        assert last.ops_recomputed > 0 and 0 < last.hooks_host_s < 0.03, last.hooks_host_s


# ---- outputs that are not tensors ------------------------------------------------------------------
_lib = torch.library.Library("slackswap_test", "DEF")
_lib.define("ninefold(Tensor x, float p) -> (Tensor, Tensor, Tensor?, int, int, Tensor, SymInt, Tensor, Tensor)")


NINEFOLD_CALLS = [0]


def _ninefold(x, p):
    """Shaped like CUDA flash attention's result: output, logsumexp, None, ints, seed tensors."""
    NINEFOLD_CALLS[0] += 1
    return x.sin() * p, x.exp().sum(-1), None, 3, 4, torch.tensor(7.0), 5, torch.tensor(11.0), torch.empty(0)


_lib.impl("ninefold", _ninefold, "CPU")


def _ninefold_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.p = inputs[1]


def _ninefold_backward(ctx, g_out, *rest):
    (x,) = ctx.saved_tensors
    return g_out * x.cos() * ctx.p, None


torch.library.register_autograd("slackswap_test::ninefold", _ninefold_backward, setup_context=_ninefold_setup)


class Ninefold(Pair):
    def forward(self, x):
        out, lse, nothing, three, four, seven, five, eleven, empty = torch.ops.slackswap_test.ninefold(self.a(x), 2.0)
        # every tensor of the result is saved below (or empty): a replay may skip the op, and must
        # then hand back each value at its place
        assert nothing is None and (three, four, five) == (3, 4, 5) and empty.numel() == 0
        h = out * lse.unsqueeze(-1) * seven * eleven
        return self.b(h.tanh() + three).tanh()


def test_ops_returning_none_and_ints_replay_with_their_whole_result():
    model = Stack(Ninefold)
    x = torch.randn(4, 16)
    reference = run(model, loss_step, x)
    prof = profile(model, loss_step, x)
    plans = [recompute_all(prof)] + [random_plan(prof, seed) for seed in range(8)]
    for plan in plans:
        ex = ss.apply(model, plan, prof)
        assert_exact(run(model, loss_step, x, ex), reference)
        assert_exact(run(model, loss_step, x, ex), reference)
    # a plan that recomputes only what follows the op in each layer: the replays skip it
    late = {a.key: Decision.RECOMPUTE if a.recomputable and "ninefold" not in
            {prof.ops[p].key.rsplit(":", 1)[-1] for p in a.producers} else Decision.KEEP for a in prof.activations}
    plan = Plan.build(prof, late, budget_bytes=prof.total_bytes, hardware_digest="any", planner="test")
    assert plan.keys(Decision.RECOMPUTE)
    ex = ss.apply(model, plan, prof)
    NINEFOLD_CALLS[0] = 0
    assert_exact(run(model, loss_step, x, ex), reference)
    assert ex.stats.last_step.ops_recomputed > 0 and NINEFOLD_CALLS[0] == len(model.layers)  # forward only


# ---- the safety net --------------------------------------------------------------------------------
class PythonNoise(Pair):
    """Draws from Python's `random`, which no replay can restore: not replayable."""

    def reset(self) -> None:
        self.rng = random.Random(0)

    def forward(self, x):
        return self.b(self.a(x).tanh() * (1 + self.rng.random())).tanh()


class Counting(Pair):
    """Mutates Python state in forward and lets it change its output: not replayable."""

    def reset(self) -> None:
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.a(x).tanh() * self.calls).tanh()


class Once(Pair):
    """Refuses a second call per step: its replay fails."""

    def reset(self) -> None:
        self.armed = True

    def forward(self, x):
        if not self.armed:
            raise RuntimeError("called twice")
        self.armed = False
        return self.b(self.a(x).tanh()).tanh()


def _reset(model):
    for layer in model.layers:
        getattr(layer, "reset", lambda: None)()


@pytest.mark.parametrize("kind, reason", [(PythonNoise, "values differ"), (Counting, "values differ"),
                                          (Once, "replay failed: RuntimeError: called twice")])
def test_a_layer_that_does_not_replay_is_demoted_logged_and_the_step_stays_exact(kind, reason, caplog):
    model = Stack(kind)
    x = torch.randn(4, 16)
    _reset(model)
    reference = run(model, loss_step, x)
    _reset(model)
    prof = profile(model, loss_step, x)
    plan = recompute_all(prof)
    recomputed = plan.keys(Decision.RECOMPUTE)
    assert recomputed
    ex = ss.apply(model, plan, prof)
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        _reset(model)
        assert_exact(run(model, loss_step, x, ex), reference)  # the verifying step: originals used
    first = ex.stats.last_step
    assert first.verified is False and set(first.demoted) <= set(recomputed) and first.demoted
    assert all(why.startswith(reason) for why in first.demoted.values())
    lines = [r.getMessage() for r in caplog.records if "did not replay exactly" in r.getMessage()]
    assert len(lines) == 1 and reason.split(":")[0] in lines[0]
    # re-planned: the demoted tensors are never recomputed again, the next steps are exact
    assert ex.plan.digest != plan.digest and not set(first.demoted) & set(ex.plan.keys(Decision.RECOMPUTE))
    assert ex.stats.demotions == [first.demoted]
    for _ in range(2):
        _reset(model)
        assert_exact(run(model, loss_step, x, ex), reference)
        assert ex.stats.last_step.fallbacks == {}


def test_without_verification_a_replay_that_cannot_match_is_an_error_not_a_wrong_gradient():
    class Growing(Pair):  # a replay sees another shape than forward did
        def reset(self) -> None:
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            h = self.a(x).tanh()
            h = torch.cat([h] * (1 + self.calls % 2), 0)[: x.shape[0] * (1 + self.calls % 2)]
            return self.b(h[: x.shape[0]] * 2).tanh()

    model = Stack(Growing)
    x = torch.randn(4, 16)
    prof = profile(model, loss_step, x)
    ex = ss.apply(model, recompute_all(prof), prof, verify=False)
    _reset(model)
    with pytest.raises(ReplayError, match="diverged from forward|made nothing|forward made"):
        run(model, loss_step, x, ex)


# ---- the replay contract, checked again ------------------------------------------------------------
class ReadsAGlobal(Pair):
    """Reads module-level state that the loop changes between forward and backward from some step on:
    it keeps the replay contract on the first step and breaks it later."""

    def forward(self, x):
        return self.b(self.a(x).tanh() * SCALE["now"]).tanh()


SCALE = {"now": 1.0}


contract_broken_step = changed_in_backward(SCALE, 2.0)


@pytest.mark.parametrize("again", [False, True], ids=["first-step-only", "verify-again"])
def test_a_layer_that_breaks_the_replay_contract_later_is_caught_when_verified_again(again, caplog):
    model = Stack(ReadsAGlobal)
    x = torch.randn(4, 16)
    prof = profile(model, loss_step, x)
    plan = recompute_all(prof)
    ex = ss.apply(model, plan, prof)
    for _ in range(2):  # the contract holds: the first step verifies, the second runs the plan
        assert_exact(run(model, loss_step, x, ex), run(model, loss_step, x))
    assert ex.stats.last_step.verified is None and ex.stats.demotions == []
    reference = run(model, contract_broken_step, x)  # autograd keeps forward's tensors: exact
    if again:
        assert ex.verify_again() is True
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        got = run(model, contract_broken_step, x, ex)
    if not again:
        # the documented limit: between two checks a layer that breaks the contract gets wrong gradients
        with pytest.raises(AssertionError, match="gradients differ"):
            assert_exact(got, reference)
        return
    assert_exact(got, reference)  # the verifying step hands backward forward's bytes
    assert ex.stats.last_step.verified is False and ex.stats.last_step.demoted
    assert any("did not replay exactly" in r.getMessage() for r in caplog.records)
    assert not set(ex.stats.last_step.demoted) & set(ex.plan.keys(Decision.RECOMPUTE))
    assert_exact(run(model, contract_broken_step, x, ex), reference)  # demoted: exact from now on


class SwitchesActivation(Pair):
    """Takes another code path (sigmoid for tanh) while SWITCHED is on: none of its saved tensors
    then has a name the plan knows, so they are all kept and nothing is recomputed."""

    def forward(self, x):
        act = torch.sigmoid if SWITCHED["on"] else torch.tanh
        return act(self.b(act(self.a(x))))


SWITCHED = {"on": False}


def test_a_verifying_step_that_compared_nothing_is_no_verdict_and_the_next_step_verifies():
    model = Stack(SwitchesActivation)
    x = torch.randn(4, 16)
    prof = profile(model, loss_step, x)
    ex = ss.apply(model, recompute_all(prof), prof)
    SWITCHED["on"] = True
    try:
        assert_exact(run(model, loss_step, x, ex), run(model, loss_step, x))
    finally:
        SWITCHED["on"] = False
    first = ex.stats.last_step
    assert first.fallbacks and first.ops_recomputed == 0  # every save kept: no replay to compare
    assert first.verified is None  # it used to pass, vacuously
    assert_exact(run(model, loss_step, x, ex), run(model, loss_step, x))
    assert ex.stats.last_step.verified is True and ex.stats.last_step.ops_recomputed > 0
    assert_exact(run(model, loss_step, x, ex), run(model, loss_step, x))
    assert ex.stats.last_step.verified is None  # verified once: the plan's steps run plainly again

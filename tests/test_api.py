"""The plain-PyTorch API (api.py): `ss.apply` runs a planner's `Planned` on the schedule the planner
lowered, so that a plan is lowered and simulated once from the planner to the executor; a bare
`Plan` is lowered by `ss.apply` itself; the default re-plan after a demotion is the planner's."""

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds import api
from slackswap_ds.hardware import load_hardware
from slackswap_ds.planners import get_planner
from slackswap_ds.runtime.executor import executor_for
from slackswap_ds.runtime.verify import swap_instead
from slackswap_ds.shares import PRIVATE

from runtime.exactness import assert_exact, run  # (tests/runtime/exactness.py: one step's loss and gradients)

transformers = pytest.importorskip("transformers")


def tiny_gpt2():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def test_a_planned_plan_is_lowered_and_simulated_once_from_the_planner_to_the_executor(plan_counts):
    model, ids = tiny_gpt2(), torch.randint(1, 128, (2, 16))
    profile = ss.profile_step(model, step, ids, warmup=0)
    counts = plan_counts
    planned = get_planner("slackswap")(profile, load_hardware("a100-80g-pcie4"), profile.total_bytes // 2, PRIVATE)
    digest = planned.plan.digest
    assert (counts.lowered[digest], counts.simulated[digest]) == (1, 1)  # the planner's own, kept in `planned`
    executor = ss.apply(model, planned, profile)
    assert executor.plan == planned.plan
    assert (counts.lowered[digest], counts.simulated[digest]) == (1, 1)  # ss.apply added none
    assert_exact(run(model, step, ids, executor), run(model, step, ids))
    assert executor.stats.last_step.peak_device_bytes > 0


def test_a_bare_plan_is_lowered_by_apply(plan_counts):
    model, ids = tiny_gpt2(), torch.randint(1, 128, (2, 16))
    profile = ss.profile_step(model, step, ids, warmup=0)
    plan = ss.plan(profile, "a100-80g-pcie4", 0.5)
    counts = plan_counts
    counts.lowered.clear()
    counts.simulated.clear()
    ss.apply(model, plan, profile)
    assert counts.lowered[plan.digest] == 1 and counts.simulated[plan.digest] == 0


def test_the_default_re_plan_is_the_planners_and_the_runtimes_own_swaps_instead():
    model, ids = tiny_gpt2(), torch.randint(1, 128, (2, 16))
    profile = ss.profile_step(model, step, ids, warmup=0)
    plan = ss.plan(profile, "a100-80g-pcie4", 0.5)
    assert ss.apply(model, plan, profile).replan is api.replan_without
    assert executor_for(model, plan, profile).replan is swap_instead


def test_re_planning_without_the_failed_keys_keeps_them_from_being_recomputed():
    model, ids = tiny_gpt2(), torch.randint(1, 128, (2, 16))
    profile = ss.profile_step(model, step, ids, warmup=0)
    plan = ss.plan(profile, "a100-80g-pcie4", 1.0, planner="full-recompute")
    failed = {k: "test" for k in plan.keys(ss.Decision.RECOMPUTE)[:2]}
    pinned, replanned = api.replan_without(profile, plan, failed)
    assert replanned.planner == plan.planner and replanned.budget_bytes == plan.budget_bytes
    assert all(replanned.decision[k] is not ss.Decision.RECOMPUTE for k in failed)


@pytest.mark.parametrize("verify_every, checked", [(3, [True, None, None, False, True]), (0, [True, None, None, None, None])])
def test_apply_checks_the_replay_contract_again_every_verify_every_steps(verify_every, checked):
    """A layer reads a global that, from the fourth step on, changes between its forward and its
    backward (it breaks the replay contract): with verify_every 3 the fourth step checks the plan's
    recomputes again, demotes that layer, and the re-planned plan's first step checks what is left;
    with 0 only the first step checks, and the broken layer trains on unchecked."""
    scale = {"now": 1.0}

    class ReadsAGlobal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.b(self.a(x).tanh() * scale["now"]).tanh()

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(ReadsAGlobal() for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.square().mean()

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(8, 32)
    profile = ss.profile_step(model, lambda m, b: m(b).backward(), x, warmup=0)
    plan = ss.plan(profile, "a100-80g-pcie4", 0.8, planner="full-recompute")
    verdicts = []
    with ss.apply(model, plan, profile, verify_every=verify_every) as stats:
        for step_number in range(1, 6):
            loss = model(x)  # (the step before closes here: its counters are stats.last_step)
            if step_number > 1:
                verdicts.append(stats.last_step.verified)
            scale["now"] = 2.0 if step_number >= 4 else 1.0
            loss.backward()
            scale["now"] = 1.0
    verdicts.append(stats.last_step.verified)
    assert verdicts == checked
    assert len(stats.demotions) == (1 if verify_every else 0)

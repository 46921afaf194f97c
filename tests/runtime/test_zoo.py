"""Every architecture of the zoo, fp32 and bf16, dropout on: the planner's plans at 0.5 and 0.75
(both must be feasible), full recompute and 20 seeded random plans give the unmodified model's
loss and every gradient bit for bit, on the verifying first step and on the next one, within the
budget (and never above the simulator's prediction), with no fallback, no op re-run that the
Schedule did not list, and no demotion. The profiled step itself stays within the 0.5 budget."""

import pytest
import torch

import slackswap_ds as ss

from exactness import assert_exact, assert_peak_as_predicted, profile, random_plan, run, without_caches

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)

RANDOM_PLANS = 20


@pytest.fixture(autouse=True, scope="module")
def quiet_transformers():
    transformers.logging.set_verbosity_error()


def test_the_zoo_covers_the_families_the_runtime_must_handle():
    traits = {t for case in zoo.ZOO.values() for t in case.traits}
    families = [case.family for case in zoo.ZOO.values()]
    assert len(zoo.ZOO) >= 14
    assert {"alibi", "parallel-attn", "eager", "sdpa", "shared-layers", "moe", "cross-attention"} <= traits
    assert families.count("encoder-decoder") >= 2 and "t5" in zoo.ZOO
    assert families.count("moe") >= 2 and "mixtral" in zoo.ZOO
    assert "dense-first" in traits and "deepseek-v3" in zoo.ZOO  # issue 19
    assert families.count("decoder") >= 3 and families.count("encoder") >= 3


# (bf16: slow, for suite time; fp32 runs every family here, bf16 with `-m slow`)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_every_plan_is_exact_and_within_budget(name, dtype):
    model, batch = zoo.ZOO[name].build(dtype)
    without_caches(model)
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    plans = {f"slackswap@{b}": ss.plan(prof, "a100-80g-pcie4", b) for b in (0.5, 0.75)}
    plans["full-recompute"] = ss.plan(prof, "a100-80g-pcie4", 1.0, planner="full-recompute")
    plans.update({f"random {seed}": random_plan(prof, seed) for seed in range(RANDOM_PLANS)})
    assert int(dict(prof.meta)["profiled_peak_bytes"]) <= plans["slackswap@0.5"].budget_bytes
    for label, plan in plans.items():
        ex = ss.apply(model, plan, prof)
        first = run(model, zoo.step, batch, ex)
        verified = ex.stats.last_step
        second = run(model, zoo.step, batch, ex)
        last = ex.stats.last_step
        assert_exact(first, reference)
        assert_exact(second, reference)
        assert_peak_as_predicted(last.peak_device_bytes, prof, plan)
        assert last.resized == 0, label  # every saved storage has the profile's size
        assert verified.fallbacks == {} and last.fallbacks == {}, (label, verified.fallbacks)
        assert last.unplanned_reruns == 0 and ex.stats.demotions == [], label
        assert verified.verified in (True, None) and last.verified is None, label

"""Every kind of plan under ZeRO-1 and ZeRO-3, through launch/train.py on 2 CPU ranks, 12 steps each
(one launch: tests/launch/in_turn.py): budgets 0.3, 0.4 and 0.5, the full-recompute planner and
seeded random plans (tests/launch/train_random.py). Losses and final parameters equal the job
without SlackSwap; every planned step within its budget, the warm-up ones too; no error. Under
ZeRO-3 plans keep or swap, never recompute (a replay would re-run ZeRO-3's parameter gathers on
one rank alone): a full-recompute planner falls back to one that can plan without recompute.

The same matrix through Hugging Face's Trainer, every rank on its own lengths every step
(tests/adoption/hf_padding.py), is marked slow (about 6 minutes: `python -m pytest -m slow`)."""

import json
import re

import pytest

from jobs import ROOT, assert_own_lengths_exact, launch_in_turn, sharing
from test_run import HF, SLACKSWAP

pytest.importorskip("deepspeed")

STEPS = 12  # 2 warm-up, 1 profiled, then 9 planned: the first of them verifies the plan
PLANS = [("0.3", {"activation_budget": 0.3}), ("0.4", {"activation_budget": 0.4}), ("0.5", {"activation_budget": 0.5}),
         ("full", {"activation_budget": 0.5, "planner": "full-recompute"}),
         ("random1", {"activation_budget": 1.0, "planner": "random-1"}),
         ("random2", {"activation_budget": 1.0, "planner": "random-2"})]
STAGES = (1, 2, 3)  # the slow matrix through the HF Trainer
# the matrix through launch/train.py: ZeRO-2's plans see what ZeRO-1's do (activations are not sharded
# below ZeRO-3), so for suite time ZeRO-2 runs here only in tests/test_engine.py's stages job, and in
# the slow matrix
FAST_STAGES = (1, 3)


def config(stage: int, slackswap: dict | None) -> dict:
    config = json.loads((ROOT / "configs" / "slackswap.json").read_text())
    config["zero_optimization"] = {"stage": stage}
    config["slackswap"].update(slackswap or {"enabled": False})
    return config


@pytest.fixture(scope="module")
def zero_plans_job(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("zero_plans")
    runs = []
    for stage in FAST_STAGES:
        for name, slackswap in [("off", None), *PLANS]:
            run = f"{name}-z{stage}"
            (tmp / f"{run}.json").write_text(json.dumps(config(stage, slackswap)))
            runs.append([run, ["--deepspeed_config", str(tmp / f"{run}.json"), "--steps", str(STEPS), "--layers", "2",
                               "--hidden", "64", "--seq", "32", "--vocab", "128",
                               "--losses", str(tmp / f"{run}.losses.json"), "--params", str(tmp / f"{run}.params")]])
    logs = launch_in_turn(2, ROOT / "tests" / "launch" / "train_random.py", runs, tmp, timeout=1500)
    return {run: (json.loads((tmp / f"{run}.losses.json").read_text()), (tmp / f"{run}.params").read_text(),
                  logs[run]) for run, _ in runs}


@sharing("zero_plans_job")
@pytest.mark.parametrize("stage", FAST_STAGES)
@pytest.mark.parametrize("plan", [name for name, _ in PLANS])
def test_every_plan_is_exact_and_within_budget_under_zero(zero_plans_job, stage, plan):
    losses, params, log = zero_plans_job[f"{plan}-z{stage}"]
    losses_off, params_off, _ = zero_plans_job[f"off-z{stage}"]
    assert len(losses) == STEPS and losses == losses_off and params == params_off
    assert "Traceback" not in log and "ReplayError" not in log
    measured = [(float(a), float(b)) for a, b in re.findall(r"activations\s+([\d.]+) MiB / budget ([\d.]+) MiB", log)]
    assert len(measured) == STEPS - 3 and all(a <= b for a, b in measured), measured  # 2 warm-up, 1 profiled
    warm_up = [float(a) for a in re.findall(r"activations\s+([\d.]+) MiB on the device \(warm-up", log)]
    assert len(warm_up) == 2 and all(a <= measured[0][1] for a in warm_up)
    recomputed = [float(a) for a in re.findall(r"recomputed ([\d.]+)\)", log)]
    if stage == 3:
        assert not any(recomputed) and "never recompute them" in log
        if plan == "full":
            assert "using offload-all instead" in log
    elif plan in ("full", "random1", "random2"):
        assert any(recomputed), plan  # the plan recomputes (it is not only keep and swap)


# ---- the same through the HF Trainer, every rank on its own lengths (slow) ------------------------
@pytest.fixture(scope="module")
def hf_zero_plans_job(tmp_path_factory) -> dict:
    """tests/adoption/hf_padding.py (unmodified, through `python -m slackswap_ds.run`) for every
    stage and plan, and without SlackSwap: one launch on 2 CPU ranks."""
    tmp = tmp_path_factory.mktemp("hf_zero_plans")
    runs = []
    for stage in STAGES:
        for name, slackswap in [("off", {"enabled": False}), *PLANS]:
            run = f"{name}-z{stage}"
            config = {**HF, "zero_optimization": {"stage": stage}, "slackswap": {**SLACKSWAP, **slackswap}}
            (tmp / f"{run}.json").write_text(json.dumps(config))
            runs.append([run, ["--deepspeed_config", str(tmp / f"{run}.json"), "--losses", str(tmp / f"{run}.losses")]])
    logs = launch_in_turn(2, ROOT / "tests" / "launch" / "hf_padding_random.py", runs, tmp, timeout=1500, unmodified=True)
    return {run: (json.loads((tmp / f"{run}.losses").read_text()),
                  [json.loads((tmp / f"{run}.losses.rank{r}").read_text()) for r in range(2)], logs[run])
            for run, _ in runs}


@pytest.mark.slow
@sharing("hf_zero_plans_job")
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("plan", [name for name, _ in PLANS])
def test_every_plan_is_exact_and_within_budget_under_zero_through_the_hf_trainer(hf_zero_plans_job, stage, plan):
    losses, ranks, log = hf_zero_plans_job[f"{plan}-z{stage}"]
    losses_off, ranks_off, _ = hf_zero_plans_job[f"off-z{stage}"]
    assert_own_lengths_exact(losses, log, ranks, losses_off, ranks_off)
    recomputes = re.search(r"recompute [1-9][\d,]* B", log)
    if stage == 3:
        assert not recomputes and "never recompute them" in log
    elif plan in ("full", "random1", "random2"):
        assert recomputes, plan  # the plan recomputes (it is not only keep and swap)

"""Every kind of plan under ZeRO-1 and ZeRO-3, through launch/train.py on CPU ranks, 12 steps each
(one launch per rank count: tests/launch/in_turn.py): budgets, the full-recompute planner and seeded
random plans (tests/launch/train_random.py). Losses and final parameters equal the job without
SlackSwap; every planned step within its budget, the warm-up ones too; no error.

Under ZeRO-3 plans recompute too (issue 36): each layer is gathered whole by ZeRO-3, on every rank at
the same point, and a replay runs inside its layer's backward with ZeRO-3's hooks paused, so that it
issues no collective of its own (deepspeed_api.gather_layers_whole). ZeRO-3 runs at budgets 0.2 / 0.4 on 8
layers (a layer's saved bytes are a tenth of the step's: a plan that recomputes whole layers fits 0.2),
with small prefetch buckets and live-parameter limits (full recompute), and with `offload_param` to the
CPU (a random plan); both plans in each variant on 4 ranks are marked slow. ZeRO-1 runs at budgets 0.3 /
0.4 on 2 layers (0.5: tests/test_engine.py's stages job); ZeRO-3 at 0.3 and ZeRO-1 at 0.5 run in the slow
HF Trainer matrix below.
The case that once died, a recomputing plan under ZeRO-3 (its replay diverged from forward on ZeRO-3's
gathers, the step went over budget, then an uncaught ReplayError), is every recomputing ZeRO-3 run here.

The same matrix through Hugging Face's Trainer, every rank on its own lengths every step
(tests/adoption/hf_padding.py), is marked slow (about 6 minutes: `python -m pytest -m slow`)."""

import json
import re

import pytest

from jobs import ROOT, assert_own_lengths_exact, launch_in_turn, sharing
from test_run import HF, SLACKSWAP

pytest.importorskip("deepspeed")

STEPS = 12  # 2 warm-up, 1 profiled, then 9 planned: the first of them verifies the plan
RANDOM = [("full", {"activation_budget": 0.5, "planner": "full-recompute"}),
          ("random1", {"activation_budget": 1.0, "planner": "random-1"}),
          ("random2", {"activation_budget": 1.0, "planner": "random-2"})]
PLANS = [("0.3", {"activation_budget": 0.3}), ("0.4", {"activation_budget": 0.4}), ("0.5", {"activation_budget": 0.5}),
         *RANDOM]  # (the HF Trainer matrix's too)
ZERO3_PLANS = [("0.2", {"activation_budget": 0.2}), ("0.3", {"activation_budget": 0.3}),
               ("0.4", {"activation_budget": 0.4}), *RANDOM]
# ZeRO-3 as users tune it: prefetch buckets and live parameters far below a layer's (every gather
# waits, nothing is prefetched), no persistent parameters; and the parameters offloaded to the CPU
ZERO3_VARIANTS = {"small": {"stage3_prefetch_bucket_size": 100, "stage3_max_live_parameters": 1000,
                            "stage3_param_persistence_threshold": 0},
                  "offload": {"offload_param": {"device": "cpu"}}}
STAGES = (1, 2, 3)  # the slow matrix through the HF Trainer
LAYERS = {1: "2", 3: "8"}
COMMON = ["--hidden", "64", "--seq", "32", "--vocab", "128"]


def config(stage: int, slackswap: dict | None, zero: dict | None = None) -> dict:
    config = json.loads((ROOT / "configs" / "slackswap.json").read_text())
    config["zero_optimization"] = {"stage": stage, **(zero or {})}
    config["slackswap"].update(slackswap or {"enabled": False})
    return config


def matrix(ranks: int) -> list[tuple[str, int, dict | None, dict, str]]:
    """(run, stage, slackswap, ZeRO options, layers) of the launch on `ranks` ranks; every variant has
    an "off" run."""
    runs = []
    if ranks == 2:  # ZeRO-2's plans see what ZeRO-1's do (activations are not sharded below ZeRO-3): for
        # suite time it runs in tests/test_engine.py's stages job and in the slow matrix only; so do
        # ZeRO-1 at 0.5 (the stages job's budget) and ZeRO-3 at 0.3 (between 0.2 and 0.4)
        runs += [(f"{name}-z1", 1, ss, {}, LAYERS[1]) for name, ss in [("off", None), *PLANS] if name != "0.5"]
        runs += [(f"{name}-z3", 3, ss, {}, LAYERS[3]) for name, ss in [("off", None), *ZERO3_PLANS] if name != "0.3"]
        # ZeRO-3's model under ZeRO-1, to compare its saved bytes with (no check of its own)
        runs += [("keepall-z1", 1, ZERO3_PLANS[0][1], {}, LAYERS[3])]
    variants = ZERO3_VARIANTS if ranks == 2 else {"": {}, **ZERO3_VARIANTS}
    for i, (variant, zero) in enumerate(variants.items()):
        suffix = f"-z3{variant and '-' + variant}"
        # on 2 ranks each variant runs one recomputing plan (full recompute, a random plan in turn); on 4 both
        plans = RANDOM[:2] if ranks == 4 else RANDOM[i % 2:i % 2 + 1]
        runs += [(f"{name}{suffix}", 3, ss, zero, LAYERS[3]) for name, ss in [("off", None), *plans]]
    return runs


def launch(ranks: int, tmp) -> dict:
    runs = []
    for run, stage, slackswap, zero, layers in matrix(ranks):
        (tmp / f"{run}.json").write_text(json.dumps(config(stage, slackswap, zero)))
        runs.append([run, ["--deepspeed_config", str(tmp / f"{run}.json"), "--steps", str(STEPS), "--layers", layers,
                           *COMMON, "--losses", str(tmp / f"{run}.losses.json"), "--params", str(tmp / f"{run}.params")]])
    logs = launch_in_turn(ranks, ROOT / "tests" / "launch" / "train_random.py", runs, tmp, timeout=1500)
    return {run: (json.loads((tmp / f"{run}.losses.json").read_text()), (tmp / f"{run}.params").read_text(),
                  logs[run]) for run, _ in runs}


@pytest.fixture(scope="module")
def zero_plans_job(tmp_path_factory) -> dict:
    return launch(2, tmp_path_factory.mktemp("zero_plans"))


@pytest.fixture(scope="module")
def zero_plans_job_4(tmp_path_factory) -> dict:
    return launch(4, tmp_path_factory.mktemp("zero_plans_4"))


def check(job: dict, run: str) -> None:
    """`run` of a launch: exact against its variant's "off" run, within budget from step one, and,
    with a recomputing planner, recomputing (under ZeRO-3 too)."""
    name, rest = run.split("-", 1)
    losses, params, log = job[run]
    losses_off, params_off, _ = job[f"off-{rest}"]
    assert len(losses) == STEPS and losses == losses_off and params == params_off
    assert "Traceback" not in log and "ReplayError" not in log and "did not replay exactly" not in log
    measured = [(float(a), float(b)) for a, b in re.findall(r"activations\s+([\d.]+) MiB / budget ([\d.]+) MiB", log)]
    assert len(measured) == STEPS - 3 and all(a <= b for a, b in measured), measured  # 2 warm-up, 1 profiled
    warm_up = [float(a) for a in re.findall(r"activations\s+([\d.]+) MiB on the device \(warm-up", log)]
    assert len(warm_up) == 2 and all(a <= measured[0][1] for a in warm_up)
    recomputed = [float(a) for a in re.findall(r"recomputed ([\d.]+)\)", log)]
    if name in ("full", "random1", "random2") or rest.startswith("z3") and name == "0.2":
        assert all(recomputed), (run, recomputed)  # the plan recomputes (it is not only keep and swap)
    if rest.startswith("z3"):
        assert "gathers each of the model's" in log and "found no plan" not in log


@sharing("zero_plans_job")
@pytest.mark.parametrize("run", [run for run, *_ in matrix(2) if not run.startswith(("off", "keepall"))])
def test_every_plan_is_exact_and_within_budget_under_zero(zero_plans_job, run):
    check(zero_plans_job, run)


@sharing("zero_plans_job")
def test_zero3_gathered_parameters_are_not_counted_as_saved_activations(zero_plans_job):
    # every linear layer saves its weight for backward; under ZeRO-3 that is a storage ZeRO-3 gathered
    # and frees after the layer (a parameter, executor.py's `_is_parameter`), not an activation: the
    # step's saved bytes, and so its budget, are those of the same model under ZeRO-1
    def keep_all(log: str) -> tuple[int, int]:
        budget, total = re.search(r"budget ([\d,]+) B of ([\d,]+) B keep-all", log).groups()
        return int(budget.replace(",", "")), int(total.replace(",", ""))

    z1, z3 = keep_all(zero_plans_job["keepall-z1"][2]), keep_all(zero_plans_job["0.2-z3"][2])
    assert z1 == z3 and z3[1] > 0
    peaks = [int(p.replace(",", "")) for p in re.findall(r"peak of saved activations ([\d,]+) B \(predicted",
                                                          zero_plans_job["0.2-z3"][2])]
    assert peaks and all(0 < p <= z3[0] for p in peaks)  # measured: under the budget, gathers beside it


@pytest.mark.slow
@sharing("zero_plans_job_4")
@pytest.mark.parametrize("run", [run for run, *_ in matrix(4) if not run.startswith("off")])
def test_every_plan_is_exact_and_within_budget_under_zero3_on_4_ranks(zero_plans_job_4, run):
    check(zero_plans_job_4, run)


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
    if plan in ("full", "random1", "random2"):  # the plan recomputes (it is not only keep and swap), under
        assert re.search(r"recompute [1-9][\d,]* B", log), plan  # ZeRO-3 too

"""ss.initialize under the real DeepSpeed launcher on CPU (2 ranks, loopback only), and the
runtime's lifecycle in process (one rank, no launcher)."""

import functools
import json
import re

import pytest

from slackswap_ds.config import load_config
from slackswap_ds.engine import EngineHooks
from slackswap_ds.errors import InvalidFileError, PlanError
from slackswap_ds.plan import Decision

from jobs import ROOT, launch_in_turn, sharing

pytest.importorskip("deepspeed")


def base_config(stage: int) -> dict:
    config = json.loads((ROOT / "configs" / "slackswap.json").read_text())
    config["zero_optimization"] = {"stage": stage}
    return config


# (stage, steps); ZeRO-2 shards what ZeRO-1 does plus gradients, not activations: for suite time its
# runs are in the slow matrices (test_zero_plans.py's HF Trainer one, test_run.py's own lengths)
ZERO_STAGES = [(0, 10), (1, 6), (3, 6)]


def zero_stage_config(stage: int, enabled: bool) -> dict:
    config = base_config(stage)
    # at 50% (the main job's 40% recomputes and packs: tests/test_launch.py runs it; for suite time this
    # matrix keeps the plans that swap and keep)
    config["slackswap"]["activation_budget"] = 0.5
    if stage == 1:  # the two ranks as a DGX A100's GPUs 0 and 1: behind one switch, sharing its uplink
        config["slackswap"].update(node="dgx-a100", host_pool_bytes_per_node="1GiB")
    config["slackswap"]["enabled"] = enabled
    return config


@pytest.fixture(scope="module")
def zero_stages_job(tmp_path_factory) -> dict[str, tuple[list[float], str]]:
    """launch/train.py under every ZeRO stage, disabled and enabled, then twice with a plan_file, in
    one 2-rank launch (tests/launch/in_turn.py: each run is train.py's main, a fresh model from its
    seed): the losses and the output of each run, by name ("off0".."off3", "on0".."on3", "file1",
    "file2"), and the job's folder ("tmp"). The disabled runs come first: the references are trained
    in processes where SlackSwap has not yet run."""
    tmp = tmp_path_factory.mktemp("zero_stages")
    runs = []

    def add(name: str, config: dict, steps: int) -> None:
        (tmp / f"{name}.json").write_text(json.dumps(config))
        runs.append([name, ["--deepspeed_config", str(tmp / f"{name}.json"), "--steps", str(steps),
                            "--losses", str(tmp / f"{name}.losses.json")]])

    for enabled in (False, True):
        for stage, steps in ZERO_STAGES:
            add(f"{'on' if enabled else 'off'}{stage}", zero_stage_config(stage, enabled), steps)
    # each block compiled with inductor (8 layers: a compiled block's backward reads all its saved
    # tensors at once), disabled then enabled
    for enabled in (False, True):
        config = base_config(0)
        config["slackswap"].update(enabled=enabled, activation_budget=0.6)
        add(f"blocks-{'on' if enabled else 'off'}", config, 5)
        runs[-1][1] += ["--compile-blocks", "inductor", "--layers", "8"]
    # the whole model compiled by engine.compile() (aot_eager: per block it computes the same numbers)
    for enabled in (False, True):
        config = base_config(0)
        config["slackswap"].update(enabled=enabled, activation_budget=0.6)
        add(f"whole-{'on' if enabled else 'off'}", config, 5)
        runs[-1][1] += ["--compile-model", "aot_eager", "--layers", "8"]
    # R-Drop: two training forwards before one backward (tests/test_lifecycle.py has it in process)
    for enabled in (False, True):
        config = base_config(0)
        config["slackswap"]["enabled"] = enabled
        add(f"rdrop-{'on' if enabled else 'off'}", config, 6)
        runs[-1][1] += ["--rdrop"]
    # then a job that writes its plan_file, and one that finds it (each its own trace_file)
    for name, steps in (("file1", 5), ("file2", 4)):
        config = base_config(0)
        config["slackswap"].update(plan_file=str(tmp / "plan.json"), trace_file=str(tmp / f"{name}.trace.json"))
        add(name, config, steps)
    logs = launch_in_turn(2, ROOT / "launch" / "train.py", runs, tmp)
    return {name: (json.loads((tmp / f"{name}.losses.json").read_text()), logs[name]) for name, _ in runs} | {
        "tmp": tmp}


@sharing("zero_stages_job")
@pytest.mark.parametrize("stage, steps", ZERO_STAGES)
def test_losses_equal_the_disabled_run_and_activations_stay_in_budget(zero_stages_job, stage, steps):
    losses_on, log_on = zero_stages_job[f"on{stage}"]
    losses_off, log_off = zero_stages_job[f"off{stage}"]
    assert len(losses_on) == steps and losses_on == losses_off
    # one plan line for the job (rank 0's: the ranks' shares are equal, so rank 1 has nothing to add),
    # agreed by both ranks over torch.distributed (no MPI launcher)
    plans = re.findall(r"slackswap rank (\d): .* plan ([0-9a-f]{12}) agreed over torch.distributed by 2 ranks", log_on)
    assert [r for r, _ in plans] == ["0"] and "slackswap rank 1" not in log_on
    shares = re.findall(r"link share D2H ([\d.]+) / H2D ([\d.]+) GB/s", log_on)
    assert shares == [("12.5", "12.5")] if stage == 1 else len(shares) == 1
    assert log_on.count("profiling a step of input shapes") == 1
    measured = [(float(a), float(b)) for a, b in re.findall(r"activations\s+([\d.]+) MiB / budget ([\d.]+) MiB", log_on)]
    profile_steps = base_config(stage)["slackswap"]["profile_steps"]
    assert len(measured) == steps - profile_steps - 1  # the step after the warm-up ones is profiled
    assert all(a <= b for a, b in measured)
    # the warm-up steps, in the shelter, are within the budget too (it is known once profiled)
    warm_up = [float(a) for a in re.findall(r"activations\s+([\d.]+) MiB on the device \(warm-up", log_on)]
    assert len(warm_up) == profile_steps and all(a <= measured[0][1] for a in warm_up)
    assert "slackswap rank" not in log_off


def _gpt2(hidden=64):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=hidden, n_head=4, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _steps(runtime_config: dict, seqs=(16, 16, 16), hidden=64):
    """A one-process runtime (no DeepSpeed) over a tiny GPT-2; the runtime after `seqs` steps."""
    return _engine_steps(runtime_config, seqs, hidden)[1]


def _engine_steps(runtime_config: dict, seqs=(16, 16, 16), hidden=64):
    """_steps, with the engine (its forward and backward hooked) beside the runtime."""
    import torch

    model = _gpt2(hidden)
    engine = _EngineShim(model)
    runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4", "profile_steps": 1,
                                                             **runtime_config}})).attach()
    for seq in seqs:
        ids = torch.randint(1, 128, (2, seq))
        engine.backward(engine.forward(input_ids=ids, labels=ids).loss)
    return engine, runtime


def test_plan_file_keeps_a_plan_per_shape_and_refuses_one_made_for_something_else(tmp_path, caplog):
    import logging

    from slackswap_ds import plan_file

    path = tmp_path / "plans.json"  # (plans of profiled shapes: derived ones are not kept)
    first = _steps({"plan_file": str(path), "derive_shapes": False}, seqs=(16, 16, 16, 32, 32))
    entries = plan_file.read(path)
    assert sorted(e.made_for.inputs for e in entries) == ["(2, 16) torch.int64; (2, 16) torch.int64",
                                                          "(2, 32) torch.int64; (2, 32) torch.int64"]
    digests = {e.made_for.inputs: e.plan.decisions for e in entries}
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        again = _steps({"plan_file": str(path), "derive_shapes": False}, seqs=(16, 16, 16, 32, 32))
    assert sum("using the plan in plan_file" in r.getMessage() for r in caplog.records) == 2
    assert {k: s.plan.decisions for k, s in again.shapes.items()} == \
        {k: s.plan.decisions for k, s in first.shapes.items()}
    assert {e.made_for.inputs: e.plan.decisions for e in plan_file.read(path)} == digests
    # made for another budget, another hardware, another model: refused with the reason, re-planned
    for change, field in [({"activation_budget": 0.6}, "budget_bytes"), ({"hardware": "h100-pcie5"}, "hardware")]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
            _steps({"plan_file": str(path), **change})
        assert any("has no plan made for this job" in r.getMessage() and field in r.getMessage()
                   for r in caplog.records), field
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        _steps({"plan_file": str(path)}, hidden=32)
    assert any("structure" in r.getMessage() for r in caplog.records)
    with pytest.raises(PlanError, match="has no plan made for this job"):
        _steps({"plan_file": str(path), "activation_budget": 0.7, "plan_file_mismatch": "error"})


def _run_lengths(lengths, config: dict | None = None, backend: str | None = None, compile_after=None,
                 compile_at: int = 0):
    """Tiny GPT-2 (each block compiled by `backend`, if given; `compile_after(model)` once the runtime
    attached, before step `compile_at` (0-based), if given), one step per sequence length, through the
    runtime's lifecycle with `config`
    (profile_steps 1 on an A100 preset) or, with None, without SlackSwap: losses, final gradients,
    the runtime, and each planned step's (peak, budget)."""
    import torch

    model = _gpt2()
    model.config.use_cache = False
    if backend is not None:
        torch._dynamo.reset()  # (Dynamo's own state, such as dims it made dynamic, from this process's earlier tests)
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = torch.compile(block, backend=backend)
    engine = _EngineShim(model)
    runtime = None
    if config is not None:
        runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4",
                                                                 "profile_steps": 1, **config}})).attach()
    torch.manual_seed(1)
    losses, peaks = [], []
    for step, seq in enumerate(lengths):
        if compile_after is not None and step == compile_at:
            compile_after(model)
        ids = torch.randint(1, 128, (2, seq))
        loss = engine.forward(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        losses.append(loss.item())
        if runtime is not None and runtime.active_plan is not None:
            peaks.append((runtime.last_stats.peak_device_bytes, runtime.active_plan.budget_bytes))
    return losses, [p.grad for p in model.parameters()], runtime, peaks


def test_a_jobs_plan_file_planned_again_by_slackswap_plan_is_adopted_by_the_next_job(tmp_path, caplog, capsys):
    """A job writes its plan_file (each plan with the step it measured); `slackswap plan --plan-file`
    plans those steps again offline with another planner and budget; a job with that planner and
    budget adopts the file's plans (no planner runs; its plans are the file's), loss and every
    gradient equal to the model without SlackSwap, every planned step within the file's budget."""
    import logging

    import torch

    from slackswap_ds import plan_file
    from slackswap_ds.cli import main

    first, second = tmp_path / "job.json", tmp_path / "offline.json"
    seqs = (16, 16, 16, 24, 24, 24)
    _steps({"plan_file": str(first), "derive_shapes": False}, seqs=seqs)
    assert main(["plan", "--plan-file", str(first), "-p", "recompute-knapsack", "-b", "0.6", "-o", str(second)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("recompute-knapsack plan for input shapes (2, ") == 2
    assert 'a job adopts these plans with "plan_file": ' in printed and '"activation_budget": 0.6' in printed
    offline = {e.made_for.inputs: e for e in plan_file.read(second)}
    assert {e.made_for.planner for e in offline.values()} == {"recompute-knapsack"}
    assert all(e.made_for.budget_bytes == int(0.6 * e.profile.total_bytes) for e in offline.values())

    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        losses, grads, runtime, peaks = _run_lengths(seqs, {"plan_file": str(second), "derive_shapes": False,
                                                            "planner": "recompute-knapsack", "activation_budget": 0.6})
    messages = [r.getMessage() for r in caplog.records]
    assert sum(f"using the plan in plan_file {second}" in m for m in messages) == 2, messages
    assert not any("has no plan made for this job" in m for m in messages)
    assert all(any(f"({e.plan.digest[:12]} there; " in m for m in messages) for e in offline.values())
    assert sorted(s.plan.decisions for s in runtime.shapes.values()) == \
        sorted(e.plan.decisions for e in offline.values())
    assert len(peaks) == 3 and all(peak <= budget for peak, budget in peaks), peaks
    plain_losses, plain_grads, _, _ = _run_lengths(seqs)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_plan_file_that_is_corrupt_or_foreign_is_refused(tmp_path):
    path = tmp_path / "plans.json"
    for text, match in [("{ not json", "cannot read plan_file"), ('{"format": "slackswap.plan/1"}', "not a job's plan_file")]:
        path.write_text(text)
        with pytest.raises(InvalidFileError, match=match):
            _steps({"plan_file": str(path)})


def test_a_plan_file_edited_to_keep_more_than_the_budget_is_refused(tmp_path, caplog):
    """Its "made for" record intact, every decision set to keep (or its budget raised): the plan
    would run over the budget, so it is refused with the reason and planned afresh, never run."""
    import logging

    path = tmp_path / "plans.json"
    _steps({"plan_file": str(path)})
    made = json.loads(path.read_text())
    for edit in ("keep everything", "raise the budget"):
        data = json.loads(json.dumps(made))
        plan = data["plans"][0]["plan"]
        if edit == "keep everything":
            plan["decisions"] = dict.fromkeys(plan["decisions"], Decision.KEEP.value)
            plan["prefetch"] = {}
            reason = "over the budget of"
        else:
            plan["budget_bytes"] *= 2
            reason = "its plan's budget is"
        path.write_text(json.dumps(data))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slackswap_ds"):
            runtime = _steps({"plan_file": str(path)})
        messages = [r.getMessage() for r in caplog.records]
        assert any("has no plan made for this job" in m and reason in m for m in messages), (edit, messages)
        assert not any("using the plan in plan_file" in m for m in messages)
        state = next(iter(runtime.shapes.values()))
        assert state.plan.budget_bytes == plan["budget_bytes"] // (2 if edit == "raise the budget" else 1)
        assert state.executor.stats.last_step.peak_device_bytes <= state.plan.budget_bytes
        path.write_text(json.dumps(data))
        with pytest.raises(PlanError, match=reason):
            _steps({"plan_file": str(path), "plan_file_mismatch": "error"})


def test_a_trace_that_cannot_be_written_is_a_warning_and_training_goes_on(tmp_path, caplog):
    """The predicted trace's path is taken by a folder: a warning naming it, no measured trace, and
    every step still runs under the plan (a trace never ends a job)."""
    import logging

    (tmp_path / "trace.predicted.json").mkdir()
    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        runtime = _steps({"trace_file": str(tmp_path / "trace.json")}, seqs=(16,) * 5)
    assert any("cannot write trace" in r.getMessage() and "trace.predicted.json" in r.getMessage()
               and "training goes on" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "trace.json").exists()
    state = next(iter(runtime.shapes.values()))
    assert state.executor.stats.steps == 3  # the steps after the profiled one, all planned


def test_traces_and_plan_files_replace_a_planted_link_instead_of_writing_through_it(tmp_path):
    victim, unborn = tmp_path / "victim.txt", tmp_path / "unborn.txt"
    victim.write_text("precious")
    for name in ("trace.json", "trace.predicted.json"):
        (tmp_path / name).symlink_to(victim)
    (tmp_path / "plans.json").symlink_to(unborn)  # dangling: a write through it would create the file
    _steps({"trace_file": str(tmp_path / "trace.json"), "plan_file": str(tmp_path / "plans.json")}, seqs=(16,) * 4)
    assert victim.read_text() == "precious" and not unborn.exists()
    for name in ("trace.json", "trace.predicted.json", "plans.json"):
        assert not (tmp_path / name).is_symlink() and json.loads((tmp_path / name).read_text())


def test_a_plan_file_that_cannot_be_written_is_used_and_never_rewritten(tmp_path, monkeypatch):
    from slackswap_ds import plan_file

    path = tmp_path / "plans.json"
    _steps({"plan_file": str(path)})
    before = path.read_bytes()
    monkeypatch.setattr(plan_file, "writable", lambda p: False)  # as for a read-only file (root may write any)
    runtime = _steps({"plan_file": str(path)}, seqs=(16, 16, 16, 32))  # a new shape: planned, not saved
    assert len(runtime.shapes) == 2 and path.read_bytes() == before


def test_bad_paths_fail_when_the_config_loads(tmp_path):
    from slackswap_ds.config import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"slackswap": {"plan_file": str(tmp_path / "missing" / "plans.json")}})
    with pytest.raises(ConfigError, match="a folder, not a file"):
        load_config({"slackswap": {"trace_file": str(tmp_path)}})


@sharing("zero_stages_job")
def test_a_model_compiled_per_block_trains_as_the_same_compiled_job_without_slackswap(zero_stages_job):
    """launch/train.py --compile-blocks inductor on 2 ranks: losses equal to the compiled job with
    "enabled": false, one plan line, every planned step within its budget."""
    (losses_on, log_on), (losses_off, _) = zero_stages_job["blocks-on"], zero_stages_job["blocks-off"]
    assert len(losses_on) == 5 and losses_on == losses_off
    assert len(re.findall(r"slackswap rank 0: .* plan [0-9a-f]{12} agreed over torch.distributed by 2 ranks",
                          log_on)) == 1
    measured = [(float(a), float(b)) for a, b in re.findall(r"activations\s+([\d.]+) MiB / budget ([\d.]+) MiB", log_on)]
    assert len(measured) == 2 and all(a <= b for a, b in measured), measured


@sharing("zero_stages_job")
def test_a_model_compiled_whole_by_engine_compile_trains_as_the_same_compiled_job_without_slackswap(zero_stages_job):
    """launch/train.py --compile-model aot_eager (engine.compile() after initialize) on 2 ranks: SlackSwap
    says once that it compiles each block on its own instead; losses equal to the job compiled whole with
    "enabled": false, one plan line, every planned step within its budget."""
    (losses_on, log_on), (losses_off, log_off) = zero_stages_job["whole-on"], zero_stages_job["whole-off"]
    assert len(losses_on) == 5 and losses_on == losses_off
    assert log_on.count("this model's compilation changed: the whole model (module.compile(), backend aot_eager) "
                        "runs eagerly around its blocks, and 8 block(s) of transformer.h") == 1
    assert "compilation changed" not in log_off
    assert len(re.findall(r"slackswap rank 0: .* plan [0-9a-f]{12} agreed over torch.distributed by 2 ranks",
                          log_on)) == 1
    measured = [(float(a), float(b)) for a, b in re.findall(r"activations\s+([\d.]+) MiB / budget ([\d.]+) MiB", log_on)]
    assert len(measured) == 2 and all(a <= b for a, b in measured), measured


@sharing("zero_stages_job")
def test_two_forwards_before_one_backward_train_exactly_within_budget_from_step_one(zero_stages_job):
    """launch/train.py --rdrop on 2 ranks (R-Drop: two training forwards of each batch, one backward of
    both losses and the distance of their logits): losses equal to the disabled run; the profiled step
    saw both forwards, so every planned step is within its budget and nothing it saves is unplanned
    (the warm-up steps, in the shelter, within the budget too)."""
    (losses_on, log_on), (losses_off, _) = zero_stages_job["rdrop-on"], zero_stages_job["rdrop-off"]
    assert len(losses_on) == 6 and losses_on == losses_off
    measured = [(float(a), float(b)) for a, b in re.findall(r"activations\s+([\d.]+) MiB / budget ([\d.]+) MiB", log_on)]
    assert len(measured) == 3 and all(a <= b for a, b in measured), measured
    warm_up = [float(a) for a in re.findall(r"activations\s+([\d.]+) MiB on the device \(warm-up", log_on)]
    assert len(warm_up) == 2 and all(a <= measured[0][1] for a in warm_up)
    assert "not in the plan's profile" not in log_on and "profiled again" not in log_on


@sharing("zero_stages_job")
def test_plan_file_is_written_then_reused_and_traces_are_written(zero_stages_job):
    tmp = zero_stages_job["tmp"]
    (_, first), (_, second) = zero_stages_job["file1"], zero_stages_job["file2"]
    saved = json.loads((tmp / "plan.json").read_text())
    assert saved["format"] == "slackswap.planfile/1" and len(saved["plans"]) == 1
    measured = json.loads((tmp / "file1.trace.json").read_text())
    predicted = json.loads((tmp / "file1.trace.predicted.json").read_text())
    assert "measured" in measured["otherData"]["title"] and "predicted" in predicted["otherData"]["title"]
    assert {e["cat"] for e in measured["traceEvents"] if e.get("ph") == "X"} >= {"fwd", "bwd"}
    assert "using the plan in plan_file" not in first
    assert f"using the plan in plan_file {tmp / 'plan.json'}" in second
    # the adopted plan was not written again: the file is as the first run left it, before its trace
    assert (tmp / "plan.json").stat().st_mtime_ns <= (tmp / "file1.trace.json").stat().st_mtime_ns
    assert (tmp / "file2.trace.json").exists()  # (the second run did get this far)


class _EngineShim:
    """The two methods EngineHooks wraps, around a real model: forward and backward, as a
    DeepSpeed engine exposes them (no distributed state, so the lifecycle runs on one process)."""

    def __init__(self, module):
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()


def test_new_input_shapes_are_profiled_and_planned_on_their_own():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    engine = _EngineShim(model)
    runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4",
                                                             "profile_steps": 1}})).attach()

    def one(seq):
        ids = torch.randint(1, 128, (2, seq))
        out = engine.forward(input_ids=ids, labels=ids, use_cache=False)
        engine.backward(out.loss)

    for seq in (16, 16, 16, 32, 32, 16):
        one(seq)
    assert len(runtime.shapes) == 2
    assert list(runtime.shapes)[-1][0][0] == (2, 16)  # the most recently used shape is last
    plans = {key: state.plan for key, state in runtime.shapes.items()}
    assert all(p is not None for p in plans.values())
    short, long = sorted(plans.values(), key=lambda p: p.budget_bytes)
    assert short.digest != long.digest and long.budget_bytes > short.budget_bytes
    assert runtime.active_plan is short  # the last step (seq 16) ran under its own shape's plan


def test_new_lengths_every_step_get_derived_plans_exact_within_budget_after_one_profiled_step(caplog):
    """A padding collator's own length every step: after the job's one profiled step, each new
    length's plan is derived (derive.py), not profiled; the first derived step fits the dims that
    are not the sequence (a loss over s - 1 tokens, GPT-2's head dim 16 when s was 16) and every
    later derivation is exact. Loss and every gradient equal the model without SlackSwap (with
    use_cache off, as SlackSwap runs a Hugging Face model: takeover.py), every step within the
    budget of its own shapes."""
    import logging
    import random

    import torch

    lengths = [random.Random(7).randint(5, 40) for _ in range(18)]
    lengths[1] = 16  # the profiled step: head dim 16 equals this length, so the first derivation is wrong

    def run(enabled: bool):
        model = _gpt2()
        engine = _EngineShim(model)
        runtime = None
        if enabled:
            runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4",
                                                                     "profile_steps": 1}})).attach()
        torch.manual_seed(1)
        losses, peaks = [], []
        for seq in lengths:
            ids = torch.randint(1, 128, (2, seq))
            loss = engine.forward(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            losses.append(loss.item())
            if runtime is not None:
                plan = runtime.active_plan
                peaks.append((runtime.last_stats.peak_device_bytes, plan.budget_bytes if plan else None))
        return losses, [p.grad for p in model.parameters()], runtime, peaks

    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        losses, grads, runtime, peaks = run(True)
    plain_losses, plain_grads, _, _ = run(False)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert runtime.profiled_steps == 1 and runtime.derived_plans == len(set(lengths[2:]) - {16})
    planned = [(peak, budget) for peak, budget in peaks[2:] if budget is not None]
    assert len(planned) == len(lengths) - 2 and all(peak <= budget for peak, budget in planned), planned
    messages = [r.getMessage() for r in caplog.records]
    assert sum("their dims are fitted to this step" in m for m in messages) == 1
    assert not any("did not fit their step" in m for m in messages)
    (refitted,) = [s for s in runtime.shapes.values() if s.refitted]
    assert all(s.checked and s.executor.stats.last_step.resized == 0 for s in runtime.shapes.values()
               if s.derived_from is not None and s is not refitted)


def test_every_step_from_the_first_is_within_the_budget(caplog):
    """The warm-up steps and the profiled one send their saved tensors to host, planned steps keep
    their plan's budget, and with replan "never" a new shape's steps run in the shelter (warned once):
    no step holds more device-resident saved bytes than the budget, from step 1 on."""
    import logging

    import torch

    model = _gpt2()
    engine = _EngineShim(model)
    runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4", "profile_steps": 2,
                                                             "replan": "never"}})).attach()
    peaks, plans = [], []
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for seq in (16, 16, 16, 16, 16, 32, 32, 16):
            ids = torch.randint(1, 128, (2, seq))
            engine.backward(engine.forward(input_ids=ids, labels=ids).loss)
            peaks.append(runtime.last_stats.peak_device_bytes)
            plans.append(runtime.active_plan)
    (state,) = runtime.shapes.values()
    budget = state.plan.budget_bytes
    assert [p is not None for p in plans] == [False, False, False, True, True, False, False, True]
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    # in the shelter and profiled, only what one backward op reads back at a time is on the device
    assert max(peaks[:3] + peaks[5:7]) < min(peaks[3:5]), peaks
    messages = [r.getMessage() for r in caplog.records]
    assert sum("warm up in the shelter" in m for m in messages) == 1
    assert sum("steps of new shapes run in the shelter" in m for m in messages) == 1


def test_a_forward_without_backward_does_not_change_the_budget_or_the_next_step(caplog):
    """"Skip this batch" under the engine: a training forward whose loss is dropped, at the profiled
    step and at a planned one. The profiled step takes the next forward of its shapes in (it could be
    R-Drop's), sees after backward that the dropped one's saves were never read and is profiled
    again: the plan is of a whole step (its budget half the real keep-all, not of two forwards),
    and the step after a dropped forward runs its plan within the budget (it used to be a second
    forward of the same step, 3.3x over)."""
    import logging

    import torch

    model = _gpt2()
    engine = _EngineShim(model)
    runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4",
                                                             "profile_steps": 1}})).attach()
    ids = torch.randint(1, 128, (2, 16))
    peaks = []
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for backward in (True, False, True, True, False, True, True):  # warm-up, dropped while profiling, ...
            out = engine.forward(input_ids=ids, labels=ids, use_cache=False)
            if backward:
                engine.backward(out.loss)
                peaks.append((runtime.last_stats.peak_device_bytes, runtime.active_plan))
            del out
    (state,) = runtime.shapes.values()
    assert state.plan.budget_bytes == state.profile.total_bytes // 2 and runtime.profiled_steps == 2
    planned = [(peak, plan) for peak, plan in peaks if plan is not None]
    assert len(planned) == 2 and all(peak <= plan.budget_bytes for peak, plan in planned), planned
    assert runtime.last_stats.fallbacks == {}
    assert sum("had no backward" in r.getMessage() for r in caplog.records) == 1
    # said once, then counted into the periodic report ("since the last report: 1 x a profiled step ...")
    assert sum(r.getMessage().startswith("slackswap: a profiled step had a forward without backward")
               for r in caplog.records) == 1


def _full_recompute_job(layer: type, **config):
    """An in-process runtime over 8 `layer`s (each maps 32 features to 32) planned by full recompute
    at 80% of its keep-all peak (the budget this small model needs for it); its engine and runtime."""
    import torch

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(layer() for _ in range(8))

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x.square().mean()

    torch.manual_seed(0)
    engine = _EngineShim(Stack())
    runtime = EngineHooks(engine, load_config({"slackswap": {
        "hardware": "a100-80g-pcie4", "profile_steps": 1, "planner": "full-recompute", "activation_budget": 0.8,
        **config}})).attach()
    return engine, runtime


def test_after_a_demotion_the_runtime_describes_the_plan_it_runs(caplog):
    """A layer that draws from Python's `random` cannot be replayed: the verifying step demotes its
    recomputes and the executor re-plans. From then on `active_plan`, the shape's plan and its
    prediction are the new plan's (they kept describing the demoted one), and it is logged."""
    import logging
    import random

    import torch

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
            self.rng = random.Random(0)

        def forward(self, x):
            return self.b(self.a(x).tanh() * (1 + self.rng.random())).tanh()

    engine, runtime = _full_recompute_job(Noisy)
    plans, predictions = [], []
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for _ in range(5):
            state = next(iter(runtime.shapes.values()), None)
            if state is not None:  # what the coming step is said to run, and its prediction
                predictions.append((state.plan, state.prediction))
            engine.backward(engine.forward(torch.randn(8, 32)))
            if runtime.active_plan is not None:  # a planned step (not the profiled one)
                plans.append(runtime.active_plan)
    state = next(iter(runtime.shapes.values()))
    assert state.executor.stats.demotions, "the noisy layer's recomputes were expected to fail verification"
    (verifying, *after), (predicted_first, *predicted_after) = plans, predictions  # the planned steps'
    assert verifying.planner == "full-recompute" and after
    assert all(p is state.executor.plan is state.plan for p in after) and after[0].digest != verifying.digest
    assert predicted_first[0] is verifying and all(plan is state.plan for plan, _ in predicted_after)
    assert all(p == state.prediction != predicted_first[1] for _, p in predicted_after)
    assert state.prediction.peak_bytes <= state.plan.budget_bytes
    assert state.executor.stats.last_step.peak_device_bytes <= state.plan.budget_bytes
    assert any(f"now running plan {state.plan.digest[:12]}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("verify_every", [0, 3])
def test_verify_every_checks_the_replay_contract_again(verify_every):
    """A layer reads a global that, from step 5 on, changes between its forward and its backward.
    With verify_every 3 the step after every third step of the plan checks it again, and step 6
    demotes it; with 0 only the first planned step checks (and the contract holds then)."""
    import torch

    scale = {"now": 1.0}

    class ReadsAGlobal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.b(self.a(x).tanh() * scale["now"]).tanh()

    engine, runtime = _full_recompute_job(ReadsAGlobal, verify_every=verify_every)
    verdicts = []
    for step in range(1, 10):
        loss = engine.forward(torch.randn(8, 32))
        scale["now"] = 2.0 if step >= 5 else 1.0
        engine.backward(loss)
        scale["now"] = 1.0
        verdicts.append(runtime.last_stats.verified)
    # step 1 warms up, step 2 is profiled, step 3 verifies the plan (the contract holds then)
    (state,) = runtime.shapes.values()
    if verify_every:
        # steps 3, 4, 5 are the plan's first three: step 6 checks it again and demotes the layers
        # reading the global, the re-planned plan's first step (7) verifies what it still recomputes,
        # and after three steps of the executor since step 6, step 9 checks again
        assert verdicts == [None, None, True, None, None, False, True, None, True]
        assert len(state.executor.stats.demotions) == 1 and runtime.active_plan is state.plan
        assert all(key.endswith(":mul") for key in state.executor.stats.demotions[0])
    else:
        assert verdicts == [None, None, True] + [None] * 6 and state.executor.stats.demotions == []


def test_a_replay_that_fails_at_a_later_step_raises_there_and_the_next_steps_fall_back(caplog):
    """From step 5 on, replaying a layer fails (its state changed between its forward and its
    backward). Forward's bytes are gone, so that step's backward raises a ReplayError, said at ERROR
    with the rank and step; its plan is demoted at once, so a loop that skips the batch goes on: the
    re-planned plan's first step verifies (and demotes the other layers without raising), and no
    later step raises. The failed tensors are kept or swapped from then on."""
    import logging

    import torch

    from slackswap_ds.plan import Decision
    from slackswap_ds.runtime.replay import ReplayError

    state = {"backward": False}

    class BreaksLater(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            if state["backward"]:
                raise RuntimeError("state changed since forward")
            return self.b(self.a(x).tanh()).tanh()

    engine, runtime = _full_recompute_job(BreaksLater)
    raised, verdicts = [], []
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for step in range(1, 10):
            loss = engine.forward(torch.randn(8, 32))
            state["backward"] = step >= 5
            try:
                engine.backward(loss)
            except ReplayError:
                raised.append(step)
            state["backward"] = False
            verdicts.append(runtime.last_stats.verified)
    (shape,) = runtime.shapes.values()
    assert raised == [5] and verdicts[2] is True and verdicts[5] is False  # steps 3 and 6 verify
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "rank 0: step 5 cannot give exact gradients" in errors[0]
    assert "layers.7" in errors[0] and "skip this batch" in errors[0]
    assert [sorted({key.split(":")[0] for key in d}) for d in shape.executor.stats.demotions] == [
        ["layers.7"], [f"layers.{i}" for i in range(7)]]
    assert runtime.active_plan is shape.plan and Decision.RECOMPUTE not in dict(shape.plan.decisions).values()
    assert runtime.last_stats.peak_device_bytes <= shape.plan.budget_bytes


def test_node_topology_comes_from_the_config_else_each_rank_has_its_own_link(monkeypatch):
    import torch

    from slackswap_ds.hardware import load_node

    node = load_node("dgx-a100")
    cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4", "node": "dgx-a100",
                                     "host_pool_bytes_per_node": "64GiB"}})
    runtime = EngineHooks(_EngineShim(torch.nn.Linear(2, 2)), cfg).attach()
    assert runtime.coordinator.topology.uplink_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert runtime.coordinator.uplink_bps == node.switch_uplink_bps
    monkeypatch.setenv("LOCAL_SIZE", "2")  # no node, no CUDA to discover it with: a link per rank
    private = EngineHooks(_EngineShim(torch.nn.Linear(2, 2)),
                          load_config({"slackswap": {"hardware": "a100-80g-pcie4"}})).attach()
    topology = private.coordinator.topology
    assert topology.uplink_of == (0, 1) and topology.source.startswith("default")


# ---- in process, one rank: what ss.initialize takes over from a Hugging Face model --------------
def _hf(kind: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).train()
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).train()


def _train(kind: str, mode: str, enabled: bool, steps: int = 4):
    """`steps` steps of ss.initialize's engine on one rank: the losses, the final parameters, the runtime."""
    import torch

    import slackswap_ds as ss
    from slackswap_ds.runtime import takeover

    takeover._said.clear()
    model = _hf(kind)
    if mode == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              # full recompute: a plan that replays every layer, whatever this machine's op times are
              "slackswap": {"enabled": enabled, "activation_budget": 0.5, "profile_steps": 1,
                            "hardware": "a100-80g-pcie4", "planner": "full-recompute"}}
    engine, *_ = ss.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(1)
    batches = [torch.randint(1, 128, (2, 16)) for _ in range(steps)]
    losses = []
    for step, ids in enumerate(batches):
        torch.manual_seed(100 + step)
        loss = engine(input_ids=ids, labels=ids, use_cache=True).loss  # the Hugging Face default, asked for
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, getattr(engine, "slackswap", None)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("mode", ["use_cache", "checkpointing"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_initialize_takes_over_caches_and_checkpointing_exactly_within_budget(single_process_group, kind, mode,
                                                                              caplog):
    import logging

    import torch

    losses_off, params_off, _ = _train(kind, mode, enabled=False)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        losses_on, params_on, runtime = _train(kind, mode, enabled=True)
    assert losses_on == losses_off
    assert all(torch.equal(params_on[n], params_off[n]) for n in params_off)
    stats, plan = runtime.last_stats, runtime.active_plan
    assert stats is not None and stats.peak_device_bytes <= plan.budget_bytes
    assert stats.fallbacks == {} and plan.keys(Decision.RECOMPUTE)  # the plan replays layers
    messages = [r.getMessage() for r in caplog.records]
    assert sum("use_cache turned off" in m for m in messages) == 1
    assert sum("torch.utils.checkpoint" in m for m in messages) == (mode == "checkpointing")


@pytest.mark.parametrize("log_every", [1, 2])
def test_the_first_planned_step_and_every_log_every_after_it_are_reported(caplog, log_every):
    """The job's first planned step gets its line at once (a short job sees a measured line), then
    one every log_every planned steps; each step is timed from the end of the one before (any
    kind: the first planned one from the profiled one), so every line has a time (with log_every 1
    they all said 0.0 ms). A prediction from op times measured on the CPU says so."""
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        _steps({"log_every": log_every, "activation_budget": 0.5}, seqs=(16,) * 6)
    reports = [r.getMessage() for r in caplog.records if "planned steps:" in r.getMessage()]
    # step 1 warms up, step 2 is profiled; steps 3-6 are planned: step 3 alone, then every log_every
    assert [int(re.search(r"last (\d+) planned steps", m).group(1)) for m in reports] == \
        ([1, 1, 1, 1] if log_every == 1 else [1, 2])
    assert all(float(re.search(r"steps: ([\d.]+) ms per step", m).group(1)) > 0 for m in reports), reports
    assert all("with op times measured on this CPU" in m and "budget" in m for m in reports)


def test_the_job_summary_is_logged_and_written_as_json_when_the_job_ends(tmp_path, caplog):
    """When the job ends (`end_of_job`, registered to run at exit), rank 0 logs its summary and writes
    it as JSON: steps by kind, profiled steps and derived plans, median step times, peaks, and per
    input shape its plan, steps, peak against budget and keep-all, and bytes moved per step. Once."""
    import json
    import logging

    path = tmp_path / "summary.json"
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        runtime = _steps({"activation_budget": 0.5, "summary_file": str(path)}, seqs=(16, 16, 16, 16, 24, 24))
        data = runtime.end_of_job()
    assert runtime.end_of_job() is None  # once
    assert json.loads(path.read_text()) == data
    assert data["steps"] == {"warm-up": 1, "profiled": 1, "planned": 4, "shelter": 0}
    assert data["profiled_steps"] == 1 and data["derived_plans"] == 1 and data["planned_steps_over_budget"] == 0
    assert set(data["median_step_ms"]) == {"profiled", "planned"}  # (the job's first step has no step before it)
    by_shapes = {row["shapes"]: row for row in data["shapes"]}
    assert [row["steps"] for row in by_shapes.values()] == [2, 2]
    for state in runtime.shapes.values():
        row = next(r for r in data["shapes"] if r["plan"] == state.plan.digest[:12])
        assert row["budget_bytes"] == state.plan.budget_bytes and row["keep_all_bytes"] == state.profile.total_bytes
        assert 0 < row["peak_bytes"] <= row["budget_bytes"] < row["keep_all_bytes"]
        assert row["swapped_bytes_per_step"] + row["recomputed_bytes_per_step"] > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slackswap summary")]
    assert "6 steps (1 warm-up, 1 profiled, 4 planned; 1 plan(s) derived" in lines[0] and "every planned step within" in lines[0]
    assert sum(": input shapes" in line for line in lines) == 2
    assert lines[-1] == (f"slackswap summary: written to {path} (rank 0's steps; every rank writes its own: "
                         f"{tmp_path / 'summary.rank<r>.json'} for rank r > 0)")


def test_an_auto_budget_is_what_a_stated_device_has_room_for_beside_the_model_state(tmp_path, caplog):
    """On a CPU "auto" takes the hardware preset's memory as the device (here a hardware file that
    states a small one), less the model state at 16 B per parameter and a 10% margin: the plan keeps
    that budget, and the log shows the sum."""
    import json
    import logging

    from slackswap_ds.budget import auto_budget_bytes

    params = sum(p.numel() for p in _gpt2().parameters())
    device = int((16 * params + 300_000) / 0.9)  # room for 300,000 B of saved activations, of 583,556 B keep-all
    hw = json.loads((ROOT / "configs" / "hardware" / "a100-80g-pcie4.json").read_text())
    hw["name"] = "small-gpu"
    hw["params"]["hbm_bytes"] = {"value": float(device), "source": "stated by this test", "status": "unmeasured"}
    (tmp_path / "small.json").write_text(json.dumps(hw))
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        runtime = _steps({"activation_budget": "auto", "hardware": str(tmp_path / "small.json")}, seqs=(16,) * 4)
    (state,) = runtime.shapes.values()
    expected = auto_budget_bytes(device, 16 * params)
    assert 299_000 < expected <= 300_000 and state.plan.budget_bytes == expected
    assert runtime.last_stats.peak_device_bytes <= expected < state.profile.total_bytes
    said = [r.getMessage() for r in caplog.records if 'activation_budget "auto"' in r.getMessage()]
    assert len(said) == 1 and f"is {expected:,} B: the device's {device:,} B less the model state's " \
        f"{16 * params:,} B" in said[0] and "margin of 10%" in said[0]


def test_a_budget_larger_than_the_device_is_warned_about_once(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        _steps({"activation_budget": "200GB"}, seqs=(16, 16, 16, 24))
    warned = [r.getMessage() for r in caplog.records if "more than the device's memory" in r.getMessage()]
    assert len(warned) == 1 and "activation_budget 200000000000 (200,000,000,000 B)" in warned[0] and "80,000,000,000 B" in warned[0]


@pytest.mark.parametrize("section, kind", [({}, "hf"), ({}, "deepspeed"), ({"activation_budget": 0.5}, "hf")],
                         ids=["hf-unset", "deepspeed-unset", "hf-set-above"])
def test_taking_over_a_models_checkpointing_never_raises_memory_unless_asked(caplog, monkeypatch, section, kind):
    """A model with Hugging Face gradient checkpointing on, or one that calls
    deepspeed.checkpointing.checkpoint around its blocks: SlackSwap runs those calls inline (said
    once: the DeepSpeed kind said nothing) and, with no activation_budget set, plans within what the
    replaced checkpointing held (every layer recomputed: the full-recompute plan's peak), so the job
    needs no more memory than before; a budget the user set is obeyed, and where it is above what
    checkpointing held (0.5 of keep-all gave 1.78x), the log says so with both figures."""
    import logging
    import re

    import deepspeed
    import torch

    from slackswap_ds import checkpointing
    from slackswap_ds.plan_maker import checkpointing_held
    from slackswap_ds.runtime import takeover

    takeover._said.clear()
    monkeypatch.setattr(checkpointing, "_INLINE_CALLS", 0)  # (the first call in a process is said)
    model = _gpt2()
    if kind == "hf":
        model.gradient_checkpointing_enable()
    else:  # Megatron-DeepSpeed style: each block through deepspeed.checkpointing.checkpoint
        for block in model.transformer.h:
            block.forward = functools.partial(lambda f, *a, **k: deepspeed.checkpointing.checkpoint(f, *a, **k),
                                              block.forward)
    engine = _EngineShim(model)
    runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4", "profile_steps": 1,
                                                             **section}})).attach()
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for _ in range(4):
            ids = torch.randint(1, 128, (2, 16))
            engine.backward(engine.forward(input_ids=ids, labels=ids, use_cache=False).loss)
            if runtime.active_plan is not None:
                assert runtime.last_stats.peak_device_bytes <= runtime.active_plan.budget_bytes
    (state,) = runtime.shapes.values()
    held = checkpointing_held(state.profile, runtime.plans.hw)
    messages = [r.getMessage() for r in caplog.records]
    said = {"hf": "calls torch.utils.checkpoint", "deepspeed": "calls deepspeed.checkpointing"}[kind]
    assert sum(said in m for m in messages) == 1
    (line,) = [m for m in messages if "own activation checkpointing is replaced" in m]
    if not section:
        assert state.plan.budget_bytes == held < state.profile.total_bytes
        assert f"within what it held: budget {held:,} B" in line
    else:
        assert state.plan.budget_bytes == state.profile.total_bytes // 2 > held
        assert f"activation_budget 0.5 ({state.plan.budget_bytes:,} B) is more than the replaced checkpointing held " \
               f"({held:,} B" in line
    assert re.search(r"keep-all [\d,]+ B", line)


def test_a_model_without_checkpointing_keeps_its_budget_after_one_with_it_in_the_same_process():
    """Which model's checkpointing was replaced is known per profiled step, not per process: an
    engine whose model checkpoints (budget: what its checkpointing held), then in the same process an
    engine whose model does not (a second job of a sweep, an eval model): the second's budget is
    activation_budget's default of its own keep-all (it was the first's rule: a process-wide flag)."""
    import torch

    from slackswap_ds.plan_maker import checkpointing_held

    budgets = []
    for checkpoints in (True, False):
        model = _gpt2()
        if checkpoints:
            model.gradient_checkpointing_enable()
        engine = _EngineShim(model)
        runtime = EngineHooks(engine, load_config({"slackswap": {"hardware": "a100-80g-pcie4",
                                                                 "profile_steps": 1}})).attach()
        for _ in range(3):
            ids = torch.randint(1, 128, (2, 16))
            engine.backward(engine.forward(input_ids=ids, labels=ids, use_cache=False).loss)
        (state,) = runtime.shapes.values()
        budgets.append((state.plan.budget_bytes, state.profile.total_bytes,
                        checkpointing_held(state.profile, runtime.plans.hw)))
    (first, _, held), (second, keep_all, _) = budgets
    assert first == held and second == keep_all // 2, budgets


def test_other_ranks_say_only_what_differs():
    import logging

    from slackswap_ds.logs import EVERY_RANK, SAME_ON_EVERY_RANK, RankZeroFilter

    def passes(rank, level, extra=None):
        record = logging.LogRecord("slackswap_ds", level, __file__, 1, "m", (), None)
        for k, v in (extra or {}).items():
            setattr(record, k, v)
        return RankZeroFilter(rank).filter(record)

    assert passes(0, logging.INFO) and not passes(1, logging.INFO) and not passes(3, logging.DEBUG)
    assert passes(1, logging.WARNING) and passes(1, logging.INFO, EVERY_RANK)
    assert passes(0, logging.WARNING, SAME_ON_EVERY_RANK) and not passes(1, logging.WARNING, SAME_ON_EVERY_RANK)


def test_at_most_max_shapes_plans_are_kept_least_recently_used_first_out(caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="slackswap_ds"):  # (a rank's later profiled steps: DEBUG, counted)
        runtime = _steps({"max_shapes": 2, "derive_shapes": False}, seqs=(16, 16, 24, 16, 32, 16, 24))
    assert [key[0][0][1] for key in runtime.shapes] == [16, 24]  # 32 pushed 24 out; 24 came back, pushing 32
    drops = [r.getMessage() for r in caplog.records if "max_shapes=2" in r.getMessage()]
    assert len(drops) == 2 and "[(2, 24), (2, 24)]" in drops[0] and "[(2, 32), (2, 32)]" in drops[1]
    profiled = [r.getMessage() for r in caplog.records if "profiling a step" in r.getMessage()]
    assert len(profiled) == 4  # 16, 24, 32, and 24 again


def test_a_budget_the_planner_cannot_meet_falls_back_to_a_planner_that_can(caplog):
    import logging

    from slackswap_ds.errors import BudgetInfeasibleError

    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        runtime = _steps({"activation_budget": 0.2}, seqs=(16, 16, 16, 16))
    plan, stats = runtime.active_plan, runtime.last_stats
    assert plan.planner == "offload-all" and stats.peak_device_bytes <= plan.budget_bytes and not stats.fallbacks
    said = [r.getMessage() for r in caplog.records if "found no plan within" in r.getMessage()]
    assert len(said) == 1 and "using offload-all instead" in said[0]
    with pytest.raises(BudgetInfeasibleError, match=r"no planner keeps .*slackswap: .*; offload-all: .*; "
                                                    r"full-recompute: .*The smallest budget that works here is [\d,]+ B"):
        _steps({"activation_budget": 0.02}, seqs=(16, 16))


def test_a_host_pool_that_runs_out_is_warned_once_and_reported(caplog):
    import logging

    import torch

    engine, runtime = _engine_steps({"log_every": 2, "activation_budget": 0.5}, seqs=(16,) * 3)
    assert runtime.active_plan.keys(Decision.SWAP)
    runtime.plans.pool.trim()  # the job's pinned pool gives back its free memory, and
    runtime.plans.pool.budget_bytes = 0  # may take no more: every swap misses
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        for _ in range(4):
            ids = torch.randint(1, 128, (2, 16))
            engine.backward(engine.forward(input_ids=ids, labels=ids).loss)
    assert runtime.last_stats.fallbacks.get("host pool exhausted: kept")
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    first = [m for level, m in messages if level == logging.WARNING and "(host pool exhausted: kept)" in m]
    reports = [m for level, m in messages if "not placed as planned" in m and "host pool exhausted" in m]
    assert len(first) == 1 and len(reports) == 2  # warned the first time, then counted every log_every steps


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_zero_offload_makes_plans_leave_its_link_time_and_pinned_memory(single_process_group, caplog):
    # DeepSpeed's own ZeRO-Offload (stage 2, optimizer on the CPU) copies gradients to the host in
    # backward and pins the optimizer state: the plan's share must be net of both, and training exact.
    import logging

    import torch

    import slackswap_ds as ss
    from slackswap_ds.hardware import load_hardware

    def train(enabled: bool):
        model = _gpt2()
        # torch's Adam steps the offloaded fp32 partitions on the CPU: the same offload (DeepSpeed's
        # pinned optimizer state, gradients copied to the host in backward), without JIT-building
        # DeepSpeed's CPU Adam (three minutes on a fresh machine)
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                  "slackswap": {"enabled": enabled, "activation_budget": 0.5, "profile_steps": 1,
                                "hardware": "a100-80g-pcie4", "host_pool_bytes_per_node": "1GiB"}}
        engine, *_ = ss.initialize(model=model, model_parameters=model.parameters(), config=config)
        torch.manual_seed(1)
        losses = []
        for step in range(4):
            ids = torch.randint(1, 128, (2, 16))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, model, getattr(engine, "slackswap", None)

    off, _, _ = train(False)
    with caplog.at_level(logging.INFO, logger="slackswap_ds"):
        on, model, runtime = train(True)
    assert on == off
    hw = load_hardware("a100-80g-pcie4")
    pinned = sum(p.numel() for p in model.parameters()) * 16  # fp32 master, m, v, gradient; one rank
    assert runtime.coordinator.shares.plan.h2d(hw) == hw.duplex_h2d_bps  # prefetches meet the gradient copies
    # the rank's pool share comes from the node's pool net of the optimizer state: a demand above
    # what is left gets exactly what is left
    from slackswap_ds.node_facts import RankFacts, shares_of

    assert runtime.coordinator.shares.own.host_pool_bytes <= (1 << 30) - pinned
    net = shares_of([RankFacts("n", 0, 10**12)], hw, hw.d2h_bps, 1 << 30, pinned)[0]
    assert net.host_pool_bytes == (1 << 30) - pinned
    assert any("ZeRO-Offload copies gradients" in r.getMessage() for r in caplog.records)



# ---- a plan travels once: lowered and simulated once from the planner to the executor -------------
def test_a_plan_is_lowered_and_simulated_once_on_its_way_to_the_executor(monkeypatch, plan_counts):
    import collections

    from slackswap_ds.plan import Plan
    from slackswap_ds.planners import common, refine

    monkeypatch.setattr(common, "_KEEP_ALL_CACHE", collections.OrderedDict())  # the ideal is simulated here
    monkeypatch.setattr(refine, "usable_cpus", lambda: 1)  # one exact search (two at once may both find this plan)
    runtime = _steps({"activation_budget": 0.5}, seqs=(16, 16, 16))  # plain; profiled and planned; planned
    state, hw = next(iter(runtime.shapes.values())), runtime.plans.hw
    plan = state.plan
    assert state.executor.plan is plan and runtime.active_plan is plan
    assert plan_counts.lowered[plan.digest] == 1  # by the planner (or fit_triggers, for a retimed plan); never again
    assert plan_counts.simulated_on[plan.digest, hw.name] == 1  # the prediction is the planner's own simulation
    keep_all = Plan.build(state.profile, common.keep_all(state.profile), budget_bytes=0, hardware_digest=hw.digest,
                          planner="keep-all")
    assert plan_counts.simulated_on[keep_all.digest, hw.name] == 1  # the ideal step: once per profile


def test_a_model_compiled_per_block_trains_under_the_runtime_as_the_same_compiled_model():
    """The engine's lifecycle (warm-up in the shelter, a profiled step, planned steps) over GPT-2 with
    each block compiled (inductor): every loss and the final gradients equal the same compiled model
    trained without SlackSwap, the planned steps within the budget (0.9: with 2 layers one compiled
    block, whose backward reads all its saved tensors at once, is half the step)."""
    import torch

    losses, grads, _, peaks = _run_lengths([16] * 5, {"activation_budget": 0.9}, "inductor")
    plain_losses, plain_grads, _, _ = _run_lengths([16] * 5, None, "inductor")
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert len(peaks) == 3 and all(peak <= budget for peak, budget in peaks), peaks


@pytest.mark.parametrize("how", ["engine.compile()", "accelerate regional"])
def test_a_model_compiled_after_initialize_is_compiled_per_block_and_trains_as_before(how, caplog):
    """The model compiled after the runtime attached, as DeepSpeed's engine.compile() does it (the
    whole module in place) or Accelerate's regional compilation (each block and each other leaf in
    place): at the first step SlackSwap compiles each block on its own instead, says so once, and
    every loss and the final gradients equal the job compiled the user's way without SlackSwap
    (aot_eager: the same numbers in either layout)."""
    import logging

    import torch

    def compile_it(model):
        if how == "engine.compile()":
            model.compile(backend="aot_eager")
            return
        for block in model.transformer.h:  # accelerate.utils.compile_regions_deepspeed
            block.compile(backend="aot_eager")
        for leaf in (model.transformer.wte, model.transformer.wpe, model.transformer.ln_f, model.lm_head):
            leaf.compile(backend="aot_eager")

    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        losses, grads, _, peaks = _run_lengths([16] * 5, {"activation_budget": 0.9}, compile_after=compile_it)
    plain_losses, plain_grads, _, _ = _run_lengths([16] * 5, None, compile_after=compile_it)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert len(peaks) == 3 and all(peak <= budget for peak, budget in peaks), peaks
    said = [r.getMessage() for r in caplog.records if "compilation changed" in r.getMessage()]
    assert len(said) == 1, said
    if how == "engine.compile()":
        assert "the whole model (module.compile(), backend aot_eager) runs eagerly around its blocks, and 2 " \
               "block(s) of transformer.h are compiled each on its own" in said[0]
    else:
        assert "transformer.wte (module.compile(), backend aot_eager) runs eagerly (it is outside the block " \
               "stacks)" in said[0] and "lm_head" in said[0]


def test_a_model_compiled_after_its_first_planned_steps_is_planned_anew_and_trains_as_the_same_compiled_job(caplog):
    """engine.compile() in the middle of training (after the warm-up, a profiled step and a planned
    one): Dynamo would trace SlackSwap's hooks inside the new graph (it crashed: "no_dispatch()"), and
    the old plan is for the eager program. The runtime sees the compilation change before that step,
    takes the model into its compile layout, drops its plans and warms up and profiles again: every
    loss and the final gradients equal the same job without SlackSwap, every planned step within budget."""
    import logging

    import torch

    def compile_it(model):
        model.compile(backend="aot_eager")

    with caplog.at_level(logging.WARNING, logger="slackswap_ds"):
        losses, grads, runtime, peaks = _run_lengths([16] * 7, {"activation_budget": 0.9}, compile_after=compile_it,
                                                     compile_at=3)
    plain_losses, plain_grads, _, _ = _run_lengths([16] * 7, None, compile_after=compile_it, compile_at=3)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert len(peaks) == 3 and all(peak <= budget for peak, budget in peaks), peaks  # steps 3, 6 and 7
    said = [r.getMessage() for r in caplog.records if "compilation changed at step" in r.getMessage()]
    assert len(said) == 1 and "changed at step 4 (compiled parts ['transformer.h.0', 'transformer.h.1']" in said[0]
    assert runtime.profiled_steps == 2  # the eager program's shapes, then the compiled one's


def test_deepcompile_offload_activation_beside_an_enabled_section_is_a_config_error():
    from slackswap_ds.config import ConfigError
    from slackswap_ds.engine import check_compile_section

    check_compile_section({"compile": {"deepcompile": True}})  # (DeepCompile alone: the model check decides)
    check_compile_section({"compile": {"offload_activation": True}})
    with pytest.raises(ConfigError, match='"offload_activation": false') as e:
        check_compile_section({"compile": {"deepcompile": True, "offload_activation": True}})
    assert '"enabled": false' in str(e.value)


@pytest.mark.parametrize("backend, seed", [("aot_eager", 3), (None, 3), (None, 4)], ids=["compiled", "eager", "eager-4"])
def test_random_lengths_every_step_stay_exact_and_within_budget(backend, seed):
    """A padding collator's own length every step, longer and shorter ones mixed (a length after
    24 and 31 that is shorter than both once raised from a fitted dim below zero), over GPT-2
    eager or compiled per block (Dynamo makes the shapes dynamic after the second length, and may
    save in another order: compiled code is profiled, never derived, and a length planned on its
    static graph is profiled again when the dynamic one saves other sizes): every step (warm-up,
    profiled, derived or planned) gives the losses and gradients of the same model without
    SlackSwap, and every planned step stays within its budget."""
    import random

    import torch

    rng = random.Random(seed)
    lengths = [24, 24, 31, 17] + [rng.choice((9, 12, 17, 24, 31, 36, 40)) for _ in range(9)]
    losses, grads, runtime, peaks = _run_lengths(lengths, {"activation_budget": 0.9}, backend)
    plain_losses, plain_grads, _, _ = _run_lengths(lengths, None, backend)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert len(peaks) >= 3 and all(peak <= budget for peak, budget in peaks), peaks
    if backend is None:
        assert runtime.derived_plans >= 3 and runtime.profiled_steps == 1, (runtime.derived_plans, runtime.profiled_steps)
    else:  # (the first length's plan was profiled on its static graph; Dynamo's dynamic one saves in another
        # order: its step holds the budget, and the length is profiled again)
        assert runtime.derived_plans == 0 and sorted(runtime.shape_plans.stale.values()) == [1], runtime.shape_plans.stale

"""Whole-job steps: 1F1B order and event times, per-stage memory with in-flight micro-batches,
ZeRO-Offload's traffic on the link, and the job command."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slackswap_ds.cli import main
from slackswap_ds.errors import ProfileError
from slackswap_ds.hardware import load_node
from slackswap_ds.pipeline import (
    GRAD_BYTES,
    PINNED_OPTIMIZER_BYTES_PER_PARAM,
    ZERO_PREFIX,
    Job,
    PipeEvent,
    offload_aware,
    offload_grad_bytes,
    one_f_one_b,
    plan_stage,
    simulate_job,
    simulate_pipeline,
    stage_profile,
    with_offload_traffic,
)
from slackswap_ds.plan import lower
from slackswap_ds.shares import PRIVATE, Share
from slackswap_ds.simulator import simulate
from slackswap_ds.workloads import PRESETS, Parallel, layer_activation_bytes

NODE = load_node("dgx-a100")
SMALL = dataclasses.replace(PRESETS["gpt3-175b"], name="small-gpt", layers=8, hidden=512, heads=8, kv_heads=8,
                            ffn=2048, seq=256, vocab=4096)


def test_one_f_one_b_orders():
    assert one_f_one_b(3, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert one_f_one_b(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer micro-batches than stages


def test_a_tiny_pipeline_has_exact_event_times():
    # 2 stages: forward 1 s / 2 s, backward 2 s / 4 s, sends 0.5 s, 3 micro-batches; by hand:
    ev = simulate_pipeline([1.0, 2.0], [2.0, 4.0], 3, p2p_s=0.5)
    got = {(e.stage, e.kind, e.micro_batch): (e.start, e.end) for e in ev}
    assert got == {
        (0, "F", 0): (0.0, 1.0), (0, "F", 1): (1.0, 2.0),  # warm-up: p - i - 1 = 1 forward, then F1
        (1, "F", 0): (1.5, 3.5),  # F(0,0) ends at 1, + 0.5 send
        (1, "B", 0): (3.5, 7.5),  # the last stage turns around at once
        (0, "B", 0): (8.0, 10.0),  # B(1,0) ends at 7.5, + 0.5 send
        (1, "F", 1): (7.5, 9.5),  # its input arrived at 2.5; the stage was busy until 7.5
        (1, "B", 1): (9.5, 13.5),
        (0, "F", 2): (10.0, 11.0),
        (0, "B", 1): (14.0, 16.0),
        (1, "F", 2): (13.5, 15.5),
        (1, "B", 2): (15.5, 19.5),
        (0, "B", 2): (20.0, 22.0),
    }
    assert all(isinstance(e, PipeEvent) for e in ev)


@pytest.mark.parametrize("sp", [False, True])
def test_stage_keep_all_bytes_are_in_flight_micro_batches_of_the_published_formula(sp):
    # Korthikanti et al.: a layer saves s·b·h·(10 + 24/t + 5as/(ht)) bytes with TP, s·b·h/t·(34 + 5as/h)
    # with TP + SP; under 1F1B stage i holds p - i micro-batches.
    job = Job(SMALL, Parallel(4, sp), pp=4, micro_batches=8)
    per_layer = layer_activation_bytes(SMALL, job.par)
    s, b, h, a, t = SMALL.seq, SMALL.micro_batch, SMALL.hidden, SMALL.heads, 4
    assert per_layer == ((34 * s * b * h + 5 * a * s * s * b) // t if sp
                         else 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t)
    for i in (1, 2):  # middle stages: layers only
        sp_ = plan_stage(job, NODE.gpu, i, float("inf"), "keep-all")
        assert sp_.in_flight == 4 - i
        assert sp_.keep_all_bytes == (4 - i) * 2 * per_layer == sp_.peak_bytes


def test_stage_peaks_from_the_events_equal_the_in_flight_formula():
    job = Job(SMALL, Parallel(2, True), pp=4, micro_batches=6)
    res = simulate_job(job, NODE, 0.7)
    for i, st in enumerate(res.stages):
        assert res.peaks[i] == (job.in_flight(i) - 1) * st.kept_bytes + st.result.peak_bytes
        assert res.peaks[i] <= st.budget_bytes
    assert res.stages[0].in_flight == 4 and res.stages[3].in_flight == 1
    digests = {st.plan.digest for st in res.stages}
    assert len(digests) == 4  # every stage has its own plan
    assert res.step_s == pytest.approx(res.pipeline_s + res.grad_comm_s + res.optimizer_s)


def test_zero_offload_gradient_copies_are_on_the_link_in_the_event_log():
    job = Job(SMALL, dp=2, zero=2, offload_optimizer=True)
    profile = stage_profile(job, NODE.gpu, 0)
    grads = offload_grad_bytes(job, 0)
    plan = plan_stage(job, NODE.gpu, 0, 0.5, "slackswap", PRIVATE).plan
    res = simulate(with_offload_traffic(lower(profile, plan), profile, grads), NODE.gpu)
    copies = [e for e in res.events if e.name.startswith(ZERO_PREFIX)]
    assert {e.name[len(ZERO_PREFIX):]: e.nbytes for e in copies} == grads
    # this rank's half of the 16-bit gradients (per region, rounded down)
    assert sum(grads.values()) == pytest.approx(job.stage_params(0) * GRAD_BYTES / 2, abs=len(grads))
    assert all(e.stream == "d2h" for e in copies)
    bwd_end = {e.name: e.end for e in res.events if e.kind == "bwd"}
    first = {}
    for o in profile.ops:
        first.setdefault(o.region, o.key)
    for e in copies:  # each leaves once its region's backward is done
        assert e.start >= bwd_end[first[e.name[len(ZERO_PREFIX):]]] - 1e-12
    assert res.bytes_d2h >= sum(grads.values())


def test_a_zero_offload_aware_share_plans_with_the_duplex_rate_and_the_pool_left():
    job = Job(SMALL, dp=2, zero=1, offload_optimizer=True)
    share = Share(host_pool_bytes=10**12)
    aware = offload_aware(share, NODE.gpu, job, 0)
    assert aware.h2d(NODE.gpu) == NODE.gpu.duplex_h2d_bps
    assert aware.host_pool_bytes == 10**12 - job.stage_params(0) // 2 * PINNED_OPTIMIZER_BYTES_PER_PARAM
    assert offload_aware(share, NODE.gpu, Job(SMALL), 0) == share


def test_bad_jobs_are_refused_with_every_reason():
    with pytest.raises(ProfileError) as e:
        Job(SMALL, pp=3, zero=3, dp=0)
    msg = str(e.value)
    assert "dp must be a positive integer" in msg and "ZeRO-3 is incompatible with pipeline parallelism" in msg
    with pytest.raises(ProfileError, match="zero must be 0, 1, 2 or 3.*schedule must be one of"):
        Job(SMALL, zero=4, schedule="gpipe")
    with pytest.raises(ProfileError, match=r"layers \(8\) must be divisible by pp \(3\)"):
        Job(SMALL, pp=3)
    with pytest.raises(ProfileError, match="needs zero >= 1"):
        Job(SMALL, offload_optimizer=True)


def test_the_job_command_prints_per_stage_peaks_and_plans(capsys):
    argv = ["simulate", "-w", "llama-7b", "--layers", "8", "--seq", "512", "--micro-batch", "1", "--tp", "2", "--sp",
            "--pp", "2", "--dp", "2", "--zero", "1", "--micro-batches", "4", "-p", "slackswap", "full-recompute"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "8 GPUs: tp 2 + sp, pp 2, dp 2, zero 1" in out and "stages under slackswap" in out
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["planner"] for r in rows] == ["slackswap", "full-recompute"]
    for r in rows:
        assert [s["in_flight"] for s in r["stages"]] == [2, 1]
        assert all(s["peak_bytes"] <= s["budget_bytes"] for s in r["stages"])
    assert main(["simulate", "--hardware", "a100-80g-pcie4", "--pp", "2"]) == 2
    assert "give --node" in capsys.readouterr().err


def test_gradient_reduction_overlapped_with_backward_leaves_only_the_tail_exposed():
    from slackswap_ds.budget import GRAD_BYTES
    from slackswap_ds.workloads import region_params

    base = Job(SMALL, dp=4, zero=1)
    after = simulate_job(base, NODE, float("inf"), "keep-all")
    during = simulate_job(dataclasses.replace(base, overlap_grad_comm=True), NODE, float("inf"), "keep-all")
    params = region_params(SMALL)
    comm = {r: NODE.gpu.collective_s("all_reduce", n * GRAD_BYTES, 4) for r, n in params.items() if n}
    # after backward: every bucket in a row (one node: NVLink); during: at least the embedding's
    # bucket, the last one backward makes, is left after it
    assert after.grad_comm_s == pytest.approx(sum(comm.values()), rel=1e-9)
    assert comm["embed"] - 1e-12 <= during.grad_comm_s < after.grad_comm_s
    assert during.pipeline_s == after.pipeline_s


def test_one_plan_for_all_stages_plans_every_stage_for_stage_0s_micro_batches():
    job = Job(SMALL, pp=4, micro_batches=8)
    budget = int(0.6 * job.in_flight(0) * stage_profile(job, NODE.gpu, 0).total_bytes)  # bytes: one GPU's memory
    per = simulate_job(job, NODE, budget, "slackswap")
    one = simulate_job(job, NODE, budget, "slackswap", one_plan=True)
    assert per.stages[0].plan == one.stages[0].plan  # stage 0 is the tightest: the same plan
    assert all(p <= budget for p in per.peaks) and all(p <= budget for p in one.peaks)
    assert sum(per.peaks) >= sum(one.peaks)  # per-stage plans use the memory later stages have free
    assert per.step_s <= one.step_s + 1e-12


@pytest.mark.parametrize("planner", ["slackswap", "optimal"])
def test_plans_for_micro_batches_in_flight_drop_in_the_last_region_too(planner):
    # One step never gains from dropping in the region that runs last; a stage holding 4 micro-batches
    # does (the 3 finished forwards keep their kept bytes), and its plan must fit all of them.
    from slackswap_ds.plan import Decision
    from slackswap_ds.planners import PLANNERS

    job = Job(SMALL, pp=4, micro_batches=8)
    profile = stage_profile(job, NODE.gpu, 0)
    budget = int(0.5 * 4 * profile.total_bytes)
    plan = PLANNERS[planner](profile, NODE.gpu, budget, holds=4).plan
    kept = plan.bytes_by_decision(profile)[Decision.KEEP]
    res = simulate(lower(profile, plan), NODE.gpu)
    assert 3 * kept + res.peak_bytes <= budget
    last = profile.regions[-1]
    assert any(plan.decision[a.key] is not Decision.KEEP for a in profile.activations if profile.region_of(a) == last)


def test_pipeline_node_benchmark_prints_both_policies(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import pipeline_node

    assert pipeline_node.main() == 0
    out = capsys.readouterr().out
    assert out.count("per stage") == len(pipeline_node.FRACTIONS) + 1 and out.count("one plan") == 3


def test_stage_peaks_count_the_micro_batches_held_as_their_definition_does():
    """stage_peaks counts held micro-batches by bisection (linear in micro-batches); here against
    the definition, micro-batch by micro-batch, on random 1F1B steps."""
    import random

    from slackswap_ds.pipeline import simulate_pipeline, stage_peaks

    def by_definition(events, kept, peak):
        out = [0] * len(kept)
        for i in range(len(kept)):
            mine = [e for e in events if e.stage == i]
            f_end = {e.micro_batch: e.end for e in mine if e.kind == "F"}
            b_end = {e.micro_batch: e.end for e in mine if e.kind == "B"}
            for e in mine:
                held = sum(1 for j, t in f_end.items() if j != e.micro_batch and t <= e.start < b_end[j])
                out[i] = max(out[i], held * kept[i] + peak[i])
        return out

    rng = random.Random(0)
    for _ in range(200):
        p, m = rng.randint(1, 6), rng.randint(1, 24)
        fwd = [rng.choice([0.5, 1.0, 2.0, rng.random()]) for _ in range(p)]
        events = simulate_pipeline(fwd, [f * rng.choice([1, 2, 3]) for f in fwd], m, rng.choice([0.0, 0.1, 1.0]))
        kept, peak = [rng.randint(0, 99) for _ in range(p)], [rng.randint(0, 99) for _ in range(p)]
        assert stage_peaks(events, kept, peak) == by_definition(events, kept, peak), (p, m)


def test_an_uneven_split_gives_each_stage_its_own_layers():
    spec = dataclasses.replace(SMALL, layers=7)
    with pytest.raises(ProfileError, match="must be divisible by pp .3., or give stage_layer_counts"):
        Job(spec, pp=3)
    with pytest.raises(ProfileError, match="add up to 6, not the model's 7 layers"):
        Job(spec, pp=3, stage_layer_counts=(2, 2, 2))
    with pytest.raises(ProfileError, match="3 positive integers"):
        Job(spec, pp=3, stage_layer_counts=(3, 4))
    job = Job(spec, pp=3, micro_batches=4, stage_layer_counts=(2, 3, 2))  # fewer beside the embedding and head
    assert [job.stage_layers(i) for i in range(3)] == [range(0, 2), range(2, 5), range(5, 7)]
    res = simulate_job(job, NODE, float("inf"), "keep-all")
    layer_ops = [sum(1 for o in st.profile.ops if o.region.startswith("layers.")) for st in res.stages]
    assert layer_ops[1] == layer_ops[0] * 3 // 2 == layer_ops[2] * 3 // 2
    # the middle stage, with the most layers, sets the pace: each of its forwards is the longest
    assert max(res.stages, key=lambda st: st.fwd_s).stage == 1


def test_training_metrics_over_the_logits_add_their_memory_bound_passes_to_every_micro_batch():
    """Composer's train metrics (llm-foundry: LanguageCrossEntropy and LanguagePerplexity) each run a
    cross-entropy over the 16-bit logits after every micro-batch's backward: under bf16 autocast a
    cast to fp32 (read 2 B, write 4 B per logit) and an fp32 log-softmax (read 4, write 4)."""
    from slackswap_ds.pipeline import logit_metric_s

    hw = NODE.gpu
    logits = SMALL.micro_batch * SMALL.seq * SMALL.vocab
    one = logits * 14 / hw.elementwise_bps + 2 * hw.kernel_overhead_s  # two kernels
    for job in (Job(SMALL, micro_batches=3), Job(SMALL, pp=2, micro_batches=3)):
        assert logit_metric_s(job, hw) == pytest.approx(one, rel=1e-12)
        plain = simulate_job(job, NODE, float("inf"), "keep-all")
        with_metrics = simulate_job(dataclasses.replace(job, logit_metrics=2), NODE, float("inf"), "keep-all")
        # on the last stage (it holds the logits), after each of the 3 micro-batches' backward: with one
        # stage every one is on the critical path; the pipeline's last stage is too (1F1B drains through it)
        assert with_metrics.step_s - plain.step_s == pytest.approx(3 * 2 * one, rel=1e-9)
    with pytest.raises(ProfileError, match="logit_metrics must be a whole number"):
        Job(SMALL, logit_metrics=-1)

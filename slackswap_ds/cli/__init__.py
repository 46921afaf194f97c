"""The ``slackswap`` command.

    slackswap simulate [--workload W ... | --model config.json ...] [--budget B ...] [--hardware H | --node N]
                       [--planner P ...] [--seq S] [--micro-batch M] [--layers L] [--tp T [--sp]]
                       [--pp P] [--dp D] [--zero Z] [--micro-batches M] [--offload-optimizer]
                       [--overlap-comm] [--json] [--trace FILE] [--plot FILE]
    slackswap plan (--workload W | --model config.json) --budget B [--hardware H | --node N] [--planner P]
                   [--tp T [--sp]] -o plan.json
    slackswap plan --plan-file JOB_FILE [--budget B] [--planner P] -o plan_file.json

With --pp, --dp, --zero, --micro-batches, --offload-optimizer or --overlap-comm, `simulate` simulates a
whole job (`pipeline.simulate_job`): one table per workload and budget, with the job's tokens per
second, what each GPU holds beside its activations and whether it fits (`job_memory`), and each
stage's plan; a size or "auto" budget is each GPU's.

A budget is a fraction of the keep-all activation peak (``0.5``, ``50%``) or a byte size (``12GiB``,
``8e9``, ``16GB``). User errors (unknown names, bad files, an infeasible budget for ``plan``) print
one line ``slackswap: error: ...`` on stderr and exit with 2; no stack traces.

This module reads the arguments and prints; `cli/sweep.py` plans and simulates the rows, and
`sim_report.py` formats the tables. ``python -m slackswap_ds.cli`` runs `main` (`__main__.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from .. import plan_file
from ..budget import Budget
from ..errors import SlackSwapError
from ..hardware import load_hardware, load_node, preset_names
from ..pipeline import Job
from ..planners import PLANNERS, get_planner, keep_all_result
from ..sim_report import job_table, paper_line, plan_summary, require_matplotlib, sweep_header, sweep_table
from ..workloads import Parallel, preset_spec, presets, workload_names
from .job_plans import replan, say
from .sweep import Group, Sweep, Target, Traced, Workload, job_groups, job_row, native_stdout_to_stderr

DEFAULT_WORKLOADS = ("bert-large", "gpt2-xl", "llama-7b")
DEFAULT_HARDWARE = "a100-80g-pcie4"
# --attention's fused kernels -> ModelSpec.attention_kernel ('flash' stays the name of FlashAttention-2)
FLASH_KERNELS = {"flash": "fa2", "fa1": "fa1", "fa-triton": "fa-triton", "xformers": "xformers"}


# ---- budgets ----------------------------------------------------------------------------------
def parse_budget(text: str) -> Budget:
    """An argparse type: a budget by `budget.py`'s rules (the config's), or a usage error."""
    try:
        return Budget.parse(str(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid budget {text!r}: {e}") from None


def _positive_int(text: str) -> int:
    """A positive whole number, also written as 1e8 (how large it may be is checked where it is used)."""
    try:
        v = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        v = math.nan
    if not (isinstance(v, int) or (math.isfinite(v) and v.is_integer())) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(v)


# ---- what the arguments name -------------------------------------------------------------------
def _names(values: Sequence[str] | None) -> list[str]:
    """Flatten repeated / comma-separated name options, keeping order, dropping duplicates."""
    out: list[str] = []
    for v in values or ():
        for part in str(v).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


def _load_target(hardware: str | None, node: str | None) -> Target:
    if node is not None:
        n = load_node(node)
        return Target(n.gpu, n)
    return Target(load_hardware(hardware or DEFAULT_HARDWARE), None)


def _overrides(args: argparse.Namespace) -> dict[str, int | bool]:
    out: dict[str, int | bool] = {}
    for opt, name in (("seq", "seq"), ("micro_batch", "micro_batch"), ("layers", "layers")):
        v = getattr(args, opt, None)
        if v is not None:
            out[name] = v
    attention = getattr(args, "attention", None)
    if attention is not None:
        out["flash"] = attention != "eager"
        if attention != "eager":
            out["attention_kernel"] = FLASH_KERNELS[attention]
    if getattr(args, "fused_loss", False):
        out["fused_loss"] = True
    return out


def _workloads(args: argparse.Namespace, default: Sequence[str]) -> list[Workload]:
    """The presets named by --workload (or `default` when neither --workload nor --model is given),
    then each --model config, every one with the shape overrides applied. Errors before any work."""
    overrides = _overrides(args)
    given = getattr(args, "workload", None)
    names = _names([given] if isinstance(given, str) else given)
    models = getattr(args, "model", None) or []
    if not names and not models:
        names = list(default)
    if names == ["all"]:
        names = workload_names()
    out = []
    for n in names:
        spec = preset_spec(n, **overrides)
        out.append(Workload(n, spec, True, spec != presets()[n]))
    for path in models:
        from ..model_config import spec_from_hf_config

        if args.seq is None or args.micro_batch is None:
            raise SlackSwapError(f"--model {path}: give --seq and --micro-batch too (a config.json holds the "
                                 f"model, not the shape of its training batches)")
        flash = None if args.attention is None else args.attention != "eager"
        spec = dataclasses.replace(spec_from_hf_config(path, seq=args.seq, micro_batch=args.micro_batch, flash=flash),
                                   **overrides)  # --layers, --attention's kernel, --fused-loss, as for presets
        out.append(Workload(spec.name, spec, False, False))
    return out


def _say_unmeasured_attention(workloads: Sequence[Workload], hw) -> None:
    """A fused kernel with no measured speed on this GPU runs at a derived speed or FlashAttention-2's:
    said, not silent."""
    for kernel in sorted({wl.spec.attention_kernel for wl in workloads if wl.spec.flash}):
        if hw.attention_rates is None or hw.attention_kernel_measured(kernel):
            continue
        derived = hw.attention_kernel_derived(kernel)
        stand_in = f"its speed is derived: {derived.rule}" if derived else "FlashAttention-2's stands in for it"
        print(f"note: {hw.name} has no measured speed of the {kernel!r} attention kernel; {stand_in}", file=sys.stderr)


def _parallel(args: argparse.Namespace) -> Parallel:
    if getattr(args, "sp", False) and getattr(args, "tp", 1) == 1:
        raise SlackSwapError("--sp (sequence parallelism) splits along the tensor-parallel group: give --tp > 1")
    return Parallel(getattr(args, "tp", 1) or 1, bool(getattr(args, "sp", False)))


# ---- simulate ----------------------------------------------------------------------------------
def _sweep(args: argparse.Namespace) -> Sweep:
    """Every name checked before any work, so a typo fails at once."""
    planners = _names(args.planner) or list(PLANNERS)
    budgets = list(dict.fromkeys(args.budget or [parse_budget("0.5")]))
    workloads = _workloads(args, DEFAULT_WORKLOADS)
    for p in planners:
        get_planner(p)
    target = _load_target(args.hardware, args.node)
    par = _parallel(args)
    profiles = [wl.profile(target.hw, par) for wl in workloads]  # (a shape over the simulator's limits fails here)
    _say_unmeasured_attention(workloads, target.hw)
    return Sweep(workloads, profiles, budgets, planners, target, par, bool(args.trace))


def _group_table(group: Group, sweep: Sweep) -> list[str]:
    wl, target, par = group.workload, sweep.target, sweep.par
    header = sweep_header(group.profile_name, target.where, wl.spec, wl.source_note, par, group.keep_all,
                          group.budget_bytes, group.model_state_bytes, target.hw.hbm_bytes)
    plain = wl.preset and not wl.overridden and par == Parallel()
    paper = paper_line(wl.name, group.budget, group.rows, target.name) if plain else None
    return sweep_table(header, group.rows, paper)


def cmd_simulate(args: argparse.Namespace) -> int:
    if _is_job(args):
        return cmd_simulate_job(args)
    if args.plot:
        require_matplotlib("--plot")  # before any work: not after every table is printed
    sweep = _sweep(args)
    rows: list[dict] = []
    traced: Traced | None = None
    out = sys.stdout
    for group in sweep.groups():
        rows.extend(group.rows)
        traced = group.traced or traced
        if not args.json:
            print("\n".join(_group_table(group, sweep)), file=out, flush=True)
    if args.json:
        json.dump([{k: v for k, v in r.items() if k != "status"} for r in rows], out, indent=1)
        out.write("\n")
        out.flush()
    rc = 0
    if args.trace:
        rc = _write_trace(traced, args.trace)
    if args.plot:
        from ..sim_report import plot_sweep

        plot_sweep(rows, args.plot)
        print(f"slackswap: sweep plot written to {args.plot}", file=sys.stderr)
    return rc


def _write_trace(traced: Traced, path: str) -> int:
    if traced.result is None:
        print(f"slackswap: error: no trace written: the slackswap plan could not be simulated: {traced.error}",
              file=sys.stderr)
        return 1
    from ..sim_report import write_trace

    write_trace(traced.result, path, title=traced.title, budget_bytes=traced.budget_bytes)
    print(f"slackswap: trace of the slackswap step written to {path}", file=sys.stderr)
    return 0


# ---- a whole job: pipeline stages, data parallelism, ZeRO -----------------------------------------
JOB_PLANNERS = ("slackswap", "full-recompute", "megatron-selective", "offload-all")  # the MILP is slow on whole stages
DEFAULT_JOB_NODE = "dgx-a100"


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts such as 5,6,6,5, got {text!r}")
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer, got {text!r}")
    return counts


def _is_job(args: argparse.Namespace) -> bool:
    return (args.pp, args.dp, args.zero, args.micro_batches, args.offload_optimizer, args.overlap_comm,
            args.schedule, args.stage_layers, args.partition_activations, args.chunks, args.reduce_dtype,
            args.sharding) != (1, 1, 0, 1, False, False, "1f1b", (), False, 1, "bf16", "deepspeed")


def cmd_simulate_job(args: argparse.Namespace) -> int:
    """One step of a job cut across GPUs (`pipeline.simulate_job`): per planner, the step time
    against the keep-all ideal, the job's tokens per second and whether each GPU holds its share;
    per stage its peak, budget, model state and plan."""
    if args.hardware is not None and args.node is None:
        raise SlackSwapError("--pp/--dp/--zero simulate a job across nodes: give --node (e.g. dgx-a100), not --hardware")
    if args.trace or args.plot:
        raise SlackSwapError("--trace and --plot are for single-rank steps; not with --pp/--dp/--zero")
    node = load_node(args.node or DEFAULT_JOB_NODE)
    planners = _names(args.planner) or list(JOB_PLANNERS)
    for p in planners:
        get_planner(p)
    budgets = list(dict.fromkeys(args.budget or [parse_budget("0.5")]))
    par = _parallel(args)
    workloads = _workloads(args, ("llama-70b",))
    jobs = [(wl, Job(wl.spec, par, args.pp, args.dp, args.micro_batches, args.zero, args.offload_optimizer,
                     args.overlap_comm, args.schedule, args.stage_layers, args.partition_activations, args.chunks,
                     grad_reduce_bytes=4 if args.reduce_dtype == "fp32" else 2, sharding=args.sharding))
            for wl in workloads]  # every job checked before any work
    _say_unmeasured_attention(workloads, node.gpu)
    rows, out = [], sys.stdout
    for wl, job, budget, results, ideal in job_groups(jobs, node, budgets, planners):
        rows += [job_row(wl, job, node, budget, planner, res, err, ideal) for planner, res, err in results]
        if not args.json:
            print("\n".join(job_table(wl.spec, node.name, job, budget, results, ideal, node.gpu.hbm_bytes)), file=out,
                  flush=True)
    if args.json:
        json.dump(rows, out, indent=1)
        out.write("\n")
    return 0


# ---- plan --------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    if args.planner is not None:
        get_planner(args.planner)
    if args.plan_file is not None:
        return _plan_job_file(args)
    args.planner = args.planner or "slackswap"
    if args.budget is None:
        raise SlackSwapError("give --budget B (a fraction of the keep-all peak, or a size)")
    if _is_job(args):
        raise SlackSwapError("slackswap plan makes one rank's plan; for a job across stages use slackswap simulate --pp")
    if args.workload is None and not args.model:
        raise SlackSwapError("give --workload W or --model config.json")
    if args.workload is not None and args.model:
        raise SlackSwapError("give --workload or --model, not both (a plan is for one model)")
    (wl,) = _workloads(args, ())
    target = _load_target(args.hardware, args.node)
    _say_unmeasured_attention([wl], target.hw)
    profile = wl.profile(target.hw, _parallel(args))
    ka = keep_all_result(profile, target.hw)
    budget_bytes = args.budget.of(profile.total_bytes)
    with native_stdout_to_stderr():
        planned = get_planner(args.planner)(profile, target.hw, budget_bytes, share=target.share)
    plan = planned.plan
    res = target.simulate(planned, budget_bytes, ka.step_s, record=False)
    if args.output == "-":
        sys.stdout.write(json.dumps(plan.to_json(), indent=1, sort_keys=True) + "\n")
        summary_out = sys.stderr
    else:
        try:
            plan.save(args.output)
        except OSError as e:
            raise SlackSwapError(f"cannot write plan {args.output!r}: {e}") from e
        summary_out = sys.stdout
    print(plan_summary(args.planner, plan, profile, target.name, args.budget, budget_bytes, res, args.output),
          file=summary_out)
    return 0 if res.feasible else 1


def _plan_job_file(args: argparse.Namespace) -> int:
    """`slackswap plan --plan-file JOB_FILE -o OUT`: the job's measured steps planned again (job_plans.py)."""
    shaped = (args.seq, args.micro_batch, args.layers, args.tp, args.sp) != (None, None, None, 1, False)
    if args.workload is not None or args.model or args.node or shaped or _is_job(args):
        raise SlackSwapError("--plan-file plans the steps a job measured, as it ran them (its hardware, node share "
                             "and shapes): give no --workload, --model, --node, shape or job layout with it")
    if args.output == "-":
        raise SlackSwapError("--plan-file writes a plan file for a job: give -o FILE")
    if not Path(args.plan_file).is_file():
        raise SlackSwapError(f"no plan file {args.plan_file!r}: a job writes one at its plan_file path")
    entries = plan_file.read(args.plan_file)
    with native_stdout_to_stderr():
        replanned = replan(entries, args.planner, args.budget, args.hardware)
    try:
        plan_file.write(args.output, [r.entry for r in replanned])
    except OSError as e:
        raise SlackSwapError(f"cannot write plan file {args.output!r}: {e}") from e
    for r in replanned:
        print(say(r, args.output))
    planners = sorted({r.entry.made_for.planner for r in replanned})
    budget = json.dumps(args.budget.json_value) if args.budget is not None else "(as the job had it)"
    print(f"a job adopts these plans with \"plan_file\": {json.dumps(args.output)}, \"planner\": "
          f"{' or '.join(json.dumps(p) for p in planners)}, \"activation_budget\": {budget}")
    return 0 if all(r.result.feasible for r in replanned) else 1


# ---- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slackswap", description="SlackSwap activation-memory planner for DeepSpeed.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_simulate_parser(sub)
    _add_plan_parser(sub)
    return parser


def _add_common_options(p: argparse.ArgumentParser) -> None:
    """Where to simulate, the shape overrides and how the job is cut: the same for every command."""
    gpus, nodes = preset_names("gpu"), preset_names("node")
    p.add_argument("--hardware", metavar="H",
                   help=f"GPU preset or hardware JSON file (default {DEFAULT_HARDWARE}; presets: {', '.join(gpus)})")
    p.add_argument("--node", metavar="N",
                   help=f"node preset or JSON file; simulates all its GPUs sharing host links "
                        f"(presets: {', '.join(nodes)}); its GPU replaces --hardware")
    p.add_argument("--seq", type=_positive_int, metavar="S", help="override the sequence length")
    p.add_argument("--micro-batch", type=_positive_int, metavar="M", help="override the micro-batch size")
    p.add_argument("--layers", type=_positive_int, metavar="L", help="override the number of layers")
    p.add_argument("--attention", choices=("eager",) + tuple(FLASH_KERNELS),
                   help="the attention implementation: 'eager' materialises the s x s scores (HF's eager path); "
                        "the others are one fused kernel each way (causal models skip the masked blocks), at the "
                        "preset's measured speed of that kernel: 'flash' FlashAttention-2 (and PyTorch SDPA's flash "
                        "backend), 'fa1' FlashAttention v1, 'fa-triton' its Triton version (llm-foundry's "
                        "attn_impl: triton), 'xformers'; default: the preset's, or by family for --model (flash "
                        "for llama/mistral/qwen2/mixtral)")
    p.add_argument("--fused-loss", action="store_true",
                   help="the loss is one kernel that reads the logits once and writes their gradient in place "
                        "(llm.c's fused_classifier), not PyTorch's log-softmax saved for a backward kernel")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="T",
                   help="tensor-parallel degree: simulate one rank of a Megatron-style T-way cut (default 1)")
    p.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism (Korthikanti et al.)")
    p.add_argument("--pp", type=_positive_int, default=1, metavar="P",
                   help="pipeline stages (1F1B); with --pp/--dp/--zero, simulate a whole job on --node")
    p.add_argument("--dp", type=_positive_int, default=1, metavar="D", help="data-parallel replicas (default 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="DeepSpeed ZeRO stage (default 0; 3: parameters gathered per micro-batch, FSDP FULL_SHARD)")
    p.add_argument("--schedule", choices=("1f1b", "deepspeed"), default="1f1b",
                   help="pipeline schedule: Megatron's 1F1B (default) or DeepSpeed's PipelineEngine (lockstep, "
                        "blocking full-activation sends, tied-embedding reduce)")
    p.add_argument("--partition-activations", action="store_true",
                   help="DeepSpeed's partition_activations (with --schedule deepspeed): a recomputed layer's "
                        "input is kept split over the tensor-parallel ranks and gathered again before recompute")
    p.add_argument("--chunks", type=_positive_int, default=1, metavar="V",
                   help="model chunks per pipeline rank: Megatron's interleaved 1F1B over pp x V virtual stages "
                        "(a V-fold smaller bubble, V-fold sends; needs micro-batches a multiple of pp)")
    p.add_argument("--stage-layers", type=_layer_counts, default=(), metavar="N,N,...",
                   help="layers per pipeline stage, first to last (an uneven split; default: layers / pp each)")
    p.add_argument("--micro-batches", type=_positive_int, default=1, metavar="M",
                   help="micro-batches per step and pipeline (gradient accumulation; default 1)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: optimizer state and step on the CPU (needs --zero 1 or 2)")
    p.add_argument("--overlap-comm", action="store_true",
                   help="reduce each layer's gradients while backward goes on (DeepSpeed's overlap_comm)")
    p.add_argument("--sharding", choices=("deepspeed", "fsdp1"), default="deepspeed",
                   help="with --zero 3, whose code shards: DeepSpeed ZeRO-3 (default; its own copies not modelled) "
                        "or PyTorch FSDP's FlatParameter (casts each gathered shard to 16 bits, and each gradient "
                        "to the reduce dtype and pre-divides it in full)")
    p.add_argument("--reduce-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="data-parallel gradient reduction in 16 bits (default; bf16 or fp16) or fp32 (FSDP's "
                        "MixedPrecision reduce_dtype=float32, as torchtitan and Composer's DEFAULT do)")


def _add_simulate_parser(sub) -> None:
    sim = sub.add_parser("simulate", help="simulate planners on workloads and compare throughput",
                         description="Plan and simulate one training step per (workload, budget, planner).")
    sim.add_argument("--workload", "-w", action="extend", nargs="+", metavar="W",
                     help=f"workload preset(s) (default {' '.join(DEFAULT_WORKLOADS)}; 'all' or any of "
                          f"{', '.join(workload_names())})")
    sim.add_argument("--model", action="append", metavar="CONFIG",
                     help="a Hugging Face config.json (or its folder) to simulate, with --seq and --micro-batch; "
                          "families: gpt2, bert, llama, mistral, qwen2, mixtral")
    sim.add_argument("--budget", "-b", action="extend", nargs="+", type=parse_budget, metavar="B",
                     help="activation budget(s): a fraction of the keep-all peak (0.5, 50%%), a size (12GiB, "
                          "16GB, 8e9) or auto (what the GPU has room for beside the model state); with "
                          "--pp/--dp/--zero a size or auto is each GPU's; default 0.5")
    sim.add_argument("--planner", "-p", action="extend", nargs="+", metavar="P",
                     help=f"planner(s) (default all: {', '.join(PLANNERS)})")
    _add_common_options(sim)
    sim.add_argument("--json", action="store_true", help="print a JSON list of rows instead of tables")
    sim.add_argument("--trace", metavar="FILE",
                     help="write the Chrome/Perfetto trace of the slackswap step for the first workload and budget")
    sim.add_argument("--plot", metavar="FILE", help="write a PNG of throughput vs budget (needs matplotlib: "
                                                    "pip install 'slackswap_ds[plot]')")
    sim.set_defaults(func=cmd_simulate)


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="make a plan and write it as JSON",
                        description="Make one plan for a simulated workload and budget and write it (Plan JSON): "
                        "to inspect what a planner decides, or for ss.apply on a profile of that workload. It is "
                        "not a plan_file for a training job: a job plans its own measured steps, and writes and "
                        "reuses its plan_file itself. With --plan-file, it plans a job's measured steps again "
                        "(another planner or budget, offline) and writes a plan_file the job adopts.")
    pl.add_argument("--workload", "-w", metavar="W", help=f"workload preset ({', '.join(workload_names())})")
    pl.add_argument("--model", action="append", metavar="CONFIG",
                    help="instead of --workload: a Hugging Face config.json, with --seq and --micro-batch")
    pl.add_argument("--plan-file", metavar="JOB_FILE",
                    help="instead of --workload: plan again the steps a job measured, from its plan_file (the "
                         "job's hardware and node share; -b and -p default to the job's); -o then writes a "
                         "plan_file that a job with that planner and activation_budget adopts")
    pl.add_argument("--budget", "-b", type=parse_budget, metavar="B",
                    help="activation budget: fraction of the keep-all peak or a size (12GiB)")
    pl.add_argument("--planner", "-p", metavar="P",
                    help=f"planner (default slackswap; {', '.join(PLANNERS)})")
    _add_common_options(pl)
    pl.add_argument("--output", "-o", required=True, metavar="FILE", help="where to write the plan ('-' = stdout)")
    pl.set_defaults(func=cmd_plan)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except SlackSwapError as e:  # a malformed preset file: the help texts list the presets
        print(f"slackswap: error: {e}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    if args.node is not None and args.hardware is not None:
        parser.print_usage(sys.stderr)
        print("slackswap: error: give --hardware or --node, not both (a node's GPU is set in its preset)",
              file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except SlackSwapError as e:
        print(f"slackswap: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `slackswap simulate --json | head`
        try:
            sys.stdout.close()
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        print("slackswap: interrupted", file=sys.stderr)
        return 130

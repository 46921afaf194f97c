"""The ``slackswap`` command.

    slackswap simulate [--workload W ... | --model config.json ...] [--budget B ...] [--hardware H | --node N]
                       [--planner P ...] [--seq S] [--micro-batch M] [--layers L] [--tp T [--sp]]
                       [--pp P] [--dp D] [--zero Z] [--micro-batches M] [--offload-optimizer]
                       [--overlap-comm] [--json] [--trace FILE] [--plot FILE]
    slackswap plan (--workload W | --model config.json) --budget B [--hardware H | --node N] [--planner P]
                   [--tp T [--sp]] -o plan.json

With --pp, --dp, --zero, --micro-batches, --offload-optimizer or --overlap-comm, `simulate` simulates a
whole job (`pipeline.simulate_job`): one table per workload and budget, with each stage's plan.

A budget is a fraction of the keep-all activation peak (``0.5``, ``50%``) or a byte size (``12GiB``,
``8e9``, ``16GB``). User errors (unknown names, bad files, an infeasible budget for ``plan``) print
one line ``slackswap: error: ...`` on stderr and exit with 2; no stack traces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from .budget import Budget
from .errors import BudgetInfeasibleError, SlackSwapError
from .hardware import Hardware, Node, load_hardware, load_node, preset_names
from .plan import Decision, Plan
from .planners import PLANNERS, PRIVATE, Planned, Share, get_planner, keep_all_result, refusal
from .profile import StepProfile
from .simulator import SimResult, simulate, simulate_node
from .workloads import PRESETS, ModelSpec, Parallel, preset_spec, transformer_profile, workload_names

DEFAULT_WORKLOADS = ("bert-large", "gpt2-xl", "llama-7b")
DEFAULT_HARDWARE = "a100-80g-pcie4"
PROGRESS_ABOVE = 6  # (workload, budget) combinations above which progress goes to stderr
SLOW_PLANNER_S = 10.0  # a planner slower than this gets a note on stderr

# SlackSwap (arXiv 2610.13003): simulated A100 + PCIe 4.0, budget 50% of the keep-all peak.
PAPER = "SlackSwap arXiv 2610.13003, simulated A100 + PCIe 4.0, 50% budget"
PAPER_THROUGHPUT_PCT = {"bert-large": 96.3, "gpt2-xl": 97.6, "llama-7b": 99.6}

GB = 1e9


# ---- budgets ----------------------------------------------------------------------------------
def parse_budget(text: str) -> Budget:
    """An argparse type: a budget by `budget.py`'s rules (the config's), or a usage error."""
    try:
        return Budget.parse(str(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid budget {text!r}: {e}") from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return v


# ---- formatting helpers ------------------------------------------------------------------------
def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB"


def _names(values: Sequence[str] | None) -> list[str]:
    """Flatten repeated / comma-separated name options, keeping order, dropping duplicates."""
    out: list[str] = []
    for v in values or ():
        for part in str(v).split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


def short_source(name: str) -> str:
    """A one-line form of a preset's `source`: the paper for the dims and the repository for the shape."""
    spec = PRESETS.get(name)
    if spec is None:
        return ""
    src = spec.source
    paper = re.search(r"\(([A-Z][\w-]+ et al\.? \d{4})", src)
    repo = re.search(r"\b([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)\b", src)
    parts = [p.group(1) for p in (paper, repo) if p]
    if not parts:
        return src if len(src) <= 60 else src[:57] + "..."
    return " + ".join(parts)


# ---- keeping stdout clean -----------------------------------------------------------------------
def _c_fflush() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # pragma: no cover - no libc (unusual platforms): nothing buffered to flush
        pass


@contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """Send what native code (e.g. the HiGHS MILP solver) prints on file descriptor 1 to stderr
    while the block runs, so that ``--json`` output on stdout stays parseable."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no usable fd 1
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        _c_fflush()
        os.dup2(saved, 1)
        os.close(saved)


# ---- one simulated row -------------------------------------------------------------------------
@dataclass
class Target:
    """Where steps are simulated: one GPU (private link) or every GPU of a node."""

    hw: Hardware
    node: Node | None

    @property
    def name(self) -> str:
        return self.node.name if self.node else self.hw.name

    @property
    def share(self) -> Share:
        return Share.of_node(self.node) if self.node else PRIVATE

    def simulate(self, planned: Planned, budget_bytes: int, ideal_s: float, record: bool) -> SimResult:
        """The planned step here: the planner's own simulation (one GPU), or, for a traced step
        or a node of GPUs sharing their links, a simulation of its schedule."""
        if self.node is None and not record:
            return dataclasses.replace(planned.result, ideal_s=ideal_s)
        if self.node is None:
            return simulate(planned.schedule, self.hw, budget_bytes=budget_bytes, ideal_s=ideal_s, record=record)
        return simulate_node([planned.schedule] * self.node.gpus, self.node, budget_bytes=budget_bytes,
                             ideal_s=ideal_s, record=record)


def _load_target(hardware: str | None, node: str | None) -> Target:
    if node is not None:
        n = load_node(node)
        return Target(n.gpu, n)
    return Target(load_hardware(hardware or DEFAULT_HARDWARE), None)


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    out = {}
    for opt, name in (("seq", "seq"), ("micro_batch", "micro_batch"), ("layers", "layers")):
        v = getattr(args, opt, None)
        if v is not None:
            out[name] = v
    return out


@dataclass(frozen=True)
class Workload:
    """One model to simulate: a preset (by name) or a user's Hugging Face config (`--model`)."""

    name: str
    spec: ModelSpec
    preset: bool
    overridden: bool

    def profile(self, hw: Hardware, par: Parallel) -> StepProfile:
        return transformer_profile(self.spec, hw, par)


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
        out.append(Workload(n, spec, True, spec != PRESETS[n]))
    for path in models:
        from .model_config import spec_from_hf_config

        if args.seq is None or args.micro_batch is None:
            raise SlackSwapError(f"--model {path}: give --seq and --micro-batch too (a config.json holds the "
                                 f"model, not the shape of its training batches)")
        spec = spec_from_hf_config(path, seq=args.seq, micro_batch=args.micro_batch)
        if args.layers is not None:
            spec = dataclasses.replace(spec, layers=args.layers)
        out.append(Workload(spec.name, spec, False, False))
    return out


def _parallel(args: argparse.Namespace) -> Parallel:
    if getattr(args, "sp", False) and getattr(args, "tp", 1) == 1:
        raise SlackSwapError("--sp (sequence parallelism) splits along the tensor-parallel group: give --tp > 1")
    return Parallel(getattr(args, "tp", 1) or 1, bool(getattr(args, "sp", False)))


def _internal_error(what: str, e: BaseException) -> None:
    """Not a user error: say so on stderr (with the traceback when SLACKSWAP_DEBUG is set)."""
    print(f"slackswap: internal error in {what}: {type(e).__name__}: {e} (row marked 'error'"
          f"{'' if os.environ.get('SLACKSWAP_DEBUG') else '; set SLACKSWAP_DEBUG=1 for the traceback'})",
          file=sys.stderr, flush=True)
    if os.environ.get("SLACKSWAP_DEBUG"):
        traceback.print_exception(e, file=sys.stderr)


def run_one(profile: StepProfile, target: Target, planner: str, budget_bytes: int, ideal_s: float,
            record: bool = False) -> tuple[dict, Plan | None, SimResult | None]:
    """Plan and simulate one (profile, budget, planner): the row's measured fields, the plan, the result."""
    fn = get_planner(planner)
    try:
        with native_stdout_to_stderr():
            planned = fn(profile, target.hw, budget_bytes, share=target.share)
    except BudgetInfeasibleError as e:
        return {"feasible": False, "status": "infeasible", "error": refusal(planner, e)}, None, None
    except Exception as e:  # a planner bug: report it in the row and on stderr, keep sweeping
        _internal_error(f"planner {planner!r}", e)
        return {"feasible": False, "status": "error", "error": f"{type(e).__name__}: {e}"}, None, None
    plan = planned.plan
    try:
        res = target.simulate(planned, budget_bytes, ideal_s, record)
    except Exception as e:
        _internal_error(f"simulating the {planner!r} plan", e)
        return {"feasible": False, "status": "error", "error": f"{type(e).__name__}: {e}"}, plan, None
    by = plan.bytes_by_decision(profile)
    row = {
        "throughput_pct": 100.0 * res.throughput,
        "step_s": res.step_s,
        "peak_bytes": res.peak_bytes,
        "feasible": res.feasible,
        "status": "ok" if res.feasible else "over budget",
        "recompute_s": res.recompute_s,
        "stall_s": dict(res.stall_s),
        "swapped_bytes": by[Decision.SWAP],
        "recomputed_bytes": by[Decision.RECOMPUTE],
    }
    if not res.feasible:
        row["error"] = f"simulated peak {res.peak_bytes:,} B exceeds the budget of {budget_bytes:,} B"
    return row, plan, res


# ---- simulate ----------------------------------------------------------------------------------
_COLUMNS = ("planner", "thru %", "step ms", "peak GB", "peak/bud", "recomp ms", "swap GB", "feasible")
_WIDTHS = (20, 8, 10, 9, 10, 11, 9, 12)


def _table_row(cells: Sequence[str]) -> str:
    first, *rest = cells
    return "  " + f"{first:<{_WIDTHS[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(rest, _WIDTHS[1:]))


def _format_row(row: dict) -> str:
    if row["status"] in ("infeasible", "error"):
        return _table_row([row["planner"], *(["-"] * 6), row["status"]])
    return _table_row([
        row["planner"],
        f"{row['throughput_pct']:.1f}",
        f"{row['step_s'] * 1e3:.1f}",
        f"{row['peak_bytes'] / GB:.2f}",
        f"{row['peak_bytes'] / row['budget_bytes']:.3f}" if row["budget_bytes"] else "-",
        f"{row['recompute_s'] * 1e3:.1f}",
        f"{row['swapped_bytes'] / GB:.2f}",
        "yes" if row["feasible"] else "NO (over)",
    ])


def _header(wl: Workload, profile_name: str, target: Target, par: Parallel, ka: SimResult, budget: Budget,
            budget_bytes: int) -> list[str]:
    spec = wl.spec
    where = (f"{target.node.name} ({target.node.gpus}x {target.hw.name}, slowest rank)" if target.node
             else target.hw.name)
    if wl.preset:
        src = short_source(wl.name) + (" (shape overridden)" if wl.overridden else "")
    else:
        src = spec.source.split(";")[0]
    cut = "" if par == Parallel() else f", one rank of tp {par.tp}{' with sequence parallelism' if par.sp else ''}"
    lines = [
        f"{profile_name} on {where}: seq {spec.seq}, micro-batch {spec.micro_batch}, "
        f"{spec.layers} layers{cut}; source: {src}",
        f"  ideal step {ka.step_s * 1e3:.1f} ms, keep-all peak {_gb(ka.peak_bytes)}, "
        f"budget {_gb(budget_bytes)} ({budget_bytes:,} B = {budget_bytes / ka.peak_bytes:.0%} of keep-all)"
        if ka.peak_bytes else f"  ideal step {ka.step_s * 1e3:.1f} ms, keep-all peak 0 B, budget {budget_bytes:,} B",
        _table_row(_COLUMNS),
    ]
    return lines


def _paper_line(name: str, budget: Budget, rows: list[dict], hardware: str) -> str | None:
    if name not in PAPER_THROUGHPUT_PCT or not (budget.is_fraction and budget.value == 0.5):
        return None
    ours = next((r for r in rows if r["planner"] == "slackswap"), None)
    if ours is None or ours.get("throughput_pct") is None:
        ours_s = "slackswap not run" if ours is None else f"slackswap {ours['status']}"
    else:
        ours_s = f"{ours['throughput_pct']:.1f}%"
    return f"  paper ({PAPER}): {PAPER_THROUGHPUT_PCT[name]:.1f}%   ours (slackswap, {hardware}): {ours_s}"


def cmd_simulate(args: argparse.Namespace) -> int:
    if _is_job(args):
        return cmd_simulate_job(args)
    planners = _names(args.planner) or list(PLANNERS)
    budgets = list(dict.fromkeys(args.budget or [parse_budget("0.5")]))
    # Validate every name before any work, so a typo fails at once.
    workloads = _workloads(args, DEFAULT_WORKLOADS)
    for p in planners:
        get_planner(p)
    target = _load_target(args.hardware, args.node)
    par = _parallel(args)

    combos = len(workloads) * len(budgets)
    progress = combos > PROGRESS_ABOVE
    rows: list[dict] = []
    trace_res: SimResult | None = None
    trace_err: str | None = None
    trace_budget: int | None = None
    trace_title = ""
    done = 0
    out = sys.stdout
    for wi, wl in enumerate(workloads):
        name = wl.name
        profile = wl.profile(target.hw, par)
        ka = keep_all_result(profile, target.hw)
        for bi, budget in enumerate(budgets):
            t0 = time.perf_counter()
            budget_bytes = budget.of(profile.total_bytes)
            want_trace = bool(args.trace) and wi == 0 and bi == 0
            group: list[dict] = []
            for planner in planners:
                record = want_trace and planner == "slackswap"
                t1 = time.perf_counter()
                fields, plan, res = run_one(profile, target, planner, budget_bytes, ka.step_s, record=record)
                if time.perf_counter() - t1 > SLOW_PLANNER_S:
                    print(f"slackswap: note: {planner} took {time.perf_counter() - t1:.0f} s on {profile.name} "
                          f"at budget {budget}", file=sys.stderr, flush=True)
                row = {
                    "workload": name,
                    "budget": budget.json_value,
                    "hardware": target.name,
                    "planner": planner,
                    "throughput_pct": None,
                    "step_s": None,
                    "ideal_s": ka.step_s,
                    "peak_bytes": None,
                    "budget_bytes": budget_bytes,
                    **fields,
                }
                group.append(row)
                if record:
                    trace_res, trace_err = res, fields.get("error") if res is None else None
            if want_trace and "slackswap" not in planners:
                fields, _, trace_res = run_one(profile, target, "slackswap", budget_bytes, ka.step_s, record=True)
                trace_err = fields.get("error") if trace_res is None else None
            if want_trace:
                trace_budget = budget_bytes
                trace_title = f"slackswap plan: {profile.name} on {target.name}, budget {budget} ({budget_bytes:,} B)"
            rows.extend(group)
            done += 1
            if progress:
                print(f"[{done}/{combos}] {name} budget {budget}: {len(planners)} planners in "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            if not args.json:
                print("\n".join(_header(wl, profile.name, target, par, ka, budget, budget_bytes)), file=out)
                for row in group:
                    print(_format_row(row), file=out)
                plain = wl.preset and not wl.overridden and par == Parallel()
                paper = _paper_line(name, budget, group, target.name) if plain else None
                if paper:
                    print(paper, file=out)
                for row in group:
                    if row["status"] in ("infeasible", "error", "over budget"):
                        print(f"  {row['planner']}: {row['status']}: {row['error']}", file=out)
                print(file=out, flush=True)

    if args.json:
        json.dump([{k: v for k, v in r.items() if k != "status"} for r in rows], out, indent=1)
        out.write("\n")
        out.flush()
    rc = 0
    if args.trace:
        if trace_res is None:
            print(f"slackswap: error: no trace written: the slackswap plan could not be simulated: {trace_err}",
                  file=sys.stderr)
            rc = 1
        else:
            from .report import write_trace

            write_trace(trace_res, args.trace, title=trace_title, budget_bytes=trace_budget)
            print(f"slackswap: trace of the slackswap step written to {args.trace}", file=sys.stderr)
    if args.plot:
        from .report import plot_sweep

        plot_sweep(rows, args.plot)
        print(f"slackswap: sweep plot written to {args.plot}", file=sys.stderr)
    return rc


# ---- a whole job: pipeline stages, data parallelism, ZeRO -----------------------------------------
JOB_PLANNERS = ("slackswap", "full-recompute", "megatron-selective", "offload-all")  # the MILP is slow on whole stages
DEFAULT_JOB_NODE = "dgx-a100"


def _is_job(args: argparse.Namespace) -> bool:
    return (args.pp, args.dp, args.zero, args.micro_batches, args.offload_optimizer, args.overlap_comm) != \
        (1, 1, 0, 1, False, False)


def cmd_simulate_job(args: argparse.Namespace) -> int:
    """One step of a job cut across GPUs (`pipeline.simulate_job`): per planner, the step time
    against the keep-all ideal, and per stage its peak, budget and plan."""
    from .pipeline import Job, ideal_step_s, simulate_job

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
    rows, out = [], sys.stdout
    for wl in _workloads(args, ("llama-70b",)):
        job = Job(wl.spec, par, args.pp, args.dp, args.micro_batches, args.zero, args.offload_optimizer,
                  args.overlap_comm)
        ideal = ideal_step_s(job, node)
        for budget in budgets:
            if not budget.is_fraction:
                raise SlackSwapError("with --pp a budget is a fraction of each stage's keep-all peak (e.g. 0.5)")
            results = []
            for planner in planners:
                try:
                    with native_stdout_to_stderr():
                        results.append((planner, simulate_job(job, node, budget.value, planner, ideal_s=ideal), None))
                except BudgetInfeasibleError as e:
                    results.append((planner, None, str(e)))
            rows += [_job_row(wl, job, node, budget, planner, res, err, ideal) for planner, res, err in results]
            if not args.json:
                print("\n".join(_job_table(wl, job, node, budget, results, ideal)), file=out, flush=True)
    if args.json:
        json.dump(rows, out, indent=1)
        out.write("\n")
    return 0


def _job_row(wl: Workload, job, node: Node, budget: Budget, planner: str, res, err: str | None, ideal: float) -> dict:
    row = {"workload": wl.name, "node": node.name, "tp": job.par.tp, "sp": job.par.sp, "pp": job.pp, "dp": job.dp,
           "zero": job.zero, "micro_batches": job.micro_batches, "offload_optimizer": job.offload_optimizer,
           "overlap_comm": job.overlap_grad_comm,
           "budget": budget.json_value, "planner": planner, "ideal_s": ideal, "feasible": res is not None}
    if res is None:
        return {**row, "error": err}
    return {**row, "step_s": res.step_s, "throughput_pct": 100 * res.throughput, "pipeline_s": res.pipeline_s,
            "grad_comm_s": res.grad_comm_s, "optimizer_s": res.optimizer_s,
            "stages": [{"stage": s.stage, "layers": [s.layers.start, s.layers.stop], "in_flight": s.in_flight,
                        "keep_all_bytes": s.keep_all_bytes, "budget_bytes": s.budget_bytes, "peak_bytes": res.peaks[i],
                        "kept_bytes": s.kept_bytes, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s,
                        "swapped_bytes": s.plan.bytes_by_decision(s.profile)[Decision.SWAP],
                        "recompute_s": s.result.recompute_s, "plan_digest": s.plan.digest}
                       for i, s in enumerate(res.stages)]}


def _job_table(wl: Workload, job, node: Node, budget: Budget, results: list, ideal: float) -> list[str]:
    cut = f"tp {job.par.tp}{' + sp' if job.par.sp else ''}, pp {job.pp}, dp {job.dp}, zero {job.zero}" + \
        (" with optimizer offload" if job.offload_optimizer else "") + \
        (", gradients reduced during backward" if job.overlap_grad_comm else "")
    lines = [f"{wl.spec.name} on {node.name} ({job.gpus} GPUs: {cut}): {job.micro_batches} micro-batches of "
             f"{wl.spec.micro_batch} x {wl.spec.seq} per step and pipeline, 1F1B",
             f"  ideal step {ideal:.3f} s (every activation kept); budget {budget} of each stage's keep-all peak",
             f"  {'planner':<20}{'thru %':>8}{'step s':>9}{'1F1B s':>9}{'grads s':>9}{'optim s':>9}{'worst peak/budget':>19}"]
    for planner, res, err in results:
        if res is None:
            lines.append(f"  {planner:<20}{'-':>8}  infeasible: {err}")
            continue
        worst = max(p / s.budget_bytes for p, s in zip(res.peaks, res.stages))
        lines.append(f"  {planner:<20}{100 * res.throughput:>8.1f}{res.step_s:>9.3f}{res.pipeline_s:>9.3f}"
                     f"{res.grad_comm_s:>9.3f}{res.optimizer_s:>9.3f}{worst:>19.3f}")
    for planner, res, _ in results:
        if res is None or planner != results[0][0]:
            continue
        lines.append(f"  stages under {planner} (one rank of each; per micro-batch: fwd, bwd, swapped, recompute):")
        lines.append("    stage  layers   in-flight  keep-all GB  budget GB  peak GB  kept GB/mb  swap GB/mb  "
                     "recomp ms  fwd ms  bwd ms  plan")
        for i, s in enumerate(res.stages):
            swap = s.plan.bytes_by_decision(s.profile)[Decision.SWAP]
            lines.append(f"    {i:>5}  {s.layers.start:>3}-{s.layers.stop - 1:<3}  {s.in_flight:>9}  "
                         f"{s.keep_all_bytes / GB:>11.2f}  {s.budget_bytes / GB:>9.2f}  {res.peaks[i] / GB:>7.2f}  "
                         f"{s.kept_bytes / GB:>10.2f}  {swap / GB:>10.2f}  {s.result.recompute_s * 1e3:>9.1f}  "
                         f"{s.fwd_s * 1e3:>6.1f}  {s.bwd_s * 1e3:>6.1f}  {s.plan.digest[:12]}")
    lines.append("")
    return lines


# ---- plan --------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    get_planner(args.planner)
    if _is_job(args):
        raise SlackSwapError("slackswap plan makes one rank's plan; for a job across stages use slackswap simulate --pp")
    if args.workload is None and not args.model:
        raise SlackSwapError("give --workload W or --model config.json")
    if args.workload is not None and args.model:
        raise SlackSwapError("give --workload or --model, not both (a plan is for one model)")
    (wl,) = _workloads(args, ())
    target = _load_target(args.hardware, args.node)
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
    by = plan.bytes_by_decision(profile)
    count = {d: len(plan.keys(d)) for d in Decision}
    print(
        f"{args.planner} plan for {profile.name} on {target.name}, budget {args.budget} = {_gb(budget_bytes)}: "
        f"keep {count[Decision.KEEP]} ({_gb(by[Decision.KEEP])}), swap {count[Decision.SWAP]} "
        f"({_gb(by[Decision.SWAP])}), recompute {count[Decision.RECOMPUTE]} ({_gb(by[Decision.RECOMPUTE])}); "
        f"simulated {100 * res.throughput:.1f}% of ideal, peak {_gb(res.peak_bytes)}"
        f"{'' if res.feasible else ' (OVER BUDGET)'}; digest {plan.digest[:12]} -> {args.output}",
        file=summary_out,
    )
    return 0 if res.feasible else 1


# ---- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    gpus, nodes = preset_names("gpu"), preset_names("node")
    parser = argparse.ArgumentParser(prog="slackswap", description="SlackSwap activation-memory planner for DeepSpeed.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hardware", metavar="H",
                       help=f"GPU preset or hardware JSON file (default {DEFAULT_HARDWARE}; presets: {', '.join(gpus)})")
        p.add_argument("--node", metavar="N",
                       help=f"node preset or JSON file; simulates all its GPUs sharing host links "
                            f"(presets: {', '.join(nodes)}); its GPU replaces --hardware")
        p.add_argument("--seq", type=_positive_int, metavar="S", help="override the sequence length")
        p.add_argument("--micro-batch", type=_positive_int, metavar="M", help="override the micro-batch size")
        p.add_argument("--layers", type=_positive_int, metavar="L", help="override the number of layers")
        p.add_argument("--tp", type=_positive_int, default=1, metavar="T",
                       help="tensor-parallel degree: simulate one rank of a Megatron-style T-way cut (default 1)")
        p.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism (Korthikanti et al.)")
        p.add_argument("--pp", type=_positive_int, default=1, metavar="P",
                       help="pipeline stages (1F1B); with --pp/--dp/--zero, simulate a whole job on --node")
        p.add_argument("--dp", type=_positive_int, default=1, metavar="D", help="data-parallel replicas (default 1)")
        p.add_argument("--zero", type=int, choices=(0, 1, 2), default=0, help="DeepSpeed ZeRO stage (default 0)")
        p.add_argument("--micro-batches", type=_positive_int, default=1, metavar="M",
                       help="micro-batches per step and pipeline (gradient accumulation; default 1)")
        p.add_argument("--offload-optimizer", action="store_true",
                       help="ZeRO-Offload: optimizer state and step on the CPU (needs --zero 1 or 2)")
        p.add_argument("--overlap-comm", action="store_true",
                       help="reduce each layer's gradients while backward goes on (DeepSpeed's overlap_comm)")

    sim = sub.add_parser("simulate", help="simulate planners on workloads and compare throughput",
                         description="Plan and simulate one training step per (workload, budget, planner).")
    sim.add_argument("--workload", "-w", action="extend", nargs="+", metavar="W",
                     help=f"workload preset(s) (default {' '.join(DEFAULT_WORKLOADS)}; 'all' or any of "
                          f"{', '.join(workload_names())})")
    sim.add_argument("--model", action="append", metavar="CONFIG",
                     help="a Hugging Face config.json (or its folder) to simulate, with --seq and --micro-batch; "
                          "families: gpt2, bert, llama, mistral, qwen2, mixtral")
    sim.add_argument("--budget", "-b", action="extend", nargs="+", type=parse_budget, metavar="B",
                     help="activation budget(s): a fraction of the keep-all peak (0.5, 50%%) or a size "
                          "(12GiB, 16GB, 8e9); default 0.5")
    sim.add_argument("--planner", "-p", action="extend", nargs="+", metavar="P",
                     help=f"planner(s) (default all: {', '.join(PLANNERS)})")
    common(sim)
    sim.add_argument("--json", action="store_true", help="print a JSON list of rows instead of tables")
    sim.add_argument("--trace", metavar="FILE",
                     help="write the Chrome/Perfetto trace of the slackswap step for the first workload and budget")
    sim.add_argument("--plot", metavar="FILE", help="write a PNG of throughput vs budget (needs matplotlib)")
    sim.set_defaults(func=cmd_simulate)

    pl = sub.add_parser("plan", help="make a plan and write it as JSON",
                        description="Make one plan for a workload and budget and write it (Plan JSON).")
    pl.add_argument("--workload", "-w", metavar="W", help=f"workload preset ({', '.join(workload_names())})")
    pl.add_argument("--model", action="append", metavar="CONFIG",
                    help="instead of --workload: a Hugging Face config.json, with --seq and --micro-batch")
    pl.add_argument("--budget", "-b", required=True, type=parse_budget, metavar="B",
                    help="activation budget: fraction of the keep-all peak or a size (12GiB)")
    pl.add_argument("--planner", "-p", default="slackswap", metavar="P",
                    help=f"planner (default slackswap; {', '.join(PLANNERS)})")
    common(pl)
    pl.add_argument("--output", "-o", required=True, metavar="FILE", help="where to write the plan ('-' = stdout)")
    pl.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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


if __name__ == "__main__":
    raise SystemExit(main())

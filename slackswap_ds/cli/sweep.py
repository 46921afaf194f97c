"""Sweeping for ``slackswap simulate``: plan and simulate every planner on every (workload, budget),
on one GPU or a node of them, or a whole job across stages, and return the rows (the objects
``--json`` prints). Nothing here formats a table: `sim_report.py` does, and the command
(`cli/__init__.py`) prints. Progress, slow-planner notes and internal errors go to stderr as the
sweep goes; a planner that fails marks its row and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from ..budget import Budget, auto_budget_bytes, model_state_bytes
from ..errors import BudgetInfeasibleError
from ..hardware import Hardware, Node
from ..job_memory import device_fits, device_state, stage_budgets, tokens_per_s
from ..pipeline import Job, StepResult, ideal_step_s, simulate_job
from ..plan import Decision, Plan
from ..planners import Planned, get_planner, keep_all_result, refusal
from ..shares import PRIVATE, Share
from ..sim_report import short_source
from ..simulator import SimResult, simulate, simulate_node
from ..step_profile import StepProfile
from ..workloads import ModelSpec, Parallel, model_params, transformer_profile

PROGRESS_ABOVE = 6  # (workload, budget) combinations above which progress goes to stderr
SLOW_PLANNER_S = 10.0  # a planner slower than this gets a note on stderr


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

    @property
    def where(self) -> str:
        """The target as a table header names it."""
        return (f"{self.node.name} ({self.node.gpus}x {self.hw.name}, slowest rank)" if self.node
                else self.hw.name)

    def simulate(self, planned: Planned, budget_bytes: int, ideal_s: float, record: bool) -> SimResult:
        """The planned step here: the planner's own simulation (one GPU), or, for a traced step
        or a node of GPUs sharing their links, a simulation of its schedule."""
        if self.node is None and not record:
            return dataclasses.replace(planned.result, ideal_s=ideal_s)
        if self.node is None:  # on purpose: the planner's simulation recorded no events to trace
            return simulate(planned.schedule, self.hw, budget_bytes=budget_bytes, ideal_s=ideal_s, record=record)
        # on purpose: the planner simulated one GPU on its share; here every GPU of the node runs at once
        return simulate_node([planned.schedule] * self.node.gpus, self.node, budget_bytes=budget_bytes,
                             ideal_s=ideal_s, record=record)


@dataclass(frozen=True)
class Workload:
    """One model to simulate: a preset (by name) or a user's Hugging Face config (`--model`)."""

    name: str
    spec: ModelSpec
    preset: bool
    overridden: bool

    def profile(self, hw: Hardware, par: Parallel) -> StepProfile:
        return transformer_profile(self.spec, hw, par)

    @property
    def source_note(self) -> str:
        """Where the model comes from, in a line: a preset's paper and repository, a config's file and type."""
        if self.preset:
            return short_source(self.spec.source) + (" (shape overridden)" if self.overridden else "")
        return self.spec.source.split(";")[0]


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
        planned = getattr(e, "planned", None)  # an anchor's plan, made blind to this share: shown over budget
        if planned is None:
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
        "kept_bytes": by[Decision.KEEP],
        "swapped_bytes": by[Decision.SWAP],
        "recomputed_bytes": by[Decision.RECOMPUTE],
        "packed_bytes": plan.packed_bytes(profile)[0],  # (kept or swapped, before packing)
        "pack_s": sum(2 * profile.by_key[k].pack_s for k in plan.packed),  # (its kernels, packing and unpacking)
    }
    if planned.search:  # how the default planner found its plan (planners/refine.py)
        row["search"], row["found"] = planned.search, planned.found
    if not res.feasible:
        row["error"] = f"simulated peak {res.peak_bytes:,} B exceeds the budget of {budget_bytes:,} B"
    return row, plan, res


def fits(fields: dict, state: int, spec: ModelSpec, hw: Hardware) -> dict:
    """A row's tokens per second (one GPU's micro-batch over its step), the model state beside its
    activations, and whether both fit the GPU's memory (None where the planner made no plan)."""
    step_s, peak = fields.get("step_s"), fields.get("peak_bytes")
    return {"tokens_per_s": spec.seq * spec.micro_batch / step_s if step_s else None, "model_state_bytes": state,
            "device_bytes": int(hw.hbm_bytes), "fits": state + peak <= hw.hbm_bytes if peak is not None else None}


# ---- a sweep -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traced:
    """The slackswap step of the first workload and budget, simulated with its events for --trace."""

    result: SimResult | None
    error: str | None  # why there is no result
    budget_bytes: int
    title: str


@dataclass(frozen=True)
class Group:
    """One (workload, budget) of a sweep: a row per planner, as `--json` prints them."""

    workload: Workload
    profile_name: str
    keep_all: SimResult
    budget: Budget
    budget_bytes: int
    rows: list[dict]
    traced: Traced | None
    model_state_bytes: int  # one rank's weights, gradients and Adam state (budget.model_state_bytes)


@dataclass(frozen=True)
class Sweep:
    """What `slackswap simulate` runs: every planner on every (workload, budget), on one target."""

    workloads: list[Workload]
    profiles: list[StepProfile]  # each workload's, on the target's GPU: built (and checked) before any work
    budgets: list[Budget]
    planners: list[str]
    target: Target
    par: Parallel
    trace: bool  # simulate the first workload and budget's slackswap step with its events

    def groups(self) -> Iterator[Group]:
        """The groups in order, each as soon as its planners are done (progress on stderr)."""
        combos = len(self.workloads) * len(self.budgets)
        done = 0
        for wi, (wl, profile) in enumerate(zip(self.workloads, self.profiles)):
            ka = keep_all_result(profile, self.target.hw)
            for bi, budget in enumerate(self.budgets):
                t0 = time.perf_counter()
                group = self._group(wl, profile, ka, budget, trace=self.trace and wi == 0 and bi == 0)
                done += 1
                if combos > PROGRESS_ABOVE:
                    print(f"[{done}/{combos}] {wl.name} budget {budget}: {len(self.planners)} planners in "
                          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                yield group

    def _group(self, wl: Workload, profile: StepProfile, ka: SimResult, budget: Budget, trace: bool) -> Group:
        """Every planner at one budget; with `trace`, the slackswap step simulated with its events too."""
        state = model_state_bytes(model_params(wl.spec, self.par))  # one rank, no ZeRO: --dp/--zero for a job
        target = self.target
        budget_bytes = budget.of(profile.total_bytes, auto_budget_bytes(target.hw.hbm_bytes, state))
        rows: list[dict] = []
        trace_res = trace_err = None
        for planner in self.planners:
            record = trace and planner == "slackswap"
            t1 = time.perf_counter()
            fields, _, res = run_one(profile, target, planner, budget_bytes, ka.step_s, record=record)
            if time.perf_counter() - t1 > SLOW_PLANNER_S:
                print(f"slackswap: note: {planner} took {time.perf_counter() - t1:.0f} s on {profile.name} "
                      f"at budget {budget}", file=sys.stderr, flush=True)
            rows.append({
                "workload": wl.name,
                "budget": budget.json_value,
                "hardware": target.name,
                "planner": planner,
                "throughput_pct": None,
                "step_s": None,
                "ideal_s": ka.step_s,
                "peak_bytes": None,
                "budget_bytes": budget_bytes,
                **fields,
                **fits(fields, state, wl.spec, target.hw),
            })
            if record:
                trace_res, trace_err = res, fields.get("error") if res is None else None
        if trace and "slackswap" not in self.planners:  # traced on purpose, though not in the table
            fields, _, trace_res = run_one(profile, target, "slackswap", budget_bytes, ka.step_s, record=True)
            trace_err = fields.get("error") if trace_res is None else None
        traced = None
        if trace:
            title = f"slackswap plan: {profile.name} on {target.name}, budget {budget} ({budget_bytes:,} B)"
            traced = Traced(trace_res, trace_err, budget_bytes, title)
        return Group(wl, profile.name, ka, budget, budget_bytes, rows, traced, state)


# ---- a whole job ------------------------------------------------------------------------------
def job_groups(jobs: list[tuple[Workload, Job]], node: Node, budgets: list[Budget],
               planners: list[str]) -> Iterator[tuple[Workload, Job, Budget, list, float]]:
    """Per job and budget, as soon as its planners are done: (workload, job, budget, `simulate_job_planners`,
    the job's ideal step). A size or "auto" is each GPU's (`job_memory.stage_budgets`)."""
    for wl, job in jobs:
        ideal = ideal_step_s(job, node)
        for budget in budgets:
            per_stage = stage_budgets(job, node.gpu.hbm_bytes, budget)
            yield wl, job, budget, simulate_job_planners(job, node, per_stage, planners, ideal), ideal


def simulate_job_planners(job: Job, node: Node, budgets: tuple[Budget, ...], planners: list[str],
                          ideal: float) -> list[tuple[str, StepResult | None, str | None]]:
    """One step of `job` per planner, each stage within its budget: (planner, its step, None) or
    (planner, None, why it is infeasible)."""
    results = []
    for planner in planners:
        try:
            with native_stdout_to_stderr():
                results.append((planner, simulate_job(job, node, budgets, planner, ideal_s=ideal), None))
        except BudgetInfeasibleError as e:
            results.append((planner, None, str(e)))
    return results


def job_row(wl: Workload, job: Job, node: Node, budget: Budget, planner: str, res: StepResult | None, err: str | None,
            ideal: float) -> dict:
    """A job's row as `--json` prints it: the cut, the budget, the step, per GPU what it holds and
    whether it fits (`job_memory`), and per stage its plan."""
    row = {"workload": wl.name, "node": node.name, "tp": job.par.tp, "sp": job.par.sp, "pp": job.pp, "dp": job.dp,
           "zero": job.zero, "micro_batches": job.micro_batches, "offload_optimizer": job.offload_optimizer,
           "overlap_comm": job.overlap_grad_comm, "schedule": job.schedule, "chunks": job.chunks,
           "sharding": job.sharding, "grad_reduce_bytes": job.grad_reduce_bytes,
           "budget": budget.json_value, "planner": planner, "ideal_s": ideal, "feasible": res is not None,
           "device_bytes": int(node.gpu.hbm_bytes)}
    states = [device_state(job, d) for d in range(job.pp)]
    devices = [{"device": s.device, "params": s.params, "model_state_bytes": s.state_bytes,
                "gathered_bytes": s.gathered} for s in states]
    if res is None:
        return {**row, "devices": devices, "error": err}
    fit = device_fits(job, res, node.gpu.hbm_bytes)
    devices = [{**d, "peak_bytes": res.peaks[i], "fits": fit[i]} for i, d in enumerate(devices)]
    return {**row, "step_s": res.step_s, "throughput_pct": 100 * res.throughput, "pipeline_s": res.pipeline_s,
            "grad_comm_s": res.grad_comm_s, "optimizer_s": res.optimizer_s,
            "tokens_per_s": tokens_per_s(job, res), "fits": all(fit), "devices": devices,
            "stages": [{"stage": s.stage, "layers": [s.layers.start, s.layers.stop], "in_flight": s.in_flight,
                        "keep_all_bytes": s.keep_all_bytes, "budget_bytes": s.budget_bytes, "peak_bytes": res.stage_device_peak(i),
                        "kept_bytes": s.kept_bytes, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s,
                        "swapped_bytes": s.plan.bytes_by_decision(s.profile)[Decision.SWAP],
                        "recompute_s": s.result.recompute_s, "plan_digest": s.plan.digest}
                       for i, s in enumerate(res.stages)]}

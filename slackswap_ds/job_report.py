"""What a job reports while it trains and when it ends (rank 0: the logger filters the others):
measured steps against the plan's prediction after the first planned step and every `log_every`
after it; the job's summary when it ends (`JobSummary`: logged, and written as JSON); and Chrome
traces of the predicted and the first measured step (`trace_file`)."""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import signal
import statistics
import time
import weakref
from typing import Iterable, Mapping

from .config import SlackSwapConfig
from .files import write_atomically
from .hardware import Hardware
from .logs import EVERY_RANK, SAME_ON_EVERY_RANK, job_rank, log
from .plan import Plan
from .plan_maker import Agreed, fate_bytes
from .shapes import Prediction, ShapeState

KINDS = ("warm-up", "profiled", "planned", "shelter")  # how a step ran (lifecycle.py)
# lifecycle transitions that can repeat every step (a padding collator's new lengths): said the first
# time, then counted in the periodic report
TALLIED = frozenset({"DERIVED", "PLANNED_ALONE", "REFITTED", "UNDERIVABLE", "NO_PLAN", "STALE", "PROFILED_AGAIN",
                     "REPLANNED", "ABANDONED", "FALLBACK_PLANNER", "SHELTER"})


class StepReports:
    """Every step of the job goes through here: planned ones (`step`) are reported against their
    prediction, the first of the job at once and then every `log_every`, with a warning if saved
    tensors were not placed as planned (to host, or kept); all of them (`unplanned` too) feed the
    job's summary."""

    def __init__(self, cfg: SlackSwapConfig, hw: Hardware, device_type: str = "cuda"):
        self.cfg, self.hw, self.device_type = cfg, hw, device_type
        self.summary = JobSummary()
        self.summarized = False  # end_of_job ran
        self.last: float | None = None  # when the previous step's backward ended (of any kind)
        self.reported = False  # the job's first planned step has been reported
        self._start()

    def _start(self) -> None:
        self.elapsed, self.timed = 0.0, 0  # wall clock from one step's end to the next planned step's
        self.steps = 0
        self.worst: tuple[float, int, Prediction | None, int] = (-1.0, 0, None, 0)  # (peak/budget, peak, its plan's)
        self.over = 0  # planned steps over their plan's budget
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.budget_waits = 0
        self.events: collections.Counter[str] = collections.Counter()  # what steps did (lifecycle transitions)

    def _tick(self) -> float | None:
        """Seconds since the previous step ended (None for the job's first)."""
        now = time.perf_counter()
        seconds, self.last = (now - self.last if self.last is not None else None), now
        return seconds

    def end_of_job(self, stage: int | None = None, lead: bool = False, state: str = "finished",
                   **counters: int) -> dict | None:
        """The job's summary (`counters`: the runtime's own, JobSummary.data; `state`: how the job
        ended), once (then None; None if no step ran). Every rank writes its own as JSON (rank 0 at
        `summary_file`, rank r beside it as `<summary>.rank<r>.json`; under pipeline parallelism a
        stage's first rank its stage's, `<summary>.stage<i>.json` for stages after the first); rank
        0 (a stage's first rank) says it."""
        if self.summarized or not sum(self.summary.counts.values()):
            return None
        self.summarized = True
        data = self.summary.data(**counters) | {"state": state, "rank": job_rank(), "device_type": self.device_type}
        if stage is not None:
            data["stage"] = stage
        path = self.summary_file(stage)
        if stage is None or lead:
            say_summary(data, path)
        return data

    def summary_file(self, stage: int | None = None) -> str | None:
        """This rank's summary file (None: none asked for; under pipeline parallelism, its stage's)."""
        path, rank = summary_path(self.cfg), job_rank()
        if path is None or (stage is None and rank == 0) or stage == 0:
            return path
        return trace_path(path, f"stage{stage}" if stage is not None else f"rank{rank}")

    def started(self, stage: int | None = None) -> None:
        """The job's first step: its summary file says the job runs (a file of an earlier job is
        never left looking like this one's)."""
        path = self.summary_file(stage)
        if path:
            try:
                write_atomically(path, json.dumps({"state": "running", "rank": job_rank()}) + "\n")
            except OSError:  # (said when the summary is written: say_summary)
                pass

    def unplanned(self, kind: str, peak_bytes: int, fallbacks: Mapping[str, int], events: Iterable = ()) -> None:
        """A warm-up, profiled or shelter step ended (`events`: its lifecycle transitions, tallied)."""
        self.summary.step(kind, self._tick(), peak_bytes, fallbacks)
        self.events.update(e.value for e in events if e.name in TALLIED)

    def step(self, plan: Plan, prediction: Prediction, peak_bytes: int, fallbacks: Mapping[str, int],
             shapes: str = "", keep_all: int | None = None, moved: tuple[int, int, int] = (0, 0, 0),
             events: Iterable = (), budget_waits: int = 0, hooks_host_s: float = 0.0) -> None:
        """A planned step ended (`moved`: its swapped, recomputed and packed bytes; `events`: its lifecycle
        transitions; `budget_waits`: copy-outs the host waited for to stay within the budget;
        `hooks_host_s`: host seconds in SlackSwap's hooks, against the plan's predicted kernel time). Each
        step's peak is held against its own plan's budget: the report names the step closest to (or
        furthest over) its budget, with that plan's prediction and budget."""
        seconds = self._tick()
        self.summary.step("planned", seconds, peak_bytes, fallbacks, plan, shapes, keep_all, moved, budget_waits)
        self.summary.host(hooks_host_s, prediction.step_s)
        if seconds is not None:
            self.elapsed += seconds
            self.timed += 1
        self.steps += 1
        self.worst = max(self.worst, (peak_bytes / max(1, plan.budget_bytes), peak_bytes, prediction,
                                      plan.budget_bytes), key=lambda w: w[0])
        self.over += peak_bytes > plan.budget_bytes
        self.fallbacks.update(fallbacks)
        self.budget_waits += budget_waits
        self.events.update(e.value for e in events if e.name in TALLIED)
        if not self.cfg.log_every or (self.reported and self.steps < self.cfg.log_every):
            return
        self.reported = True
        self._report()

    def _report(self) -> None:
        _, peak, prediction, budget = self.worst
        per_step = f"{1e3 * self.elapsed / self.timed:.1f} ms" if self.timed else "(not timed)"
        log.info("slackswap: last %d planned steps: %s per step (wall clock, optimizer included; the plan "
                 "predicts %.1f ms for forward and backward on %s%s), peak of saved activations %s B (predicted "
                 "%s B, budget %s B)%s", self.steps, per_step, 1e3 * prediction.step_s, self.hw.name,
                 measured_on(self.device_type), f"{peak:,}", f"{prediction.peak_bytes:,}", f"{budget:,}",
                 f"; {self.over} step(s) over their plan's budget" if self.over else "")
        if self.budget_waits:
            log.info("slackswap: in the last %d steps the host waited %d time(s) for a copy-out to end so that a save "
                     "stayed within the budget: the copies were slower than the plan timed them", self.steps,
                     self.budget_waits)
        if self.events:
            log.info("slackswap: since the last report: %s",
                     "; ".join(f"{n} x {what}" for what, n in sorted(self.events.items(), key=lambda e: (-e[1], e[0]))))
        if self.fallbacks:
            log.warning("slackswap rank %d: in the last %d steps, saved tensors not placed as planned: %s", job_rank(),
                        self.steps, ", ".join(f"{n} x {why}" for why, n in sorted(self.fallbacks.items())))
        self._start()


def measured_on(device_type: str) -> str:
    """Said beside a prediction whose op times were profiled on something other than a GPU (a CPU
    job's plan is made for a GPU preset's copies, but its compute times are this CPU's)."""
    return "" if device_type == "cuda" else f", with op times measured on this {device_type.upper()}"


def below_floor(cfg: SlackSwapConfig, shelter_peak: int) -> str | None:
    """What to say of a budget in bytes below what a warm-up step held with every saved tensor on
    host (`shelter_peak`: what an op reads at once, the least any plan holds), or None: no plan can
    keep it, and the smallest budget that works is about that peak."""
    budget = cfg.budget
    if budget.is_fraction or budget.is_auto or shelter_peak <= budget.of(0):
        return None
    return (f"activation_budget {cfg.activation_budget} ({budget.of(0):,} B) is less than this model's steps hold on "
            f"the device with every saved tensor on host ({shelter_peak:,} B in the warm-up: what an op reads at "
            f"once): no plan can keep it; the smallest budget that works is about {shelter_peak:,} B")


def say_compiled_anew(step: int, compiled: frozenset[str], before: frozenset[str], warmup_steps: int) -> None:
    log.warning("slackswap: the model's compilation changed at step %d (compiled parts %s, before %s): the plans "
                "made for it are dropped, and its input shapes are profiled and planned again after %d warm-up "
                "step(s) in the shelter. Compile the model before its first step to avoid this",
                step, sorted(compiled) or "none", sorted(before) or "none", warmup_steps, extra=SAME_ON_EVERY_RANK)


def say_own_plan(who: str, shapes: str, state: ShapeState, how: str, holds: int | None, device_type: str,
                 level: int = logging.INFO) -> None:
    """A plan a rank made alone, for input shapes of its own (every rank says its own; `who`: `rank
    r`, or `stage s rank r` with `holds` micro-batches in flight)."""
    plan = state.plan
    own = "" if holds is None else f" of this rank's own ({holds} micro-batch(es) in flight),"
    log.log(level, "slackswap %s: input shapes %s: plan %s%s %s; budget %s B of %s B keep-all; %s; planner %s%s "
             "predicts %.1f%% of ideal throughput%s", who, shapes, plan.digest[:12], own, how, f"{plan.budget_bytes:,}",
             f"{(holds or 1) * state.profile.total_bytes:,}", fate_bytes(plan, state.profile), plan.planner,
             in_parens(state.search), 100 * state.prediction.throughput, measured_on(device_type), extra=EVERY_RANK)


def say_replaced_checkpointing(cfg: SlackSwapConfig, profile_bytes: int, budget: int, held: int) -> None:
    """The model's own activation checkpointing ran inline (SlackSwap replaced it): what it held
    (`held`: every layer recomputed), and what the plan holds (`budget`; keep-all `profile_bytes`):
    the same where the user set no `activation_budget`, else said as set, and warned where more."""
    if "activation_budget" not in cfg.model_fields_set:
        log.info("slackswap: this model's own activation checkpointing is replaced by the plan, within what it held: "
                 "budget %s B (every layer recomputed holds that; keep-all %s B). activation_budget is not set: "
                 "give one to trade memory for speed", f"{budget:,}", f"{profile_bytes:,}")
    elif budget > held:
        log.warning("slackswap: this model's own activation checkpointing is replaced by the plan, and activation_budget "
                    "%s (%s B) is more than the replaced checkpointing held (%s B, every layer recomputed; keep-all %s "
                    "B): the job may hold more activation memory than before; leave activation_budget unset to hold "
                    "what it held", cfg.activation_budget, f"{budget:,}", f"{held:,}", f"{profile_bytes:,}")
    else:
        log.info("slackswap: this model's own activation checkpointing is replaced by the plan: keep-all %s B, budget "
                 "%s B (activation_budget %s); the replaced checkpointing would have held %s B (every layer "
                 "recomputed)", f"{profile_bytes:,}", f"{budget:,}", cfg.activation_budget, f"{held:,}")


def say_agreed_plan(state: ShapeState, agreed: Agreed, coordinator, hw: Hardware, device_type: str) -> None:
    """One plan line per job (rank 0's), and one from each rank whose link share differs."""
    plan, shares = agreed.plan, coordinator.shares
    channel = coordinator.job_channel()
    rank_hw = shares.own.limit(hw)  # this rank's link as shared with its neighbours
    throughput = 100 * state.prediction.throughput
    if channel.rank == 0:
        log.info("slackswap rank 0: budget %s B of %s B keep-all; %s; planner %s%s on %s (link share D2H %.1f / "
                 "H2D %.1f GB/s) predicts %.1f%% of ideal throughput%s; plan %s agreed over %s by %d ranks",
                 f"{plan.budget_bytes:,}", f"{state.profile.total_bytes:,}", fate_bytes(plan, state.profile),
                 plan.planner, found_by(agreed), hw.name, rank_hw.d2h_bps / 1e9, rank_hw.h2d_bps / 1e9, throughput,
                 measured_on(device_type), plan.digest[:12], coordinator.via, channel.world)
    elif shares.own != shares.lead:  # the same plan; what differs on this rank
        log.info("slackswap rank %d: plan %s with this rank's link share D2H %.1f / H2D %.1f GB/s and pool %s "
                 "(rank 0 differs) predicts %.1f%% of ideal throughput", channel.rank, plan.digest[:12],
                 rank_hw.d2h_bps / 1e9, rank_hw.h2d_bps / 1e9, shares.own.host_pool_bytes, throughput,
                 extra=EVERY_RANK)


def found_by(agreed: Agreed) -> str:
    """` (how the planner found the plan)` where it says (refine.py), else nothing."""
    return in_parens(agreed.planned.search if agreed.planned is not None else "")


def in_parens(search: str) -> str:
    return f" ({search})" if search else ""


def say_stage_plan(state: ShapeState, agreed: Agreed, coordinator, hw: Hardware, holds: int,
                   device_type: str) -> None:
    """A pipeline stage's agreed plan, said by its first rank (one line per stage)."""
    if not coordinator.leads_group():
        return
    plan, profile = agreed.plan, agreed.profile
    log.info("slackswap stage %d (ranks %s): %d micro-batch(es) in flight; budget %s B of %s B keep-all (%d x %s "
             "B); per micro-batch %s; planner %s%s on %s predicts %.1f%% of ideal throughput and a peak of %s B%s; "
             "plan %s agreed over %s by %d ranks", coordinator.stage, coordinator.members, holds,
             f"{plan.budget_bytes:,}", f"{holds * profile.total_bytes:,}", holds, f"{profile.total_bytes:,}",
             fate_bytes(plan, profile), plan.planner, found_by(agreed), hw.name, 100 * state.prediction.throughput,
             f"{state.prediction.peak_bytes:,}", measured_on(device_type), plan.digest[:12], coordinator.via,
             coordinator.group_size(), extra=EVERY_RANK)


class JobSummary:
    """What the job did, step by step, for its summary: steps by kind, their wall-clock times, the
    peak of saved activations, fallbacks, and per input shape its plan and what its steps did."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.counts: collections.Counter[str] = collections.Counter()
        self.peaks: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.over_budget = 0  # planned steps whose peak exceeded their plan's budget
        self.budget_waits = 0  # copy-outs the host waited for so that saves stayed within the budget
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.shapes: dict[str, dict] = {}
        self.hooks_s: list[tuple[float, float]] = []  # per planned step: (host s in SlackSwap's hooks, predicted kernel s)

    def host(self, hooks_s: float, kernels_s: float) -> None:
        """A planned step's host time in SlackSwap's hooks, and the forward and backward its plan predicts."""
        self.hooks_s.append((hooks_s, kernels_s))

    def step(self, kind: str, seconds: float | None, peak_bytes: int, fallbacks: Mapping[str, int],
             plan: Plan | None = None, shapes: str = "", keep_all: int | None = None,
             moved: tuple[int, int, int] = (0, 0, 0), budget_waits: int = 0) -> None:
        self.counts[kind] += 1
        self.budget_waits += budget_waits
        if seconds is not None:
            self.times[kind].append(seconds)
        self.peaks[kind] = max(self.peaks[kind], peak_bytes)
        self.fallbacks.update(fallbacks)
        if plan is None:
            return
        self.over_budget += peak_bytes > plan.budget_bytes
        row = self.shapes.setdefault(shapes, {"steps": 0, "peak_bytes": 0, "swapped_bytes": 0, "recomputed_bytes": 0,
                                              "packed_bytes": 0})
        if row.get("plan") != plan.digest[:12]:  # the row's peak is held against its plan's budget: a new plan's own
            row["peak_bytes"] = 0
        row.update(plan=plan.digest[:12], planner=plan.planner, budget_bytes=plan.budget_bytes,
                   keep_all_bytes=keep_all)  # the latest plan of these shapes (a re-plan replaces it)
        row["steps"] += 1
        row["peak_bytes"] = max(row["peak_bytes"], peak_bytes)
        row["swapped_bytes"] += moved[0]
        row["recomputed_bytes"] += moved[1]
        row["packed_bytes"] += moved[2]

    def data(self, **counters: int) -> dict:
        """The summary as JSON-ready data (`counters`: the runtime's own, profiled steps and derived plans)."""
        shapes = [{"shapes": key, **row, "swapped_bytes_per_step": row["swapped_bytes"] // row["steps"],
                   "recomputed_bytes_per_step": row["recomputed_bytes"] // row["steps"],
                   "packed_bytes_per_step": row["packed_bytes"] // row["steps"]}
                  for key, row in self.shapes.items()]
        return {"steps": {kind: self.counts[kind] for kind in KINDS}, **counters,
                "median_step_ms": {kind: round(1e3 * statistics.median(t), 3) for kind, t in self.times.items() if t},
                "peak_saved_bytes": {kind: self.peaks[kind] for kind in KINDS if self.counts[kind]},
                "planned_steps_over_budget": self.over_budget, "budget_waits": self.budget_waits,
                **({"hooks_host_ms": round(1e3 * statistics.median(h for h, _ in self.hooks_s), 3),
                    "predicted_kernels_ms": round(1e3 * statistics.median(k for _, k in self.hooks_s), 3)}
                   if self.hooks_s else {}),
                "fallbacks": dict(self.fallbacks), "shapes": shapes}


def at_exit(end_of_job) -> None:
    """`end_of_job` (a runtime's bound method, taking `state=`) runs when the process exits, unless
    the runtime is gone by then (the summary without keeping the runtime alive), and when it is
    stopped by SIGTERM (a scheduler's preemption: Python would exit without atexit), marked so:
    then the handler that was there acts (the default: the process ends by SIGTERM, as before)."""
    method = weakref.WeakMethod(end_of_job)
    atexit.register(lambda: method() is not None and method()())
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, AttributeError):  # pragma: no cover - a platform without SIGTERM
        return

    def on_sigterm(signum, frame):
        if method() is not None:
            method()(state="stopped by SIGTERM")
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            os.kill(os.getpid(), signal.SIGTERM)  # (the default action now: the process ends by SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: at exit only
        pass


def say_summary(data: dict, path: str | None) -> None:
    """Log the summary (rank 0; a stage's first rank under pipeline parallelism, with `data["stage"]`),
    and write it to `path` as JSON if given (a warning if it cannot be)."""
    stage = data.get("stage")
    head, extra = ("slackswap summary: ", None) if stage is None else (f"slackswap stage {stage} summary: ", EVERY_RANK)
    steps, times, shapes = data["steps"], data["median_step_ms"], data["shapes"]
    over = data["planned_steps_over_budget"]
    lines = [f"{sum(steps.values())} steps ({', '.join(f'{n} {kind}' for kind, n in steps.items() if n)}; "
             f"{data.get('derived_plans', 0)} plan(s) derived for new input shapes without a profiled step); "
             + (f"{over} planned step(s) over their plan's budget" if over else
                "every planned step within its plan's budget")]
    if times:
        lines.append("median step time (wall clock, optimizer included): "
                     + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in times.items()))
    lines.append("peak of saved activations on the device: "
                 + ", ".join(f"{kind} {b:,} B" for kind, b in data["peak_saved_bytes"].items()))
    for row in shapes[:8]:
        lines.append(f"input shapes {row['shapes']}: plan {row['plan']} ({row['planner']}), {row['steps']} steps, "
                     f"peak {row['peak_bytes']:,} B of budget {row['budget_bytes']:,} B (keep-all "
                     f"{row['keep_all_bytes'] or 0:,} B), per step swapped {row['swapped_bytes_per_step']:,} B, "
                     f"recomputed {row['recomputed_bytes_per_step']:,} B, packed {row['packed_bytes_per_step']:,} B")
    if len(shapes) > 8:
        lines.append(f"... and {len(shapes) - 8} more input shapes" + (f" (all in {path})" if path else ""))
    if data.get("device_type") == "cuda" and "hooks_host_ms" in data:  # (on a CPU, kernels are host time too)
        hooks, kernels = data["hooks_host_ms"], data["predicted_kernels_ms"]
        verdict = ("hidden while the host stays ahead of the GPU" if hooks < kernels else
                   "more than the kernels take: the GPU waits on the host")
        lines.append(f"host time in SlackSwap's hooks: median {hooks:.2f} ms per planned step, {hooks / max(kernels, 1e-9):.1%} "
                     f"of the {kernels:.2f} ms its plan predicts for forward and backward ({verdict})")
    if data.get("budget_waits"):
        lines.append(f"the host waited {data['budget_waits']} time(s) for a copy-out to end so that a save stayed "
                     f"within the budget (the copies were slower than the plan timed them)")
    if data["fallbacks"]:
        lines.append("saved tensors not placed as planned: "
                     + ", ".join(f"{n} x {why}" for why, n in sorted(data["fallbacks"].items())))
    for line in lines:
        log.info("%s%s", head, line, extra=extra)
    if path:
        try:
            write_atomically(path, json.dumps(data, indent=1) + "\n")
        except OSError as e:
            log.warning("slackswap: the summary could not be written to %s (%s)", path, e, extra=extra)
            return
        log.info("%swritten to %s%s", head, path, "" if stage is not None else
                 f" (rank 0's steps; every rank writes its own: {trace_path(path, 'rank<r>')} for rank r > 0)",
                 extra=extra)


def summary_path(cfg: SlackSwapConfig) -> str | None:
    """`summary_file`, else `<trace>.summary.json` beside `trace_file`, else None."""
    if cfg.summary_file:
        return cfg.summary_file
    return trace_path(cfg.trace_file, "summary") if cfg.trace_file else None


def trace_path(trace_file: str, kind: str) -> str:
    """`trace_file` for the measured step; <stem>.<kind><suffix> beside it for the prediction (and
    the summary)."""
    if kind == "measured":
        return trace_file
    root, ext = os.path.splitext(trace_file)
    return f"{root}.{kind}{ext or '.json'}"


def write_job_trace(result, trace_file: str, kind: str, **kw) -> bool:
    """The `kind` ("predicted", "measured") trace of `result` at its path beside `trace_file`;
    whether it was written. A trace that cannot be written (a full disk, a read-only folder, a path
    that is not a regular file) is a warning: the job trains on without it."""
    from .sim_report import ReportError, write_trace

    try:
        write_trace(result, trace_path(trace_file, kind), **kw)
    except ReportError as e:
        log.warning("slackswap: %s; training goes on without the trace", e)
        return False
    return True


__all__ = ["JobSummary", "KINDS", "StepReports", "TALLIED", "at_exit", "below_floor", "measured_on", "say_agreed_plan", "say_own_plan",
           "say_replaced_checkpointing", "say_stage_plan", "say_summary", "summary_path", "trace_path", "write_job_trace"]

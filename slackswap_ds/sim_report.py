"""Reports of simulated (and, later, measured) steps: Chrome-trace / Perfetto JSON, sweep plots, and
the text tables `slackswap simulate` and `slackswap plan` print (see "Tables" below).

`chrome_trace` turns anything shaped like a `SimResult` into the Chrome "traceEvents" JSON object
format, which chrome://tracing, https://ui.perfetto.dev and speedscope open directly:

* one process per GPU (``pid = gpu + 1``, named ``GPU <gpu>``);
* one thread (track) per stream, ``compute`` (tid 1), ``d2h`` (tid 2), ``h2d`` (tid 3); streams
  with other names (a measured runtime may record more) get the next tids in order of appearance;
* one complete event (``ph: "X"``) per instruction: ``ts``/``dur`` in microseconds, ``name`` = the
  op or activation key, ``cat`` = its kind (fwd, bwd, recompute, copy_out, copy_in), ``args.bytes``;
* a counter track (``ph: "C"``) ``device activation bytes`` per GPU from ``result.memory``, and,
  when a budget is given, a separate constant counter ``device activation budget`` (separate so
  that viewers which stack the series of one counter do not stack the budget on top of the bytes).

The input only needs ``.events`` (objects with gpu, stream, kind, name, start, end, nbytes; start/end
in seconds) and ``.memory`` ((gpu, seconds, bytes) tuples); step_s / ideal_s / peak_bytes are copied
into ``otherData`` when present.

Tables: `sweep_table` (one per workload and budget: a row per planner), `job_table` (a whole job:
a row per planner, then the stages under the first one) and `plan_summary` (one line). They format
rows already computed, shaped as `slackswap simulate --json` prints them; nothing here plans or
simulates.

No torch; matplotlib (setup.cfg's `plot` extra) is imported only to draw a plot.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .budget import AUTO_MARGIN, Budget
from .errors import SlackSwapError, import_extra
from .files import write_atomically
from .job_memory import device_fits, device_state, tokens_per_s
from .pipeline import Job, StepResult
from .plan import Decision, Plan
from .simulator import SimResult
from .step_profile import StepProfile
from .workloads import ModelSpec, Parallel

STREAM_TIDS = {"compute": 1, "d2h": 2, "h2d": 3}
MEMORY_COUNTER = "device activation bytes"
BUDGET_COUNTER = "device activation budget"
TRACE_FORMAT = "slackswap.trace/1"
GB = 1e9


class ReportError(SlackSwapError):
    """A report that cannot be produced (e.g. a plot or a trace that cannot be written)."""


def _us(seconds: float) -> float:
    """Seconds -> microseconds, rounded to the nanosecond so equal times print equal."""
    return round(float(seconds) * 1e6, 3)


def chrome_trace(result: Any, *, title: str, budget_bytes: int | None = None) -> dict:
    """The Chrome-trace JSON object (``{"traceEvents": [...], ...}``) of one step (see the module docstring)."""
    events = list(getattr(result, "events", ()) or ())
    memory = list(getattr(result, "memory", ()) or ())
    gpus = sorted({int(e.gpu) for e in events} | {int(m[0]) for m in memory})

    tids = dict(STREAM_TIDS)
    for e in events:
        if e.stream not in tids:
            tids[e.stream] = max(tids.values()) + 1

    meta: list[dict] = []
    for g in gpus:
        pid = g + 1
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"GPU {g}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": g}})
        for stream, tid in tids.items():
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": stream}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    body: list[dict] = []
    for e in events:
        body.append({
            "ph": "X",
            "pid": int(e.gpu) + 1,
            "tid": tids[e.stream],
            "ts": _us(e.start),
            "dur": round(_us(e.end) - _us(e.start), 3),
            "name": str(e.name),
            "cat": str(getattr(e.kind, "value", e.kind)),
            "args": {"bytes": int(getattr(e, "nbytes", 0) or 0)},
        })
    for g, t, nbytes in memory:
        body.append({"ph": "C", "pid": int(g) + 1, "tid": 0, "ts": _us(t), "name": MEMORY_COUNTER,
                     "args": {"bytes": int(nbytes)}})
    if budget_bytes is not None:
        end = max([e.end for e in events] + [m[1] for m in memory] + [0.0])
        for g in gpus:
            for t in (0.0, end):
                body.append({"ph": "C", "pid": g + 1, "tid": 0, "ts": _us(t), "name": BUDGET_COUNTER,
                             "args": {"budget": int(budget_bytes)}})
    # Stable order: by time, then complete events before counters at the same instant.
    body.sort(key=lambda ev: (ev["ts"], ev["ph"] != "X"))

    other: dict[str, Any] = {"format": TRACE_FORMAT, "title": title}
    for attr in ("step_s", "ideal_s", "peak_bytes", "recompute_s", "bytes_d2h", "bytes_h2d"):
        v = getattr(result, attr, None)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            other[attr] = v
    if budget_bytes is not None:
        other["budget_bytes"] = int(budget_bytes)
    return {"traceEvents": meta + body, "displayTimeUnit": "ms", "otherData": other}


def write_trace(result: Any, path: str | Path, **kw: Any) -> Path:
    """Write `chrome_trace(result, **kw)` to `path` (title defaults to the file name) atomically, never
    through a link (files.write_atomically); returns the path. ReportError if it cannot."""
    path = Path(path)
    kw.setdefault("title", path.stem)
    try:
        write_atomically(path, json.dumps(chrome_trace(result, **kw), separators=(",", ":")) + "\n")
    except OSError as e:
        raise ReportError(f"cannot write trace {str(path)!r}: {e}") from e
    return path


def trace_busy_us(trace: Mapping, stream: str = "compute", gpu: int = 0) -> float:
    """Sum of the complete-event durations on one stream track of one GPU (microseconds)."""
    names = {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in trace["traceEvents"]
             if ev.get("ph") == "M" and ev.get("name") == "thread_name"}
    return sum(ev["dur"] for ev in trace["traceEvents"]
               if ev.get("ph") == "X" and ev["pid"] == gpu + 1 and names.get((ev["pid"], ev["tid"])) == stream)


# ---- plots -------------------------------------------------------------------------------------
def require_matplotlib(needed_by: str = "plotting") -> None:
    """MissingExtraError naming `pip install 'slackswap_ds[plot]'` unless matplotlib can be imported:
    for a command to call before any work."""
    import_extra("matplotlib", "plot", needed_by)


def _figure(ncols: int, nrows: int, width: float, height: float):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")  # (the layout leaves room for titles and legends)
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def plot_sweep(rows: Iterable[Mapping], path: str | Path) -> Path:
    """PNG of `sweep_figure(rows)`; ReportError if it cannot be written."""
    fig = sweep_figure(rows)
    path = Path(path)
    try:
        fig.savefig(path, format="png", dpi=120)
    except OSError as e:
        raise ReportError(f"cannot write plot {str(path)!r}: {e}") from e
    return path


def sweep_figure(rows: Iterable[Mapping]):
    """Throughput (% of ideal) against budget, one subplot per workload, one line per planner.

    `rows` are the objects `slackswap simulate --json` prints. When every budget is a fraction, the
    bottom x axis is the budget as a % of the keep-all peak and the top one the same budget in GB
    (of that workload's keep-all peak); else the bottom one is the budget in GB. Rows without a
    throughput (the planner found the budget infeasible) leave gaps; with several hardware the
    lines are labelled ``planner @ hardware``. The title is wrapped to the figure's width."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ReportError("plot_sweep: no rows to plot")
    fractions = all(isinstance(r["budget"], (int, float)) and 0 < r["budget"] <= 1 for r in rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    hardware = list(dict.fromkeys(r["hardware"] for r in rows))
    labels = list(dict.fromkeys(r["planner"] if len(hardware) == 1 else f"{r['planner']} @ {r['hardware']}"
                                for r in rows))
    width = 4.2 * len(workloads) + 0.8
    ncol = max(1, min(len(labels), int(width // 2.1)))  # the legend below the plots, a column per ~2 in
    fig, axes = _figure(len(workloads), 1, width, 4.2 + 0.22 * -(-len(labels) // ncol))
    for ax, w in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == w]
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in mine:
            label = r["planner"] if len(hardware) == 1 else f"{r['planner']} @ {r['hardware']}"
            x = 100 * r["budget"] if fractions else r["budget_bytes"] / GB
            tp = r.get("throughput_pct")
            y = float(tp) if tp is not None and r.get("feasible", True) else math.nan
            lines.setdefault(label, []).append((x, y))
        for label, pts in lines.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
        ax.set_title(w)
        ax.set_ylabel("throughput (% of ideal)")
        ax.grid(True, alpha=0.3)
        if not fractions:
            ax.set_xlabel("budget (GB of saved activations)")
            continue
        ax.set_xlabel("budget (% of the keep-all peak)")
        keep_all = mine[0]["budget_bytes"] / mine[0]["budget"] / GB  # GB: budget_bytes is int(fraction x keep-all)
        if keep_all <= 0:
            continue
        top = ax.secondary_xaxis("top", functions=(lambda pct, k=keep_all: pct * k / 100,
                                                   lambda gb_, k=keep_all: gb_ * 100 / k))
        top.set_xlabel(f"budget (GB; keep-all peak {keep_all:.2f} GB)")
    handles = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    drawn = [label for label in labels if label in handles]
    fig.legend([handles[label] for label in drawn], drawn, loc="outside lower center", ncol=ncol, fontsize="small")
    title = f"simulated throughput vs activation budget on {', '.join(hardware)}"
    fig.suptitle(textwrap.fill(title, width=int(width * 8)))  # about 8 characters per inch at 12 pt
    return fig


# ---- tables ------------------------------------------------------------------------------------

# SlackSwap (arXiv 2610.13003): simulated A100 + PCIe 4.0, budget 50% of the keep-all peak.
PAPER = "SlackSwap arXiv 2610.13003, simulated A100 + PCIe 4.0, 50% budget"
PAPER_THROUGHPUT_PCT = {"bert-large": 96.3, "gpt2-xl": 97.6, "llama-7b": 99.6}

SWEEP_COLUMNS = ("planner", "thru %", "step ms", "tok/s", "peak GB", "peak/bud", "recomp ms", "swap GB", "pack GB",
                 "feasible", "fits")  # (pack GB: the bytes of the tensors a plan packs, before packing)
_WIDTHS = (20, 8, 10, 10, 9, 10, 11, 9, 9, 12, 6)


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB"


def short_source(source: str) -> str:
    """A one-line form of a preset's `source`: the paper for the dims and the repository for the shape."""
    paper = re.search(r"\(([A-Z][\w-]+ et al\.? \d{4})", source)
    repo = re.search(r"\b([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)\b", source)
    parts = [p.group(1) for p in (paper, repo) if p]
    if not parts:
        return source if len(source) <= 60 else source[:57] + "..."
    return " + ".join(parts)


def _table_row(cells: Sequence[str]) -> str:
    first, *rest = cells
    return "  " + f"{first:<{_WIDTHS[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(rest, _WIDTHS[1:]))


def sweep_row(row: Mapping) -> str:
    """One planner's row of a sweep table."""
    if row["status"] in ("infeasible", "error"):
        return _table_row([row["planner"], *(["-"] * 8), row["status"], "-"])
    fits = row.get("fits")
    return _table_row([
        row["planner"],
        f"{row['throughput_pct']:.1f}",
        f"{row['step_s'] * 1e3:.1f}",
        f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "-",
        f"{row['peak_bytes'] / GB:.2f}",
        f"{row['peak_bytes'] / row['budget_bytes']:.3f}" if row["budget_bytes"] else "-",
        f"{row['recompute_s'] * 1e3:.1f}",
        f"{row['swapped_bytes'] / GB:.2f}",
        f"{row.get('packed_bytes', 0) / GB:.2f}",
        "yes" if row["feasible"] else "NO (over)",
        "-" if fits is None else "yes" if fits else "NO",
    ])


def sweep_header(profile_name: str, where: str, spec: ModelSpec, source: str, par: Parallel, keep_all: SimResult,
                 budget_bytes: int, state_bytes: int, device_bytes: float) -> list[str]:
    """What was simulated where, the keep-all step and peak against the budget, the model state
    beside the GPU's memory, and the column names."""
    cut = "" if par == Parallel() else f", one rank of tp {par.tp}{' with sequence parallelism' if par.sp else ''}"
    ka = keep_all
    room = device_bytes - state_bytes
    return [
        f"{profile_name} on {where}: seq {spec.seq}, micro-batch {spec.micro_batch}, "
        f"{spec.layers} layers{cut}; source: {source}",
        f"  ideal step {ka.step_s * 1e3:.1f} ms, keep-all peak {gb(ka.peak_bytes)}, "
        f"budget {gb(budget_bytes)} ({budget_bytes:,} B = {budget_bytes / ka.peak_bytes:.0%} of keep-all)"
        if ka.peak_bytes else f"  ideal step {ka.step_s * 1e3:.1f} ms, keep-all peak 0 B, budget {budget_bytes:,} B",
        f"  model state {gb(state_bytes)} (16 B per parameter: 16-bit weights and gradients, Adam's fp32 master, "
        f"m and v; no ZeRO) of the GPU's {gb(device_bytes)}: "
        + (f"activations up to {gb(room)} fit beside it" if room > 0 else
           "the model state alone does not fit (shard it: --dp with --zero)"),
        _table_row(SWEEP_COLUMNS),
    ]


def paper_line(name: str, budget: Budget, rows: list[dict], hardware: str) -> str | None:
    """The paper's throughput beside ours, for a preset the paper reports, at its 50% budget."""
    if name not in PAPER_THROUGHPUT_PCT or not (budget.is_fraction and budget.value == 0.5):
        return None
    ours = next((r for r in rows if r["planner"] == "slackswap"), None)
    if ours is None or ours.get("throughput_pct") is None:
        ours_s = "slackswap not run" if ours is None else f"slackswap {ours['status']}"
    else:
        ours_s = f"{ours['throughput_pct']:.1f}%"
    return f"  paper ({PAPER}): {PAPER_THROUGHPUT_PCT[name]:.1f}%   ours (slackswap, {hardware}): {ours_s}"


def sweep_table(header: list[str], rows: list[dict], paper: str | None) -> list[str]:
    """The header, a row per planner, the paper line (if any), why each failed row failed, a blank line."""
    lines = header + [sweep_row(row) for row in rows] + ([paper] if paper else [])
    lines += [f"  {row['planner']}: {row['status']}: {row['error']}" for row in rows
              if row["status"] in ("infeasible", "error", "over budget")]
    return lines + [""]


def job_table(spec: ModelSpec, node_name: str, job: Job, budget: Budget,
              results: list[tuple[str, StepResult | None, str | None]], ideal: float, device_bytes: float) -> list[str]:
    """A whole job's step per planner (or why it is infeasible), then each stage under the first planner."""
    cut = f"tp {job.par.tp}{' + sp' if job.par.sp else ''}, pp {job.pp}, dp {job.dp}, zero {job.zero}" + \
        (f", {job.chunks} chunks per device (interleaved)" if job.chunks > 1 else "") + \
        (" with optimizer offload" if job.offload_optimizer else "") + \
        (", gradients reduced during backward" if job.overlap_grad_comm else "") + \
        (f", sharded by {job.sharding}" if job.zero == 3 and job.sharding != "deepspeed" else "") + \
        (", fp32 gradient reduction" if job.grad_reduce_bytes == 4 and job.dp > 1 else "")
    lines = [f"{spec.name} on {node_name} ({job.gpus} GPUs: {cut}): {job.micro_batches} micro-batches of "
             f"{spec.micro_batch} x {spec.seq} per step and pipeline, "
             f"{'DeepSpeed PipelineEngine schedule' if job.schedule == 'deepspeed' else '1F1B'}",
             f"  ideal step {ideal:.3f} s (every activation kept); {_job_budget(job, budget, device_bytes)}",
             *_job_state_lines(job, device_bytes),
             f"  {'planner':<20}{'thru %':>8}{'step s':>9}{'pipe s':>9}{'grads s':>9}{'optim s':>9}"
             f"{'worst peak/budget':>19}{'tok/s':>11}{'fits':>6}"]
    for planner, res, err in results:
        if res is None:
            lines.append(f"  {planner:<20}{'-':>8}  infeasible: {err}")
            continue
        worst, fit = res.worst_peak_ratio, all(device_fits(job, res, device_bytes))
        lines.append(f"  {planner:<20}{100 * res.throughput:>8.1f}{res.step_s:>9.3f}{res.pipeline_s:>9.3f}"
                     f"{res.grad_comm_s:>9.3f}{res.optimizer_s:>9.3f}{worst:>19.3f}"
                     f"{tokens_per_s(job, res):>11,.0f}{'yes' if fit else 'NO':>6}")
    for planner, res, _ in results:
        if res is None or planner != results[0][0]:
            continue
        lines += _stage_lines(planner, res)
    lines.append("")
    return lines


def _job_budget(job: Job, budget: Budget, device_bytes: float) -> str:
    split = f", split evenly among its {job.chunks} chunks" if job.chunks > 1 else ""
    if budget.is_fraction:
        return f"budget {budget} of each stage's keep-all peak"
    if budget.is_auto:
        return (f"budget auto: each GPU's {gb(device_bytes)} less what it holds beside its activations (below) and "
                f"{AUTO_MARGIN:.0%} of it{split}")
    return f"budget {gb(int(budget.value))} per GPU{split}"


ZERO_SHARDS = {0: "no ZeRO", 1: "ZeRO 1 shards the optimizer state over dp {dp}",
               2: "ZeRO 2 shards the gradients and the optimizer state over dp {dp}",
               3: "ZeRO 3 shards all three over dp {dp}"}


def _job_state_lines(job: Job, device_bytes: float) -> list[str]:
    """What each GPU holds beside its saved activations (`job_memory`), and what "fits" counts."""
    states = [device_state(job, d) for d in range(job.pp)]

    def amount(values: list[int]) -> str:
        return gb(min(values)) if min(values) == max(values) else f"{gb(min(values))} to {gb(max(values))}"

    what = ("16-bit weights; the optimizer state and the gradients on the host: ZeRO-Offload" if job.offload_optimizer
            else "16 B per parameter: 16-bit weights and gradients, Adam's fp32 master, m and v")
    line = f"  model state per GPU {amount([s.state_bytes for s in states])} ({what}; " + \
        ZERO_SHARDS[job.zero].format(dp=job.dp) + ")"
    if any(s.gathered for s in states):
        line += (f" + {amount([s.gathered for s in states])} of 16-bit parameters gathered (ZeRO 3: the region "
                 f"running and the one prefetched)")
    held = max(s.total_bytes for s in states)
    room = ("the model state alone does not fit (shard it: --dp with --zero)" if held >= device_bytes
            else f"activations up to {gb(device_bytes - held)} fit beside it")
    per_stage = " (per stage: state GB below)" if len({s.total_bytes for s in states}) > 1 else ""
    return [f"{line} of the GPU's {gb(device_bytes)}{per_stage}: {room}",
            "  fits: that and the plan's simulated peak of saved activations within the GPU's memory (not counted: "
            "backward's temporaries, communication buffers, the allocator's fragmentation, the CUDA context)"]


def _stage_lines(planner: str, res: StepResult) -> list[str]:
    interleaved = (" (interleaved: peak GB and state GB are the whole device's, all its chunks)" if res.job.chunks > 1
                   else "")
    state = "model state and gathered parameters" if res.job.zero == 3 and res.job.dp > 1 else "model state"
    lines = [f"  stages under {planner} (one rank of each; per micro-batch: fwd, bwd, swapped, "
             f"recompute; state GB: the GPU's {state}){interleaved}:",
             "    stage  layers   in-flight  keep-all GB  budget GB  peak GB  state GB  kept GB/mb  swap GB/mb  "
             "recomp ms  fwd ms  bwd ms  plan"]
    for i, s in enumerate(res.stages):
        swap = s.plan.bytes_by_decision(s.profile)[Decision.SWAP]
        held = device_state(res.job, i % res.job.pp).total_bytes
        lines.append(f"    {i:>5}  {s.layers.start:>3}-{s.layers.stop - 1:<3}  {s.in_flight:>9}  "
                     f"{s.keep_all_bytes / GB:>11.2f}  {s.budget_bytes / GB:>9.2f}  "
                     f"{res.stage_device_peak(i) / GB:>7.2f}  {held / GB:>8.2f}  "
                     f"{s.kept_bytes / GB:>10.2f}  {swap / GB:>10.2f}  {s.result.recompute_s * 1e3:>9.1f}  "
                     f"{s.fwd_s * 1e3:>6.1f}  {s.bwd_s * 1e3:>6.1f}  {s.plan.digest[:12]}")
    return lines


def plan_summary(planner: str, plan: Plan, profile: StepProfile, where: str, budget: Budget, budget_bytes: int,
                 result: SimResult, output: str) -> str:
    """One line: what a plan keeps, swaps and recomputes, how its step simulates, where it went."""
    by = plan.bytes_by_decision(profile)
    count = {d: len(plan.keys(d)) for d in Decision}
    return (
        f"{planner} plan for {profile.name} on {where}, budget {budget} = {gb(budget_bytes)}: "
        f"keep {count[Decision.KEEP]} ({gb(by[Decision.KEEP])}), swap {count[Decision.SWAP]} "
        f"({gb(by[Decision.SWAP])}), recompute {count[Decision.RECOMPUTE]} ({gb(by[Decision.RECOMPUTE])}), "
        f"packed {len(plan.packed)} ({gb(plan.packed_bytes(profile)[0])}); "
        f"simulated {100 * result.throughput:.1f}% of ideal, peak {gb(result.peak_bytes)}"
        f"{'' if result.feasible else ' (OVER BUDGET)'}; digest {plan.digest[:12]} -> {output}"
    )

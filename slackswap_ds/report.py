"""Reports of simulated (and, later, measured) steps: Chrome-trace / Perfetto JSON and sweep plots.

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

No torch; matplotlib is imported only by `plot_sweep`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import SlackSwapError

STREAM_TIDS = {"compute": 1, "d2h": 2, "h2d": 3}
MEMORY_COUNTER = "device activation bytes"
BUDGET_COUNTER = "device activation budget"
TRACE_FORMAT = "slackswap.trace/1"


class ReportError(SlackSwapError):
    """A report that cannot be produced (e.g. plotting without matplotlib installed)."""


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
    """Write `chrome_trace(result, **kw)` to `path` (title defaults to the file name); returns the path."""
    path = Path(path)
    kw.setdefault("title", path.stem)
    try:
        path.write_text(json.dumps(chrome_trace(result, **kw), separators=(",", ":")) + "\n")
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
def _figure(ncols: int, nrows: int, width: float, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ReportError("plots need matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def plot_sweep(rows: Iterable[Mapping], path: str | Path) -> Path:
    """PNG: throughput (% of ideal) against budget, one subplot per workload, one line per planner.

    `rows` are the objects `slackswap simulate --json` prints. The x axis is the budget as a % of
    the keep-all peak when every budget is a fraction, else the budget in GB. Rows without a
    throughput (the planner found the budget infeasible) leave gaps; with several hardware the
    lines are labelled ``planner @ hardware``."""
    rows = [dict(r) for r in rows]
    if not rows:
        raise ReportError("plot_sweep: no rows to plot")
    fractions = all(isinstance(r["budget"], (int, float)) and 0 < r["budget"] <= 1 for r in rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    hardware = list(dict.fromkeys(r["hardware"] for r in rows))
    fig, axes = _figure(len(workloads), 1, 4.2 * len(workloads) + 0.8, 3.8)
    for ax, w in zip(axes[0], workloads):
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r["workload"] != w:
                continue
            label = r["planner"] if len(hardware) == 1 else f"{r['planner']} @ {r['hardware']}"
            x = 100 * r["budget"] if fractions else r["budget_bytes"] / 1e9
            tp = r.get("throughput_pct")
            y = float(tp) if tp is not None and r.get("feasible", True) else math.nan
            lines.setdefault(label, []).append((x, y))
        for label, pts in lines.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
        ax.set_title(w)
        ax.set_xlabel("budget (% of keep-all peak)" if fractions else "budget (GB)")
        ax.set_ylabel("throughput (% of ideal)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"simulated throughput vs activation budget ({', '.join(hardware)})")
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path, format="png", dpi=120)
    except OSError as e:
        raise ReportError(f"cannot write plot {str(path)!r}: {e}") from e
    return path

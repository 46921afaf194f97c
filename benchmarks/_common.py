"""Small helpers shared by the benchmark scripts: output folder, JSON writing, progress, tables."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from slackswap_ds.cli import native_stdout_to_stderr

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results"


def out_dir(path: str | Path | None) -> Path:
    """The output folder (created if missing); relative paths are taken from the current directory."""
    p = Path(path) if path is not None else DEFAULT_OUT
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(_clean(obj), indent=1, sort_keys=False, allow_nan=False) + "\n")


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_s(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2f} s"
    m, s = divmod(seconds, 60)
    return f"{int(m)}m{s:04.1f}s"


def gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table. `align` has one char per column: 'l' or 'r' (default: first l, rest r)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


class PlannerTimeout(Exception):
    """A planner call that ran past its wall-clock limit (the benchmark row records it)."""


# native solvers (HiGHS) write diagnostics straight to fd 1; keep them out of the printed tables
stdout_to_stderr = native_stdout_to_stderr


def _quiet_call(fn, args: tuple, kwargs: dict):
    with stdout_to_stderr():
        return fn(*args, **kwargs)


def call_with_timeout(fn, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None):
    """`fn(*args, **kwargs)` with its fd-1 output sent to stderr; in a forked child process when
    `timeout` (seconds) is set, so a slow call (e.g. a MILP) can be abandoned: raises PlannerTimeout
    after `timeout` s and kills the child. Exceptions raised by `fn` are re-raised here."""
    kwargs = kwargs or {}
    if timeout is None:
        return _quiet_call(fn, args, kwargs)
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:  # leaving the block terminates the worker, finished or not
        job = pool.apply_async(_quiet_call, (fn, args, kwargs))
        try:
            return job.get(timeout)
        except multiprocessing.TimeoutError:
            raise PlannerTimeout(f"gave up after {timeout:g} s") from None

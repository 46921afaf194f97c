"""HiGHS's own output kept off the process's stdout and stderr while it solves.

HiGHS writes lines of its own from C++ whatever its `output_flag` says (its banner when the first
solver of a process is made; debug lines such as "HighsMipSolverData::transformNewIntegerFeasibleSolution
tmpSolver.run();" in some builds): 97 of them in the README's `slackswap simulate`, and in a training
job's log. File descriptors are the process's, so the redirection is too: the default planner's
two searches run in two threads (planners/refine.py), and share it."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading

SOLVER_OUTPUT_ENV = "SLACKSWAP_SOLVER_OUTPUT"  # set (to anything but "0"): HiGHS's own lines are shown
_HIGHS_LINE = re.compile(r"^\s*(Highs|HiGHS|Running HiGHS|Includes third-party software)")


class _SolverOutput:
    """The process's stdout and stderr descriptors while solves run (`solver_output_dropped`). File
    descriptors are the process's, not a thread's: the first solve to start sends both to one
    temporary file, the last to end puts them back, under a lock. (Each solve saving and restoring
    them on its own, two solves in two threads (planners/refine.py) left the process writing into the
    first one's deleted file: a job printed nothing after its first plan.)"""

    def __init__(self):
        self.lock = threading.Lock()
        self.solves = 0  # solves running now
        self.saved: tuple[int, int] | None = None  # the real descriptors, while solves run
        self.sink = None  # the temporary file both point to meanwhile

    def enter(self) -> None:
        with self.lock:
            if self.solves == 0:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    saved = (os.dup(1), os.dup(2))
                except (OSError, ValueError):  # no such descriptors (a daemon): nothing to keep quiet
                    saved = None
                if saved is not None:
                    self.saved, self.sink = saved, tempfile.TemporaryFile()
                    os.dup2(self.sink.fileno(), 1)
                    os.dup2(self.sink.fileno(), 2)
            self.solves += 1

    def leave(self) -> None:
        with self.lock:
            self.solves -= 1
            if self.solves or self.saved is None:
                return
            saved, sink, self.saved, self.sink = self.saved, self.sink, None, None
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            with sink:
                sink.seek(0)
                rest = [line for line in sink.read().decode(errors="replace").splitlines(keepends=True)
                        if not _HIGHS_LINE.match(line)]
            if rest:
                os.write(2, "".join(rest).encode())


_SOLVER_OUTPUT = _SolverOutput()


@contextlib.contextmanager
def solver_output_dropped():
    """HiGHS writes lines of its own to the process's stdout and stderr from C++ whatever its
    `output_flag` says (its banner when the first solver of a process is made; debug lines such as
    "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" in some builds). Both
    file descriptors go to a temporary file while any solve runs (`_SolverOutput`: solves in several
    threads share it); afterwards HiGHS's lines are dropped and anything else (another thread's
    output) is written to stderr. `SLACKSWAP_SOLVER_OUTPUT=1` leaves them alone."""
    if os.environ.get(SOLVER_OUTPUT_ENV, "0") != "0":
        yield
        return
    _SOLVER_OUTPUT.enter()
    try:
        yield
    finally:
        _SOLVER_OUTPUT.leave()

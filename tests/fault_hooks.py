"""How a worker of a fault test (tests/faults/worker.py, tests/pipe/worker.py) makes one of its ranks
fail on cue, and says what it does so that the test can time every rank (tests/jobs.py reads the
lines): `FAULT-TEST enter <rank>` as the step with the fault begins, `FAULT-TEST stopping <rank>`
before a rank stops itself, `FAULT-TEST done <rank>` at the end.

No torch here: a worker calls `ranks_from_mpi()` before it imports DeepSpeed or SlackSwap."""

from __future__ import annotations

import os
import signal
import sys


def ranks_from_mpi() -> None:
    """Under mpiexec (MPICH's PMI variables), set the torch.distributed variables DeepSpeed reads."""
    for mpi, ours in (("PMI_RANK", "RANK"), ("PMI_SIZE", "WORLD_SIZE"), ("MPI_LOCALRANKID", "LOCAL_RANK")):
        if mpi in os.environ:
            os.environ[ours] = os.environ[mpi]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))


def say(text: str) -> None:
    """One write per line: lines of several ranks that share a pipe (mpiexec's) never interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def stop_here() -> None:
    """Stop this process (SIGSTOP): alive to the operating system, silent to its partners."""
    say(f"FAULT-TEST stopping {os.environ['RANK']}")
    os.kill(os.getpid(), signal.SIGSTOP)


def fault_before(module, name: str, fault) -> None:
    """Run `fault` when module.<name> (an agreement function the runtime calls) is next called on
    this rank, then the function itself (if the fault returns)."""
    real = getattr(module, name)

    def faulty(*args, **kwargs):
        fault()
        return real(*args, **kwargs)

    setattr(module, name, faulty)

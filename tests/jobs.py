"""Multi-process CPU jobs for the tests, in one place: the environment every rank runs in, the
launcher lines (DeepSpeed's, torchrun, Accelerate's, mpiexec), a runner for a whole launch, a runner
per transport for jobs whose ranks a test watches one by one, and free loopback ports.

Every address is 127.0.0.1 and every interface `lo`: these jobs never leave the machine.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = shutil.which("mpiexec")
# the two ways ranks agree: torch.distributed's store (the ranks started here, as torchrun would)
# and MPI (mpiexec); MPI's cases are skipped where mpiexec is not installed
TRANSPORTS = ["torch", pytest.param("mpi", marks=pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"))]
# the same, MPI's case marked slow (suite time): the logic is the transport-free protocol's, checked on
# torch's store; the MPI transport keeps its own cases in the suite (test_node_facts.py, and the faults
# that TRANSPORTS still parametrize)
TRANSPORTS_MPI_SLOW = ["torch", pytest.param("mpi", marks=[pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"),
                                                          pytest.mark.slow])]

# The suite runs on two pytest-xdist workers (setup.cfg). Jobs whose ranks must answer within a
# deadline (sync_timeout_s) run one at a time, on one worker: their ranks then compete with one
# other test at most, never with another deadline job's ranks.
DEADLINES = pytest.mark.xdist_group("deadlines")


def sharing(fixture: str) -> pytest.MarkDecorator:
    """The tests that read one module-scoped job (`fixture`) run on one worker: the job runs once."""
    return pytest.mark.xdist_group(fixture)


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1 (for launchers and process groups in tests: loopback only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of every process of a CPU job: DeepSpeed's CPU accelerator; every address and
    interface on loopback; output unbuffered, so that lines arrive as they are written (the fault
    tests time them); one thread per rank, because with several, how CPU kernels split their sums
    follows the machine's load and two runs of the *same* model then differ in the last bits; and this
    checkout first on the path (the ranks import slackswap_ds, and the workers their helpers, from it)."""
    path = os.pathsep.join([str(ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    # Jobs plan with the default planner whole, as a user's do: its exact search (highspy's import, a
    # fraction of a second, and a solve of milliseconds on these models) within the suite's budget
    # (tests/conftest.py), which every process of a job inherits.
    return {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


@functools.lru_cache(maxsize=None)
def checkout_autoroute():
    """This checkout's start-up hook, slackswap_ds/autoroute.py, as a module. The one in sys.modules
    was loaded at interpreter start by the environment's .pth: the installed package's, which is
    another checkout's where this one is a worktree beside an editable install; then this file is
    loaded on its own (its lazy imports of the package find this checkout's, first on the path)."""
    import importlib.util

    path = ROOT / "slackswap_ds" / "autoroute.py"
    loaded = sys.modules.get("slackswap_ds.autoroute")
    if loaded is not None and Path(loaded.__file__).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location("slackswap_ds.autoroute", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- launcher lines ------------------------------------------------------------------------------
def deepspeed_line(ranks: int | None, *argv: str) -> list[str]:
    """`deepspeed --num_gpus ranks argv...` on loopback (ranks None: argv says where, e.g. a hostfile)."""
    gpus = ["--num_gpus", str(ranks)] if ranks is not None else []
    return [sys.executable, "-m", "deepspeed.launcher.runner", *gpus, "--master_addr", "127.0.0.1",
            "--master_port", str(free_loopback_port()), *argv]


def torchrun_line(ranks: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
            "127.0.0.1", "--master_port", str(free_loopback_port()), *argv]


def accelerate_line(ranks: int, deepspeed_config: Path, *argv: str) -> list[str]:
    """`accelerate launch` with its DeepSpeed plugin reading `deepspeed_config`, one machine."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--deepspeed_config_file",
            str(deepspeed_config), "--num_processes", str(ranks), "--num_machines", "1", "--main_process_ip",
            "127.0.0.1", "--main_process_port", str(free_loopback_port()), *argv]


def mpiexec_line(ranks: int, *argv: str) -> list[str]:
    """`mpiexec -iface lo -n ranks argv...` (MPICH's Hydra, kept on loopback)."""
    return [MPIEXEC, "-iface", "lo", "-n", str(ranks), *argv]


def run_launch(cmd: list[str], env: dict | None = None, timeout: float = 600) -> str:
    """Run a launch to its end; everything it printed, stdout and stderr as one stream in the order
    it was written (a rank's log lines keep their place among its prints). It must succeed."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def launch_in_turn(ranks: int, script: Path, runs: list, tmp: Path, timeout: float = 900,
                   unmodified: bool = False) -> dict[str, str]:
    """A training script's main() run several times in one `deepspeed --num_gpus ranks` launch
    (tests/launch/in_turn.py; runs: [name, the script's arguments] each): each run's output by name.
    `unmodified`: a script that never heard of SlackSwap (tests/adoption/), launched through
    `python -m slackswap_ds.run`."""
    (tmp / "runs.json").write_text(json.dumps(runs))
    route = ("--module", "slackswap_ds.run") if unmodified else ()
    out = run_launch(deepspeed_line(ranks, *route, str(ROOT / "tests" / "launch" / "in_turn.py"), str(script),
                                    str(tmp / "runs.json")), timeout=timeout)
    parts = re.split(r"^=== (?:RUN (\S+)|END)$", out, flags=re.M)
    logs = dict(zip(parts[1::2], parts[2::2]))  # (the text after `=== END`, the launcher's, is None's)
    assert [name for name in logs if name] == [name for name, _ in runs], out[-4000:]
    return logs


def assert_own_lengths_exact(losses_on: list, out_on: str, ranks_on: list[dict], losses_off: list,
                             ranks_off: list[dict], compiled: bool = False) -> None:
    """tests/adoption/hf_padding.py (every rank on its own lengths, 30 steps) under SlackSwap, against
    the job without: equal losses and final parameters; on every rank every step within its budget
    (a planned step's: its plan's, the budget fraction of the keep-all of the profile it was planned
    from, measured or derived; a warm-up or profiled step's: the fraction of the bytes it saved),
    one or two profiled steps for many distinct lengths (the others' plans derived; `compiled`: each
    length profiled, none derived, since compiled code is not derived); no rank waited for another's
    planning."""
    assert len(losses_on) == 30 and losses_on == losses_off
    assert ranks_on[0]["parameters"] == ranks_off[0]["parameters"]
    assert "data-parallel ranks are on different input shapes" in out_on
    assert not re.search(r"did not (answer|report|send)|AgreementError|Traceback|ReplayError", out_on)
    for r, rank in enumerate(ranks_on):
        steps = rank["steps"]
        assert len(steps) == 30 and sum(b is None for _, b, _, _ in steps) == 1 + rank["profiled"], (r, steps)
        over = [(step, peak, budget, rank["fraction"] * saved) for step, (peak, budget, _, saved) in enumerate(steps, 1)
                if peak > (budget if budget is not None else rank["fraction"] * saved)]
        assert not over, (r, over, steps)
        if compiled:
            assert len(rank["shapes"]) >= 12 and rank["profiled"] == len(rank["shapes"]), (r, rank)
            assert rank["derived"] == 0, (r, rank)
            continue
        assert len(rank["shapes"]) >= 12 and 1 <= rank["profiled"] <= 2, (r, rank)
        assert rank["derived"] >= len(rank["shapes"]) - rank["profiled"], (r, rank)


# ---- jobs watched rank by rank -------------------------------------------------------------------
@dataclass
class Rank:
    lines: list = field(default_factory=list)  # (monotonic time, text)
    rc: int | None = None  # torch transport only: MPI's launcher reports one status for the job
    exited: float | None = None

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if re.search(pattern, line)), None)

    @property
    def entered(self) -> float:
        """When a fault job's rank began the step with the fault (`FAULT-TEST enter`, tests/fault_hooks.py)."""
        return self.first("^FAULT-TEST enter")[0]

    @property
    def error(self) -> tuple[float, str]:
        """When and how the rank said that the job stops."""
        found = self.first("The job stops")
        assert found, "no error line:\n" + "\n".join(line for _, line in self.lines[-40:])
        return found


@dataclass
class Job:
    ranks: list[Rank]
    rc: int  # the launcher's (MPI) or the worst rank's (torch)
    seconds: float
    began: float  # when it was launched (monotonic)
    output: str = ""  # everything every rank printed


def _read(stream, sink) -> None:
    for line in stream:
        sink(time.monotonic(), line.rstrip("\n"))


def run_torch(argv: list[str], n: int = 4, limit_s: float = 150, **env: str) -> Job:
    """`python argv...` as n ranks on one torch.distributed store, started as torchrun starts them
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT), every line of each timed as it comes. Ranks still
    alive once every other has exited and they said `FAULT-TEST stopping` (stopped on purpose), or
    at limit_s, are killed."""
    port, ranks, procs, readers = free_loopback_port(), [Rank() for _ in range(n)], [], []
    began = time.monotonic()
    for r in range(n):
        p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                             env=cpu_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_PORT=str(port), **env))
        t = threading.Thread(target=_read, args=(p.stdout, lambda at, line, k=ranks[r]: k.lines.append((at, line))))
        t.start()
        procs.append(p)
        readers.append(t)
    try:
        while time.monotonic() - began < limit_s:
            for r, p in enumerate(procs):
                if ranks[r].rc is None and p.poll() is not None:
                    ranks[r].rc, ranks[r].exited = p.returncode, time.monotonic()
            running = [r for r, p in enumerate(procs) if ranks[r].rc is None]
            stopped = [r for r in running if any("FAULT-TEST stopping" in line for _, line in ranks[r].lines)]
            if running == stopped:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in readers:
            t.join()
    return Job(ranks, max(abs(k.rc) if k.rc is not None else 0 for k in ranks), time.monotonic() - began, began,
               "\n".join(line for k in ranks for _, line in k.lines))


# under mpiexec every rank writes to one pipe: a line is a rank's by what it says, the fault hooks'
# markers (`FAULT-TEST <what> <rank>`, tests/fault_hooks.py) and the engine's error line
MPI_RANK_LINE = r"FAULT-TEST \w+ (\d+)|slackswap rank (\d+): .*?The job stops"


def run_mpi(argv: list[str], n: int = 4, limit_s: float = 150, **env: str) -> Job:
    """`mpiexec -iface lo -n n python argv...`, its lines timed as they come and given to their
    ranks by MPI_RANK_LINE; a job still running at limit_s is killed, and that is an error."""
    ranks, everything = [Rank() for _ in range(n)], []

    def sink(at, line):
        everything.append(line)
        # a line may carry pieces of several ranks' output: every marker in it counts
        for m in re.finditer(MPI_RANK_LINE, line):
            ranks[int(m.group(1) or m.group(2))].lines.append((at, m.group(0)))

    began = time.monotonic()
    p = subprocess.Popen(mpiexec_line(n, sys.executable, *argv), cwd=ROOT,
                         env=cpu_env(MASTER_PORT=str(free_loopback_port()), **env), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    reader = threading.Thread(target=_read, args=(p.stdout, sink))
    reader.start()
    try:
        rc = p.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
        raise AssertionError(f"mpiexec did not end within {limit_s} s")
    finally:
        reader.join()
    return Job(ranks, rc, time.monotonic() - began, began, "\n".join(everything))


def run_ranks(transport: str, argv: list[str], n: int = 4, limit_s: float = 150, **env: str) -> Job:
    """The job under one transport: "torch" (run_torch) or "mpi" (run_mpi)."""
    return (run_torch if transport == "torch" else run_mpi)(argv, n=n, limit_s=limit_s, **env)


def rank_rows(transport: str, argv: list[str], n: int = 4, limit_s: float = 300) -> list[dict]:
    """Run a worker that writes each rank's result as JSON to $SLACKSWAP_TEST_OUT/<rank>.json (files,
    not stdout: the ranks' lines share mpiexec's pipe); the rows by rank, one per rank."""
    with tempfile.TemporaryDirectory() as out:
        job = run_ranks(transport, argv, n=n, limit_s=limit_s, SLACKSWAP_TEST_OUT=out)
        rows = {row["rank"]: row for row in (json.loads(p.read_text()) for p in Path(out).glob("*.json"))}
    assert sorted(rows) == list(range(n)), job.output[-4000:]
    return [rows[r] for r in range(n)]


# ---- fault jobs: every surviving rank names the one at fault, in time ----------------------------
FAULT_TIMEOUT_S = 6.0  # the fault jobs' sync_timeout_s
FAULT_MARGIN_S = 5.0  # what a rank may take past it


def assert_named(job: Job, survivors, pattern: str) -> None:
    """Every survivor logged an error matching `pattern` within FAULT_TIMEOUT_S + FAULT_MARGIN_S of
    the faulty step, and exited non-zero (under MPI the launcher ends the job at the first exit:
    every survivor has said why by then, and the job's status is non-zero); nothing segfaulted."""
    assert job.rc != 0
    assert "Segmentation fault" not in job.output and "core dumped" not in job.output
    assert "signal 11" not in job.output.lower() and "SIGSEGV" not in job.output
    for r in survivors:
        rank = job.ranks[r]
        at, line = rank.error
        assert re.search(pattern, line), f"rank {r}: {line}"
        took = at - rank.entered
        assert took <= FAULT_TIMEOUT_S + FAULT_MARGIN_S, f"rank {r} took {took:.1f} s: {line}"
        if rank.rc is not None:
            assert rank.rc == 1, f"rank {r} exited with {rank.rc}"
            assert rank.exited - rank.entered <= FAULT_TIMEOUT_S + FAULT_MARGIN_S

"""Faults in a real 4-rank DeepSpeed job under SlackSwap (tests/faults/worker.py), under both
transports: the torch.distributed store (4 processes started here, as torchrun would) and MPI
(`mpiexec -iface lo -n 4`). Whatever one rank does (stops, dies, plans another shape), every
surviving rank says which rank is at fault and why, and exits non-zero within sync_timeout_s + 5 s
of the step that went wrong; nothing hangs, nothing segfaults. Plus a stress test: 50 agreement
rounds with random delays on random ranks under mpiexec."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import free_loopback_port

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "faults" / "worker.py"
TIMEOUT_S = 6.0  # the jobs' sync_timeout_s
MARGIN_S = 5.0  # what a rank may take past it
MPIEXEC = shutil.which("mpiexec")


def env(**extra: str) -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


@dataclass
class Rank:
    lines: list = field(default_factory=list)  # (monotonic time, text)
    rc: int | None = None  # torch transport only: MPI's launcher reports one status for the job
    exited: float | None = None

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if re.search(pattern, line)), None)

    @property
    def entered(self) -> float:
        return self.first("^FAULT-TEST enter")[0]

    @property
    def error(self) -> tuple[float, str]:
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


def worker_args(scenario: str) -> list[str]:
    return [str(WORKER), scenario, str(TIMEOUT_S)]


def run_torch(scenario: str, n: int = 4, limit_s: float = 150, args: list[str] | None = None) -> Job:
    """n processes on one store, as torchrun starts them; ranks still alive once the others have
    exited (a stopped one) are killed. `args`: another worker's command line."""
    port, ranks, procs, readers = free_loopback_port(), [Rank() for _ in range(n)], [], []
    began = time.monotonic()
    for r in range(n):
        p = subprocess.Popen([sys.executable, *(args or worker_args(scenario))], cwd=ROOT, text=True,
                             env=env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_PORT=str(port)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


def run_mpi(scenario: str, n: int = 4, limit_s: float = 150, args: list[str] | None = None) -> Job:
    ranks, everything = [Rank() for _ in range(n)], []

    def sink(at, line):
        everything.append(line)
        # one pipe for every rank: a line is ours by what it says (the worker's markers, the
        # engine's error line); a line may still carry pieces of several ranks' output
        for m in re.finditer(r"FAULT-TEST \w+ (\d+)|slackswap rank (\d+): .*?The job stops", line):
            ranks[int(m.group(1) or m.group(2))].lines.append((at, m.group(0)))

    began = time.monotonic()
    p = subprocess.Popen([MPIEXEC, "-iface", "lo", "-n", str(n), sys.executable, *(args or worker_args(scenario))],
                         cwd=ROOT, env=env(MASTER_PORT=str(free_loopback_port())), text=True,
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


TRANSPORTS = ["torch", pytest.param("mpi", marks=pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"))]


def launch(transport: str, scenario: str) -> Job:
    return run_torch(scenario) if transport == "torch" else run_mpi(scenario)


def assert_named(job: Job, survivors, pattern: str) -> None:
    """Every survivor logged an error matching `pattern` within TIMEOUT_S + MARGIN_S of the
    faulty step, and exited non-zero (under MPI the launcher ends the job at the first exit:
    every survivor has said why by then, and the job's status is non-zero)."""
    assert job.rc != 0
    assert "Segmentation fault" not in job.output and "core dumped" not in job.output
    assert "signal 11" not in job.output.lower() and "SIGSEGV" not in job.output
    for r in survivors:
        rank = job.ranks[r]
        at, line = rank.error
        assert re.search(pattern, line), f"rank {r}: {line}"
        assert at - rank.entered <= TIMEOUT_S + MARGIN_S, f"rank {r} took {at - rank.entered:.1f} s: {line}"
        if rank.rc is not None:
            assert rank.rc == 1, f"rank {r} exited with {rank.rc}"
            assert rank.exited - rank.entered <= TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rank_0_stopped_while_it_plans(transport):
    job = launch(transport, "stop0-plan")
    why = "store did not answer .*rank 0, whose process hosts it, is stopped" if transport == "torch" else "rank 0 did not send a plan"
    assert_named(job, [1, 2, 3], why)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_stopped_at_agreement(transport):
    job = launch(transport, "stop3-agree")
    assert_named(job, [0, 1, 2], r"ranks \[3\] did not report")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_dead_before_the_node_facts(transport):
    job = launch(transport, "kill2-facts")
    if transport == "torch":
        assert_named(job, [0, 1, 3], r"ranks \[2\] did not send their node facts")
        return
    # MPI's launcher ends the whole job as soon as one rank exits before MPI_Finalize: nobody waits
    # on the dead rank, so there is nothing for SlackSwap to name
    assert job.rc != 0
    assert max(r.entered for r in job.ranks if r.first("^FAULT-TEST enter")) <= job.began + job.seconds
    assert job.seconds - (max(r.entered for r in job.ranks) - job.began) <= TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_with_another_shape(transport):
    job = launch(transport, "shape3")
    assert_named(job, [0, 1, 2, 3], r"ranks \[3\] plan another step than rank 0 .*rank 3: input shapes \(2, 12, 32\)")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_new_shape_on_some_ranks_only(transport):
    job = launch(transport, "newshape23")
    pattern = "rank 0 did not answer .* not planning this step"
    if transport == "torch":
        pattern += r" \(ranks \[2, 3\] entered this round; ranks \[0, 1\] did not\)"
    assert_named(job, [2, 3], pattern)


def test_sync_mpi_without_an_mpi_launch_is_refused_at_once():
    job = run_torch("sync-mpi", n=2)
    for rank in job.ranks:
        assert rank.rc == 1
        assert rank.first(r'"sync": "mpi" needs a job launched by MPI'), rank.lines[-5:]
        assert not rank.first("FAULT-TEST enter")  # refused by initialize, before any step


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_50_agreement_rounds_with_random_delays_under_mpiexec():
    proc = subprocess.run([MPIEXEC, "-iface", "lo", "-n", "4", sys.executable, str(ROOT / "tests" / "faults" / "stress.py"),
                           "50", "10"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert sorted(re.findall(r"STRESS ok (\d) 50 1", out)) == ["0", "1", "2", "3"], out[-3000:]

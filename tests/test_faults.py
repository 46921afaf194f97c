"""Faults in a real 4-rank DeepSpeed job under SlackSwap (tests/faults/worker.py), under both
transports: the torch.distributed store (4 processes started here, as torchrun would) and MPI
(`mpiexec -iface lo -n 4`). Whatever one rank does (stops, dies, runs another model), every
surviving rank says which rank is at fault and why, and exits non-zero within sync_timeout_s + 5 s
of the step that went wrong; nothing hangs, nothing segfaults. Ranks on other input shapes are no
fault: each plans its own, nobody waits. Plus a stress test: 50 agreement rounds with random delays
on random ranks under mpiexec."""

from __future__ import annotations

import re
import sys

import pytest

from jobs import (DEADLINES, FAULT_MARGIN_S, FAULT_TIMEOUT_S, MPIEXEC, ROOT, TRANSPORTS, TRANSPORTS_MPI_SLOW, Job,
                  assert_named, mpiexec_line, run_launch, run_ranks)

pytest.importorskip("deepspeed")
pytestmark = DEADLINES

WORKER = ROOT / "tests" / "faults" / "worker.py"


def launch(transport: str, scenario: str, n: int = 4) -> Job:
    return run_ranks(transport, [str(WORKER), scenario, str(FAULT_TIMEOUT_S)], n=n)


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_rank_0_stopped_while_it_plans(transport):
    job = launch(transport, "stop0-plan")
    why = "store did not answer .*rank 0, whose process hosts it, is stopped" if transport == "torch" else "rank 0 did not send a plan"
    assert_named(job, [1, 2, 3], why)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_stopped_at_agreement(transport):
    job = launch(transport, "stop3-agree")
    assert_named(job, [0, 1, 2], r"ranks \[3\] did not report")


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_a_rank_dead_before_the_node_facts(transport):
    job = launch(transport, "kill2-facts")
    if transport == "torch":
        assert_named(job, [0, 1, 3], r"ranks \[2\] did not send their node facts")
        return
    # MPI's launcher ends the whole job as soon as one rank exits before MPI_Finalize: nobody waits
    # on the dead rank, so there is nothing for SlackSwap to name
    assert job.rc != 0
    assert max(r.entered for r in job.ranks if r.first("^FAULT-TEST enter")) <= job.began + job.seconds
    assert job.seconds - (max(r.entered for r in job.ranks) - job.began) <= FAULT_TIMEOUT_S + FAULT_MARGIN_S


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_a_rank_that_runs_another_model_on_the_same_shapes(transport):
    job = launch(transport, "forward3")
    assert_named(job, [0, 1, 2, 3], r"ranks \[3\] profiled another step than rank 0 on the same input shapes")


def assert_trained(job: Job) -> None:
    """No fault: every rank trained all its steps and exited 0, no rank waited for another's plan."""
    assert job.rc == 0, job.output[-3000:]
    assert all(r.first("^FAULT-TEST done") for r in job.ranks), job.output[-3000:]
    assert job.seconds < FAULT_TIMEOUT_S + 60 and not re.search(r"did not (answer|report|send)", job.output)


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_a_rank_on_another_shape_plans_its_own(transport):
    job = launch(transport, "shape3")
    assert_trained(job)
    assert "data-parallel ranks are on different input shapes" in job.output
    assert re.search(r"slackswap rank 3: input shapes \[\(2, 12, 32\)\]: plan \w+ planned from its profile", job.output)


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_a_new_shape_on_some_ranks_only_is_planned_there_alone(transport):
    job = launch(transport, "newshape23")
    assert_trained(job)
    for r in (2, 3):  # derived from their profile of length 8: no profiled step, no exchange
        assert re.search(rf"slackswap rank {r}: input shapes \[\(2, 16, 32\)\]: plan \w+ derived", job.output)
    assert not re.search(r"slackswap rank [01]: input shapes \[\(2, 16", job.output)


@pytest.mark.parametrize("transport", TRANSPORTS_MPI_SLOW)
def test_a_rank_that_runs_another_model_on_a_later_shape_is_logged_without_waiting(transport):
    """Later shapes are planned by each rank alone; their structures are compared lazily: of rank 3
    (whose profile of the new length differs) and each other rank, the later to publish logs it."""
    job = launch(transport, "lateforward3")
    assert_trained(job)
    said = re.findall(r"slackswap rank (\d): input shapes \(2, 16, 32\) torch.float32: ranks \[([\d, ]+)\] profiled "
                      r"them with another structure", job.output)
    assert said and all(rank == "3" or others == "3" for rank, others in said), job.output[-3000:]
    named = {r for rank, others in said for r in ([int(x) for x in others.split(", ")] if rank == "3" else [int(rank)])}
    assert named == {0, 1, 2}, said


def test_sync_mpi_without_an_mpi_launch_is_refused_at_once():
    job = launch("torch", "sync-mpi", n=2)
    for rank in job.ranks:
        assert rank.rc == 1
        assert rank.first(r'"sync": "mpi" needs a job launched by MPI'), rank.lines[-5:]
        assert not rank.first("FAULT-TEST enter")  # refused by initialize, before any step


@pytest.mark.slow  # (suite time: the fault cases above run the same protocol, a round each)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_50_agreement_rounds_with_random_delays_under_mpiexec():
    out = run_launch(mpiexec_line(4, sys.executable, str(ROOT / "tests" / "faults" / "stress.py"), "50", "10"),
                     timeout=300)
    assert sorted(re.findall(r"STRESS ok (\d) 50 1", out)) == ["0", "1", "2", "3"], out[-3000:]

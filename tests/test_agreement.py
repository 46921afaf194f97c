"""Plan agreement over the torch.distributed store (the transport when MPI did not launch the job):
real gloo process groups of 4 ranks on 127.0.0.1, one process per rank. The MPI transport runs the
same protocol in tests/test_dist.py; a tampered plan is checked here under both transports."""

import pytest

from slackswap_ds.agreement import Solo, agree, exchange
from slackswap_ds.hardware import load_node
from slackswap_ds.workloads import workload

from jobs import DEADLINES, ROOT, TRANSPORTS, rank_rows

pytestmark = DEADLINES

WORKER = ROOT / "tests" / "torch_dist" / "worker.py"
MPI_WORKER = ROOT / "tests" / "mpi" / "worker.py"  # the same protocol under mpiexec (tests/test_dist.py)


def run_ranks(scenario: str, timeout_s: float = 60, n: int = 4) -> list[dict]:
    """The worker's scenario on n ranks over the store: each rank's row."""
    return rank_rows("torch", [str(WORKER), scenario, str(timeout_s)], n=n)


def test_replicas_agree_over_the_store_and_train_exactly():
    rows = run_ranks("agree")
    assert len({r["digest"] for r in rows}) == 1
    assert all(r["exact"] for r in rows)
    assert rows[0]["store_keys_left"] == 0  # rank 0 cleared the round's keys from the store


def test_a_rank_that_exits_before_agreement_is_named_within_the_timeout():
    rows = run_ranks("exit1", timeout_s=5)
    assert rows[1]["exited"]
    for r in (rows[0], rows[2], rows[3]):
        assert "ranks [1] did not report within sync_timeout_s=5" in r["error"]
        assert r["seconds"] < 5 + 5 + 10  # the deadline, plus the verdict's own, plus slack


@pytest.mark.slow  # (suite time: the engine-level case, test_faults' a_rank_stopped_at_agreement, runs in the suite)
def test_a_stuck_rank_is_named_within_the_timeout():
    rows = run_ranks("stuck1", timeout_s=5)
    for r in (rows[0], rows[2], rows[3]):
        assert "ranks [1] did not report within sync_timeout_s=5" in r["error"]
        assert r["seconds"] < 5 + 5 + 10
    assert "rank 1" in rows[1]["error"]  # when it wakes, its partners are gone: an error, not a hang


@pytest.mark.slow  # (suite time: the engine-level case, test_faults' a_rank_dead_before_the_node_facts, runs in the suite)
def test_a_rank_gone_before_the_node_facts_exchange_is_named():
    rows = run_ranks("coordinate-exit3", timeout_s=5)
    for r in rows[:3]:
        assert "ranks [3] did not send their node facts" in r["error"], r["error"]
        assert r["seconds"] < 5 + 10


def test_rank_0_gone_is_named_by_the_others():
    rows = run_ranks("exit0", timeout_s=5)
    for r in rows[1:]:
        assert "rank 0" in r["error"], r["error"]
        assert r["seconds"] < 5 + 5 + 10


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tampered_plan_is_detected_and_named(transport):
    # rank 2 flips one decision of the plan it receives: every rank names it, over either transport
    rows = rank_rows(transport, [str(WORKER if transport == "torch" else MPI_WORKER), "tamper", "60"])
    for r in rows:
        assert "ranks [2]" in r["error"] and ("digest differs" in r["error"] or "does not fit" in r["error"])


def test_a_plan_that_arrives_unreadable_is_named_not_a_crash():
    rows = run_ranks("garble")
    for r in rows:
        assert "ranks [2] could not read the plan they received" in r["error"], r["error"]


def test_the_engine_coordinates_nodes_over_the_store():
    from slackswap_ds.shares import water_fill

    node = load_node("dgx-a100")
    rows = run_ranks("coordinate")
    assert {r["channel"] for r in rows} == {"StoreChannel"}
    for members in ((0, 1), (2, 3)):  # ranks_per_node = 2: two nodes; each pair behind one switch
        pair = [rows[r] for r in members]
        assert sum(r["d2h"] for r in pair) == node.switch_uplink_bps
        assert sum(r["h2d"] for r in pair) == node.switch_uplink_bps
        # the pool (64 KiB per node) is far below both demands: split max-min fairly, i.e. evenly
        demands = [r["demand"] for r in pair]
        assert min(demands) > 65536 // 2
        assert [r["pool"] for r in pair] == water_fill(65536, demands) == [32768, 32768]
    # rank 0 plans with the tightest share of all four: the least link and the least pool
    assert all(r["plan_d2h"] == min(x["d2h"] for x in rows) for r in rows)
    assert all(r["plan_pool"] == min(x["pool"] for x in rows) for r in rows)


def test_one_rank_agrees_with_itself():
    profile = workload("bert-large", load_node("dgx-a100").gpu)
    assert agree(Solo(), profile, None, 1.0) == (profile, None)
    assert exchange(Solo(), "facts", "x", 1.0, "facts") == ["x"]
    with pytest.raises(ValueError, match="cannot send"):
        Solo().post("plan", b"", [1])

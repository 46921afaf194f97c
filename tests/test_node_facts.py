"""Node coordination under a real MPI launcher: `mpiexec -iface lo -n 4` (loopback only), with the
4 ranks grouped as 2 nodes x 2 ranks by the host-grouping override."""

import pytest

from slackswap_ds.hardware import load_node
from slackswap_ds.node_facts import RankFacts, shares_of
from slackswap_ds.shares import Share, split_node, tightest, water_fill

from jobs import DEADLINES, MPIEXEC, ROOT, rank_rows

pytestmark = [pytest.mark.skipif(MPIEXEC is None or pytest.importorskip("mpi4py") is None, reason="no mpiexec"),
              DEADLINES]


def mpirun(*args: str, n: int = 4) -> list[dict]:
    """tests/mpi/worker.py under `mpiexec -iface lo -n n`: each rank's row."""
    return rank_rows("mpi", [str(ROOT / "tests" / "mpi" / "worker.py"), *args], n=n)


def test_ranks_grouped_as_two_nodes_of_two_share_each_node_budget_and_link():
    node = load_node("dgx-a100")
    rows = mpirun("shares", "3000", "1000", "2000")
    assert [r["node_ranks"] for r in rows] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for members in ((0, 1), (2, 3)):
        group = [rows[r] for r in members]
        # both ranks sit behind one switch: its uplink is split between them, exactly
        assert sum(r["d2h"] for r in group) == node.switch_uplink_bps
        assert sum(r["h2d"] for r in group) == node.switch_uplink_bps
        # demands (3000 + 1000) exceed the node pool (2000): max-min fair shares, within the pool
        assert [r["pool"] for r in group] == [1000, 1000]


def test_replicas_agree_on_one_plan_and_train_exactly():
    rows = mpirun("agree", "60")
    assert len({r["digest"] for r in rows}) == 1
    assert all(r["exact"] for r in rows)


@pytest.mark.slow  # (suite time: the store's case, test_agreement's, runs in the suite)
def test_a_rank_that_exits_before_agreement_is_named_within_the_timeout():
    rows = mpirun("exit", "5")
    assert rows[1].get("exited")
    for r in (rows[0], rows[2], rows[3]):
        assert "ranks [1] did not report within sync_timeout_s=5" in r["error"]


@pytest.mark.slow  # (suite time: MPI's engine-level case, test_faults' a_rank_stopped_at_agreement[mpi], runs in the suite)
def test_a_stuck_rank_is_named_within_the_timeout():
    rows = mpirun("stuck", "5")
    for r in (rows[0], rows[2], rows[3]):
        assert "ranks [1] did not report within sync_timeout_s=5" in r["error"]
        assert r["seconds"] < 5 + 5 + 10
    assert "rank 1" in rows[1]["error"]  # when it wakes, the verdict is long gone: an error, not a hang


def test_pool_shares_fit_when_demand_is_below_the_pool():
    node = load_node("dgx-a100")
    shares = split_node([0, 0, 1, 1], [100, 200, 300, 400], node.gpu, node.switch_uplink_bps, 10_000)
    assert [s.host_pool_bytes for s in shares] == [100, 200, 300, 400]
    assert [s.d2h_bps for s in shares] == [node.switch_uplink_bps / 2] * 4
    odd = split_node([0, 0, 1], [1, 1, 1], node.gpu, node.switch_uplink_bps, None)  # the third: a switch to itself
    assert odd[2].d2h_bps == min(node.gpu.d2h_bps, node.switch_uplink_bps)
    assert odd[2].host_pool_bytes is None


def test_shares_are_computed_per_node_and_the_plan_fits_the_tightest_rank():
    node = load_node("dgx-a100")
    # node "a": ranks 0, 1 behind one switch; node "b": rank 2 alone on its switch, rank 3 too
    facts = [RankFacts("a", 0, 600), RankFacts("a", 0, 200), RankFacts("b", 0, 100), RankFacts("b", 1, 100)]
    shares = shares_of(facts, node.gpu, node.switch_uplink_bps, 400)
    assert [s.d2h_bps for s in shares] == [node.switch_uplink_bps / 2] * 2 + [min(node.gpu.d2h_bps, node.switch_uplink_bps)] * 2
    assert [s.host_pool_bytes for s in shares] == [200, 200, 100, 100]  # node a: over its pool, max-min fair
    least = tightest(shares)
    assert (least.d2h_bps, least.h2d_bps, least.host_pool_bytes) == (node.switch_uplink_bps / 2,
                                                                    node.switch_uplink_bps / 2, 100)
    assert tightest([shares[2], type(shares[2])()]).host_pool_bytes == 100  # a Share() without a pool: unlimited


def test_the_pool_is_split_max_min_fairly_by_demand():
    assert water_fill(400, [600, 200]) == [200, 200]  # the small demand is met, the rest shared
    assert water_fill(1000, [100, 700, 700]) == [100, 450, 450]
    assert water_fill(1000, [100, 200]) == [100, 200]  # all fit: each its demand
    assert water_fill(10, [None, None, None]) == [3, 3, 3]  # unknown demands: equal shares
    assert water_fill(10, [2, None]) == [2, 8]
    assert water_fill(0, [5, 5]) == [0, 0] and water_fill(7, []) == []


def test_a_node_share_is_the_same_policy_with_unknown_demands():
    node = load_node("dgx-a100")
    of_node = Share.of_node(node)
    split = split_node([node.switch_of(g) for g in range(node.gpus)], [None] * node.gpus, node.gpu,
                       node.switch_uplink_bps, int(node.host_bytes))
    assert all(s == of_node for s in split)
    assert of_node.host_pool_bytes == int(node.host_bytes) // node.gpus
    assert of_node.d2h_bps == min(node.gpu.d2h_bps, node.switch_uplink_bps / node.gpus_per_switch)


def test_rank_facts_round_trip_and_bad_demands_are_refused():
    f = RankFacts("host-1", 3, 12345)
    assert RankFacts.from_json(f.to_json()) == f
    node = load_node("dgx-a100")
    with pytest.raises(ValueError, match="one demand per local rank"):
        split_node([0, 0], [1], node.gpu, 1e9, None)
    with pytest.raises(ValueError, match=">= 0"):
        split_node([0], [-1], node.gpu, 1e9, None)

"""Exact event times on hand-checkable cases (times in seconds, bytes, bytes/s)."""

import pytest

from slackswap_ds.hardware import Node
from slackswap_ds.plan import Decision, Plan, lower
from slackswap_ds.simulator import SimulationError, simulate, simulate_node
from slackswap_ds.step_profile import Activation, Op, StepProfile

from conftest import toy_hardware, two_region_profile


def make_plan(profile, budget=1000, prefetch=None, blocking=False, **decisions):
    dec = {a.key: Decision.KEEP for a in profile.activations}
    dec.update({k.replace("_", ":"): Decision(v) for k, v in decisions.items()})
    return Plan.build(profile, dec, budget_bytes=budget, hardware_digest="toy", planner="test",
                      prefetch=prefetch, blocking=blocking)


def events(res):
    return [(e.stream, e.kind, e.name, e.start, e.end) for e in res.events]


def test_keep_all_runs_forward_then_backward():
    p = two_region_profile()
    res = simulate(lower(p, make_plan(p)), toy_hardware(), budget_bytes=60)
    assert res.step_s == 12.0
    assert res.peak_bytes == 60 and res.feasible
    assert [e[3:] for e in events(res)] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    # memory: +10 +20 +10 +20 in forward, then freed region by region in backward
    assert [m[2] for m in res.memory] == [0, 10, 30, 40, 60, 40, 30, 10, 0]


def test_recompute_runs_producer_at_region_start_and_lowers_peak():
    p = two_region_profile()
    res = simulate(lower(p, make_plan(p, r0_y="recompute")), toy_hardware(), budget_bytes=40)
    assert ("compute", "recompute", "r0:0:a", 8.0, 9.0) in events(res)
    assert res.step_s == 13.0 and res.recompute_s == 1.0
    assert res.peak_bytes == 40 and res.feasible


def test_swap_copy_out_after_saving_op_and_prefetch_at_trigger():
    p = two_region_profile()
    plan = make_plan(p, r0_x="swap", prefetch={"r0:x": "r1:0:a"})
    res = simulate(lower(p, plan), toy_hardware(), budget_bytes=60)
    ev = events(res)
    assert ("d2h", "copy_out", "r0:x", 1.0, 2.0) in ev  # 10 B at 10 B/s after fwd(op 0)
    assert ("h2d", "copy_in", "r0:x", 8.0, 9.0) in ev  # after bwd(op 2) ends at 8
    assert res.step_s == 12.0 and res.stall_s["compute"] == 0.0
    # r0:x leaves at t=2; peak is at end of forward: 20 + 10 + 20
    assert res.peak_bytes == 50
    assert res.bytes_d2h == res.bytes_h2d == 10


def test_late_prefetch_stalls_compute():
    p = two_region_profile()
    plan = make_plan(p, r0_x="swap", prefetch={"r0:x": "r0:1:b"})  # copy starts when bwd(1) ends at 10
    res = simulate(lower(p, plan), toy_hardware(), budget_bytes=60)
    assert ("h2d", "copy_in", "r0:x", 10.0, 11.0) in events(res)
    assert ("compute", "bwd", "r0:0:a", 11.0, 13.0) in events(res)
    assert res.step_s == 13.0 and res.stall_s["compute"] == pytest.approx(1.0)


def test_duplex_slows_h2d_while_d2h_runs():
    # one op saves a 40 B tensor (copy-out 4 s); a second region's swapped tensor comes back meanwhile
    ops = [Op("a:0:f", 1, 10, "a"), Op("b:0:f", 0.5, 1, "b")]
    acts = [Activation("a:x", 10, (0,)), Activation("b:x", 40, (1,))]
    p = StepProfile("duplex", ops, acts)
    plan = make_plan(p, a_x="swap", b_x="swap")
    res = simulate(lower(p, plan), toy_hardware(d2h=10, h2d=10, duplex_d2h=10, duplex_h2d=5))
    ev = {(e[0], e[2]): (e[3], e[4]) for e in events(res)}
    # a:x: 10 B copied out 1..2; b:x: 40 B copied out 2..6 (fwd(b) ends at 1.5 but the engine is busy)
    assert ev["d2h", "a:x"] == (1.0, 2.0)
    assert ev["d2h", "b:x"] == (2.0, 6.0)
    # b:x is needed first (bwd(b) at 1.5) and can only come back after its copy-out: 6..10
    assert ev["h2d", "b:x"] == (6.0, 10.0)
    # a:x (10 B) waits for the h2d engine: 10..11
    assert ev["h2d", "a:x"] == (10.0, 11.0)


def test_duplex_rate_applies_while_both_directions_move():
    # x is saved by op 0 but also read by op 2's backward, so it comes back first, while the
    # 100 B copy-out of y (2..12) still runs: x moves at the duplex rate, 5 B/s
    ops = [Op("a:0:f", 1, 1, "a"), Op("a:1:g", 1, 1, "a"), Op("a:2:h", 1, 1, "a")]
    acts = [Activation("a:x", 10, (0, 2)), Activation("a:y", 100, (1,))]
    p = StepProfile("overlap", ops, acts)
    plan = make_plan(p, a_x="swap", a_y="swap")
    res = simulate(lower(p, plan), toy_hardware(d2h=10, h2d=10, duplex_d2h=10, duplex_h2d=5))
    ev = {(e[0], e[2]): (e[3], e[4]) for e in events(res)}
    assert ev["d2h", "a:x"] == (1.0, 2.0)
    assert ev["d2h", "a:y"] == (2.0, 12.0)
    assert ev["h2d", "a:x"] == (3.0, 5.0)  # starts at the end of forward, 10 B at 5 B/s
    assert ev["h2d", "a:y"] == (12.0, 22.0)  # after its own copy-out, alone again: 10 B/s
    assert res.stall_s["compute"] == pytest.approx(2.0 + 16.0)  # waits for x (3..5), then for y (6..22)


def test_shared_switch_uplink_halves_each_rate():
    p = two_region_profile()
    plan = make_plan(p, r0_x="swap", prefetch={"r0:x": "r1:0:a"})
    hw = toy_hardware(d2h=10, h2d=10, duplex_d2h=10, duplex_h2d=10)
    node = Node("pair", hw, gpus=2, gpus_per_switch=2, switches_per_socket=1, switch_uplink_bps=10,
                socket_mem_bps=1e9, host_bytes=1e9)
    sch = lower(p, plan)
    res = simulate_node([sch, sch], node)
    for g in (0, 1):
        copy = [e for e in res.events if e.gpu == g and e.stream == "d2h"][0]
        assert (copy.start, copy.end) == (1.0, 3.0)  # 10 B at 5 B/s each
    alone = simulate(sch, node.gpu)
    assert [e for e in alone.events if e.stream == "d2h"][0].end == 2.0


def test_socket_bandwidth_caps_all_copies():
    p = two_region_profile()
    plan = make_plan(p, r0_x="swap", prefetch={"r0:x": "r1:0:a"})
    hw = toy_hardware(d2h=10, h2d=10)
    node = Node("socket", hw, gpus=2, gpus_per_switch=1, switches_per_socket=2, switch_uplink_bps=100,
                socket_mem_bps=4, host_bytes=1e9)
    sch = lower(p, plan)
    res = simulate_node([sch, sch], node)
    assert {(e.start, e.end) for e in res.events if e.stream == "d2h"} == {(1.0, 6.0)}  # 2 B/s each


def test_copy_latency_is_added_once_per_copy():
    p = two_region_profile()
    plan = make_plan(p, r0_x="swap", prefetch={"r0:x": "r1:0:a"})
    res = simulate(lower(p, plan), toy_hardware(latency=0.5))
    assert ("d2h", "copy_out", "r0:x", 1.0, 2.5) in events(res)


def test_blocking_plan_makes_forward_wait_for_copy_out():
    p = two_region_profile()
    plan = make_plan(p, r0_x="swap", blocking=True, prefetch={"r0:x": "r1:0:a"})
    res = simulate(lower(p, plan), toy_hardware())
    assert ("compute", "fwd", "r0:1:b", 2.0, 3.0) in events(res)
    assert res.stall_s["compute"] == 1.0


def test_over_budget_is_reported_infeasible():
    p = two_region_profile()
    res = simulate(lower(p, make_plan(p)), toy_hardware(), budget_bytes=59)
    assert not res.feasible and res.peak_bytes == 60


def test_same_schedule_gives_identical_events(a100):
    from slackswap_ds.planners import PLANNERS
    from slackswap_ds.budget import resolve_budget
    from slackswap_ds.workloads import workload

    p = workload("bert-large", a100, micro_batch=2, seq=128)
    plan = PLANNERS["slackswap"](p, a100, resolve_budget(0.5, p)).plan
    first = simulate(lower(p, plan), a100)
    assert simulate(lower(p, plan), a100).events == first.events


def test_node_needs_enough_gpus():
    p = two_region_profile()
    with pytest.raises(SimulationError, match="has 1 GPUs"):
        simulate_node([lower(p, make_plan(p))] * 2, Node.single(toy_hardware()))


# ---- start offsets (start_s) --------------------------------------------------------------------
def pair_node(hw):
    """Two GPUs behind one switch whose uplink carries one GPU's full copy rate."""
    return Node("pair", hw, gpus=2, gpus_per_switch=2, switches_per_socket=1, switch_uplink_bps=10,
                socket_mem_bps=1e9, host_bytes=1e9)


def swap_schedule(p):
    return lower(p, make_plan(p, r0_x="swap", prefetch={"r0:x": "r1:0:a"}))


def test_zero_offsets_give_the_same_result_as_none():
    p = two_region_profile()
    node = pair_node(toy_hardware(d2h=10, h2d=10, duplex_d2h=10, duplex_h2d=10))
    sch = swap_schedule(p)
    base = simulate_node([sch, sch], node, budget_bytes=60, ideal_s=12.0)
    assert simulate_node([sch, sch], node, budget_bytes=60, ideal_s=12.0, start_s=[0.0, 0.0]) == base


def test_zero_offsets_give_the_same_result_on_a_dgx(a100):
    from slackswap_ds.hardware import load_node
    from slackswap_ds.planners import PLANNERS
    from slackswap_ds.shares import Share
    from slackswap_ds.budget import resolve_budget
    from slackswap_ds.workloads import workload

    node = load_node("dgx-a100")
    p = workload("bert-large", node.gpu, micro_batch=2, seq=128)
    budget = resolve_budget(0.5, p)
    sch = lower(p, PLANNERS["slackswap"](p, node.gpu, budget, share=Share.of_node(node)).plan)
    base = simulate_node([sch] * node.gpus, node, budget_bytes=budget, ideal_s=1.0)
    zero = simulate_node([sch] * node.gpus, node, budget_bytes=budget, ideal_s=1.0, start_s=[0.0] * node.gpus)
    assert zero == base and zero.events == base.events and zero.memory == base.memory


def test_one_gpu_with_an_offset_ends_exactly_that_much_later():
    p = two_region_profile()
    hw = toy_hardware()
    sch = swap_schedule(p)
    base = simulate(sch, hw, budget_bytes=60)
    late = simulate_node([sch], Node.single(hw), budget_bytes=60, start_s=[2.5])
    assert late.step_s == base.step_s + 2.5 == 14.5
    assert [(e.stream, e.name, e.start - 2.5, e.end - 2.5) for e in late.events] == [
        (e.stream, e.name, e.start, e.end) for e in base.events]
    assert late.stall_s == base.stall_s  # waiting to start is not a stall
    assert late.peak_bytes == base.peak_bytes and late.bytes_d2h == base.bytes_d2h


def test_offset_separates_copies_that_share_an_uplink():
    p = two_region_profile()
    node = pair_node(toy_hardware(d2h=10, h2d=10, duplex_d2h=10, duplex_h2d=10))
    sch = swap_schedule(p)

    def copies(res):
        return {(e.gpu, e.stream): (e.start, e.end) for e in res.events if e.stream != "compute"}

    # together: both 10 B copy-outs share the 10 B/s uplink on 1..3 (see test_shared_switch_uplink_halves_each_rate)
    # offset 0.5: GPU 0 alone 1..1.5 (5 B), both at 5 B/s 1.5..2.5, GPU 1 alone again 2.5..3 (5 B at 10 B/s)
    half = simulate_node([sch, sch], node, start_s=[0.0, 0.5])
    assert copies(half)[0, "d2h"] == (1.0, 2.5) and copies(half)[1, "d2h"] == (1.5, 3.0)
    # offset 1: the copies no longer overlap, each runs at the GPU's full 10 B/s, in both directions
    apart = simulate_node([sch, sch], node, start_s=[0.0, 1.0])
    assert copies(apart) == {(0, "d2h"): (1.0, 2.0), (0, "h2d"): (8.0, 9.0),
                             (1, "d2h"): (2.0, 3.0), (1, "h2d"): (9.0, 10.0)}
    assert [r.step_s for r in apart.per_gpu] == [12.0, 13.0]
    assert apart.step_s == 13.0  # the node waits for the delayed GPU: its offset counts
    assert apart.per_gpu[1].stall_s == apart.per_gpu[0].stall_s


@pytest.mark.parametrize("start_s, match", [([0.0], "1 offsets for 2 schedules"),
                                            ([0.0, -1.0], "must be finite and >= 0"),
                                            ([0.0, float("nan")], "must be finite and >= 0"),
                                            ([0.0, float("inf")], "must be finite and >= 0")])
def test_bad_offsets_are_rejected(start_s, match):
    p = two_region_profile()
    sch = lower(p, make_plan(p))
    with pytest.raises(SimulationError, match=match):
        simulate_node([sch, sch], pair_node(toy_hardware()), start_s=start_s)

import json

import pytest

from slackswap_ds.errors import InvalidFileError, PlanError
from slackswap_ds.plan import END_OF_FORWARD, Decision, Kind, Plan, lower, need_op

from conftest import two_region_profile


def build(p, **kw):
    dec = {a.key: Decision.KEEP for a in p.activations}
    dec.update(kw.pop("dec", {}))
    return Plan.build(p, dec, budget_bytes=kw.pop("budget", 50), hardware_digest="hw", planner="test", **kw)


def test_json_round_trip_and_digest_are_stable(tmp_path):
    p = two_region_profile()
    plan = build(p, dec={"r0:x": Decision.SWAP, "r1:y": Decision.RECOMPUTE}, prefetch={"r0:x": "r1:0:a"})
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path, profile=p)
    assert again == plan and again.digest == plan.digest
    # canonical: key order in the file does not matter
    data = json.loads(path.read_text())
    shuffled = dict(reversed(list(data.items())))
    assert Plan.from_json(shuffled).digest == plan.digest
    # a known digest: changes only if the canonical format changes
    assert len(plan.digest) == 64
    assert build(p, dec={"r0:x": Decision.SWAP}).digest != plan.digest


def test_swap_without_trigger_prefetches_at_end_of_forward():
    p = two_region_profile()
    plan = build(p, dec={"r0:x": Decision.SWAP})
    assert plan.trigger == {"r0:x": END_OF_FORWARD}


def test_plan_for_another_profile_is_refused(tmp_path):
    p = two_region_profile()
    plan = build(p)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    from slackswap_ds.step_profile import StepProfile

    other = StepProfile("other", p.ops, p.activations[:3] + (p.activations[3].__class__("r1:y", 21, (3,), (2,), ("r1:x",)),))
    with pytest.raises(PlanError, match="made for profile"):
        Plan.load(plan_path, profile=other)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read plan"),
        ('{"format": "something-else"}', "not a slackswap plan"),
        ('{"format": "slackswap.plan/1", "decisions": {"a": "teleport"}}', "malformed"),
        ('{"format": "slackswap.plan/1", "decisions": {}, "prefetch": {}}', "malformed"),
    ],
)
def test_corrupted_plan_files_give_a_reason(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(InvalidFileError, match=message):
        Plan.load(path)


def test_check_reports_every_problem_at_once():
    p = two_region_profile()
    with pytest.raises(PlanError) as err:
        Plan.build(p, {"r0:x": Decision.RECOMPUTE, "ghost": Decision.KEEP}, budget_bytes=1, hardware_digest="",
                   planner="t")
    msg = str(err.value)
    assert "no decision for 3 activation(s)" in msg
    assert "unknown activation" in msg
    assert "'r0:x' cannot be recomputed" in msg


def test_trigger_after_need_is_refused():
    p = two_region_profile()
    with pytest.raises(PlanError, match="after backward needs it"):
        build(p, dec={"r0:x": Decision.SWAP}, prefetch={"r0:x": "r0:0:a"})
    with pytest.raises(PlanError, match="not an op"):
        build(p, dec={"r0:x": Decision.SWAP}, prefetch={"r0:x": "nope"})


def test_need_moves_to_region_start_when_a_recompute_depends_on_the_swap():
    p = two_region_profile()
    plan = build(p, dec={"r0:x": Decision.SWAP, "r0:y": Decision.RECOMPUTE})
    assert need_op(p, plan, "r0:x") == 1  # region r0's first backward op, where recompute runs
    plain = build(p, dec={"r0:x": Decision.SWAP})
    assert need_op(p, plain, "r0:x") == 0


def test_lowering_streams_and_memory_effects():
    p = two_region_profile()
    plan = build(p, dec={"r0:x": Decision.SWAP, "r0:y": Decision.RECOMPUTE}, prefetch={"r0:x": "r1:0:a"})
    s = lower(p, plan)
    compute = [(s.instrs[i].kind, s.instrs[i].name) for i in s.stream("compute")]
    assert compute == [
        (Kind.FWD, "r0:0:a"), (Kind.FWD, "r0:1:b"), (Kind.FWD, "r1:0:a"), (Kind.FWD, "r1:1:b"),
        (Kind.BWD, "r1:1:b"), (Kind.BWD, "r1:0:a"), (Kind.RECOMPUTE, "r0:0:a"), (Kind.BWD, "r0:1:b"),
        (Kind.BWD, "r0:0:a"),
    ]
    [out] = [s.instrs[i] for i in s.stream("d2h")]
    [back] = [s.instrs[i] for i in s.stream("h2d")]
    assert out.free_end == ("r0:x",) and back.alloc_start == ("r0:x",)
    recompute = s.instrs[s.stream("compute")[6]]
    # the recompute reads the swapped x, so it waits for x's copy-in
    assert recompute.waits == (s.stream("h2d")[0],) and recompute.alloc_end == ("r0:y",)
    # y is not saved in forward (RECOMPUTE)
    assert s.instrs[s.stream("compute")[1]].alloc_end == ()

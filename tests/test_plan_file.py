"""plan_file entries: what a plan was made for, refused with the reason when it differs; atomic
writes; one entry per input shape."""

import json
import threading

import pytest
from conftest import two_region_profile

from slackswap_ds import plan_file
from slackswap_ds.errors import InvalidFileError
from slackswap_ds.plan import Decision, Plan
from slackswap_ds.plan_file import PlanEntry, MadeFor


def made_for(**kw) -> MadeFor:
    base = dict(inputs="(2, 16) torch.int64", structure="s" * 8, budget_bytes=100, hardware="a100 abc",
                planner="slackswap", share="d2h None h2d None pool None", world="2 ranks, 2 per node")
    return MadeFor(**{**base, **kw})


def a_plan(budget=100) -> Plan:
    profile = two_region_profile()
    return Plan.build(profile, {a.key: Decision.KEEP for a in profile.activations}, budget_bytes=budget,
                      hardware_digest="abc", planner="slackswap")


def test_only_an_entry_made_for_exactly_this_job_is_found_and_the_reason_is_given():
    entries = [PlanEntry(made_for(), a_plan()), PlanEntry(made_for(inputs="(2, 32) torch.int64"), a_plan())]
    assert plan_file.find(entries, made_for()) == (entries[0], [])
    entry, why = plan_file.find(entries, made_for(budget_bytes=50, hardware="h100 def"))
    assert entry is None
    assert why == ["budget_bytes: 50 here, 100 in the file", "hardware: 'h100 def' here, 'a100 abc' in the file"]
    assert plan_file.find([], made_for()) == (None, [])
    assert plan_file.find(entries, made_for(inputs="(4, 8) torch.int64")) == (None, [])  # a new shape: no reason


def test_round_trip_and_one_entry_per_input_shape(tmp_path):
    path = tmp_path / "plans.json"
    assert plan_file.read(path) == []
    first = PlanEntry(made_for(), a_plan())
    plan_file.write(path, plan_file.upsert([], first))
    second = PlanEntry(made_for(inputs="(2, 32) torch.int64"), a_plan(7))
    entries = plan_file.upsert(plan_file.read(path), second)
    replaced = PlanEntry(made_for(budget_bytes=5), a_plan(5))  # the same shapes again: replaces the first
    plan_file.write(path, plan_file.upsert(entries, replaced))
    got = plan_file.read(path)
    assert [(e.made_for, e.plan.digest) for e in got] == [(second.made_for, second.plan.digest),
                                                          (replaced.made_for, replaced.plan.digest)]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


@pytest.mark.parametrize("text, match", [("{ nope", "cannot read plan_file"),
                                         ('{"format": "slackswap.plan/1"}', "one plan written by `slackswap plan`"),
                                         ('{"format": "slackswap.planfile/0"}', "not a slackswap plan file"),
                                         ('{"format": "slackswap.planfile/1", "plans": [{"made_for": {}}]}',
                                          "made_for")])
def test_a_malformed_file_is_refused_with_the_reason(tmp_path, text, match):
    path = tmp_path / "plans.json"
    path.write_text(text)
    with pytest.raises(InvalidFileError, match=match):
        plan_file.read(path)


def test_writes_are_atomic_under_concurrent_writers_and_readers(tmp_path):
    """Two writers and a reader on one path: the reader always sees a whole file."""
    path = tmp_path / "plans.json"
    plan_file.write(path, [PlanEntry(made_for(), a_plan())])
    stop, torn, reads = threading.Event(), [], [0]

    def writer(n):
        entries = [PlanEntry(made_for(inputs=f"({i},) torch.int64"), a_plan(i)) for i in range(n)]
        while not stop.is_set():
            plan_file.write(path, entries)

    def reader():
        while not stop.is_set():
            try:
                json.loads(path.read_text())
                reads[0] += 1
            except json.JSONDecodeError:
                torn.append(1)

    threads = [threading.Thread(target=writer, args=(n,)) for n in (3, 40)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    threading.Event().wait(1.5)
    stop.set()
    for t in threads:
        t.join()
    assert reads[0] > 50 and torn == []


def test_a_read_only_file_is_not_writable(tmp_path):
    path = tmp_path / "plans.json"
    plan_file.write(path, [PlanEntry(made_for(), a_plan())])
    path.chmod(0o444)
    try:
        import os

        if os.access(path, os.W_OK):  # root ignores the mode
            pytest.skip("this user can write a read-only file")
        assert not plan_file.writable(path) and plan_file.writable(tmp_path / "new.json")
    finally:
        path.chmod(0o644)


def test_a_plan_from_slackswap_plan_is_told_apart_from_a_jobs_plan_file(tmp_path):
    """`slackswap plan -o f` writes one plan of a simulated workload; given as a job's plan_file it
    is named for what it is, and the message says how a job gets its plan_file."""
    from slackswap_ds.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "-w", "bert-large", "-b", "0.5", "--seq", "128", "--micro-batch", "2", "-o", str(path)]) == 0
    with pytest.raises(InvalidFileError, match="written by `slackswap plan` for a simulated workload") as e:
        plan_file.read(path)
    assert "A job writes its own plan_file" in str(e.value)


def test_an_entry_keeps_the_profile_its_plan_was_made_from_and_refuses_another(tmp_path):
    profile = two_region_profile()
    path = tmp_path / "plans.json"
    entry = PlanEntry(made_for(structure=profile.structure_digest), a_plan(), profile)
    plan_file.write(path, [entry])
    (back,) = plan_file.read(path)
    assert back == entry and back.profile.digest == profile.digest
    data = json.loads(path.read_text())
    data["plans"][0]["made_for"]["structure"] = "another step"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidFileError, match="profile of another step"):
        plan_file.read(path)


def test_a_share_is_written_and_read_back_exactly():
    from slackswap_ds.shares import Share

    for share in (Share(), Share(12.5e9, 1 / 3 * 1e10, 1 << 30), Share(None, 7.0, None)):
        assert Share.parse(share.describe()) == share
    with pytest.raises(ValueError, match="not a share"):
        Share.parse("d2h fast")

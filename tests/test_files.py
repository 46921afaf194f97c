"""files.py: JSON read with an error that names the file whatever the file holds; writes that are
atomic, replace a link instead of writing through it, and never replace a device or a FIFO."""

import json
import os

import pytest

from slackswap_ds import plan_file
from slackswap_ds.errors import InvalidFileError
from slackswap_ds.files import read_json, write_atomically
from slackswap_ds.plan import Plan
from slackswap_ds.step_profile import StepProfile

HOSTILE = {
    "nested 100k deep": ("[" * 100_000 + "]" * 100_000).encode(),
    "a 100k-digit number": ('{"format": ' + "9" * 100_000 + "}").encode(),
    "not UTF-8": b"\xff\xfe\x00garbage",
    "not JSON": b"{ nope",
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_every_reader_names_the_file_whatever_it_holds(tmp_path, content):
    path = tmp_path / "hostile.json"
    path.write_bytes(content)
    with pytest.raises(InvalidFileError, match=f"cannot read thing '{path}'"):
        read_json(path, "thing")
    with pytest.raises(InvalidFileError, match=f"cannot read plan_file '{path}'.*delete it"):
        plan_file.read(path)
    with pytest.raises(InvalidFileError, match=f"cannot read plan '{path}'"):
        Plan.load(path)
    with pytest.raises(InvalidFileError, match=f"cannot read profile '{path}'"):
        StepProfile.load(path)


@pytest.mark.parametrize("budget", [1.5, True, -1, "12", 1e999])
def test_a_plan_budget_must_be_a_whole_number_of_bytes(budget):
    d = {"format": "slackswap.plan/1", "decisions": {"a": "keep"}, "prefetch": {}, "budget_bytes": budget,
         "profile_digest": "p", "hardware_digest": "h", "planner": "x", "planner_version": "1"}
    with pytest.raises(InvalidFileError, match="budget_bytes must be an integer >= 0"):
        Plan.from_json(json.loads(json.dumps(d)))


def test_a_write_replaces_a_link_and_never_writes_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    write_atomically(link, "new")
    assert victim.read_text() == "precious"
    assert not link.is_symlink() and link.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim"]  # no temporary left


def test_a_write_never_replaces_a_device_or_a_fifo(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        before = os.lstat(path)
        with pytest.raises(OSError, match="not a regular file"):
            write_atomically(path, "x")
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]

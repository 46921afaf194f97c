"""Plan agreement among ranks that must run one plan (data-parallel replicas), over any `Channel`.

One protocol for both transports (MPI point to point, or the torch.distributed key-value store),
so a dead or stuck rank is *named* the same way, never waited on forever:

    rank 0  -> every rank   "plan":    rank 0's profile and plan, canonical JSON bytes (no pickle)
    rank r  -> rank 0       "report":  does the plan fit r's own step? and the digest r received
    rank 0  -> every rank   "verdict": "ok", or the error text naming the ranks at fault
    rank r  -> rank 0       "verdict.ack": r has the verdict (rank 0 may now exit, taking the
                                       torch.distributed store or the MPI job with it)

Deadlines: no rank waits longer than `timeout_s` (+ MARGIN_S) for any one rank. A rank that never
sends its report is named by rank 0; if rank 0 itself is gone, the others name it: they wait for its
plan until their own deadline, then for its verdict at most `timeout_s` + MARGIN_S after the plan
came (rank 0 judges by its own deadline, which began before it sent the plan). `exchange` (every
rank's text to every rank, through rank 0, with the same deadlines, verdict and ack) carries the
small facts ranks share before planning: node, uplink, demand.

A rank that gives up *shouts* why (`give_up`), once, to every rank: every wait also listens for a
shout, so the ranks still waiting fail at once with the first cause, and every surviving rank says
who is at fault before a launcher tears the job down.

This module is torch- and MPI-free: a Channel only moves bytes.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Callable, Protocol, Sequence

from .errors import PlanError, SlackSwapError
from .plan import Plan
from .step_profile import StepProfile

_FITS, _OTHER_STEP, _PLAN_UNFIT, _UNREADABLE = 1, 2, 3, 4  # a rank's report on the plan it received
# poll every 1 ms at first, backing off to 50 ms: agreement is once per shape, and with thousands of
# ranks, fast polls of rank 0's store would be a storm of requests
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.05
# past a deadline: for a verdict that rank 0 sends by its deadline (a little later than ours: its
# clock began when it sent the plan), and for acks of a verdict (a live rank acks within a poll, but
# a machine with more ranks than cores may not run it for a while)
MARGIN_S, ACK_S = 2.0, 3.0


class AgreementError(SlackSwapError):
    """Ranks that must run the same plan do not agree, or did not answer in time."""


class GaveUp(AgreementError):
    """Another rank shouted that it gave up (its reason is in the message): nothing to add, so not
    shouted again."""


class Channel(Protocol):
    """Non-blocking messages between the ranks of one job. A message is named; within one round
    every (name, sender) pair is sent at most once. A channel of a group of the job's ranks (one
    pipeline stage's) numbers them 0..world-1 and may list their job ranks in `members`, which
    errors then name."""

    rank: int
    world: int

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        """Send `data` to the ranks `to`; returns at once."""

    def poll(self, name: str, sender: int) -> bytes | None:
        """The message `name` from `sender`, if it has arrived; never blocks."""

    def finish(self, deadline: float) -> None:
        """Let this round's sends complete (until `deadline`, then drop them: the receiver is gone);
        the next round's messages never mix with this one's."""

    def shout(self, data: bytes) -> None:
        """Tell every rank, whatever round it is in, that this one gave up and why; returns at once."""

    def hear(self) -> tuple[int, bytes] | None:
        """The first shout of any rank (sender, text), if one has arrived; never blocks."""


def wait_for(channel: Channel, name: str, senders: Sequence[int], deadline: float,
             listen: bool = True) -> dict[int, bytes]:
    """Messages `name` from `senders` that arrive by `deadline` (monotonic seconds). While any is
    missing, a shout of another rank ends the wait (`GaveUp`), unless `listen` is false (a rank
    collecting acks of a verdict has decided already)."""
    got: dict[int, bytes] = {}
    pending = list(senders)
    pause = _POLL_FIRST_S
    while True:
        for r in list(pending):
            data = channel.poll(name, r)
            if data is not None:
                got[r] = data
                pending.remove(r)
        if not pending or time.monotonic() >= deadline:
            return got
        heard = channel.hear() if listen else None
        if heard is not None:
            sender, why = heard
            raise GaveUp(f"rank {_job(channel, channel.rank)}: rank {_job(channel, sender)} gave up: "
                         f"{why.decode(errors='replace')}")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, _POLL_MAX_S)


def exchange(channel: Channel, name: str, text: str, timeout_s: float, what: str, grace_s: float = 0.0) -> list[str]:
    """Every rank's `text`, in rank order, on every rank, through rank 0 (so every rank names the
    same culprit): an AgreementError naming the ranks whose text did not reach rank 0 within
    `timeout_s` (`what` says what was being exchanged), plus `grace_s` where ranks may first have
    to finish a round of their own with that deadline (a pipeline stage's agreement: its own
    first rank names a culprit there sooner, and shouts)."""
    rank, world = channel.rank, channel.world
    if world == 1:
        return [text]
    deadline = time.monotonic() + timeout_s + grace_s
    waited = f"sync_timeout_s={timeout_s:g}" + (f" (+{grace_s:g} s for their own round first)" if grace_s else "")
    with _shouting(channel):
        if rank == 0:
            got = wait_for(channel, name, range(1, world), deadline)
            missing = [r for r in range(1, world) if r not in got]
            error = (f"ranks {_jobs(channel, missing)} did not send their {what} within {waited} "
                     f"(exited, stuck, or not planning this step: {_NOT_PLANNING})") if missing else ""
            answer = json.dumps({"error": error, "all": [text] + [got[r].decode() for r in sorted(got)]})
            _send_verdict(channel, name + ".all", answer.encode(), sorted(got), time.monotonic() + ACK_S)
            if error:
                raise AgreementError(f"rank {_job(channel, 0)}: {error}")
            return json.loads(answer)["all"]
        channel.post(name, text.encode(), [0])
        reply, where = _receive_verdict(channel, name + ".all", deadline + MARGIN_S, sent=name)
        if reply is None:
            lead = _job(channel, 0)
            raise AgreementError(f"rank {_job(channel, rank)}: rank {lead} did not answer the exchange of {what} "
                                 f"within {waited}: rank {lead} exited, is stuck, or is not planning this "
                                 f"step{where} ({_NOT_PLANNING})")
        answer = json.loads(reply.decode())
        if answer["error"]:
            raise AgreementError(f"rank {_job(channel, rank)} (verdict of rank {_job(channel, 0)}): {answer['error']}")
        return answer["all"]


def agree(channel: Channel, local: StepProfile, plan: Plan | None, timeout_s: float,
          on_receive: Callable[[Plan], Plan] | None = None) -> tuple[StepProfile, Plan]:
    """Rank 0's profile and plan on every rank (see the module docstring); `plan` matters on rank 0
    only. `on_receive` lets a test tamper with what a rank received."""
    if channel.world == 1:
        return local, plan
    deadline = time.monotonic() + timeout_s
    with _shouting(channel):
        return _agree(channel, local, plan, timeout_s, deadline, on_receive)


def _agree(channel: Channel, local: StepProfile, plan: Plan | None, timeout_s: float, deadline: float,
           on_receive: Callable[[Plan], Plan] | None) -> tuple[StepProfile, Plan]:
    rank, world = channel.rank, channel.world
    if rank == 0:
        payload = json.dumps({"profile": local.to_json(), "plan": plan.to_json()}).encode()
        channel.post("plan", payload, range(1, world))
        reports = wait_for(channel, "report", range(1, world), deadline)
        problems = _judge(reports, world, plan.digest, timeout_s, lambda rs: _jobs(channel, rs), _job(channel, 0))
        verdict = "ok" if not problems else "; ".join(problems)
        _send_verdict(channel, "verdict", verdict.encode(), sorted(reports), time.monotonic() + ACK_S)
        if problems:
            raise AgreementError("plan agreement failed: " + verdict)
        return local, plan

    got = wait_for(channel, "plan", [0], deadline)
    if 0 not in got:
        lead = _job(channel, 0)
        raise AgreementError(f"rank {_job(channel, rank)}: rank {lead} did not send a plan within "
                             f"sync_timeout_s={timeout_s:g}: rank {lead} exited, is stuck, or planned for longer than that")
    plan_came = time.monotonic()
    try:
        data = json.loads(got[0].decode())
        profile = StepProfile.from_json(data["profile"])
        received = Plan.from_json(data["plan"])
    except (ValueError, KeyError, TypeError, SlackSwapError):  # not what rank 0 sent: report, do not crash
        status, digest = _UNREADABLE, ""
    else:
        if on_receive is not None:
            received = on_receive(received)
        status = _FITS if profile.structure_digest == local.structure_digest else _OTHER_STEP
        try:
            received.check(profile)
        except PlanError:
            status = _PLAN_UNFIT
        digest = received.digest
    channel.post("report", bytes([status]) + digest.encode(), [0])
    reply, _ = _receive_verdict(channel, "verdict", plan_came + timeout_s + MARGIN_S)
    if reply is None:
        lead = _job(channel, 0)
        raise AgreementError(f"rank {_job(channel, rank)}: no verdict from rank {lead} within "
                             f"sync_timeout_s={timeout_s:g} of its plan (rank {lead} exited or is stuck)")
    verdict = reply.decode()
    if verdict != "ok":
        raise AgreementError(f"plan agreement failed (verdict of rank {_job(channel, 0)}): {verdict}")
    return profile, received


_NOT_PLANNING = ("a rank plans a step whose input shapes it has not seen before; every data-parallel rank must "
                 "see the same input shapes at the same step")


def _job(channel: Channel, rank: int) -> int:
    """`rank` of `channel` as the job numbers it: a group's channel (the ranks of one pipeline
    stage, say) numbers its members from 0 and lists their job ranks in `members`."""
    members = getattr(channel, "members", None)
    return members[rank] if members else rank


def _jobs(channel: Channel, ranks) -> list[int]:
    return [_job(channel, r) for r in ranks]


def give_up(channel: Channel, why: str) -> None:
    """Shout `why` to every rank (see the module docstring), once per channel, best effort: a rank
    that gives up must not hang or fail anew while saying so."""
    if getattr(channel, "_gave_up", False) or channel.world == 1:
        return
    channel._gave_up = True
    try:
        channel.shout(why.encode())
    except Exception:  # noqa: BLE001  (the transport itself may be what failed)
        pass


@contextlib.contextmanager
def _shouting(channel: Channel):
    """Failures of the protocol are shouted to every rank before they propagate."""
    try:
        yield
    except GaveUp:
        raise
    except AgreementError as e:
        give_up(channel, str(e))
        raise


def _present(channel: Channel, name: str) -> str:
    """Which ranks are in this round (transports that can tell: the store), for an error message."""
    present = getattr(channel, "present", None)
    if present is None:
        return ""
    try:
        here = present(name)
    except AgreementError:
        return ""
    absent = [r for r in range(channel.world) if r not in here]
    return f" (ranks {_jobs(channel, here)} entered this round; ranks {_jobs(channel, absent)} did not)"


def _send_verdict(channel: Channel, name: str, verdict: bytes, to: Sequence[int], deadline: float) -> None:
    """Rank 0 ends a round: the verdict to the ranks `to`, then their acks (rank 0 may exit next,
    taking the store or the MPI job with it, before a slow rank has read it)."""
    channel.post(name, verdict, to)
    wait_for(channel, name + ".ack", to, deadline, listen=False)
    channel.finish(deadline)


def _receive_verdict(channel: Channel, name: str, deadline: float, sent: str = "") -> tuple[bytes | None, str]:
    """Any other rank ends a round: (rank 0's verdict, acknowledged, ""), or, if none came by
    `deadline`, (None, which ranks had sent this round's `sent` message, where the transport
    can tell)."""
    got = wait_for(channel, name, [0], deadline)
    if 0 in got:
        channel.post(name + ".ack", b"", [0])
    where = _present(channel, sent) if 0 not in got and sent else ""
    channel.finish(deadline)
    return got.get(0), where


def _judge(reports: dict[int, bytes], world: int, digest: str, timeout_s: float,
           name: Callable[[list[int]], list[int]] = list, lead: int = 0) -> list[str]:
    """Rank 0's verdict on the reports: one sentence per kind of fault, each naming its ranks
    (`name`: as the job numbers them; `lead`: rank 0's job rank)."""
    problems = []
    silent = [r for r in range(1, world) if r not in reports]
    if silent:
        problems.append(f"ranks {name(silent)} did not report within sync_timeout_s={timeout_s:g} "
                        f"(exited or stuck before plan agreement)")
    other_step = sorted(r for r, b in reports.items() if b[0] == _OTHER_STEP)
    if other_step:
        problems.append(f"ranks {name(other_step)} run a different step than rank {lead} (saved-tensor names or bytes "
                        f"differ): they cannot share its plan; make every data-parallel rank run the same model "
                        f"on the same shapes")
    unreadable = sorted(r for r, b in reports.items() if b[0] == _UNREADABLE)
    if unreadable:
        problems.append(f"ranks {name(unreadable)} could not read the plan they received (corrupted in transit)")
    unfit = sorted(r for r, b in reports.items() if b[0] == _PLAN_UNFIT)
    if unfit:
        problems.append(f"ranks {name(unfit)} received a plan that does not fit rank {lead}'s own profile")
    mismatch = sorted(r for r, b in reports.items() if b[0] != _UNREADABLE and b[1:].decode(errors="replace") != digest)
    if mismatch:
        problems.append(f"ranks {name(mismatch)} hold a plan whose digest differs from rank {lead}'s {digest[:12]} "
                        f"(corrupted or tampered in transit)")
    return problems


class Solo:
    """The Channel of a job of one rank: there is no one to talk to."""

    rank, world = 0, 1

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        if list(to):
            raise ValueError(f"a job of one rank cannot send to ranks {list(to)}")

    def poll(self, name: str, sender: int) -> bytes | None:
        return None

    def finish(self, deadline: float) -> None:
        pass

    def shout(self, data: bytes) -> None:
        pass

    def hear(self) -> tuple[int, bytes] | None:
        return None

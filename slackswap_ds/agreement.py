"""Plan agreement among ranks that must run one plan (data-parallel replicas), over any `Channel`.

One protocol for both transports (MPI point to point, or the torch.distributed key-value store),
so a dead or stuck rank is *named* the same way, never waited on forever:

    rank 0  -> every rank   "plan":    rank 0's profile and plan, canonical JSON bytes (no pickle)
    rank r  -> rank 0       "report":  does the plan fit r's own step? and the digest r received
    rank 0  -> every rank   "verdict": "ok", or the error text naming the ranks at fault
    rank r  -> rank 0       "verdict.ack": r has the verdict (rank 0 may now exit, taking the
                                       torch.distributed store or the MPI job with it)

Every wait polls against one deadline (`timeout_s`). A rank that never sends its report is named by
rank 0; if rank 0 itself is gone, the others name it. `exchange` (every rank's text to every rank,
through rank 0, with the same deadline, verdict and ack) carries the small facts ranks share before
planning: node, uplink, demand.

This module is torch- and MPI-free: a Channel only moves bytes.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Protocol, Sequence

from .errors import PlanError, SlackSwapError
from .plan import Plan
from .profile import StepProfile

_FITS, _OTHER_STEP, _PLAN_UNFIT, _UNREADABLE = 1, 2, 3, 4  # a rank's report on the plan it received
# poll every 1 ms at first, backing off to 50 ms: agreement is once per shape, and with thousands of
# ranks, fast polls of rank 0's store would be a storm of requests
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.05


class AgreementError(SlackSwapError):
    """Ranks that must run the same plan do not agree, or did not answer in time."""


class Channel(Protocol):
    """Non-blocking messages between the ranks of one job. A message is named; within one round
    every (name, sender) pair is sent at most once."""

    rank: int
    world: int

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        """Send `data` to the ranks `to`; returns at once."""

    def poll(self, name: str, sender: int) -> bytes | None:
        """The message `name` from `sender`, if it has arrived; never blocks."""

    def finish(self, deadline: float) -> None:
        """Let this round's sends complete (until `deadline`, then drop them: the receiver is gone);
        the next round's messages never mix with this one's."""


def wait_for(channel: Channel, name: str, senders: Sequence[int], deadline: float) -> dict[int, bytes]:
    """Messages `name` from `senders` that arrive by `deadline` (monotonic seconds)."""
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
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, _POLL_MAX_S)


def exchange(channel: Channel, name: str, text: str, timeout_s: float, what: str) -> list[str]:
    """Every rank's `text`, in rank order, on every rank, through rank 0 (so every rank names the
    same culprit): an AgreementError naming the ranks whose text did not reach rank 0 within
    `timeout_s` (`what` says what was being exchanged)."""
    rank, world = channel.rank, channel.world
    if world == 1:
        return [text]
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        got = wait_for(channel, name, range(1, world), deadline)
        missing = [r for r in range(1, world) if r not in got]
        error = (f"ranks {missing} did not send their {what} within sync_timeout_s={timeout_s:g} "
                 f"(exited or stuck)") if missing else ""
        answer = json.dumps({"error": error, "all": [text] + [got[r].decode() for r in sorted(got)]})
        _send_verdict(channel, name + ".all", answer.encode(), sorted(got), deadline + timeout_s)
        if error:
            raise AgreementError(f"rank 0: {error}")
        return json.loads(answer)["all"]
    channel.post(name, text.encode(), [0])
    reply = _receive_verdict(channel, name + ".all", deadline + timeout_s)
    if reply is None:
        raise AgreementError(f"rank {rank}: rank 0 did not answer the exchange of {what} within "
                             f"sync_timeout_s={timeout_s:g} (rank 0 exited or is stuck)")
    answer = json.loads(reply.decode())
    if answer["error"]:
        raise AgreementError(f"rank {rank} (verdict of rank 0): {answer['error']}")
    return answer["all"]


def agree(channel: Channel, local: StepProfile, plan: Plan | None, timeout_s: float,
          on_receive: Callable[[Plan], Plan] | None = None) -> tuple[StepProfile, Plan]:
    """Rank 0's profile and plan on every rank (see the module docstring); `plan` matters on rank 0
    only. `on_receive` lets a test tamper with what a rank received."""
    rank, world = channel.rank, channel.world
    if world == 1:
        return local, plan
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        payload = json.dumps({"profile": local.to_json(), "plan": plan.to_json()}).encode()
        channel.post("plan", payload, range(1, world))
        reports = wait_for(channel, "report", range(1, world), deadline)
        problems = _judge(reports, world, plan.digest, timeout_s)
        verdict = "ok" if not problems else "; ".join(problems)
        _send_verdict(channel, "verdict", verdict.encode(), sorted(reports), deadline + timeout_s)
        if problems:
            raise AgreementError("plan agreement failed: " + verdict)
        return local, plan

    got = wait_for(channel, "plan", [0], deadline)
    if 0 not in got:
        raise AgreementError(f"rank {rank}: rank 0 did not send a plan within sync_timeout_s={timeout_s:g} "
                             f"(rank 0 exited or is stuck)")
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
    reply = _receive_verdict(channel, "verdict", deadline + timeout_s)
    if reply is None:
        raise AgreementError(f"rank {rank}: no verdict from rank 0 within sync_timeout_s={timeout_s:g}")
    verdict = reply.decode()
    if verdict != "ok":
        raise AgreementError(f"plan agreement failed (verdict of rank 0): {verdict}")
    return profile, received


def _send_verdict(channel: Channel, name: str, verdict: bytes, to: Sequence[int], deadline: float) -> None:
    """Rank 0 ends a round: the verdict to the ranks `to`, then their acks (rank 0 may exit next,
    taking the store or the MPI job with it, before a slow rank has read it)."""
    channel.post(name, verdict, to)
    wait_for(channel, name + ".ack", to, deadline)
    channel.finish(deadline)


def _receive_verdict(channel: Channel, name: str, deadline: float) -> bytes | None:
    """Any other rank ends a round: rank 0's verdict, acknowledged; None if none came by `deadline`."""
    got = wait_for(channel, name, [0], deadline)
    if 0 in got:
        channel.post(name + ".ack", b"", [0])
    channel.finish(deadline)
    return got.get(0)


def _judge(reports: dict[int, bytes], world: int, digest: str, timeout_s: float) -> list[str]:
    """Rank 0's verdict on the reports: one sentence per kind of fault, each naming its ranks."""
    problems = []
    silent = [r for r in range(1, world) if r not in reports]
    if silent:
        problems.append(f"ranks {silent} did not report within sync_timeout_s={timeout_s:g} "
                        f"(exited or stuck before plan agreement)")
    other_step = sorted(r for r, b in reports.items() if b[0] == _OTHER_STEP)
    if other_step:
        problems.append(f"ranks {other_step} run a different step than rank 0 (saved-tensor names or bytes "
                        f"differ): they cannot share its plan; make every data-parallel rank run the same model "
                        f"on the same shapes")
    unreadable = sorted(r for r, b in reports.items() if b[0] == _UNREADABLE)
    if unreadable:
        problems.append(f"ranks {unreadable} could not read the plan they received (corrupted in transit)")
    unfit = sorted(r for r, b in reports.items() if b[0] == _PLAN_UNFIT)
    if unfit:
        problems.append(f"ranks {unfit} received a plan that does not fit rank 0's own profile")
    mismatch = sorted(r for r, b in reports.items() if b[0] != _UNREADABLE and b[1:].decode(errors="replace") != digest)
    if mismatch:
        problems.append(f"ranks {mismatch} hold a plan whose digest differs from rank 0's {digest[:12]} "
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

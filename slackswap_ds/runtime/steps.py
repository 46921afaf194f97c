"""The steps of an executor: the one running now, pipeline micro-batches held open, and what a
closed step leaves behind.

A step is the forwards since the last backward and the backward that follows them: a forward
after a backward opens a new one, so several forwards before one backward (gradient
accumulation, a second forward) are one step. A forward whose graph autograd let go of before
any backward (its loss dropped) ends its step: the model's next forward opens a new one. Each step runs under the Program current when it
opened; the first step under a plan that recomputes verifies it (verify.py).

Micro-batches. Under 1F1B a pipeline stage runs the forwards of several micro-batches before the
backward of the first: each micro-batch is a step of its own, open from its forward to the end of
its backward, several at once. The schedule says which is which (the executor cannot tell a
micro-batch's forward from a second forward of gradient accumulation): start(tag) before its
forward, resume(tag) before its backward, finish(tag) after it. Device bytes are counted over
every open step (residency.py), so a step's peak is the stage's.

Verification again. `verify_again()` makes the next step a verifying one under the same plan; with
`verify_every` N > 0, every N-th step closed under a plan that recomputes asks for it, because the
replay contract can break after the first step (a layer that reads state which changes between its
forward and its backward). Between two checks such a layer trains with wrong gradients, as under
torch.utils.checkpoint; with 0 only the first step checks.

Closing a step releases what its backward let go, puts its counters in `stats.last_step` (and its
timeline, if recorded, in `stats.last_timeline`), demotes what failed verification (or failed to
replay on a later step, which raised: a loop that skips that batch goes on under the demoted plan),
and warns once per kind of fallback. The caller holds the executor's lock around every method here.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Hashable

from ..logs import SayOnce, job_rank
from .entries import Entries
from .program import Program
from .records import Step
from .residency import Residency
from .stats import RunStats
from .swaps import Swaps
from .verify import Verifier


__all__ = ["Steps"]


class Steps:
    """Opening and closing the steps of one executor (see the module docstring). `opened` is
    called with each new step (the executor resets its regions and starts a timeline there);
    `closed` with each closed step that ran without a plan (the profiler's tracer stops there)."""

    def __init__(self, entries: Entries, swaps: Swaps, verifier: Verifier, residency: Residency, *, verify: bool,
                 opened: Callable[[Step], None], closed: Callable[[Step], None], verify_every: int = 0,
                 said: SayOnce | None = None):
        self.entries, self.swaps, self.verifier, self.residency = entries, swaps, verifier, residency
        self.verify = verify  # the first step under each plan that recomputes checks its recomputes
        self.verify_every = verify_every  # and every this many steps after (0: never again)
        self.said = said or SayOnce()  # a kind of fallback is warned once (a job's executors share one)
        self.opened, self.closed = opened, closed
        self.stats = RunStats()
        self.program: Program | None = None  # what new steps run under (None: no plan)
        self.current: Step | None = None  # the step whose forward or backward runs now
        self._verify_next = False
        self._micro_batches: dict[Hashable, Step] = {}  # open steps by micro-batch (start())

    def set_program(self, program: Program) -> None:
        self.program = program
        self.stats.plan = program.plan
        self._verify_next = self.verify and bool(program.rerun)

    def verify_again(self) -> bool:
        """The next step checks the plan's recomputes again (the replay contract, verify.py, holds
        at every step, not only the first: a layer that starts reading changed state is caught
        here); whether it will (False: nothing is recomputed, or verification is off)."""
        self._verify_next = self.verify and self.program is not None and bool(self.program.rerun)
        return self._verify_next

    def abandoned(self) -> bool:
        """The current step saved tensors in forward and autograd has let go of every one before
        any backward (a training forward whose loss was dropped: "skip this batch"). A forward
        now is the next step's, not a second forward of this one (steps.py's module docstring)."""
        step = self.current
        if step is None or step.backward or not step.by_storage or step in self._micro_batches.values():
            return False
        self.entries.drain()
        # what still holds an entry may be only this executor: a lingering entry's own hold
        # (entries.py), a recorded layer call's pins on its arguments (calls.py)
        ours = collections.Counter(id(e) for e in step.lingering)
        ours.update(id(e) for call in step.calls.values() for e in call.pins)
        return all(e.holders <= ours[id(e)] for e in step.by_storage.values())

    def forward(self) -> Step:
        """The step a forward runs in: the current one, or a new one after a backward."""
        step = self.current
        if step is None or step.backward:
            self.leave()
            step = self.current = self._new()
        return step

    def _new(self) -> Step:
        step = Step(self.program, self._verify_next and self.program is not None)
        self._verify_next = self._verify_next and not step.verifying  # one step checks the plan's recomputes
        self.opened(step)
        return step

    # ---- micro-batches of a pipeline schedule (see the module docstring) -----------------------------
    def start(self, tag: Hashable) -> None:
        if tag in self._micro_batches:
            raise RuntimeError(f"micro-batch {tag!r} started twice before its backward")
        self.leave()
        self.current = self._micro_batches[tag] = self._new()

    def resume(self, tag: Hashable) -> None:
        self.leave()
        self.current = self._micro_batches[tag]

    def finish(self, tag: Hashable) -> None:
        step = self._micro_batches.pop(tag)
        if self.current is step:
            self.current = None
        self._close(step)

    @property
    def open_micro_batches(self) -> int:
        return len(self._micro_batches)

    # ---- closing --------------------------------------------------------------------------------
    def leave(self) -> None:
        """Leave the current step: closed, unless it is a micro-batch's (which stays open)."""
        step = self.current
        if step is None:
            return
        self.current = None
        if step in self._micro_batches.values():
            return  # a micro-batch between its forward and its backward: finish() closes it
        self._close(step)

    def _close(self, step: Step) -> None:
        self.entries.drain()
        self.entries.let_go(step)
        step.closed = True
        if step.live == 0:
            step.clear()
        self.closed(step)
        stats = step.stats
        stats.host_pool_bytes = self.swaps.bytes_in_use()
        self.stats.steps += 1
        self.stats.last_step = stats
        timeline = self.residency.timeline
        if timeline is not None:
            self.stats.last_timeline = timeline.close(stats.peak_device_bytes)
            self.residency.timeline = None
        demoted = None
        if step.verifying:
            demoted = self.verifier.closed(step)
            if demoted is None and stats.verified is None and step.program is self.program:
                self.verify_again()  # nothing was compared: no verdict yet, the next step checks
        elif step.failures and step.program is self.program:  # a later replay failed (and raised)
            demoted = self.verifier.demote(step.program, step.failures)
        if demoted is not None:  # what failed is never recomputed again
            self.set_program(demoted)
            self.stats.demotions.append(dict(step.failures))
        elif self.verify_every and step.program is not None and self.stats.steps % self.verify_every == 0:
            self.verify_again()  # (nothing recomputed, or verification off: it says no)
        for why, n in stats.fallbacks.items():
            # a derived plan's first step checks its sizes: a tensor larger than derived, and what the
            # run-time budget guard then does, are expected there (derive.py, program.py), and the
            # engine says what it did about it
            level = logging.INFO if "derived" in why else logging.WARNING
            self.said(why, level, "slackswap rank %d: %d saved tensor(s) in a step (%s); counted in stats.fallbacks "
                      "and the job's reports, %s once", job_rank(), n, why,
                      "warned" if level == logging.WARNING else "said")

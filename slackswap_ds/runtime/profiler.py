"""Measure a `StepProfile` from one real training step, within the memory budget.

The profiled step runs under an `Executor` without a plan, which sends every saved tensor to the
host pool as it is saved (blocking, so the device never holds more than the tensor being copied)
and brings it back when backward needs it; a `StepTracer` beside it names and times the ops. So
the step that measures the model needs no more device memory for activations than a plan will
allow: it runs where keep-all does not fit, which is the case SlackSwap exists for. Checkpoint
calls inside the model run inline (takeover.py), so the profile sees the real keep-all footprint.

Each activation is one saved storage. Its bytes are the storage's; its users the ops whose
backward read it; its region the region it was first saved in. Its producers are the ops a
replay of its layer call runs to make it again (replay.py): from the call's first op up to the
op that finally writes it, every op whose outputs the step did not save in that call (or that
writes in place), plus its own writers; the saved tensors those ops read, or that skipped ops
before it hand back, or that the call takes as arguments, are its deps. A storage made outside
its layer call, or saved in a gap between calls, has no producers: it can be kept or swapped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..logs import SAME_ON_EVERY_RANK, log
from ..step_profile import Activation, Op, StepProfile
from .device import device_of
from .executor import Executor
from .op_clock import clock_for
from .naming import is_gap
from .stats import StepStats
from .takeover import inline_checkpoint_calls
from .tracing import StepTracer, TracedSave

StepFn = Callable[[nn.Module, Any], torch.Tensor]
_SAID: set[tuple[str, ...]] = set()  # the layer sets said to call compiled code (once each per process)


class ProfileSession:
    """``with ProfileSession(model) as session: step_fn(model, batch)``; then ``session.profile()``.

    `timer`: the op clock (default: perf_counter, synchronized on CUDA); `pool`: the host pool the
    saved tensors go to (default: an unbounded one); `keep_bytes`: saved bytes that may stay on the
    device (default 0: everything goes to host). Backward's copies back come on top of them (what
    one op reads), so keep well under the budget; the host holds only what is not kept."""

    def __init__(self, model: nn.Module, *, timer: Callable[[], float] | None = None, pool=None,
                 keep_bytes: int = 0):
        self.model = model
        device = device_of(model)
        # the tracer asks for the region while the step runs, when the executor exists
        self.tracer = StepTracer(lambda: self.executor.regions.label, clock_for(device, timer), device.type)
        self.executor = Executor.profiling(model, self.tracer, keep_bytes=keep_bytes, pool=pool)
        self.forwards = [0]  # where each forward of the step began: the tracer's saves before it
        self._checkpoint_calls_before = inline_checkpoint_calls()
        # whether the model called torch.utils.checkpoint or deepspeed.checkpointing in the step (the
        # calls ran inline: its own checkpointing was replaced by the plan); known once the step ends
        self.replaced_checkpointing = False

    def __enter__(self) -> "ProfileSession":
        self.executor.__enter__()
        try:
            self.tracer.__enter__()
        except BaseException:
            self.executor.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.tracer.__exit__(*exc)
        finally:
            self.executor.__exit__(*exc)
            self.replaced_checkpointing = inline_checkpoint_calls() > self._checkpoint_calls_before
        return False

    def another_forward(self) -> None:
        """A second (third, ...) forward of the step begins (R-Drop, contrastive losses): traced as
        part of the same step (its layer calls are labelled @1, @2: naming.py)."""
        self.forwards.append(len(self.tracer.saves))

    def unread_forwards(self) -> list[int]:
        """The forwards of the step (0 the first) most of whose saves backward never read: forwards
        without a backward (a skipped batch) that the profile must not plan for. (Most, not all: a
        storage both forwards save, their input, is one save, read by the other's backward; a
        forward that is backwarded has every save read but those of a branch the loss ignores.)"""
        bounds = [*self.forwards, len(self.tracer.saves)]
        saves = self.tracer.saves
        return [i for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
                if b > a and 2 * sum(s.read for s in saves[a:b]) < b - a]

    def end_forward(self) -> None:
        """What runs from now on outside backward is not the model's step (DeepSpeed's own
        bookkeeping before it calls backward, which differs between ranks): not traced."""
        self.tracer.forward_done = True

    @property
    def stats(self) -> StepStats:
        """The profiled step's counters (its peak of device-resident saved bytes, say)."""
        return self.executor.stats.last_step

    def profile(self, name: str | None = None) -> StepProfile:
        return build_profile(self.tracer, name or type(self.model).__name__, self.executor.call_arguments,
                             self.stats.peak_device_bytes)


def profile_step(model: nn.Module, step_fn: StepFn, batch: Any, *, name: str | None = None, warmup: int = 1,
                 timer: Callable[[], float] | None = None, pool=None, keep_bytes: int = 0) -> StepProfile:
    """Run `step_fn(model, batch)` (forward + backward) `warmup` times, then once traced, every
    time with saved tensors beyond `keep_bytes` sent to host (see the module docstring), and
    return the measured profile. Gradients the steps accumulate are left to the caller."""
    for _ in range(warmup):
        with ProfileSession(model, timer=timer, pool=pool, keep_bytes=keep_bytes).executor:
            step_fn(model, batch)
    with ProfileSession(model, timer=timer, pool=pool, keep_bytes=keep_bytes) as session:
        step_fn(model, batch)
    return session.profile(name)


# ---- building the profile ------------------------------------------------------------------------
def build_profile(tracer: StepTracer, name: str, arguments: dict[str, list[str]] | None = None,
                  peak_bytes: int | None = None) -> StepProfile:
    """The StepProfile of a traced step; `arguments`: per layer call, the keys of the saved
    tensors it took as arguments (a replay needs them back)."""
    tracer.clock.settle()  # (CUDA events: the ops' times are read now, after the step)
    ops = tracer.ops
    profile_ops = tuple(Op(o.key, o.fwd_s, o.bwd_s, o.region) for o in ops)
    saves = tracer.saves
    users = {s.key: _users(tracer, s) for s in saves}
    regen = _Regeneration(tracer, users, arguments or {})
    unseen = {r for r in tracer.compiled_in if not is_gap(r)}  # layers that called compiled code: not replayable
    activations = []
    for s in saves:
        producers, deps = ((), ()) if s.region in unseen else regen.of(s)
        nbytes = tracer.storages[s.sid].nbytes
        packed = s.packed_bytes if s.packed_bytes is not None and s.packed_bytes < nbytes else None
        activations.append(Activation(s.key, nbytes, tuple(sorted(users[s.key])), producers, deps, s.shape,
                                      packed, s.pack_s if packed is not None else 0.0))
    meta = {"source": "measured", "layers": str(len({o.region for o in ops if not is_gap(o.region)}))}
    if peak_bytes is not None:
        meta["profiled_peak_bytes"] = str(peak_bytes)
    if unseen:
        meta["compiled_code_in"] = ",".join(sorted(unseen))
        _say_compiled_code_in(sorted(unseen))
    return StepProfile(name, profile_ops, tuple(activations), tuple(meta.items()))


def _say_compiled_code_in(regions: list[str]) -> None:
    if tuple(regions) in _SAID:
        return
    _SAID.add(tuple(regions))
    log.warning("slackswap: %d layer(s) call compiled code (a torch.compile'd function) from their eager code (%s): "
                "a replay cannot see inside it, so their saved tensors are kept or swapped, never recomputed. To "
                "have them recomputed, compile each such layer whole (blocks[i] = torch.compile(blocks[i]))",
                len(regions), ", ".join(regions[:4]) + (", ..." if len(regions) > 4 else ""), extra=SAME_ON_EVERY_RANK)


def _users(tracer: StepTracer, save: TracedSave) -> set[int]:
    """The ops whose backward read it. The first of them must be an op of the region it was saved
    in (that is where the profile places it); if backward never read it there, the op that saved
    it stands in: the op that made it when it was saved right after that op ran, else the next
    op (inputs are saved just before their op runs)."""
    ops = tracer.ops
    users = set(save.users)
    if users and ops[min(users)].region == save.region:
        return users
    before, last = save.ops_before, save.ops_before - 1
    if last >= 0 and ops[last].region == save.region and save.sid in ops[last].writes:
        saver = last
    elif before < len(ops) and ops[before].region == save.region:
        saver = before
    elif last >= 0 and ops[last].region == save.region:
        saver = last
    else:  # a region with no op of its own (only views and a custom Function): the nearest op
        saver = min(max(last, 0), len(ops) - 1)
    return {u for u in users if u > saver} | {saver}


class _Regeneration:
    """Producers and deps of each saved storage (see the module docstring)."""

    def __init__(self, tracer: StepTracer, users: dict[str, set[int]], arguments: dict[str, list[str]]):
        self.tracer, self.users, self.arguments = tracer, users, arguments
        ops = tracer.ops
        self.saved_in: dict[str, dict[int, TracedSave]] = {}  # region -> sid -> its save there
        self.by_key = {s.key: s for s in tracer.saves}
        for s in tracer.saves:
            self.saved_in.setdefault(s.region, {})[s.sid] = s
        self.first_save: dict[int, TracedSave] = {}
        for s in tracer.saves:
            self.first_save.setdefault(s.sid, s)
        self.region_ops: dict[str, list[int]] = {}
        for o in ops:
            self.region_ops.setdefault(o.region, []).append(o.index)
        self._runs: dict[str, dict[int, bool]] = {}

    def writers(self, save: TracedSave) -> list[int]:
        """The ops that wrote the saved storage before it was saved (its maker, then in place)."""
        return [w for w in self.tracer.storages[save.sid].writers if w < save.ops_before]

    def final_writer(self, save: TracedSave) -> int | None:
        writers = self.writers(save)
        return writers[-1] if writers else None

    def runs(self, region: str) -> dict[int, bool]:
        """Op -> whether a replay of the region runs it when every saved tensor is at hand."""
        out = self._runs.get(region)
        if out is None:
            ops, saved = self.tracer.ops, self.saved_in.get(region, {})
            out = {}
            storages = self.tracer.storages
            for k in self.region_ops.get(region, ()):
                op = ops[k]
                out[k] = op.inplace or any(not storages[sid].by_value and (sid not in saved or
                                                                           self.final_writer(saved[sid]) != k)
                                           for sid in op.writes)
            self._runs[region] = out
        return out

    def of(self, save: TracedSave) -> tuple[tuple[int, ...], tuple[str, ...]]:
        tracer, region = self.tracer, save.region
        st = tracer.storages[save.sid]
        if is_gap(region) or st.producer is None:
            return (), ()
        ops = tracer.ops
        writers = self.writers(save)
        if not writers or any(ops[w].region != region for w in writers):
            return (), ()  # made (or last written) outside its layer call
        last = writers[-1]
        if any(ops[u].region != region for u in self.users[save.key]):
            return (), ()  # read in another region's backward, before this region's replay would run
        saved = self.saved_in[region]
        start = self.region_ops[region][0]
        runs = self.runs(region)
        producers = {k for k in self.region_ops[region] if k <= last and runs[k]} | set(writers)

        def dep(sid: int) -> TracedSave | None:
            """The save a replay takes `sid` from: this region's, or an earlier region's (alive
            then: backward reaches earlier regions later)."""
            own = saved.get(sid)
            if own is not None:
                return own
            first = self.first_save.get(sid)
            return first if first is not None and first.ops_before <= start else None

        deps: set[str] = set()
        for k in self.region_ops[region]:
            if k > last:
                break
            touched = ops[k].reads if k in producers else ops[k].writes  # read by a re-run op / handed back
            for sid in touched:
                other = dep(sid)
                if other is not None and other.sid != save.sid:
                    deps.add(other.key)
        for key in self.arguments.get(region, ()):  # the replay calls the layer with them
            other = dep(self.by_key[key].sid)
            if other is not None and other.sid != save.sid:
                deps.add(other.key)
        return tuple(sorted(producers)), tuple(sorted(deps))

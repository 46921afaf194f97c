"""An asynchronous device on the CPU, so that the Stream protocol runs (and can fail) without a GPU.

On DeepSpeed's CPU accelerator every copy is synchronous on the calling thread, so the protocol of
device.py (side streams waiting for compute, events, sources kept alive, buffers released after
their copy, compute waiting before a read) would only ever be read. `SLACKSWAP_ASYNC_EMULATION=1`
gives CPU runs `EmulatedAccelerator` instead, which `Device` drives through the very code it uses
on CUDA:

* the compute stream is the host thread: its work is done when the host returns from it, so a side
  stream's `wait_stream(compute)` is met at once, and compute waiting on an event blocks the host;
* each side stream (D2H, H2D) is a worker thread that runs its queue in order: a copy lands after
  its delay (`Delays`: seeded random by default, fixed, or bytes / bandwidth + latency), an event
  completes when the worker reaches it, a `wait_event` holds the worker until that event completes;
* a copy's destination holds poison (bytes 0xFF: NaN for floats, -1 / 255 / True for integers and
  bools) from the moment it is issued until it lands: a read before the event computes with poison;
* a copy's source is held weakly: let go before the copy lands (rule 3), the destination keeps its
  poison and the run stops with the rule's name;
* `Sanitizer` (stream_sanitizer.py) checks the protocol's numbered rules as the host issues work.

`SLACKSWAP_EMULATION_DELAY` sets the delays (`Delays.parse`), `SLACKSWAP_EMULATION_SEED` the random
ones' seed. Emulation is for tests and measurements of overlap; it is never faster than the
synchronous path.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import SlackSwapError
from ..logs import SAME_ON_EVERY_RANK, log
from .stream_sanitizer import COMPUTE, Clock, Sanitizer

__all__ = ["Delays", "EmulatedAccelerator", "EmulationError", "emulated_if_requested", "emulation_requested", "ENV",
           "ENV_DELAY", "ENV_SEED"]

ENV = "SLACKSWAP_ASYNC_EMULATION"
ENV_DELAY = "SLACKSWAP_EMULATION_DELAY"
ENV_SEED = "SLACKSWAP_EMULATION_SEED"
ON = ("1", "true", "on", "yes")     # the values of SLACKSWAP_ASYNC_EMULATION (any case); unset: off
OFF = ("0", "false", "off", "no")
POISON = 0xFF                        # every byte of a destination until its copy lands
IDLE_EXIT_S = 2.0                    # a worker with nothing to do for this long ends (restarted on demand)


class EmulationError(SlackSwapError, ValueError):
    """A value of SLACKSWAP_ASYNC_EMULATION or SLACKSWAP_EMULATION_DELAY that is not understood."""


def emulated_if_requested(acc):
    """`acc` (DeepSpeed's accelerator), or on a CPU the emulated device when SLACKSWAP_ASYNC_EMULATION
    asks for it; either way said once (the variable is ignored on a GPU, with a warning)."""
    if not emulation_requested():
        return acc
    if str(acc.device_name()) != "cpu":
        log.warning("slackswap: %s=1 is ignored on this %s device: it emulates an asynchronous device on a "
                    "CPU only", ENV, acc.device_name(), extra=SAME_ON_EVERY_RANK)
        return acc
    emulated = EmulatedAccelerator.from_env()
    log.warning("slackswap: the device is emulated (%s=1): copies run on worker-thread side streams with "
                "delays of %s, destinations hold poison until their copy lands, and the Stream protocol is "
                "checked; for tests, not for speed", ENV, emulated.delays, extra=SAME_ON_EVERY_RANK)
    return emulated


def emulation_requested() -> bool:
    """Whether SLACKSWAP_ASYNC_EMULATION asks for the emulated device (unset: no); an unknown value
    is an EmulationError naming the choices."""
    value = os.environ.get(ENV)
    word = "0" if value is None else value.strip().lower()
    if word in ON or word in OFF:
        return word in ON
    raise EmulationError(f"{ENV}={value!r} is not one of its values: {', '.join(ON)} select the emulated "
                         f"asynchronous device, {', '.join(OFF)} (or unset) the synchronous CPU path")


_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_RATES = {"GB/s": 1e9, "MB/s": 1e6}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


def _duration(text: str) -> float | None:
    m = re.fullmatch(_NUMBER + r"\s*(s|ms|us)?", text.strip())
    if m is None or (m.group(2) is None and float(m.group(1)) != 0):
        return None
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]


@dataclass(frozen=True)
class Delays:
    """How long an emulated copy takes once its stream reaches it: `latency_s + nbytes / bytes_per_s`
    (`bytes_per_s` 0: no byte term), plus a uniform random part in [0, `jitter_s`] drawn from a
    generator seeded with `seed` (one per stream)."""

    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0

    FORMS = ("random:<time> (uniform in [0, time]; the default is random:1ms)", "<time> (fixed, e.g. 0, 2ms, 50us)",
             "<rate>[+<time>] (bytes / rate + latency, e.g. 12GB/s+10us)")

    @classmethod
    def parse(cls, text: str | None, seed: int = 0) -> "Delays":
        """The delays SLACKSWAP_EMULATION_DELAY names (None: the default, random up to 1 ms)."""
        text = "random:1ms" if text is None or not text.strip() else text.strip()
        if text.startswith("random:") and (jitter := _duration(text[len("random:"):])) is not None:
            return cls(jitter_s=jitter, seed=seed)
        if (fixed := _duration(text)) is not None:
            return cls(latency_s=fixed, seed=seed)
        rate, _, latency = text.partition("+")
        m = re.fullmatch(_NUMBER + r"\s*(GB/s|MB/s)", rate.strip())
        lat = _duration(latency) if latency else 0.0
        if m is not None and float(m.group(1)) > 0 and lat is not None:
            return cls(latency_s=lat, bytes_per_s=float(m.group(1)) * _RATES[m.group(2)], seed=seed)
        raise EmulationError(f"{ENV_DELAY}={text!r} is not a delay; write one of: " + "; ".join(cls.FORMS))

    @classmethod
    def from_env(cls) -> "Delays":
        seed = os.environ.get(ENV_SEED, "0")
        if not seed.strip().lstrip("-").isdigit():
            raise EmulationError(f"{ENV_SEED}={seed!r} is not an integer")
        return cls.parse(os.environ.get(ENV_DELAY), int(seed))

    def of(self, nbytes: int, rng: random.Random) -> float:
        jitter = rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0
        return self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0) + jitter

    def __str__(self) -> str:
        parts = [f"bytes / {self.bytes_per_s / 1e9:g} GB/s"] if self.bytes_per_s else []
        if self.latency_s or not (parts or self.jitter_s):
            parts.append(f"{self.latency_s * 1e3:g} ms")
        if self.jitter_s:
            parts.append(f"random up to {self.jitter_s * 1e3:g} ms (seed {self.seed})")
        return " + ".join(parts)


def poison(t: torch.Tensor) -> None:
    """Fill `t` with poison: 0xFF bytes (NaN for floats), or per element where it is not contiguous."""
    with torch.no_grad():
        if t.is_contiguous():
            if t.numel():
                t.view(torch.uint8).fill_(POISON)
        elif t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        else:
            t.fill_(True if t.dtype == torch.bool else -1 if t.dtype.is_signed else POISON)


def _host_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


class EmulatedEvent:
    """A CUDA event's meaning: complete once its stream has run everything queued before `record`."""

    def __init__(self, enable_timing: bool = False, **_ignored):
        self._done = threading.Event()
        self._done.set()                 # never recorded: complete, as torch.cuda.Event.query() says
        self.stream: "EmulatedStream | None" = None
        self.clock = Clock()             # what is done once this event completes
        self.when = 0.0                  # time.perf_counter() at completion

    def record(self, stream: "EmulatedStream") -> None:
        stream.record(self)

    def query(self) -> bool:
        done = self._done.is_set()
        if done and self.stream is not None:
            self.stream.acc.sanitizer.seen(self.clock)
        return done

    def synchronize(self) -> None:
        """Block the host until the event completes (the time it blocks is the emulated stall)."""
        if self.stream is None:
            return
        acc = self.stream.acc
        acc.sanitizer.raise_pending()
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            acc.count_blocked(time.perf_counter() - start)
        self.query()

    def _complete(self) -> None:
        self.when = time.perf_counter()
        self._done.set()


class EmulatedStream:
    """The compute stream (`sid` 0: the host thread) or a side stream run by a worker thread."""

    def __init__(self, acc: "EmulatedAccelerator", sid: int, name: str):
        self.acc, self.sid, self.name = acc, sid, name
        self.seq = 0                                  # copies issued (an event's clock counts copies)
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._rng = random.Random(acc.delays.seed * 1000 + sid)
        self._busy_until = 0.0                        # when the link ends the copy it runs (perf_counter)

    @property
    def is_compute(self) -> bool:
        return self.sid == COMPUTE

    # -- the CUDA stream interface Device uses --------------------------------------------------
    def wait_event(self, event: EmulatedEvent) -> None:
        if self.is_compute:                           # the host is the compute stream: it blocks
            event.synchronize()
            return
        on_compute = event.stream is None or event.stream.is_compute
        self.acc.sanitizer.waited(self.sid, event.clock, on_compute)
        if not event._done.is_set():
            self._enqueue(lambda: self._waited_for(event))

    def wait_stream(self, other: "EmulatedStream") -> None:
        event = EmulatedEvent()
        other.record(event)
        self.wait_event(event)

    def record(self, event: EmulatedEvent) -> None:
        event.stream = self
        event.clock = Clock(self.acc.sanitizer.host)
        if self.is_compute:                           # compute work is done when the host gets here
            event._complete()
            return
        event.clock.merge(self.acc.sanitizer.clocks.get(self.sid, Clock()))
        event.clock[self.sid] = self.seq
        event._done.clear()
        self._enqueue(event._complete)

    def query(self) -> bool:
        event = EmulatedEvent()
        self.record(event)
        return event.query()

    def synchronize(self) -> None:
        event = EmulatedEvent()
        self.record(event)
        event.synchronize()

    # -- copies ---------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> None:
        """Queue `dst.copy_(src)` after everything queued before it; `dst` holds poison until it lands."""
        self.seq += 1
        seq = self.seq
        self.acc.sanitizer.copy(self.sid, seq, direction, *_host_range(dst if direction == "d2h" else src))
        poison(dst)
        source = weakref.ref(src)
        delay = self.acc.delays.of(src.numel() * src.element_size(), self._rng)
        sanitizer = self.acc.sanitizer
        issued = time.perf_counter()

        def land() -> None:
            # The link takes the copy once it is issued and the copy before it has ended; the copy ends
            # `delay` later. Timed from when the previous one should have ended, not from when this
            # thread woke (sleep overshoots by ~0.1 ms here): back-to-back copies keep the link's pace.
            end = max(self._busy_until, issued) + delay
            self._busy_until = end
            remaining = end - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            alive = source()
            if alive is None:                         # rule 3: its block could hold other data by now
                sanitizer.source_lost(self.sid, seq)
                return
            with torch.no_grad():
                dst.copy_(alive)

        self._enqueue(land)

    def _waited_for(self, event: EmulatedEvent) -> None:
        event._done.wait()
        self._busy_until = max(self._busy_until, event.when)  # nothing after the wait starts before it

    # -- the worker ---------------------------------------------------------------------------
    def _enqueue(self, op: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append(op)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=f"slackswap-emulated-{self.name}",
                                                daemon=True)
                self._worker.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._cond.wait_for(lambda: self._queue, timeout=IDLE_EXIT_S):
                    self._worker = None               # idle: end; the next _enqueue starts another
                    return
                op = self._queue[0]
            try:
                op()
            except Exception as e:  # noqa: BLE001 - the host hears of it at its next call; the queue goes on
                self.acc.sanitizer.failed(f"{self.name}'s worker: {type(e).__name__}: {e}")
            with self._cond:
                self._queue.popleft()

    def __repr__(self) -> str:
        return f"EmulatedStream({self.name})"


class EmulatedAccelerator:
    """The subset of DeepSpeed's accelerator interface `Device` uses, on host tensors, asynchronous
    (module docstring). `sanitizer` holds the protocol's checks; `delays` the copies' durations."""

    def __init__(self, delays: Delays | None = None):
        self.delays = delays or Delays.parse(None)
        self.sanitizer = Sanitizer()
        self.blocked_s = 0.0                          # host time spent waiting for copies: the stall
        self._blocked_lock = threading.Lock()
        self.compute = EmulatedStream(self, COMPUTE, "compute")
        self._sides: list[EmulatedStream] = []
        self._local = threading.local()

    @classmethod
    def from_env(cls) -> "EmulatedAccelerator":
        return cls(Delays.from_env())

    def __repr__(self) -> str:
        return f"EmulatedAccelerator(delays {self.delays})"

    # -- identity (a CPU device that is not synchronized) ----------------------------------------
    def device_name(self, device_index=None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def is_synchronized_device(self) -> bool:
        return False

    # -- streams and events ---------------------------------------------------------------------
    @property
    def Stream(self):
        def make(device=None, **_ignored) -> EmulatedStream:
            stream = EmulatedStream(self, len(self._sides) + 1, f"side{len(self._sides) + 1}")
            self._sides.append(stream)
            return stream
        return make

    @property
    def Event(self):
        return EmulatedEvent

    def current_stream(self, device_index=None) -> EmulatedStream:
        return getattr(self._local, "stream", self.compute)

    @contextlib.contextmanager
    def stream(self, stream: EmulatedStream):
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def synchronize(self, device_index=None) -> None:
        for side in list(self._sides):
            side.synchronize()
        self.sanitizer.raise_pending()

    def check_read(self, event: EmulatedEvent) -> None:
        """The compute stream is about to read what the copy of `event` wrote (rule 7)."""
        self.sanitizer.read(event.clock)

    def issue_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: EmulatedStream, direction: str) -> None:
        """`Device._copy`'s asynchronous copy on a side stream (the CUDA path's non_blocking copy_)."""
        stream.copy(dst, src, direction)

    def count_blocked(self, seconds: float) -> None:
        with self._blocked_lock:
            self.blocked_s += seconds

    # -- pinned host memory ---------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        if self.is_pinned(tensor):
            return tensor
        pinned = torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)
        self._pin(pinned)
        return pinned

    def pin_empty(self, *size, dtype, device="cpu") -> torch.Tensor:
        out = torch.empty(*size, dtype=dtype, device=device)
        self._pin(out)
        return out

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.sanitizer.is_pinned(*_host_range(tensor))

    def _pin(self, tensor: torch.Tensor) -> None:
        # Ranges stay listed after their memory is freed (nothing tells the host when): memory reused
        # for an unpinned tensor then passes for pinned, so rule 2 may miss a case, never invent one.
        storage = tensor.untyped_storage()
        self.sanitizer.pinned_range(storage.data_ptr(), storage.nbytes())

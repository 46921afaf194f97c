"""Streams, events and pinned host memory through DeepSpeed's accelerator, with a synchronous CPU path.

`Device` is the only place the runtime touches streams and events. It exposes exactly what the
executor needs: two side copy streams (D2H and H2D), `copy_out` / `copy_in` returning a
`CopyHandle`, pinning, and counters. The ordering rules are in the "Stream protocol" block below;
the executor refers to it by that name.

What DeepSpeed's CPU accelerator (deepspeed 0.19.8, `CPU_Accelerator`) really does — checked by
running it, and the reason for the synchronous path:

- `Stream` and `Event` are properties that return ``None``; `current_stream()` and
  `default_stream()` return ``None``; `stream(s)` is a no-op context manager; `synchronize()` does
  nothing; `is_synchronized_device()` is ``True``. There is nothing to record or wait on, so a
  device without streams (``has_streams`` False) copies synchronously, on the calling thread.
- `pin_memory(t)` returns ``t`` itself (same object, no copy, nothing page-locked) and
  `is_pinned(t)` is ``False``; `pin_empty(n, dtype=...)` returns a plain, unpinned host tensor.
  (Only when ``DS_PIN_MEMORY_BACKEND=native`` is active does it return an mlock-ed copy.)
- `device()` returns ``None`` and `current_device_name()` returns ``"cpu"``.

So on CPU a "device" tensor is a host tensor, and `copy_out` / `copy_in` are real host-to-host
`copy_` calls into / out of the pool: plan logic, pooling and byte accounting run for real; only the
overlap does not exist.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import SlackSwapError
from .emulation import emulated_if_requested

__all__ = ["CopyHandle", "Device", "DeviceError", "DeviceStats", "TorchAccelerator", "device_of"]


def device_of(module: torch.nn.Module) -> torch.device:
    """The device a model computes on: its first parameter's (the CPU for a model without any)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


class DeviceError(SlackSwapError, ValueError):
    """A copy request whose tensors do not fit together (shape, dtype, device or aliasing)."""


# ---------------------------------------------------------------------------------------------
# Stream protocol
# ---------------------------------------------------------------------------------------------
# Three streams per device: the *current* (compute) stream, a D2H side stream and an H2D side
# stream (two, so that swap-out and prefetch use both copy engines at once). Every rule below
# exists because the host enqueues work ahead of the GPU and the caching allocator recycles a
# block as soon as the host frees it on the stream it was allocated on.
#
# D2H (copy_out: device activation -> pooled pinned host buffer)
#   1. side.wait_stream(current) before the copy: the kernels that produce `src` were enqueued on
#      the compute stream and may not have run yet; without the wait the copy reads stale bytes.
#   2. copy with non_blocking=True on the side stream into *pinned* memory (pageable memory makes
#      the copy synchronous), then record an event on the side stream.
#   3. keep `src` alive until the event has completed. `src` was allocated on the compute stream;
#      if it were freed while the copy is in flight, the allocator would hand its block to the
#      next compute-stream allocation, whose kernels are not ordered after the side stream's copy.
#      The Device holds a reference to `src` (in its per-stream queue of copies in flight, whoever
#      holds the copy's handle: a step abandoned mid-forward drops its handles) and drops it once
#      the copy's event is seen complete: at the next copy on that stream, or when a handle's
#      `done()` / `wait()` sees its copy complete. We do not use `src.record_stream(side)`: it holds
#      the block until *all* work queued on the side stream at free time is done (later swaps
#      included), which inflates device memory — the queue releases it at the copy's own event.
#   4. the host buffer may be read by the host only after the event (`wait()` / `done()`), and
#      must not be handed to another copy before then (HostPool.release(buf, after=handle)).
#
# H2D (copy_in: pooled pinned host buffer -> device tensor, the prefetch)
#   5. the destination is allocated on the *compute* (current) stream, the stream that reads and
#      frees it, so its block goes back to the pool compute allocates from (a block allocated on a
#      side stream can only be reused by that stream: reserved memory would grow with every prefetch).
#      That block may have belonged to a tensor whose kernels are still queued on the compute stream,
#      so the H2D stream first waits for the compute stream (`side.wait_stream(current)`): the copy
#      starts no earlier than compute reaches the point where it was issued, which is the Schedule's
#      meaning of a prefetch trigger. No record_stream is needed: producer-side ordering is the wait,
#      consumer and allocator share one stream.
#   6. with `after=` (the D2H handle that filled the host buffer), the H2D stream also waits on that
#      copy's event: a prefetch issued before its copy-out ended never blocks the host. Then copy
#      non_blocking=True on the H2D stream and record an event.
#   7. the compute stream waits for that event before using the tensor: `wait_on_current()` does
#      `current.wait_event(event)` — a device-side wait, the host does not block.
#   8. the pinned source buffer must not be recycled until the event completes (the copy reads it
#      asynchronously): HostPool.release(buf, after=handle) defers it until `handle.done()`.
#
# Counting: a `wait()` on a copy that is not yet complete and every `synchronize()` on a device
# with streams count as host-blocking waits (the steady-state target is zero per step).
# Without streams (CPU) every copy is synchronous, every handle is born complete, and no wait counts.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceStats:
    """Counters of one `Device` since construction or `reset_stats()`."""

    copies_d2h: int
    copies_h2d: int
    bytes_d2h: int
    bytes_h2d: int
    host_waits: int


class CopyHandle:
    """One issued copy. `tensor` is the destination; see "Stream protocol" for the rules.

    `done()` polls (never blocks), `wait()` blocks the host until the copy is complete,
    `wait_on_current()` makes the current stream wait on the device. Each returns/keeps `tensor`."""

    __slots__ = ("direction", "nbytes", "tensor", "host_waited", "_device", "_event", "_complete")

    def __init__(self, device: "Device", direction: str, tensor: torch.Tensor, nbytes: int, event: Any = None):
        self.direction = direction            # "d2h" or "h2d"
        self.nbytes = nbytes
        self.tensor = tensor
        self.host_waited = False              # True once a wait() on this handle had to block
        self._device = device
        self._event = event                   # None: the copy was synchronous
        self._complete = event is None

    def _finish(self) -> None:
        self._complete = True
        self._device._let_go(self.direction)

    def done(self) -> bool:
        """True once the copy has completed (polls the event; never blocks). Releases the source."""
        if not self._complete and self._event.query():
            self._finish()
        return self._complete

    def wait(self) -> torch.Tensor:
        """Block the host until the copy has completed; return the destination tensor."""
        if not self._complete:
            if not self._event.query():
                self.host_waited = True
                self._device._count_host_wait()
            self._event.synchronize()
            self._finish()
        return self.tensor

    def wait_on_current(self) -> torch.Tensor:
        """Make the current stream wait for the copy (no host synchronization); return the destination.
        Use it before the compute stream reads a prefetched tensor (rule 7)."""
        if self._event is not None:
            self._device._acc.current_stream().wait_event(self._event)
        return self.tensor

    def check_read(self) -> None:
        """Where the device checks the Stream protocol (the emulated one): rule 7 held before a read."""
        if self._event is not None and hasattr(self._device._acc, "check_read"):
            self._device._acc.check_read(self._event)

    def __repr__(self) -> str:
        state = "done" if self._complete else "in flight"
        return f"CopyHandle({self.direction}, {self.nbytes} B, {state})"


class TorchAccelerator:
    """The subset of DeepSpeed's accelerator interface that `Device` uses, served by plain torch.

    Used only when deepspeed cannot be imported (it is a dependency, so normally never), and in tests.
    CUDA when available, otherwise a CPU device without streams or pinning."""

    def __init__(self, device_type: str | None = None):
        self._type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if self._type not in ("cuda", "cpu"):
            raise DeviceError(f"TorchAccelerator supports 'cuda' or 'cpu', got {self._type!r}; "
                              f"use DeepSpeed's get_accelerator() for other devices")
        if self._type == "cuda" and not torch.cuda.is_available():
            raise DeviceError("TorchAccelerator('cuda') requested but torch.cuda.is_available() is False")
        self._cuda = self._type == "cuda"

    def device_name(self, device_index=None) -> str:
        return self._type

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    @property
    def Stream(self):
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def synchronize(self, device_index=None):
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor.pin_memory() if self._cuda else tensor

    def pin_empty(self, *size, dtype, device="cpu"):
        return torch.empty(*size, dtype=dtype, device=device, pin_memory=self._cuda)

    def is_pinned(self, tensor) -> bool:
        return bool(self._cuda and tensor.is_pinned())


def _default_accelerator():
    """DeepSpeed's accelerator (plain torch's without DeepSpeed); on a CPU, the emulated asynchronous
    device instead when SLACKSWAP_ASYNC_EMULATION asks for it (emulation.py), said once."""
    try:
        from deepspeed.accelerator import get_accelerator  # slow import: only here, lazily
    except ImportError:
        acc = TorchAccelerator()
    else:
        acc = get_accelerator()
    return emulated_if_requested(acc)


def _native_pinning_active() -> bool:
    try:
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
    except ImportError:
        return False
    return get_active_native_pinned_memory() is not None


class Device:
    """One accelerator as the runtime sees it (one per process: `Device.current()`).

    `name` ("cuda", "cpu", ...), `torch_device` (the process's current device), `has_streams`
    (False on DeepSpeed's CPU accelerator: no streams or events exist, copies are synchronous)."""

    _current: ClassVar["Device | None"] = None
    _cpu: ClassVar["Device | None"] = None
    _current_lock: ClassVar[threading.Lock] = threading.Lock()

    __slots__ = ("_acc", "_name", "_torch_device", "_has_streams", "_d2h", "_h2d", "_lock", "_counts",
                 "_pinning", "_in_flight", "_issue_copy")

    def __init__(self, accelerator=None):
        acc = _default_accelerator() if accelerator is None else accelerator
        self._acc = acc
        self._issue_copy = getattr(acc, "issue_copy", None)  # (issues copies itself: the emulated device)
        self._name = str(acc.device_name())
        self._torch_device = torch.device(acc.current_device_name())
        stream_cls, event_cls = getattr(acc, "Stream", None), getattr(acc, "Event", None)
        synchronized = bool(getattr(acc, "is_synchronized_device", lambda: False)())
        self._has_streams = stream_cls is not None and event_cls is not None and not synchronized
        self._d2h = self._h2d = None          # side streams, created on first use
        self._lock = threading.Lock()         # hooks may run on autograd's device threads
        self._counts = dict(copies_d2h=0, copies_h2d=0, bytes_d2h=0, bytes_h2d=0, host_waits=0)
        self._pinning: tuple[bool, bool] | None = None   # (pins for real, torch rounds to 2^k), probed lazily
        # per side stream, its copies in flight, oldest first: (event, the source the copy reads)
        self._in_flight: dict[str, collections.deque] = {"d2h": collections.deque(), "h2d": collections.deque()}

    @classmethod
    def current(cls) -> "Device":
        """The process's Device on DeepSpeed's current accelerator (created once, then cached)."""
        with cls._current_lock:
            if cls._current is None:
                cls._current = cls()
            return cls._current

    @classmethod
    def of(cls, device: torch.device) -> "Device":
        """The Device for tensors on `device`: the process's accelerator if it is of that type
        (`current()`), else the synchronous CPU path (a model on CPU on a GPU machine)."""
        current = cls.current()
        if current.torch_device.type == device.type:
            return current
        with cls._current_lock:
            if cls._cpu is None:
                cls._cpu = cls.cpu()
            return cls._cpu

    @classmethod
    def cpu(cls) -> "Device":
        """A Device on DeepSpeed's CPU accelerator (the synchronous path), whatever the machine has."""
        try:
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        except ImportError:
            return cls(TorchAccelerator("cpu"))
        return cls(CPU_Accelerator())

    # -- identity ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def torch_device(self) -> torch.device:
        return self._torch_device

    @property
    def has_streams(self) -> bool:
        return self._has_streams

    @property
    def accelerator(self):
        return self._acc

    @property
    def d2h_stream(self):  # the side stream of copy_out (None without streams)
        return self._side("d2h") if self._has_streams else None

    @property
    def h2d_stream(self):  # the side stream of copy_in (None without streams)
        return self._side("h2d") if self._has_streams else None

    def __repr__(self) -> str:
        return f"Device({self._torch_device}, has_streams={self._has_streams})"

    # -- pinned host memory ---------------------------------------------------------------------
    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked version of a host tensor (the tensor itself if already pinned, and on DeepSpeed's
        CPU accelerator: nothing can be page-locked without a device runtime, nor need be)."""
        if self.is_pinned(tensor):
            return tensor
        return self._acc.pin_memory(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(self._acc.is_pinned(tensor))

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """A fresh 1-D uint8 host tensor of `nbytes`, pinned where the device can pin.

        Uses the accelerator's `pin_empty` (page-locks fresh memory) rather than `pin(empty(n))`,
        which would first allocate pageable memory and then copy it into a second, pinned block."""
        pin_empty = getattr(self._acc, "pin_empty", None)
        if pin_empty is not None:
            out = pin_empty(nbytes, dtype=torch.uint8)
        else:
            out = self._acc.pin_memory(torch.empty(nbytes, dtype=torch.uint8))
        return out.view(-1)

    @property
    def pins_memory(self) -> bool:
        """Whether `pin` / `empty_pinned` really page-lock memory (False on the CPU accelerator)."""
        return self._probe_pinning()[0]

    def pinned_alloc_bytes(self, nbytes: int) -> int:
        """Host bytes that one pinned allocation of `nbytes` really occupies.

        torch's pinned memory comes from its CachingHostAllocator, which rounds every block up to a
        power of two (by default; `pinned_max_round_threshold` can lift it). DeepSpeed's CUDA
        accelerator pins through torch, so a 3 MiB pinned request costs 4 MiB. Unpinned (CPU) and
        DeepSpeed native (mlock) pinning are exact. HostPool budgets with this number."""
        if nbytes <= 0 or not self._probe_pinning()[1]:
            return max(nbytes, 0)
        return 1 << (nbytes - 1).bit_length()

    def _probe_pinning(self) -> tuple[bool, bool]:
        if self._pinning is None:
            pins = self.is_pinned(self.empty_pinned(1))
            self._pinning = (pins, pins and not _native_pinning_active())
        return self._pinning

    # -- copies ---------------------------------------------------------------------------------
    def copy_out(self, src: torch.Tensor, dst: torch.Tensor) -> CopyHandle:
        """Copy a device tensor into a host tensor of the same shape and dtype (D2H).

        With streams: on the D2H side stream, after it waits for the current stream, non-blocking,
        keeping `src` alive until the copy completes (Stream protocol, rules 1-4). Without streams:
        a synchronous `dst.copy_(src)` and a completed handle. Values are copied, not strides."""
        self._check_pair(src, dst, "copy_out", src_on_device=True)
        nbytes = src.numel() * src.element_size()
        self._count("d2h", nbytes)
        if not self._has_streams:
            self._copy(dst, src, None, "d2h")
            return CopyHandle(self, "d2h", dst, nbytes)
        acc = self._acc
        current, side = acc.current_stream(), self._side("d2h")
        side.wait_stream(current)                                   # rule 1
        with acc.stream(side):
            self._copy(dst, src, side, "d2h")                       # rule 2
            event = acc.Event()
            event.record(side)
        self._hold("d2h", event, src)                               # rule 3
        return CopyHandle(self, "d2h", dst, nbytes, event)

    def copy_in(self, src: torch.Tensor, dst: torch.Tensor | None = None, *,
                after: CopyHandle | None = None) -> CopyHandle:
        """Copy a host tensor to the device (H2D); `handle.tensor` is the device tensor.

        With streams: on the H2D side stream, non-blocking, after the work queued on the current
        stream and after `after` (the copy-out that filled `src`), both device-side; a missing `dst`
        is allocated on the current stream (Stream protocol, rules 5-8). Consume with
        `handle.wait_on_current()`. Without streams: synchronous; a missing `dst` is a new tensor
        (never a view of `src`, whose pool buffer will be reused)."""
        if dst is not None:
            self._check_pair(dst, src, "copy_in", src_on_device=True)
        elif src.device.type != "cpu":
            raise DeviceError(f"copy_in expects a host (cpu) source tensor, got one on {src.device}; "
                              f"pass the pooled host buffer's view")
        nbytes = src.numel() * src.element_size()
        self._count("h2d", nbytes)
        if dst is None:
            dst = torch.empty(src.shape, dtype=src.dtype, device=self._torch_device)   # rule 5
        if not self._has_streams:
            self._copy(dst, src, None, "h2d")
            return CopyHandle(self, "h2d", dst, nbytes)
        acc = self._acc
        current, side = acc.current_stream(), self._side("h2d")
        side.wait_stream(current)                                   # rule 5
        if after is not None and not after.done():
            side.wait_event(after._event)                           # rule 6
        with acc.stream(side):
            self._copy(dst, src, side, "h2d")                       # rule 6
            event = acc.Event()
            event.record(side)
        self._hold("h2d", event, src)                               # (rule 8's buffer: the pool)
        return CopyHandle(self, "h2d", dst, nbytes, event)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream, direction: str) -> None:
        """`dst.copy_(src)`, non-blocking on `stream` (None: synchronous), or the accelerator's `issue_copy`."""
        if self._issue_copy is not None and stream is not None:
            self._issue_copy(dst, src, stream, direction)
        elif dst.requires_grad or src.requires_grad:
            with torch.no_grad():
                dst.copy_(src, non_blocking=stream is not None)
        else:  # (the hot path: pool buffers and storages' bytes record nothing for autograd)
            dst.copy_(src, non_blocking=stream is not None)

    def synchronize(self) -> None:
        """Block the host until all queued work on the device is done (counted as a host wait)."""
        if self._has_streams:
            self._count_host_wait()
        self._acc.synchronize()
        with self._lock:
            for q in self._in_flight.values():
                q.clear()

    # -- counters -------------------------------------------------------------------------------
    def stats(self) -> DeviceStats:
        with self._lock:
            return DeviceStats(**self._counts)

    def reset_stats(self) -> None:
        with self._lock:
            for key in self._counts:
                self._counts[key] = 0

    # -- internals ------------------------------------------------------------------------------
    def _count(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self._counts[f"copies_{direction}"] += 1
            self._counts[f"bytes_{direction}"] += nbytes

    def _hold(self, direction: str, event: Any, src: torch.Tensor) -> None:
        self._let_go(direction)
        with self._lock:  # `src` lives until its copy's event completes (Stream protocol, rule 3)
            self._in_flight[direction].append((event, src))

    def _let_go(self, direction: str) -> None:
        """Drop the sources of `direction`'s oldest copies that have ended (a stream ends them in order)."""
        with self._lock:
            q = self._in_flight[direction]
            while q and q[0][0].query():
                q.popleft()

    def _count_host_wait(self) -> None:
        with self._lock:
            self._counts["host_waits"] += 1

    def _side(self, which: str):
        stream = self._d2h if which == "d2h" else self._h2d
        if stream is None:
            try:
                stream = self._acc.Stream(device=self._torch_device)
            except TypeError:                       # accelerators whose Stream takes no device
                stream = self._acc.Stream()
            if which == "d2h":
                self._d2h = stream
            else:
                self._h2d = stream
        return stream

    def _check_pair(self, device_t: torch.Tensor, host_t: torch.Tensor, op: str, src_on_device: bool) -> None:
        if device_t.shape != host_t.shape or device_t.dtype != host_t.dtype:
            raise DeviceError(f"{op}: source and destination must have the same shape and dtype; got "
                              f"{tuple(device_t.shape)} {device_t.dtype} on {device_t.device} and "
                              f"{tuple(host_t.shape)} {host_t.dtype} on {host_t.device}; view the host "
                              f"buffer with the device tensor's dtype and shape")
        if not host_t.is_cpu:
            raise DeviceError(f"{op}: the host tensor must be on cpu, got {host_t.device}")
        if device_t.device.type != self._torch_device.type:
            raise DeviceError(f"{op}: the device tensor is on {device_t.device} but this Device is "
                              f"{self._torch_device}")
        if (not self._has_streams and device_t.numel() and host_t.numel()
                and device_t.untyped_storage().data_ptr() == host_t.untyped_storage().data_ptr()):
            raise DeviceError(f"{op}: source and destination share storage; the copy must go to a "
                              f"separate (pooled) buffer")

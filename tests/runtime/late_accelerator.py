"""An accelerator whose copies land late, for testing the Stream protocol on CPU.

It looks like a GPU to `Device` (streams, events, `has_streams`) but runs on host tensors:

* a copy issued on a side stream first fills its destination with junk (NaN bytes); the real
  bytes arrive only when the copy *completes*;
* a copy completes when the host learns it has (`event.synchronize()`, or the second
  `event.query()` after it was recorded), or when another stream is made to wait for it
  (`wait_event` / `wait_stream`: everything that stream runs later is ordered after the copy);
* the source of a copy is held weakly: if nothing else keeps it alive until the copy completes
  (rule 3 of the protocol), the destination gets junk, as a reused GPU block would give;
* the current stream is per thread (autograd may run backward on another thread).

So an executor that reads a prefetch before making compute wait on it, or lets a copy's source
go, computes with NaNs, and the bit-exact tests catch it.
"""

from __future__ import annotations

import threading
import weakref

import torch

JUNK = 0xFF  # as float bytes: NaN


class _Copy:
    __slots__ = ("dst", "src", "done")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor):
        self.dst, self.src, self.done = dst, weakref.ref(src), False

    def land(self) -> None:
        if self.done:
            return
        self.done = True
        src = self.src()
        with torch.no_grad():
            if src is None:  # freed while the copy was in flight: the block now holds other data
                self.dst.view(torch.uint8).fill_(JUNK) if self.dst.is_contiguous() else self.dst.fill_(float("nan"))
            else:
                self.dst.copy_(src)


class LateStream:
    def __init__(self, acc: "LateAccelerator", name: str):
        self.acc, self.name = acc, name
        self.copies: list[_Copy] = []

    def wait_event(self, event: "LateEvent") -> None:
        event.land()

    def wait_stream(self, other: "LateStream") -> None:
        for c in other.copies:
            c.land()

    def __repr__(self) -> str:
        return f"LateStream({self.name})"


class LateEvent:
    def __init__(self):
        self.copies: list[_Copy] = []
        self.queries = 0

    def record(self, stream: LateStream) -> None:
        self.copies = [c for c in stream.copies if not c.done]

    def land(self) -> None:
        for c in self.copies:
            c.land()

    def query(self) -> bool:
        self.queries += 1
        if self.queries >= 2:
            self.land()
        return all(c.done for c in self.copies)

    def synchronize(self) -> None:
        self.land()


class LateAccelerator:
    """The subset of DeepSpeed's accelerator interface `Device` uses (see the module docstring)."""

    def __init__(self):
        self.default = LateStream(self, "compute")
        self._local = threading.local()
        self.made = 0
        self.issued = 0

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def is_synchronized_device(self) -> bool:
        return False

    @property
    def Stream(self):
        def make(device=None):
            self.made += 1
            return LateStream(self, f"side{self.made}")
        return make

    @property
    def Event(self):
        return LateEvent

    def current_stream(self, device_index=None) -> LateStream:
        return getattr(self._local, "stream", self.default)

    def stream(self, stream: LateStream):
        acc = self

        class _Ctx:
            def __enter__(self):
                self.prev = acc.current_stream()
                acc._local.stream = stream

            def __exit__(self, *exc):
                acc._local.stream = self.prev
        return _Ctx()

    def synchronize(self, device_index=None) -> None:
        pass  # copies land through their events; nothing else is asynchronous here

    def issue_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: LateStream) -> None:
        self.issued += 1
        with torch.no_grad():
            if dst.is_contiguous():
                dst.view(torch.uint8).fill_(JUNK)
            else:
                dst.fill_(float("nan"))
        stream.copies = [c for c in stream.copies if not c.done]
        stream.copies.append(_Copy(dst, src))

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor

    def pin_empty(self, *size, dtype, device="cpu"):
        return torch.empty(*size, dtype=dtype, device=device)

    def is_pinned(self, tensor) -> bool:
        return False

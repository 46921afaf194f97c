"""Pooled pinned host buffers under a byte budget.

The executor swaps an activation out by acquiring a `HostBuffer`, viewing it with the activation's
dtype and shape, and `Device.copy_out` into that view; backward prefetches it with `Device.copy_in`
and releases the buffer once the H2D copy is done (`release(buf, after=handle)` defers that).
`acquire` never raises for exhaustion and never blocks: it returns None, and the caller keeps or
recomputes the activation instead.

Sizes and memory. Training repeats the same shapes every step, so buffers are kept per *exact*
size class (the request rounded up to `alignment`, 512 B by default, so every dtype view is aligned):
after one step every request of the next step finds a free buffer of exactly its size, and no byte
is wasted on rounding. Power-of-two classes would make buffers interchangeable across sizes but
waste up to half of each buffer (25-50% for hidden sizes like 1600 or 11008); the repeating pattern
does not need that flexibility. A request that finds no exact match takes the smallest free buffer
of at most `max_reuse_ratio` (2x) its size before carving new memory, and any larger free buffer
rather than missing.

Buffers are carved from *slabs* (at least `slab_bytes`, 64 MiB by default) rather than pinned one
by one, for two reasons: torch's pinned allocator rounds every block up to a power of two (so exact
sizes pinned one by one would silently cost up to twice their bytes — see
`Device.pinned_alloc_bytes`), and page-locking is slow (cudaHostAlloc, milliseconds per call), so
few large allocations are better during warm-up. A slab's bytes are its real pinned size, and the
budget is checked against those. Carved buffers are never split or merged; `trim()` frees slabs
that have no buffer in use (and if the budget would otherwise be exceeded, fully free slabs are
reused or freed before declaring a miss).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..errors import SlackSwapError
from ..logs import log

__all__ = ["HostBuffer", "HostPool", "HostPoolError", "PoolStats"]

_FREE, _IN_USE, _PENDING, _DEAD = "free", "in use", "pending release", "trimmed"


class HostPoolError(SlackSwapError, ValueError):
    """Misuse of a HostPool: releasing a buffer twice or to the wrong pool, viewing a released one."""


class _Ready(Protocol):
    def done(self) -> bool: ...


@dataclass(frozen=True)
class PoolStats:
    """Counters of a HostPool. Bytes are capacities (buffer sizes), not requested sizes."""

    budget_bytes: int | None
    allocations: int          # real host (slab) allocations ever made
    bytes_allocated: int      # host bytes held now (<= budget_bytes)
    bytes_in_use: int         # capacity of buffers acquired and not yet back in the pool
    peak_bytes_in_use: int    # since construction or reset_peak()
    acquires: int             # acquire() calls
    misses: int               # acquire() calls that returned None
    reuses: int               # acquires served by a free buffer (no new memory carved)
    frees: int                # slabs freed by trim() or to make room
    pending: int              # buffers released with `after=` whose copy has not completed yet


class _Slab:
    __slots__ = ("data", "size", "top", "live", "buffers")

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.size = data.numel()
        self.top = 0            # bump pointer: bytes carved so far
        self.live = 0           # buffers carved from it that are in use or pending
        self.buffers: list[HostBuffer] = []


class HostBuffer:
    """A pooled 1-D uint8 host buffer of `nbytes` (>= the requested size). Views use its first bytes."""

    __slots__ = ("_pool", "_slab", "_data", "offset", "nbytes", "_state")

    def __init__(self, pool: "HostPool", slab: _Slab, offset: int, nbytes: int):
        self._pool, self._slab, self.offset, self.nbytes = pool, slab, offset, nbytes
        self._data = slab.data[offset:offset + nbytes]
        self._state = _FREE

    @property
    def data(self) -> torch.Tensor:
        """The whole buffer as a 1-D uint8 tensor (pinned where the device pins)."""
        return self._data

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A typed tensor of `shape` over the buffer's first bytes (shares its memory)."""
        if self._state != _IN_USE:
            raise HostPoolError(f"view of a host buffer that is {self._state}; acquire a buffer and view it "
                                f"before releasing it")
        if dtype is torch.uint8 and len(shape) == 1 and 0 <= shape[0] <= self.nbytes:  # (a swap's bytes: the hot path)
            return self._data[:shape[0]]  # (a tensor of its own: a caller's metadata change stays its own)
        shape = torch.Size(shape)
        need = shape.numel() * dtype.itemsize
        if need > self.nbytes:
            raise HostPoolError(f"a {dtype} view of shape {tuple(shape)} needs {need} bytes but the buffer "
                                f"holds {self.nbytes}; acquire at least {need} bytes")
        return self._data[:need].view(dtype).view(shape)

    def __repr__(self) -> str:
        return f"HostBuffer({self.nbytes} B, {self._state})"


class HostPool:
    """Pinned host buffers pooled by exact size class under `budget_bytes` (None: unbounded).

    `device` supplies `empty_pinned(nbytes)` and `pinned_alloc_bytes(nbytes)` (a `Device`)."""

    def __init__(self, budget_bytes: int | None, device, *, slab_bytes: int = 64 << 20, alignment: int = 512,
                 max_reuse_ratio: float = 2.0):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise HostPoolError(f"budget_bytes must be a non-negative int or None, got {budget_bytes!r}")
        if alignment < 16 or alignment & (alignment - 1):
            raise HostPoolError(f"alignment must be a power of two >= 16 (the largest dtype), got {alignment}")
        if slab_bytes < alignment:
            raise HostPoolError(f"slab_bytes must be at least alignment ({alignment}), got {slab_bytes}")
        if max_reuse_ratio < 1:
            raise HostPoolError(f"max_reuse_ratio must be >= 1, got {max_reuse_ratio}")
        self.budget_bytes = budget_bytes
        self.device = device
        self.slab_bytes, self.alignment, self.max_reuse_ratio = slab_bytes, alignment, max_reuse_ratio
        self._lock = threading.RLock()       # pack hooks (forward) and unpack hooks (backward threads)
        self._slabs: list[_Slab] = []
        self._free: dict[int, list[HostBuffer]] = {}
        self._free_sizes: list[int] = []      # sorted keys of _free with a non-empty list
        self._pending: list[tuple[HostBuffer, _Ready]] = []
        self._allocated = self._in_use = self._peak = 0
        self._allocations = self._acquires = self._misses = self._reuses = self._frees = 0
        self.pinning_failed: str | None = None  # why the host refused to pin more (the pool stopped growing)

    # -- public ---------------------------------------------------------------------------------
    def acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least `nbytes`, or None when the budget cannot fit one (counted as a miss)."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise HostPoolError(f"acquire expects a non-negative int byte count, got {nbytes!r}")
        with self._lock:
            self._acquires += 1
            self._reclaim()
            size = self.size_class(nbytes)
            buf = self._take_free(size, int(size * self.max_reuse_ratio))
            if buf is not None:
                self._reuses += 1
            else:
                buf = self._carve(size) or self._new_slab(size)
                if buf is None:
                    buf = self._take_free(size, None)
                    if buf is not None:
                        self._reuses += 1
                    else:
                        buf = self._make_room(size)
            if buf is None:
                self._misses += 1
                return None
            buf._state = _IN_USE
            buf._slab.live += 1
            self._in_use += buf.nbytes
            self._peak = max(self._peak, self._in_use)
            return buf

    def release(self, buf: HostBuffer, after: _Ready | None = None) -> None:
        """Return `buf` to the pool; with `after` (e.g. the CopyHandle still reading or writing it),
        only once `after.done()` — until then it stays counted in use and is never handed out."""
        with self._lock:
            if not isinstance(buf, HostBuffer) or buf._pool is not self:
                raise HostPoolError(f"release of {buf!r}, which was not acquired from this pool; release "
                                    f"each buffer to the pool it came from")
            if buf._state != _IN_USE:
                raise HostPoolError(f"release of a host buffer that is already {buf._state} (double release?); "
                                    f"release each acquired buffer exactly once")
            if after is not None and not after.done():
                buf._state = _PENDING
                self._pending.append((buf, after))
            else:
                self._to_free(buf)

    def trim(self) -> int:
        """Free every slab with no buffer in use; return the bytes freed.

        (On CUDA the memory goes back to torch's pinned-memory cache, not yet to the OS.)"""
        with self._lock:
            self._reclaim()
            freed = 0
            for slab in [s for s in self._slabs if s.live == 0]:
                freed += self._drop_slab(slab)
            for slab in self._slabs:          # un-carve free buffers at the end of partly used slabs
                while slab.buffers and slab.buffers[-1]._state == _FREE:
                    tail = slab.buffers.pop()
                    self._unlist(tail)
                    slab.top = tail.offset
            return freed

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self.budget_bytes, self._allocations, self._allocated, self._in_use, self._peak,
                             self._acquires, self._misses, self._reuses, self._frees, len(self._pending))

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._in_use

    def size_class(self, nbytes: int) -> int:
        """The capacity a request of `nbytes` is served with: rounded up to `alignment`, at least one unit."""
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    # -- internals ------------------------------------------------------------------------------
    def _reclaim(self) -> None:
        if self._pending:
            still = []
            for buf, after in self._pending:
                if after.done():
                    self._to_free(buf)
                else:
                    still.append((buf, after))
            self._pending = still

    def _to_free(self, buf: HostBuffer) -> None:
        buf._state = _FREE
        buf._slab.live -= 1
        self._in_use -= buf.nbytes
        lst = self._free.get(buf.nbytes)
        if not lst:
            self._free[buf.nbytes] = lst = []
            bisect.insort(self._free_sizes, buf.nbytes)
        lst.append(buf)                       # LIFO: the most recently used buffer is warm in cache

    def _take_free(self, size: int, limit: int | None) -> HostBuffer | None:
        i = bisect.bisect_left(self._free_sizes, size)
        if i == len(self._free_sizes) or (limit is not None and self._free_sizes[i] > limit):
            return None
        cap = self._free_sizes[i]
        lst = self._free[cap]
        buf = lst.pop()
        if not lst:
            del self._free[cap]
            self._free_sizes.pop(i)
        return buf

    def _unlist(self, buf: HostBuffer) -> None:
        lst = self._free[buf.nbytes]
        lst.remove(buf)
        if not lst:
            del self._free[buf.nbytes]
            self._free_sizes.remove(buf.nbytes)
        buf._state = _DEAD

    def _carve(self, size: int) -> HostBuffer | None:
        for slab in reversed(self._slabs):
            if slab.size - slab.top >= size:
                return self._carve_from(slab, size)
        return None

    def _slab_size(self, size: int, room: int | None) -> int:
        """Bytes of a new slab for a `size` request given `room` left in the budget (0: none fits).

        The preferred size is max(slab_bytes, size) as really allocated (a power of two where
        torch rounds pinned blocks); with too little room, the largest slab whose real size fits."""
        dev = self.device
        want = dev.pinned_alloc_bytes(max(self.slab_bytes, size))
        if room is None or want <= room:
            return want
        fit = room // self.alignment * self.alignment
        if fit > 0 and dev.pinned_alloc_bytes(fit) > room:
            fit = 1 << (room.bit_length() - 1)            # largest power of two within room
        if fit < size or dev.pinned_alloc_bytes(fit) > room:
            return 0
        return fit

    def _room(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self._allocated

    def _new_slab(self, size: int) -> HostBuffer | None:
        nbytes = self._slab_size(size, self._room())
        if nbytes == 0:
            return None
        try:
            data = self.device.empty_pinned(nbytes)
        except RuntimeError as e:  # (torch.AcceleratorError / OutOfMemoryError: the host cannot pin more)
            self._pinning_failed(nbytes, e)
            return None
        self._allocations += 1
        self._allocated += self.device.pinned_alloc_bytes(nbytes)
        self._slabs.append(_Slab(data))
        return self._carve_from(self._slabs[-1], size)

    def _pinning_failed(self, nbytes: int, error: RuntimeError) -> None:
        """The host would not pin `nbytes` more: the pool stops growing at what it holds (its budget
        from now on; a request it cannot serve is a miss, which the caller falls back from), said once."""
        if self.pinning_failed is None:
            self.pinning_failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            log.warning("slackswap: the host would not pin %s more bytes beside the pool's %s (%s); the host pool "
                        "stops growing here, and saved tensors it cannot take stay on the device. Set "
                        "\"host_pool_bytes_per_node\" within the host's pinnable memory, or lower the micro-batch",
                        f"{nbytes:,}", f"{self._allocated:,}", self.pinning_failed)
        self.budget_bytes = self._allocated if self.budget_bytes is None else min(self.budget_bytes, self._allocated)

    def _carve_from(self, slab: _Slab, size: int) -> HostBuffer:
        buf = HostBuffer(self, slab, slab.top, size)
        slab.top += size
        slab.buffers.append(buf)
        return buf

    def _make_room(self, size: int) -> HostBuffer | None:
        """Last resort before a miss: re-carve a fully free slab, or free them all for a new one."""
        idle = [s for s in self._slabs if s.live == 0]
        for slab in sorted(idle, key=lambda s: s.size):
            if slab.size >= size:
                for buf in slab.buffers:
                    self._unlist(buf)
                slab.buffers, slab.top = [], 0
                return self._carve_from(slab, size)
        room = self._room()
        if not idle or room is None:
            return None
        reclaimable = sum(self.device.pinned_alloc_bytes(s.size) for s in idle)
        if self._slab_size(size, room + reclaimable) == 0:
            return None
        for slab in idle:
            self._drop_slab(slab)
        return self._new_slab(size)

    def _drop_slab(self, slab: _Slab) -> int:
        for buf in slab.buffers:
            self._unlist(buf)
        self._slabs.remove(slab)
        freed = self.device.pinned_alloc_bytes(slab.size)
        self._allocated -= freed
        self._frees += 1
        return freed

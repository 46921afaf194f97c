"""HostPool: exact byte accounting, zero allocations after warm-up, misses instead of errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap_ds.errors import SlackSwapError
from slackswap_ds.runtime.device import Device
from slackswap_ds.runtime.host_pool import HostBuffer, HostPool, HostPoolError, PoolStats

KiB = 1024


@pytest.fixture(scope="module")
def cpu():
    return Device.cpu()


class Pow2Device:
    """Stands in for a CUDA Device: pinned blocks cost the next power of two (torch's host allocator)."""

    def __init__(self):
        self.allocated = []

    def empty_pinned(self, nbytes):
        self.allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def pinned_alloc_bytes(self, nbytes):
        return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def run_step(pool, sizes):
    """One training step: forward acquires in order, backward releases in reverse; returns misses."""
    bufs = [pool.acquire(n) for n in sizes]
    for b in reversed(bufs):
        if b is not None:
            pool.release(b)
    return sum(b is None for b in bufs)


STEP = [3 * KiB, 10 * KiB, 3 * KiB, 1000, 7 * KiB, 10 * KiB, 1000, 64]


@pytest.mark.parametrize("slab_bytes", [512, 4 * KiB, 64 * KiB, 64 << 20])
def test_no_allocations_after_warmup(cpu, slab_bytes):
    pool = HostPool(None, cpu, slab_bytes=slab_bytes)
    run_step(pool, STEP)
    run_step(pool, STEP)
    warm = pool.stats()
    for _ in range(10):
        assert run_step(pool, STEP) == 0
    after = pool.stats()
    assert after.allocations == warm.allocations
    assert after.bytes_allocated == warm.bytes_allocated
    assert after.reuses - warm.reuses == 10 * len(STEP)       # every request served from the pool
    assert after.acquires - warm.acquires == 10 * len(STEP)
    assert after.misses == 0 and after.bytes_in_use == 0


def test_no_allocations_after_warmup_with_interleaved_releases(cpu):
    """Buffers freed in backward while others are still held, as swaps are in a real step."""
    pool = HostPool(None, cpu, slab_bytes=8 * KiB)

    def step():
        a, b = pool.acquire(5000), pool.acquire(2000)
        pool.release(a)
        c = pool.acquire(5000)
        d = pool.acquire(700)
        for x in (b, d, c):
            pool.release(x)

    step()
    step()
    n = pool.stats().allocations
    for _ in range(5):
        step()
    assert pool.stats().allocations == n and pool.stats().misses == 0


def test_exhaustion_returns_none_and_counts_a_miss(cpu):
    pool = HostPool(4 * KiB, cpu, slab_bytes=4 * KiB)
    a = pool.acquire(3 * KiB)
    b = pool.acquire(1 * KiB)
    assert a is not None and b is not None
    assert pool.acquire(1) is None
    s = pool.stats()
    assert (s.acquires, s.misses, s.bytes_allocated, s.bytes_in_use) == (3, 1, 4 * KiB, 4 * KiB)
    pool.release(b)
    assert pool.acquire(1) is b                                 # 512 B class reuses the 1 KiB buffer
    assert pool.stats().reuses == 1


def test_budget_smaller_than_one_slab_gets_a_smaller_slab(cpu):
    pool = HostPool(1000, cpu)                                  # default 64 MiB slabs
    buf = pool.acquire(100)
    assert buf is not None and buf.nbytes == 512
    assert pool.stats().bytes_allocated == 512                  # largest aligned slab within budget
    assert pool.acquire(100) is None                            # 488 B left: less than one class


def test_repeating_pattern_over_budget_misses_the_same_and_never_grows(cpu):
    pool = HostPool(16 * KiB, cpu, slab_bytes=4 * KiB)
    misses = [run_step(pool, STEP) for _ in range(6)]
    assert misses[1:] == [misses[1]] * 5 and misses[1] > 0
    s = pool.stats()
    assert s.bytes_allocated <= 16 * KiB and s.misses == sum(misses)
    n = s.allocations
    run_step(pool, STEP)
    assert pool.stats().allocations == n


def test_unbounded_pool(cpu):
    pool = HostPool(None, cpu, slab_bytes=4 * KiB)
    bufs = [pool.acquire(64 * KiB) for _ in range(20)]
    assert all(b is not None for b in bufs)
    s = pool.stats()
    assert s.misses == 0 and s.bytes_in_use == 20 * 64 * KiB and s.bytes_allocated == 20 * 64 * KiB
    assert s.budget_bytes is None


def test_size_classes_and_fallback_to_larger_free_buffer(cpu):
    pool = HostPool(None, cpu, slab_bytes=64 * KiB, alignment=512)
    assert [pool.size_class(n) for n in (0, 1, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    big = pool.acquire(1000)
    pool.release(big)
    assert pool.acquire(600) is big                             # 1024 <= 2 x 1024: reused
    small = pool.acquire(8 * KiB)
    pool.release(small)
    tiny = pool.acquire(100)                                    # 8 KiB > 2 x 512: carve instead
    assert tiny is not small and tiny.nbytes == 512
    assert pool.stats().allocations == 1


def test_larger_free_buffer_is_taken_rather_than_missing(cpu):
    pool = HostPool(8 * KiB, cpu, slab_bytes=8 * KiB)
    big = pool.acquire(8 * KiB)
    pool.release(big)
    assert pool.acquire(100) is big                             # beyond the 2x ratio, but better than None
    assert pool.stats().misses == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16,
                                   torch.uint8, torch.complex64])
def test_typed_views_round_trip_exactly(cpu, dtype):
    pool = HostPool(None, cpu, slab_bytes=4 * KiB)
    pool.acquire(3)                                             # so the next buffer has a non-zero offset
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        x = torch.rand(5, 7, generator=g) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        x = (torch.randn(5, 7, generator=g, dtype=torch.float32) * 1e3).to(dtype)
    else:
        x = torch.randint(-2**31 if dtype == torch.int64 else 0, 2**31 if dtype == torch.int64 else 255,
                          (5, 7), generator=g, dtype=dtype)
    buf = pool.acquire(x.numel() * x.element_size())
    assert buf.offset > 0
    v = buf.view(dtype, x.shape)
    v.copy_(x)
    assert torch.equal(buf.view(dtype, x.shape), x)
    assert v.dtype == dtype and v.shape == x.shape and v.is_contiguous()
    assert v.data_ptr() == buf.data.data_ptr()
    assert v.data_ptr() % 512 == buf.data.data_ptr() % 512 == pool._slabs[0].data.data_ptr() % 512


def test_special_float_bits_survive(cpu):
    pool = HostPool(None, cpu, slab_bytes=KiB)
    x = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -float("inf")])
    buf = pool.acquire(x.nbytes)
    buf.view(torch.float32, x.shape).copy_(x)
    y = buf.view(torch.float32, x.shape)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_view_errors(cpu):
    pool = HostPool(None, cpu, slab_bytes=KiB)
    buf = pool.acquire(512)
    with pytest.raises(HostPoolError, match="needs 1024 bytes"):
        buf.view(torch.float32, (256,))
    pool.release(buf)
    with pytest.raises(HostPoolError, match="free"):
        buf.view(torch.float32, (2,))


def test_double_and_foreign_release(cpu):
    pool, other = HostPool(None, cpu, slab_bytes=KiB), HostPool(None, cpu, slab_bytes=KiB)
    buf = pool.acquire(10)
    with pytest.raises(HostPoolError, match="not acquired from this pool"):
        other.release(buf)
    with pytest.raises(HostPoolError, match="not acquired from this pool"):
        pool.release(torch.empty(10, dtype=torch.uint8))
    pool.release(buf)
    with pytest.raises(HostPoolError, match="double release") as e:
        pool.release(buf)
    assert isinstance(e.value, SlackSwapError)


def test_bad_arguments(cpu):
    with pytest.raises(HostPoolError):
        HostPool(-1, cpu)
    with pytest.raises(HostPoolError):
        HostPool(None, cpu, alignment=48)
    with pytest.raises(HostPoolError):
        HostPool(None, cpu).acquire(-5)


def test_deferred_release_waits_for_the_copy(cpu):
    class Flag:
        ready = False

        def done(self):
            return self.ready

    pool = HostPool(None, cpu, slab_bytes=KiB)
    buf, flag = pool.acquire(KiB), Flag()
    pool.release(buf, after=flag)
    assert pool.stats().pending == 1 and pool.stats().bytes_in_use == KiB
    other = pool.acquire(KiB)
    assert other is not buf                                     # still being copied: never handed out
    with pytest.raises(HostPoolError, match="pending release"):
        pool.release(buf)
    flag.ready = True
    assert pool.acquire(KiB) is buf
    assert pool.stats().pending == 0


def test_release_after_a_completed_copy_handle_is_immediate(cpu):
    pool = HostPool(None, cpu, slab_bytes=KiB)
    buf = pool.acquire(16)
    handle = cpu.copy_out(torch.arange(4, dtype=torch.float32), buf.view(torch.float32, (4,)))
    pool.release(buf, after=handle)
    s = pool.stats()
    assert s.pending == 0 and s.bytes_in_use == 0


def test_trim_and_peak(cpu):
    pool = HostPool(None, cpu, slab_bytes=2 * KiB)
    a, b, c = pool.acquire(2 * KiB), pool.acquire(2 * KiB), pool.acquire(KiB)
    assert pool.stats().peak_bytes_in_use == 5 * KiB
    pool.release(a)
    pool.release(c)
    assert pool.trim() == 4 * KiB                               # a's slab and c's slab; b's stays
    s = pool.stats()
    assert (s.bytes_allocated, s.frees, s.bytes_in_use, s.peak_bytes_in_use) == (2 * KiB, 2, 2 * KiB, 5 * KiB)
    pool.reset_peak()
    assert pool.stats().peak_bytes_in_use == 2 * KiB
    with pytest.raises(HostPoolError, match="trimmed"):
        a.view(torch.uint8, (1,))
    pool.release(b)
    assert pool.trim() == 2 * KiB and pool.stats().bytes_allocated == 0


def test_trim_uncarves_free_tail_of_a_partly_used_slab(cpu):
    pool = HostPool(None, cpu, slab_bytes=4 * KiB)
    held, b = pool.acquire(KiB), pool.acquire(3 * KiB)
    pool.release(b)
    assert held is not None
    pool.trim()
    assert pool.stats().bytes_allocated == 4 * KiB
    c = pool.acquire(2 * KiB)                                   # carved from the reclaimed tail
    assert c.offset == KiB and pool.stats().allocations == 1


def test_idle_slabs_are_recarved_when_the_budget_is_full(cpu):
    """A new shape pattern (re-plan) reuses memory of the old pattern instead of missing."""
    pool = HostPool(8 * KiB, cpu, slab_bytes=4 * KiB)
    olds = [pool.acquire(KiB) for _ in range(8)]
    for b in olds:
        pool.release(b)
    new = pool.acquire(3 * KiB)                                 # no 3 KiB buffer, no room: re-carve a slab
    assert new is not None and pool.stats().allocations == 2
    big = pool.acquire(8 * KiB)                                 # needs both slabs' memory: freed, one new
    assert big is None                                          # one slab is in use by `new`
    pool.release(new)
    big = pool.acquire(8 * KiB)
    assert big is not None and pool.stats().bytes_allocated == 8 * KiB and pool.stats().frees == 2


def test_pow2_pinned_accounting_never_exceeds_budget():
    dev = Pow2Device()
    pool = HostPool(100 * KiB, dev, slab_bytes=16 * KiB)
    a = pool.acquire(40 * KiB)                                  # one 64 KiB slab (the real pinned size)
    assert dev.allocated == [64 * KiB] and pool.stats().bytes_allocated == 64 * KiB
    b = pool.acquire(20 * KiB)                                  # carved from the same slab
    assert b is not None and pool.stats().allocations == 1
    c = pool.acquire(20 * KiB)                                  # 36 KiB of budget left: a 32 KiB slab
    assert c is not None and dev.allocated[-1] == 32 * KiB
    assert pool.acquire(20 * KiB) is None
    assert all(n & (n - 1) == 0 for n in dev.allocated)
    assert pool.stats().bytes_allocated == 96 * KiB <= 100 * KiB
    for x in (a, b, c):
        pool.release(x)


def test_stats_is_a_frozen_snapshot(cpu):
    pool = HostPool(None, cpu)
    s = pool.stats()
    assert isinstance(s, PoolStats)
    with pytest.raises(AttributeError):
        s.misses = 3
    pool.acquire(1)
    assert s.acquires == 0 and pool.stats().acquires == 1


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 6000), st.integers(0, 10)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, budget=st.one_of(st.none(), st.integers(0, 40000)), slab=st.sampled_from([512, 3000, 8192]),
       pow2=st.booleans())
def test_invariants_on_random_sequences(ops, budget, slab, pow2):
    dev = Pow2Device() if pow2 else Device.cpu()
    pool = HostPool(budget, dev, slab_bytes=slab)
    held: list[tuple[HostBuffer, int, int]] = []
    stamp = 0
    for is_acquire, n, pick in ops:
        if is_acquire or not held:
            buf = pool.acquire(n)
            if buf is not None:
                assert buf.nbytes >= n
                stamp += 1
                buf.data.fill_(stamp % 256)
                held.append((buf, n, stamp % 256))
        else:
            buf, _, _ = held.pop(pick % len(held))
            pool.release(buf)
        s = pool.stats()
        assert budget is None or s.bytes_allocated <= budget
        assert s.bytes_in_use == sum(b.nbytes for b, _, _ in held) <= s.bytes_allocated
        assert s.peak_bytes_in_use >= s.bytes_in_use
        assert s.acquires - s.misses >= s.reuses
        spans = sorted((b.data.data_ptr(), b.data.data_ptr() + b.nbytes) for b, _, _ in held)
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:])), "live buffers overlap"
        for b, _, v in held:                                    # nobody else wrote into a live buffer
            assert bool((b.data == v).all())


class RefusingDevice(Pow2Device):
    """A host that pins up to `limit` bytes, then refuses as CUDA does (cudaHostAlloc's out of memory)."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def empty_pinned(self, nbytes):
        if sum(self.allocated) + nbytes > self.limit:
            raise torch.AcceleratorError("CUDA error: out of memory") if hasattr(torch, "AcceleratorError") \
                else RuntimeError("CUDA error: out of memory")
        return super().empty_pinned(nbytes)


def test_a_host_that_refuses_to_pin_more_is_a_miss_said_once_and_the_pool_stops_growing(caplog):
    pool = HostPool(None, RefusingDevice(limit=64 * KiB), slab_bytes=32 * KiB)
    held = [pool.acquire(30 * KiB), pool.acquire(30 * KiB)]  # two slabs: 64 KiB pinned
    assert all(b is not None for b in held)
    with caplog.at_level("WARNING", logger="slackswap_ds"):
        assert pool.acquire(30 * KiB) is None  # a third slab would pass the host's limit
        assert pool.acquire(30 * KiB) is None  # not tried again: the pool's budget is what it holds
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "would not pin 32,768 more bytes" in said[0] and "host_pool_bytes_per_node" in said[0]
    assert pool.budget_bytes == 64 * KiB and pool.pinning_failed.endswith("out of memory")
    assert pool.stats().misses == 2 and pool.device.allocated == [32 * KiB, 32 * KiB]
    pool.release(held[0])
    assert pool.acquire(30 * KiB) is not None  # what it holds still serves

"""Device: the synchronous CPU path (always) and the stream/event protocol (CUDA only)."""

import time

import pytest
import torch

from slackswap_ds.errors import SlackSwapError
from slackswap_ds.runtime.device import CopyHandle, Device, DeviceError, DeviceStats, TorchAccelerator
from slackswap_ds.runtime.emulation import emulation_requested
from slackswap_ds.runtime.host_pool import HostPool

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["deepspeed", "torch"])
def cpu(request):
    """The synchronous path, through DeepSpeed's CPU accelerator and through the plain-torch fallback."""
    return Device.cpu() if request.param == "deepspeed" else Device(TorchAccelerator("cpu"))


# -- CPU accelerator: what DeepSpeed really provides --------------------------------------------

def test_deepspeed_cpu_accelerator_has_no_streams_and_does_not_pin():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    acc = CPU_Accelerator()
    assert acc.Stream is None and acc.Event is None and acc.current_stream() is None
    assert acc.is_synchronized_device()
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    dev = Device(acc)
    assert (dev.name, dev.torch_device, dev.has_streams) == ("cpu", torch.device("cpu"), False)
    assert dev.d2h_stream is None and dev.h2d_stream is None
    assert dev.pin(t) is t and not dev.is_pinned(t) and not dev.pins_memory
    assert dev.pinned_alloc_bytes(3000) == 3000                 # no power-of-two rounding without pinning


def test_current_is_cached():
    assert Device.current() is Device.current()
    assert Device.current().has_streams == (torch.cuda.is_available() or emulation_requested())


def test_empty_pinned_is_flat_uint8(cpu):
    t = cpu.empty_pinned(100)
    assert t.dtype == torch.uint8 and t.shape == (100,) and t.device.type == "cpu"


# -- CPU: real synchronous copies ----------------------------------------------------------------

def test_cpu_round_trip_copies_for_real(cpu):
    x = torch.randn(4, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    host = torch.empty_like(x)
    out = cpu.copy_out(x, host)
    assert isinstance(out, CopyHandle) and out.done() and out.tensor is host
    assert torch.equal(host, x) and host.data_ptr() != x.data_ptr()
    back = cpu.copy_in(host)
    assert back.done()
    y = back.wait_on_current()
    assert torch.equal(y, x) and y.data_ptr() not in (x.data_ptr(), host.data_ptr())
    host.zero_()                                                # the pool reuses the host buffer ...
    assert torch.equal(y, x)                                    # ... the restored tensor is not a view of it
    assert back.wait() is y
    assert cpu.stats() == DeviceStats(copies_d2h=1, copies_h2d=1, bytes_d2h=80, bytes_h2d=80, host_waits=0)
    cpu.synchronize()
    assert cpu.stats().host_waits == 0
    cpu.reset_stats()
    assert cpu.stats() == DeviceStats(0, 0, 0, 0, 0)


def test_cpu_copy_in_into_given_destination(cpu):
    host = torch.arange(6, dtype=torch.int64).view(2, 3)
    dst = torch.zeros(2, 3, dtype=torch.int64)
    h = cpu.copy_in(host, dst)
    assert h.tensor is dst and torch.equal(dst, host)


def test_cpu_round_trip_through_the_pool(cpu):
    pool = HostPool(None, cpu, slab_bytes=4096)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        x = (torch.randn(3, 7) * 100).to(dtype)
        buf = pool.acquire(x.numel() * x.element_size())
        cpu.copy_out(x, buf.view(dtype, x.shape)).wait()
        y = cpu.copy_in(buf.view(dtype, x.shape)).wait_on_current()
        pool.release(buf)
        assert torch.equal(y, x) and y.dtype == dtype
    s = cpu.stats()
    assert s.copies_d2h == s.copies_h2d == 4 and s.bytes_d2h == s.bytes_h2d == 21 * (4 + 2 + 8 + 1)


def test_copies_do_not_record_autograd(cpu):
    x = torch.randn(3, requires_grad=True) * 2                  # a saved activation in a graph
    host = torch.empty(3)
    cpu.copy_out(x, host)
    assert not host.requires_grad and host.grad_fn is None
    y = cpu.copy_in(host).tensor
    assert not y.requires_grad


def test_non_contiguous_source_copies_values(cpu):
    x = torch.arange(12.0).view(3, 4).t()
    host = torch.empty(4, 3)
    cpu.copy_out(x, host)
    assert torch.equal(host, x) and host.is_contiguous()


def test_mismatched_pairs_are_rejected(cpu):
    with pytest.raises(DeviceError, match="same shape and dtype") as e:
        cpu.copy_out(torch.ones(3), torch.empty(4))
    assert isinstance(e.value, SlackSwapError)
    with pytest.raises(DeviceError, match="same shape and dtype"):
        cpu.copy_out(torch.ones(3), torch.empty(3, dtype=torch.float64))
    x = torch.ones(4)
    with pytest.raises(DeviceError, match="share storage"):
        cpu.copy_out(x, x.view(4))
    assert cpu.stats().copies_d2h == 0                          # rejected copies are not counted


# -- the Stream protocol, scripted: streams and events that only log, on CPU ----------------------
# This runs the has_streams code path everywhere (real copies, logged ordering), so the protocol's
# bookkeeping is tested even without a GPU; the CUDA tests below check the real thing.

class FakeEvent:
    def __init__(self, log):
        self.log, self.complete, self.stream = log, False, None

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name))

    def query(self):
        return self.complete

    def synchronize(self):
        self.log.append(("synchronize_event", self.stream.name))
        self.complete = True


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.stream.name))


class FakeAccelerator:
    """Streams and events that log what Device does; copies happen for real on the host."""

    def __init__(self):
        self.log, self.events, self.made = [], [], 0
        self.compute = FakeStream(self.log, "compute")
        self._current = self.compute

    def device_name(self, device_index=None):
        return "cpu"

    def current_device_name(self):
        return "cpu"

    def is_synchronized_device(self):
        return False

    @property
    def Stream(self):
        def make(device=None):
            self.made += 1
            return FakeStream(self.log, ("d2h", "h2d")[self.made - 1] if self.made <= 2 else f"s{self.made}")
        return make

    @property
    def Event(self):
        def make():
            self.events.append(FakeEvent(self.log))
            return self.events[-1]
        return make

    def current_stream(self, device_index=None):
        return self._current

    def stream(self, stream):
        acc = self

        class Ctx:
            def __enter__(self):
                acc.log.append(("enter", stream.name))
                acc._prev, acc._current = acc._current, stream

            def __exit__(self, *exc):
                acc.log.append(("exit", stream.name))
                acc._current = acc._prev
        return Ctx()

    def synchronize(self, device_index=None):
        self.log.append(("synchronize",))

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor

    def is_pinned(self, tensor):
        return False


def held(dev: Device, direction: str) -> list:
    """The sources the device keeps for its copies of `direction` in flight (rule 3)."""
    return [src for _, src in dev._in_flight[direction]]


def test_a_dropped_handle_leaves_its_source_held_until_the_copy_ends(scripted):
    dev, acc = scripted
    src = torch.ones(3)
    dev.copy_out(src, torch.empty(3))                          # (the handle is dropped at once)
    assert held(dev, "d2h") == [src]
    acc.events[-1].complete = True
    dev.copy_out(torch.zeros(2), torch.empty(2))               # the next copy lets the finished one go
    assert len(held(dev, "d2h")) == 1 and held(dev, "d2h")[0] is not src


@pytest.fixture
def scripted(monkeypatch):
    acc = FakeAccelerator()
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, stream: acc.log.append(("record_stream", tuple(t.shape), stream.name)),
                        raising=False)
    dev = Device(acc)
    assert (dev.d2h_stream.name, dev.h2d_stream.name) == ("d2h", "h2d")   # created in this order, once
    assert dev.d2h_stream is dev.d2h_stream and acc.made == 2
    return dev, acc


def test_scripted_d2h_protocol(scripted):
    dev, acc = scripted
    assert dev.has_streams and dev.d2h_stream.name == "d2h"
    src, host = torch.arange(6.0), torch.empty(6)
    h = dev.copy_out(src, host)
    assert acc.log == [("wait_stream", "d2h", "compute"), ("enter", "d2h"), ("record", "d2h"), ("exit", "d2h")]
    assert torch.equal(host, src) and not h.done() and held(dev, "d2h") == [src]   # rule 3: src held
    acc.log.clear()
    h.wait_on_current()                                        # compute waits
    assert acc.log == [("wait_event", "compute", "d2h")] and not h.done()
    assert dev.stats().host_waits == 0
    acc.log.clear()
    h.wait()                                                   # event still incomplete: host blocks
    assert acc.log == [("synchronize_event", "d2h")] and h.host_waited and h.done() and held(dev, "d2h") == []
    assert dev.stats() == DeviceStats(1, 0, 24, 0, 1)
    h.wait()
    assert dev.stats().host_waits == 1                         # already complete: no second wait


def test_scripted_d2h_source_released_when_event_completes(scripted):
    dev, acc = scripted
    src = torch.ones(3)
    h = dev.copy_out(src, torch.empty(3))
    assert not h.done() and held(dev, "d2h") == [src]
    acc.events[-1].complete = True
    assert h.done() and held(dev, "d2h") == []
    h.wait()
    assert not h.host_waited and dev.stats().host_waits == 0


def test_scripted_h2d_protocol_allocates_on_compute_and_orders_after_it(scripted):
    dev, acc = scripted
    host = torch.arange(4, dtype=torch.int64)
    h = dev.copy_in(host)
    # rule 5: allocated on the compute stream (outside the side stream), the copy after compute
    assert acc.log == [("wait_stream", "h2d", "compute"), ("enter", "h2d"), ("record", "h2d"), ("exit", "h2d")]
    assert torch.equal(h.tensor, host) and h.tensor.data_ptr() != host.data_ptr()
    assert held(dev, "h2d") == [host]                          # the pinned source is still read
    acc.log.clear()
    t = h.wait_on_current()
    assert acc.log == [("wait_event", "compute", "h2d")]       # rule 7; no record_stream needed
    assert held(dev, "h2d") == [host]                          # the host buffer waits for done()
    acc.events[-1].complete = True
    assert h.done() and held(dev, "h2d") == [] and t is h.tensor


def test_scripted_h2d_after_a_copy_out_waits_on_its_event_not_the_host(scripted):
    dev, acc = scripted
    out = dev.copy_out(torch.ones(3), torch.empty(3))
    acc.log.clear()
    h = dev.copy_in(torch.ones(3), after=out)                  # rule 6: the copy-out has not ended
    assert acc.log[:2] == [("wait_stream", "h2d", "compute"), ("wait_event", "h2d", "d2h")]
    assert dev.stats().host_waits == 0 and not out.host_waited
    acc.events[0].complete = True
    acc.log.clear()
    dev.copy_in(torch.ones(3), after=out)                      # ended: nothing to wait for
    assert ("wait_event", "h2d", "d2h") not in acc.log
    h.wait()
    assert acc.log == [("wait_stream", "h2d", "compute"), ("enter", "h2d"), ("record", "h2d"), ("exit", "h2d"),
                       ("synchronize_event", "h2d")]


def test_scripted_h2d_wait_blocks_the_host_once(scripted):
    dev, acc = scripted
    h = dev.copy_in(torch.ones(2))
    acc.log.clear()
    h.wait()
    assert acc.log == [("synchronize_event", "h2d")] and dev.stats().host_waits == 1


def test_scripted_h2d_into_given_destination_waits_for_compute(scripted):
    dev, acc = scripted
    dst = torch.zeros(3)
    h = dev.copy_in(torch.ones(3), dst)
    assert acc.log[0] == ("wait_stream", "h2d", "compute") and h.tensor is dst
    acc.log.clear()
    h.wait_on_current()
    assert acc.log == [("wait_event", "compute", "h2d")]


def test_scripted_release_after_handle_defers_until_done(scripted):
    dev, acc = scripted
    pool = HostPool(None, dev, slab_bytes=4096)
    buf = pool.acquire(32)
    h = dev.copy_out(torch.ones(8), buf.view(torch.float32, (8,)))
    pool.release(buf, after=h)
    assert pool.acquire(32) is not buf and pool.stats().pending == 1
    acc.events[-1].complete = True
    assert pool.acquire(32) is buf and pool.stats().pending == 0


def test_scripted_synchronize_counts(scripted):
    dev, acc = scripted
    dev.synchronize()
    assert acc.log == [("synchronize",)] and dev.stats().host_waits == 1


# -- CUDA: the Stream protocol ---------------------------------------------------------------------
# torch.cuda._sleep(cycles) keeps a stream busy (~1e9 cycles is ~0.5 s on current GPUs), which turns
# "the copy waited / overlapped / was ordered" into facts the host can observe.

SLEEP = 1_000_000_000
MiB = 1 << 20


@pytest.fixture
def gpu():
    dev = Device.current()
    assert dev.has_streams and dev.name == "cuda"
    torch.cuda.synchronize()
    dev.reset_stats()
    return dev


@cuda
def test_cuda_device_identity_and_pinning(gpu):
    assert gpu.torch_device == torch.device("cuda", torch.cuda.current_device())
    assert gpu.d2h_stream is not None and gpu.h2d_stream is not None and gpu.d2h_stream != gpu.h2d_stream
    assert gpu.pins_memory
    t = gpu.pin(torch.ones(10))
    assert gpu.is_pinned(t) and gpu.pin(t) is t
    assert gpu.is_pinned(gpu.empty_pinned(1000))
    assert gpu.pinned_alloc_bytes(3 * MiB) == 4 * MiB        # torch's CachingHostAllocator rounds to 2^k


@cuda
def test_cuda_round_trip_and_counters(gpu):
    x = torch.randn(256, 1024, device=gpu.torch_device)
    host = gpu.empty_pinned(x.nbytes).view(torch.float32).view(x.shape)
    out = gpu.copy_out(x, host)
    out.wait()
    assert torch.equal(host, x.cpu())
    back = gpu.copy_in(host)
    y = back.wait_on_current()
    assert y.device == x.device and torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    s = gpu.stats()
    assert (s.copies_d2h, s.copies_h2d, s.bytes_d2h, s.bytes_h2d) == (1, 1, x.nbytes, x.nbytes)


@cuda
def test_cuda_d2h_waits_for_the_producer_on_the_compute_stream(gpu):
    """Rule 1: the kernel writing `x` is still queued behind a sleep when copy_out is issued."""
    x = torch.zeros(MiB, device=gpu.torch_device)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    x.fill_(7.0)
    host = torch.empty(MiB, pin_memory=True)
    h = gpu.copy_out(x, host)
    assert not h.done()
    h.wait()
    assert h.host_waited and gpu.stats().host_waits == 1
    assert bool((host == 7.0).all())


@cuda
def test_cuda_d2h_overlaps_compute(gpu):
    x = torch.randn(16 * MiB, device=gpu.torch_device)        # 64 MiB
    host = torch.empty(x.shape, pin_memory=True)
    torch.cuda.synchronize()
    h = gpu.copy_out(x, host)
    torch.cuda._sleep(SLEEP)                                   # compute busy after the copy was issued
    h.wait()                                                   # returns while compute is still busy
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert torch.equal(host, x.cpu())


@cuda
def test_cuda_h2d_overlaps_compute_queued_after_it(gpu):
    """A prefetch runs while compute issued after it is busy (rule 5 orders it only after the
    compute queued before it)."""
    host = torch.randn(16 * MiB).pin_memory()
    torch.cuda.synchronize()
    h = gpu.copy_in(host)
    torch.cuda._sleep(SLEEP)
    h.wait()
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert torch.equal(h.tensor.cpu(), host)


@cuda
def test_cuda_h2d_after_copy_out_needs_no_host_wait(gpu):
    """Rule 6: a prefetch issued while its copy-out is still queued waits on the device."""
    x = torch.full((MiB,), 3.0, device=gpu.torch_device)
    host = torch.empty(MiB, pin_memory=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(gpu.d2h_stream):
        torch.cuda._sleep(SLEEP)                               # delay the D2H stream
    out = gpu.copy_out(x, host)
    back = gpu.copy_in(host, after=out)
    y = back.wait_on_current() + 1.0
    assert gpu.stats().host_waits == 0 and not out.done()
    torch.cuda.synchronize()
    assert bool((y == 4.0).all())


@cuda
def test_cuda_source_is_kept_alive_until_the_copy_completes(gpu):
    """Rule 3: dropping the last user reference to `src` while its copy is queued does not free its block."""
    src = torch.full((4 * MiB,), 5.0, device=gpu.torch_device)
    ptr = src.data_ptr()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)                                   # the copy waits behind this (rule 1)
    host = torch.empty(src.shape, pin_memory=True)
    h = gpu.copy_out(src, host)
    del src
    other = torch.full((4 * MiB,), 9.0, device=gpu.torch_device)
    assert other.data_ptr() != ptr                             # the handle still holds src's block
    h.wait()
    assert bool((host == 5.0).all())


@cuda
def test_cuda_wait_on_current_orders_compute_after_h2d_without_host_sync(gpu):
    """Rules 6-7: the compute stream, not the host, waits for the prefetch."""
    host = torch.full((MiB,), 3.0).pin_memory()
    torch.cuda.synchronize()
    with torch.cuda.stream(gpu.h2d_stream):
        torch.cuda._sleep(SLEEP)                               # delay the H2D stream
    t0 = time.perf_counter()
    h = gpu.copy_in(host)
    y = h.wait_on_current() * 2.0                              # queued on compute behind the copy
    assert time.perf_counter() - t0 < 0.2 and not h.done()     # the host did not block
    torch.cuda.synchronize()
    assert bool((y == 6.0).all()) and h.done()
    assert gpu.stats().host_waits == 0                         # torch.cuda.synchronize() is not ours
    gpu.synchronize()
    assert gpu.stats().host_waits == 1


@cuda
def test_cuda_prefetched_block_goes_back_to_the_compute_pool(gpu):
    """Rule 5: a prefetched tensor is allocated on the compute stream, so once freed its block is
    reused by compute (reserved memory does not grow with every prefetch)."""
    host = torch.full((4 * MiB,), 2.0).pin_memory()
    torch.cuda.synchronize()
    t = gpu.copy_in(host).wait_on_current()
    total = t.sum()
    ptr = t.data_ptr()
    del t
    reserved = torch.cuda.memory_reserved()
    again = torch.empty(4 * MiB, device=gpu.torch_device)      # a compute-stream allocation
    assert again.data_ptr() == ptr and torch.cuda.memory_reserved() == reserved
    torch.cuda.synchronize()
    assert total.item() == 8.0 * MiB


@cuda
def test_cuda_given_destination_is_ordered_after_compute(gpu):
    dst = torch.zeros(MiB, device=gpu.torch_device)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    dst.fill_(1.0)                                             # pending compute write to dst
    h = gpu.copy_in(torch.full((MiB,), 4.0).pin_memory(), dst)
    h.wait_on_current()
    torch.cuda.synchronize()
    assert bool((dst == 4.0).all())                            # the copy came after the fill


@cuda
def test_cuda_pool_buffers_are_pinned(gpu):
    pool = HostPool(None, gpu, slab_bytes=MiB)
    buf = pool.acquire(3 * MiB)
    assert gpu.is_pinned(buf.data) and pool.stats().bytes_allocated == 4 * MiB
    x = torch.randn(3 * MiB // 4, device=gpu.torch_device)
    h = gpu.copy_out(x, buf.view(torch.float32, x.shape))
    pool.release(buf, after=h)
    h.wait()
    assert pool.acquire(3 * MiB) is buf

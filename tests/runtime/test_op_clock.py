"""The profiler's op clocks (runtime/op_clock.py): host time, and device events read after the step."""

from types import SimpleNamespace

import torch

from slackswap_ds.runtime.op_clock import EventClock, WallClock, clock_for


class FakeDevice:
    """A device queue: `run(s)` queues s seconds of kernels; an event records the queue's end time,
    known (like a real event's) only once the device is synchronized."""

    def __init__(self):
        self.queued_until, self.synced, self.syncs = 0.0, False, 0

    def run(self, seconds: float) -> None:
        self.queued_until += seconds
        self.synced = False

    def synchronize(self) -> None:
        self.syncs += 1
        self.synced = True

    def event(self):
        device = self

        class Event:
            def record(self):
                self.at, self.device = device.queued_until, device

            def elapsed_time(self, end) -> float:
                assert device.synced, "read before the device was synchronized"
                return (end.at - self.at) * 1e3  # ms, as torch's
        return Event()


def test_event_clock_adds_each_ops_device_time_after_the_step_with_one_synchronization():
    gpu = FakeDevice()
    clock = EventClock(gpu.event, gpu.synchronize)
    a, b = SimpleNamespace(fwd_s=0.0, bwd_s=0.0), SimpleNamespace(fwd_s=0.0, bwd_s=0.0)
    for op, seconds in ((a, 0.25), (b, 0.5)):
        start = clock.mark()
        gpu.run(seconds)
        clock.add(op, "fwd_s", start)
    start = clock.mark()
    gpu.run(0.125)
    end = clock.mark()
    gpu.run(1.0)  # (queued after the end mark: not the op's)
    clock.add(a, "bwd_s", start, end)
    clock.add(a, "bwd_s", start, end)  # two backward kernels of one op add up
    assert (a.fwd_s, b.fwd_s, gpu.syncs) == (0.0, 0.0, 0)  # nothing read, nothing synchronized inside the step
    clock.settle()
    assert (a.fwd_s, b.fwd_s, a.bwd_s, gpu.syncs) == (0.25, 0.5, 0.25, 1)
    clock.settle()  # nothing pending: no second synchronization, nothing added twice
    assert (a.fwd_s, a.bwd_s, gpu.syncs) == (0.25, 0.25, 1)


def test_event_clock_elapsed_is_read_at_once():
    gpu = FakeDevice()
    clock = EventClock(gpu.event, gpu.synchronize)
    start = clock.mark()
    gpu.run(0.75)
    assert clock.elapsed(start) == 0.75 and gpu.syncs == 1


def test_wall_clock_adds_host_time_at_once():
    ticks = iter([1.0, 3.5, 10.0, 12.0])
    clock = WallClock(lambda: next(ticks))
    op = SimpleNamespace(fwd_s=0.5)
    start = clock.mark()
    clock.add(op, "fwd_s", start)
    assert op.fwd_s == 3.0
    assert clock.elapsed(clock.mark()) == 2.0
    clock.settle()
    assert op.fwd_s == 3.0


def test_the_clock_for_a_device():
    assert isinstance(clock_for(torch.device("cpu")), WallClock)
    fake = clock_for(torch.device("cuda"), timer=lambda: 0.0)  # a given timer wins, on any device
    assert isinstance(fake, WallClock)
    assert isinstance(clock_for(torch.device("cuda")), EventClock)  # (built without touching CUDA)

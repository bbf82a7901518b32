"""DeviceWaiter: sleeps through the expected part of a wait, never returns before the event."""

from __future__ import annotations

import time

import pytest

from roofline.worker.device_wait import DeviceWaiter


class FakeEvent:
    """Fires ``delay_s`` after it is made; ``synchronize`` spins like cudaEventSynchronize."""

    def __init__(self, delay_s: float) -> None:
        self.fire_at = time.perf_counter() + delay_s
        self.spun = False

    def query(self) -> bool:
        return time.perf_counter() >= self.fire_at

    def synchronize(self) -> None:
        self.spun = True
        while not self.query():
            pass


def test_first_wait_spins_then_sleeps_most_of_a_steady_wait() -> None:
    waiter = DeviceWaiter()
    first = FakeEvent(0.02)
    waiter.wait(first, 256)
    assert first.query() and first.spun and waiter.slept_s == 0.0
    for _ in range(20):
        event = FakeEvent(0.02)
        waiter.wait(event, 256)
        assert event.query()  # never back before the event fired
    # once learned, most of each 20 ms wait is slept (the default spins at most 15% + 0.3 ms)
    assert waiter.slept_s > 0.3 * 19 * 0.02


def test_faster_step_overslept_once_then_estimate_shrinks() -> None:
    waiter = DeviceWaiter()
    for _ in range(25):
        waiter.wait(FakeEvent(0.02), 100)
    learned = waiter._expected_s[waiter.bucket(100)]
    assert learned > 0.01
    fast = FakeEvent(0.001)
    waiter.wait(fast, 100)
    assert fast.query() and waiter.num_overslept >= 1
    assert waiter._expected_s[waiter.bucket(100)] < learned


def test_buckets_are_separate_and_ready_events_return_at_once() -> None:
    waiter = DeviceWaiter()
    for _ in range(10):
        waiter.wait(FakeEvent(0.01), 1)
    slept = waiter.slept_s
    prefill = FakeEvent(0.005)
    waiter.wait(prefill, 8192)  # a new size: no estimate yet, so it spins
    assert prefill.spun and waiter.slept_s == slept
    done = FakeEvent(0.0)
    waiter.wait(done, 1)  # ready already: neither a sleep nor a spin
    assert waiter.slept_s == slept and not done.spun
    assert DeviceWaiter.bucket(1) == 1 and DeviceWaiter.bucket(256) == 256
    assert DeviceWaiter.bucket(257) == 512


def test_pinned_sleep_holds_the_thread_on_its_cpu_and_restores_the_affinity(monkeypatch) -> None:
    import os
    import time

    from roofline.worker import device_wait

    if not hasattr(os, "sched_setaffinity") or device_wait._current_cpu() is None:
        pytest.skip("no sched_setaffinity / sched_getcpu here")
    allowed = os.sched_getaffinity(0)
    during = []
    monkeypatch.setattr(time, "sleep", lambda s: during.append(os.sched_getaffinity(0)))
    device_wait.pinned_sleep(0.001)
    assert during and (len(during[0]) == 1 or len(allowed) == 1) and during[0] <= allowed
    assert os.sched_getaffinity(0) == allowed

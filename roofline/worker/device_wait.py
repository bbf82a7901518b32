"""Waiting for a launched step's sampled ids without spinning a core through the whole step.

``cudaEventSynchronize`` under the default scheduling flags spins the calling thread until the
event fires, so an engine whose host work takes 2 ms of a 10 ms step shows 100% of a core busy
(the serving engine core did, at ~64 requests in flight). A blocking-sync event sleeps instead,
but the wake-up comes late by tens of microseconds every step, which batch-1 decode cannot
afford. :class:`DeviceWaiter` does both: it sleeps through the part of the wait it expects with
confidence and spins only over the last part. The expected wait is a moving average kept per
step size (token count rounded up to a power of two: a long prefill chunk and a decode step
wait very differently), measured exactly whenever the spin catches the event firing. When a
sleep overshoots (the event had already fired on waking) the estimate shrinks, so a step that
got faster costs at most one late wake-up before the sleeps shorten.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Protocol


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceWaiter:
    """Sleep-then-spin waits on CUDA events, one estimate per step-size bucket."""

    def __init__(
        self,
        min_sleep_s: float = 0.001,
        spin_fraction: float = 0.15,
        min_spin_s: float = 0.0003,
        smoothing: float = 0.2,
        pin_sleeps: bool = True,
    ) -> None:
        self.min_sleep_s = min_sleep_s
        """Waits expected shorter than this (after the spin margin) are spun through."""
        self.spin_fraction = spin_fraction
        self.min_spin_s = min_spin_s
        """The spun tail of a wait: ``max(min_spin_s, spin_fraction * expected)``."""
        self.smoothing = smoothing
        self.pin_sleeps = pin_sleeps
        """Sleep on the CPU the thread runs on (``pinned_sleep``): it wakes with warm caches."""
        self._expected_s: dict[int, float] = {}
        self.slept_s = 0.0
        """Seconds slept in all (instead of spinning): what the waiter saved the host."""
        self.num_overslept = 0
        """Waits whose sleep ended after the event had fired (each cost a late wake-up)."""

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return 1 << max(num_tokens - 1, 0).bit_length()

    def wait(self, event: _Event, num_tokens: int) -> None:
        """Return once ``event`` has fired (a step of ``num_tokens`` rows launched it)."""
        if event.query():
            return  # the device finished first: nothing learned about how long it takes
        key = self.bucket(num_tokens)
        expected = self._expected_s.get(key, 0.0)
        t0 = time.perf_counter()
        sleep_s = expected - max(self.min_spin_s, self.spin_fraction * expected)
        if sleep_s >= self.min_sleep_s:
            if self.pin_sleeps:
                pinned_sleep(sleep_s)
            else:
                time.sleep(sleep_s)
            self.slept_s += sleep_s
            if event.query():  # overslept: the wait was shorter than expected; shrink it
                self.num_overslept += 1
                self._expected_s[key] = expected * (1.0 - self.smoothing) ** 2
                return
        event.synchronize()
        waited = time.perf_counter() - t0  # exact: the spin saw the event fire
        self._expected_s[key] = expected + self.smoothing * (waited - expected)


_SCHED_GETCPU = None
"""libc's ``sched_getcpu`` once looked up (False where there is none)."""


def _current_cpu() -> int | None:
    """The CPU the calling thread runs on (Linux ``sched_getcpu``), or None."""
    global _SCHED_GETCPU
    if _SCHED_GETCPU is None:
        try:
            _SCHED_GETCPU = ctypes.CDLL(None).sched_getcpu
        except (OSError, AttributeError):
            _SCHED_GETCPU = False
    return int(_SCHED_GETCPU()) if _SCHED_GETCPU else None


def pinned_sleep(seconds: float) -> None:
    """``time.sleep`` with the calling thread held on the CPU it runs on (Linux; elsewhere a
    plain sleep). A thread woken from a sleep may land on another core, its caches cold: on the
    H100's host, the engine's host work per decode step at 256 running took 2.46 ms spinning,
    3.75 ms sleeping and 3.08 ms sleeping on one core (``scripts/gpu_presets.py``). Only the
    sleep is pinned: threads the caller starts afterwards (grammar pools) keep every CPU."""
    cpu = _current_cpu() if hasattr(os, "sched_setaffinity") else None
    allowed = os.sched_getaffinity(0) if cpu is not None else None
    if cpu is None or len(allowed) < 2 or cpu not in allowed:  # type: ignore[arg-type]
        time.sleep(seconds)
        return
    os.sched_setaffinity(0, (cpu,))
    try:
        time.sleep(seconds)
    finally:
        os.sched_setaffinity(0, allowed)  # type: ignore[arg-type]

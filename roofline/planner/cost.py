"""Serving cost and batching efficiency.

Cost per million tokens is the price of the GPUs for the time a million tokens take:
``price_per_gpu_hour x num_gpus / 3600 / tokens_per_s x 1e6``. Batching waste counts decode
slot-steps that carry no token: a static batch runs until its longest request ends, so every
shorter request leaves its slot idle; continuous batching hands a freed slot to the next request
at once and idles only in the tail, when the queue is empty.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


def cost_per_million_tokens(
    price_per_gpu_hour: float, tokens_per_s: float, num_gpus: int = 1
) -> float:
    """Dollars (or any currency) per 1e6 tokens at a sustained throughput."""
    if tokens_per_s <= 0 or price_per_gpu_hour < 0 or num_gpus <= 0:
        raise ValueError("throughput and GPU count must be positive, price non-negative")
    return price_per_gpu_hour * num_gpus / 3600.0 / tokens_per_s * 1e6


@dataclass(frozen=True)
class BatchingWaste:
    num_steps: int
    """Decode steps until every request is done."""
    useful_slot_steps: int
    total_slot_steps: int

    @property
    def waste_fraction(self) -> float:
        return (
            1.0 - self.useful_slot_steps / self.total_slot_steps if self.total_slot_steps else 0.0
        )

    @property
    def utilization(self) -> float:
        return 1.0 - self.waste_fraction


def _check(lengths: list[int], batch_size: int) -> None:
    if batch_size <= 0:
        raise ValueError("batch_size must be positive")
    if not lengths or min(lengths) <= 0:
        raise ValueError("lengths must be a non-empty list of positive token counts")


def static_batching_waste(lengths: list[int], batch_size: int) -> BatchingWaste:
    """Requests taken ``batch_size`` at a time in order; each batch runs ``max(len)`` steps with
    ``batch_size`` slots reserved (the last, partial batch reserves only what it holds)."""
    _check(lengths, batch_size)
    steps = total = 0
    for i in range(0, len(lengths), batch_size):
        batch = lengths[i : i + batch_size]
        steps += max(batch)
        total += len(batch) * max(batch)
    return BatchingWaste(steps, sum(lengths), total)


def continuous_batching_waste(lengths: list[int], batch_size: int) -> BatchingWaste:
    """Each request starts in the first slot that frees (in order); slots are reserved until
    the last request ends."""
    _check(lengths, batch_size)
    free_at = [0] * min(batch_size, len(lengths))
    heapq.heapify(free_at)
    end = 0
    for n in lengths:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + n)
        end = max(end, start + n)
    return BatchingWaste(end, sum(lengths), end * len(free_at))

"""The all-reduce cost model shared by the engine's choice of transport and the planner.

Two algorithms, as the engine runs them on GPUs of one host: messages up to ``ONE_SHOT_MAX_BYTES``
take the one-shot custom all-reduce (each rank reads the ``p - 1`` peers' buffers: one hop,
``(p - 1) n`` bytes over its link), larger ones NCCL's ring (``2 (p - 1)`` hops, each moving
``n / p`` bytes: ``2 (p - 1) / p * n`` bytes per link). Both in the alpha-beta form, with the
link's bandwidth and latency from the planner's ``GPUSpec``. No torch here (the planner and the
simulator import it).
"""

from __future__ import annotations

ONE_SHOT_MAX_BYTES = 256 * 1024
"""Largest message the engine all-reduces one-shot (``custom_allreduce.MAX_BYTES``). Measured on
two H200s inside CUDA graphs (bf16, BENCHMARKS.md): one-shot 8.9 / 9.5 / 9.2 / 13.6 us against
NCCL's 43.7 / 9.5 / 12.6 / 12.1 us at 8 / 32 / 128 / 512 KB, so the crossover lies between
128 and 512 KB."""


def ring_allreduce_s(
    num_bytes: float, num_ranks: int, bw_bytes_per_s: float, hop_s: float
) -> float:
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    steps = 2 * (num_ranks - 1)
    return steps / num_ranks * num_bytes / bw_bytes_per_s + steps * hop_s


def one_shot_allreduce_s(
    num_bytes: float, num_ranks: int, bw_bytes_per_s: float, hop_s: float
) -> float:
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    return (num_ranks - 1) * num_bytes / bw_bytes_per_s + 2 * hop_s  # write-signal, then read


def allreduce_s(num_bytes: float, num_ranks: int, bw_bytes_per_s: float, hop_s: float) -> float:
    """What the engine's all-reduce of ``num_bytes`` costs: one-shot up to the threshold."""
    if num_bytes <= ONE_SHOT_MAX_BYTES:
        return one_shot_allreduce_s(num_bytes, num_ranks, bw_bytes_per_s, hop_s)
    return ring_allreduce_s(num_bytes, num_ranks, bw_bytes_per_s, hop_s)

"""The machine's own ceilings, measured in the same run as the benchmark they judge: memory
bandwidth (a large device-to-device copy) and the matmul rate (a large square GEMM). Every
benchmark divides its figures by these, so a roofline percentage never rests on a datasheet.

The matmul rate is a burst (ten synchronised GEMMs, ~15 ms of work), the stricter ceiling for
long compute-bound steps: on an H100 SXM it ran at 1,980 MHz, while GEMMs back to back for 2 s
reach the 700 W cap and fall to a median ~1,420 MHz, 695-698 TFLOP/s against a burst of 743-768
(``scripts/gpu_clocks.py``, 2026-11-24, BENCHMARKS.md)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roofline.planner.hardware import GPUSpec, custom_gpu


@dataclass(frozen=True)
class Ceilings:
    device_name: str
    bandwidth_bytes_per_s: float
    """Copy bandwidth: (bytes read + bytes written) / time."""
    matmul_flops_per_s: float
    matmul_dtype: str

    def as_gpu_spec(self) -> GPUSpec:
        """The planner's hardware description built from these measurements (the model's
        compute dtype is assumed to be the one measured)."""
        flops = self.matmul_flops_per_s
        if self.matmul_dtype == "float32":
            flops *= 2  # GPUSpec derives the fp32 rate as half of its 16-bit figure
        return custom_gpu(self.device_name, 1.0, self.bandwidth_bytes_per_s / 1e9, flops / 1e12)


def time_fn(
    fn: Callable[[], object], device: torch.device, iters: int = 10, warmup: int = 3
) -> float:
    """Median seconds of ``fn`` (CUDA events on the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device) -> float:
    numel = (1 << 30) // 4 if device.type == "cuda" else (256 << 20) // 4
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, iters=20 if device.type == "cuda" else 5)
    return 2 * src.numel() * 4 / seconds


def measure_matmul(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1536
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = time_fn(lambda: a @ b, device, iters=10 if device.type == "cuda" else 3)
    return 2 * n**3 / seconds


def measure(device: torch.device, dtype: torch.dtype) -> Ceilings:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return Ceilings(
        device_name=name,
        bandwidth_bytes_per_s=measure_bandwidth(device),
        matmul_flops_per_s=measure_matmul(device, dtype),
        matmul_dtype=str(dtype).removeprefix("torch."),
    )

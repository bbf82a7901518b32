"""Probes of one 8192-token prefill through the whole model, for ``scripts/gpu_prefill.py``
(imported by it, not run alone): the step with the attention launch skipped (the floor any
attention kernel adds to), the host's pieces before and around the step's kernels, and the
device's idle time between consecutive kernels."""

from __future__ import annotations

import collections
import time

import torch
from gpu_startup_prefill import SUMMARY, timed_generate


def attention_floor(llm, fresh, flops: float, rate: float) -> None:  # noqa: ANN001
    """The 8192 prefill with the prefill attention launch skipped (its output left as
    allocated; tokens meaningless): what the rest of the step costs, the floor any attention
    kernel adds to."""
    from roofline.attention import split_backend, triton_backend

    saved = split_backend.prefill_attention, triton_backend.prefill_attention

    def skip(q, *args, out=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return torch.empty_like(q) if out is None else out

    split_backend.prefill_attention = triton_backend.prefill_attention = skip
    try:
        timed_generate(llm, fresh, 1)
        t = timed_generate(llm, fresh, 3)
    finally:
        split_backend.prefill_attention, triton_backend.prefill_attention = saved
    pct = 100 * flops / t / rate
    print(f"  8192-token prefill with the attention launch skipped: {t * 1e3:.1f} ms ({pct:.1f}% "
          "of matmul counting attention's FLOPs)", flush=True)  # fmt: skip
    SUMMARY.append(("8B prefill 8192, attention skipped (the floor)", f"{t * 1e3:.1f} ms"))


def host_phases(llm, prompt: list[int]) -> None:  # noqa: ANN001
    """Host milliseconds of one generate's pieces before and around its step's kernels
    (wrappers on the engine's own methods), and when the first device work was queued."""
    from roofline import SamplingParams
    from roofline.core.scheduler import Scheduler
    from roofline.engine.llm_engine import LLMEngine
    from roofline.worker import host_batch, model_runner
    from roofline.worker.graph_mode import MixedStepPath
    from roofline.worker.model_runner import ModelRunner

    spent: dict[str, float] = collections.defaultdict(float)
    patches = []

    def timed(owner, name: str, label: str) -> None:  # noqa: ANN001
        original = getattr(owner, name)

        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t

        patches.append((owner, name, vars(owner)[name]))  # the raw attribute (classmethods)
        setattr(owner, name, wrapper)

    timed(LLMEngine, "add_request", "add_request (validate, hash)")
    timed(Scheduler, "schedule", "scheduler.schedule")
    timed(host_batch.HostBatch, "build", "HostBatch.build")
    timed(model_runner, "upload", "upload (lists -> pinned -> device)")
    timed(MixedStepPath, "plan", "mixed plan")
    timed(ModelRunner, "launch_batch", "launch_batch (all of it)")
    timed(type(llm.llm_engine.runner.model), "forward", "model forward (host launches)")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
    wall = time.perf_counter() - t0
    parts = "; ".join(f"{k} {v * 1e3:.2f}" for k, v in spent.items())
    print(f"  host pieces of one 8192 generate (wall {wall * 1e3:.1f} ms): {parts}", flush=True)


def device_gaps(llm, prompt: list[int], label: str = "device", top_n: int = 6) -> None:  # noqa: ANN001
    """The device's idle time between consecutive kernels of one generate, by the kernel each
    gap follows (profiler timestamps), with the device time of that kernel."""
    from torch.profiler import ProfilerActivity, profile

    from roofline import SamplingParams

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    if not spans:
        print("  (no device events)")
        return
    by_prev: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    busy = idle = 0.0
    end = spans[0][0]
    prev = "(start)"
    for start, stop, name in spans:
        gap = max(0.0, start - end)
        idle += gap
        by_prev[prev][0] += 1
        by_prev[prev][1] += gap
        by_prev[name][2] += stop - start
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        prev = name
    span = spans[-1][1] - spans[0][0]
    print(f"  {label}: first kernel to last {span / 1e3:.1f} ms = busy {busy / 1e3:.1f} + idle "
          f"{idle / 1e3:.1f} ms over {len(spans)} kernels", flush=True)  # fmt: skip
    top = sorted(by_prev.items(), key=lambda kv: -kv[1][1])[:top_n]
    print("  idle after (count, ms; the kernel's own ms): " + "; ".join(
        f"{n} x{c} {g / 1e3:.2f} ({own / 1e3:.2f})" for n, (c, g, own) in top))  # fmt: skip
    SUMMARY.append(("8192 prefill device idle between kernels", f"{idle / 1e3:.1f} ms of "
                                                               f"{span / 1e3:.1f}"))  # fmt: skip

"""Where the cuDNN prefill path's time goes between kernels: one 8192-token fresh prefill of
the dummy Llama-3.1-8B with the path on and off, the device's idle time between consecutive
kernels by the kernel each gap follows (profiler timestamps), and the step's wall time.
Run from the repo root: ``PYTHONPATH=.:scripts python scripts/gpu_sdpa_gaps.py`` (~1 min)."""

from __future__ import annotations

import collections

import gpu_prefill as gp
import torch
from gpu_startup_prefill import timed_generate

from roofline import LLM, SamplingParams
from roofline.attention import sdpa_prefill as sp  # noqa: F401


def gaps(llm, prompt: list[int], label: str) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:48]) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    by_prev: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    busy = idle = 0.0
    end, prev = spans[0][0], "(start)"
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
    print(f"{label}: first kernel to last {span / 1e3:.1f} ms = busy {busy / 1e3:.1f} + idle "
          f"{idle / 1e3:.1f} ms over {len(spans)} kernels", flush=True)  # fmt: skip
    for n, (c, g, own) in sorted(by_prev.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"    idle after {n:<48} x{c:<4} {g / 1e3:7.2f} ms (own {own / 1e3:7.2f} ms)")


def main() -> None:
    llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **gp.PRESET_KW)
    backend = llm.llm_engine.runner.backend
    base = list(range(100, 100 + 8192))
    count = iter(range(5, 100000))

    def fresh(i: int) -> list[int]:
        llm.llm_engine.kv_manager.reset_prefix_cache()
        return [next(count)] + base[1:]

    for on in (True, False, True):
        backend.sdpa_prefill.enabled = on
        timed_generate(llm, fresh, 2)
        t = timed_generate(llm, fresh, 5)
        print(f"path {'on' if on else 'off'}: 8192 prefill {t * 1e3:.1f} ms", flush=True)
        gaps(llm, fresh(0), f"path {'on' if on else 'off'}")


if __name__ == "__main__":
    main()

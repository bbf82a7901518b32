"""Where the cuDNN prefill path's time goes between kernels: one 8192-token fresh prefill of
the dummy Llama-3.1-8B with the path on and off, the device's idle time between consecutive
kernels by the kernel each gap follows (profiler timestamps), and the step's wall time.
Run from the repo root: ``PYTHONPATH=.:scripts python scripts/gpu_sdpa_gaps.py`` (~1 min)."""

from __future__ import annotations

import gpu_prefill as gp
from gpu_prefill_probes import device_gaps
from gpu_startup_prefill import timed_generate

from roofline import LLM


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
        device_gaps(llm, fresh(0), f"path {'on' if on else 'off'}", top_n=10)


if __name__ == "__main__":
    main()

"""The grouped cascade's two kernels at the shared-prefix preset's decode shape (B = 256, prefix
2,000, suffix 128, Llama-3.1-8B heads) for Nsight Compute: after warm-up, the prefix pass and
the suffix pass each run once between ``cudaProfilerStart`` / ``Stop``, so that

    ncu --clock-control none --profile-from-start off --set full python scripts/gpu_ncu_cascade.py

profiles exactly those two launches (stall reasons, pipe use, L2 / DRAM traffic). Without ncu
it prints each pass's time (CUDA events, median of 50) and the pair's.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_ncu_wo import timed  # noqa: E402
from gpu_presets import shared_batch  # noqa: E402
from gpu_shared_prefix import grouped  # noqa: E402

from roofline.kernels.cascade_grouped import GroupedTuning  # noqa: E402


def main() -> None:
    b = shared_batch(256, 2000, 128)
    t = GroupedTuning()
    for passes in ("prefix", "suffix", "both"):
        for _ in range(3):
            grouped(b, t, passes)
    torch.cuda.synchronize()
    if os.environ.get("NCU") == "1":
        torch.cuda.cudart().cudaProfilerStart()
        grouped(b, t, "prefix")
        torch.cuda.synchronize()
        grouped(b, t, "suffix")
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    for passes in ("prefix", "suffix", "both"):
        print(f"{passes:7s} {timed(lambda p=passes: grouped(b, t, p)):7.1f} us (eager, events)")


if __name__ == "__main__":
    main()

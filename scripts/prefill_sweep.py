"""Tile sweep of the paged prefill attention kernel on one 8192-token causal prompt
(32 query / 8 KV heads, head dim 128, bf16, page size 16), beside PyTorch SDPA on contiguous
K/V. Prints TFLOP/s per (BLOCK_M, BLOCK_N, warps, stages), best first.

    python scripts/prefill_sweep.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roofline.kernels.prefill_attention import causal_attention_flops, prefill_attention

CONFIGS = [
    (128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 4, 3),
    (128, 64, 8, 4), (128, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4),
    (128, 32, 4, 4), (64, 32, 4, 4),
]  # fmt: skip


def timed(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def main() -> None:
    n, h, hk, d, ps = 8192, 32, 8, 128, 16
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(n, h, d, device=dev, dtype=dt)
    k = torch.randn(n, hk, d, device=dev, dtype=dt)
    v = torch.randn(n, hk, d, device=dev, dtype=dt)
    pages = torch.randperm(n // ps, device=dev, dtype=torch.int32)
    k_cache = torch.empty(n // ps, ps, hk, d, device=dev, dtype=dt)
    v_cache = torch.empty_like(k_cache)
    k_cache[pages.long()] = k.view(n // ps, ps, hk, d)
    v_cache[pages.long()] = v.view(n // ps, ps, hk, d)
    bt = pages[None]
    qsl = torch.tensor([0, n], device=dev, dtype=torch.int32)
    sl = torch.tensor([n], device=dev, dtype=torch.int32)
    flops = causal_attention_flops([n], [n], h, d)
    scale = d**-0.5
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(h // hk, 1).transpose(0, 1)[None],
        v.repeat_interleave(h // hk, 1).transpose(0, 1)[None], is_causal=True,
    )[0].transpose(0, 1)  # fmt: skip
    rows = []
    for bm, bn, w, st in CONFIGS:
        cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        try:
            out = prefill_attention(q, k_cache, v_cache, bt, qsl, sl, scale, n, **cfg)
            err = (out.float() - ref.float()).abs().max().item()
            t = timed(
                lambda cfg=cfg: prefill_attention(q, k_cache, v_cache, bt, qsl, sl, scale, n, **cfg)
            )
            rows.append((flops / t / 1e12, f"{bm}x{bn} w{w} s{st}", err))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            rows.append((0.0, f"{bm}x{bn} w{w} s{st}", f"{type(e).__name__}: {e}"[:300]))
    qh = q.transpose(0, 1).contiguous()[None]  # [1, H, N, D]: SDPA's flash path wants 4-D
    kh = k.repeat_interleave(h // hk, 1).transpose(0, 1).contiguous()[None]
    vh = v.repeat_interleave(h // hk, 1).transpose(0, 1).contiguous()[None]
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))
    print(f"SDPA (contiguous K/V): {flops / t_sdpa / 1e12:.0f} TFLOP/s")
    for tf, name, err in sorted(rows, key=lambda r: -r[0]):
        print(f"{name:>16}: {tf:6.0f} TFLOP/s  max err {err}")


if __name__ == "__main__":
    main()

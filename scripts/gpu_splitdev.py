"""H100 check of the device-side split length of the split-K decode attention (one call).

``roofline bench latency --model llama-3.1-8b`` without ``--max-model-len`` measured 164.2 tok/s
at batch 1 (6.09 ms a step) where ``--max-model-len 8448`` gives 5.58-5.71 ms: the decode graphs
are captured with ``max_seq_len = max_model_len``, so at 131,072 each split of the 8B's split-K
kernel (``UNFUSED_FASTER`` keeps it on the unfused path) is 2,048 tokens long and a 512-768 token
context runs in one program per KV head. ``kernels.decode_attention.DEVICE_SPLIT`` takes each
request's split length from its own context on the device.

For ``max_model_len`` 8,448 and 131,072, with ``DEVICE_SPLIT`` off (today) and on, one engine
each (Llama-3.1-8B config, random bf16 weights, CUDA graphs): the batch-1 decode step (input 512,
output 256, twice), batch 1 at a 4,096-token prompt, batches 8 and 32; the parity of the kernel
with the flag on against the torch reference first. A table last: ship ``DEVICE_SPLIT`` on if
the 131,072 rows reach the 8,448 ones and no 8,448 row is slower with it.

    python scripts/gpu_splitdev.py [--quick]        (about 2 minutes on one H100)
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import traceback

import torch

from roofline import LLM
from roofline.bench import latency
from roofline.bench.ceilings import measure
from roofline.kernels import decode_attention as da

DEVICE = "cuda"


def parity() -> None:
    """The kernel with the device split against the reference: contexts 1..9000 in one batch,
    a grid sized for 131,072 tokens, bf16, 8B head shapes."""
    torch.manual_seed(0)
    lens = [1, 100, 129, 700, 2049, 4100, 9000]
    page_size, num_kv_heads, head_dim, group = 16, 8, 128, 4
    pages_per_req = -(-max(lens) // page_size)
    num_pages = pages_per_req * len(lens)
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    block_table = torch.randperm(num_pages, device=DEVICE).int().view(len(lens), pages_per_req)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEVICE).bfloat16()
    scale = head_dim**-0.5
    ref = da.decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale).float()
    for on in (False, True):
        da.set_device_split(on)
        out = da.decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len=131072, num_splits=64
        )
        err = (out.float() - ref).abs().max().item()
        print(f"parity device_split={on}: max abs diff {err:.2e} {'ok' if err < 2e-2 else 'BAD'}")
    da.set_device_split(False)


def engine_rows(max_model_len: int, device_split: bool, ceil, quick: bool) -> dict[str, float]:
    da.set_device_split(device_split)
    llm = None
    try:
        t0 = time.perf_counter()
        llm = LLM(
            "llama-3.1-8b", load_format="dummy", device=DEVICE, max_model_len=max_model_len,
            max_num_seqs=32, gpu_memory_utilization=0.55,
        )  # fmt: skip
        torch.cuda.synchronize()
        startup = time.perf_counter() - t0
        eng = llm.llm_engine
        rows = latency.run(eng, ceil, [1, 1] if quick else [1, 1, 8, 32], 512, 256)
        long = latency.run(eng, ceil, [1], 4096, 128)
        print(latency.format_rows(rows + long), flush=True)
        out = {"b1": min(r.step_ms_p50 for r in rows if r.batch_size == 1)}
        out.update({f"b{r.batch_size}": r.step_ms_p50 for r in rows if r.batch_size > 1})
        out["b1@4k"] = long[0].step_ms_p50
        out["b1_tok_s"] = 1e3 / out["b1"]
        out["b1_pct"] = max(r.roofline_pct for r in rows if r.batch_size == 1)
        out["startup_s"] = startup
        return out
    finally:
        da.set_device_split(False)
        llm = None
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 only")
    ap.add_argument("--one", nargs=2, metavar=("MAX_MODEL_LEN", "ON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # one engine in this process (a finished engine's memory is not given back)
        mml, on = int(args.one[0]), args.one[1] == "1"
        ceil = measure(torch.device(DEVICE), torch.bfloat16)
        print("RESULT " + json.dumps(engine_rows(mml, on, ceil, args.quick)), flush=True)
        return
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    try:
        parity()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    results: dict[tuple[int, bool], dict[str, float]] = {}
    for max_model_len in (8448, 131072):
        for on in (False, True):
            print(f"=== max_model_len {max_model_len}, device split {on}", flush=True)
            cmd = [sys.executable, __file__, "--one", str(max_model_len), "1" if on else "0"]
            cmd += ["--quick"] if args.quick else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    results[max_model_len, on] = json.loads(line[7:])
                else:
                    print(line, flush=True)
            if proc.returncode:
                print(proc.stderr[-3000:], flush=True)
    print("\nmax_model_len device_split  b1 ms  b1 tok/s  % roof  b1@4k ms  b8 ms  b32 ms  start s")
    for (mml, on), r in results.items():
        print(f"{mml:>13} {str(on):>12} {r['b1']:6.3f} {r['b1_tok_s']:9.1f} {r['b1_pct']:6.1f}% "
              f"{r['b1@4k']:9.3f} {r.get('b8', float('nan')):6.2f} "
              f"{r.get('b32', float('nan')):7.2f} {r['startup_s']:8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

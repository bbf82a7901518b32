"""Tensor parallelism on the GPU: parity and cost of the worker path, then (with 2+ GPUs) the
TP = 2 speedup and the custom all-reduce against NCCL. Prints a short table last.

    python scripts/gpu_tp.py [--quick]

1. TP = 1 through the worker path (``distributed_executor_backend="mp"``: one worker process,
   the step sent as a message) against today's in-process runner, Qwen3-0.6B on random weights
   written as safetensors: identical greedy tokens, batch-1 decode step time and offline
   throughput (target: within 2%).
2. With 2+ GPUs: all-reduce of 8 KB .. 1 MB bf16 between 2 ranks, the one-shot custom kernel vs
   NCCL, checked for the exact sum, timed eagerly and inside a CUDA graph; Llama-3.1-8B batch-1
   decode and Qwen3-0.6B offline throughput at TP = 2 vs TP = 1.
NVLink multicast stays off (the workers set NCCL_NVLS_ENABLE=0 etc.; so does this script).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

for _k, _v in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ[_k] = _v

import torch  # noqa: E402

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.bench import latency, throughput, workloads  # noqa: E402
from roofline.bench.ceilings import measure  # noqa: E402
from roofline.models.weights import MODEL_CONFIGS_DIR  # noqa: E402

ROWS: list[tuple[str, str]] = []


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name}: {value}", flush=True)


def write_checkpoint(short: str, folder: Path) -> Path:
    """Random bf16 weights of a bundled config as one safetensors file (both paths load it)."""
    from safetensors.torch import save_file

    from roofline.config import ModelConfig
    from roofline.distributed.loader import dummy_checkpoint

    cfg_path = MODEL_CONFIGS_DIR / short / "config.json"
    cfg = ModelConfig.from_json(cfg_path)
    tensors = {
        n: t.cpu().contiguous()
        for n, t in dummy_checkpoint(cfg, 0, torch.bfloat16, torch.device("cuda"))
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(cfg_path.read_text())
    return folder


def free(box: list) -> None:
    """Shut down and drop the LLM in ``box`` (the caller holds no other reference), so the
    next engine's memory budget does not count it."""
    if box:
        box.pop().llm_engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def small_workload(vocab: int, n: int) -> workloads.Workload:
    return workloads.synthetic(n, (128, 512), (256, 256), vocab)


def section_tp1(ckpt: Path, ceil, quick: bool, summary: dict) -> None:
    prompts = [[100 + i * 7 + j for j in range(40 + 10 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    results = {}
    for label, kw in (("in-process", {}), ("worker (mp)", {"distributed_executor_backend": "mp"})):
        box: list = []
        try:
            box.append(LLM(str(ckpt), device="cuda", gpu_memory_utilization=0.6, **kw))
            llm = box[0]
            toks = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            rows = latency.run(llm.llm_engine, ceil, [1], 128, 256)
            wl = small_workload(llm.llm_engine.model_config.vocab_size, 64 if quick else 256)
            res = throughput.run(llm, ceil, wl, use_tqdm=False)
            results[label] = (toks, rows[0].step_ms_p50, res.output_tok_s)
            row(f"qwen3-0.6b TP=1 {label}: bs1 step ms", f"{rows[0].step_ms_p50:.3f}")
            row(f"qwen3-0.6b TP=1 {label}: offline out tok/s", f"{res.output_tok_s:,.0f}")
        finally:
            llm = None
            free(box)
    if len(results) == 2:
        (t0, s0, r0), (t1, s1, r1) = results["in-process"], results["worker (mp)"]
        row("TP=1 worker path greedy tokens identical", str(t0 == t1))
        row("TP=1 worker path bs1 step time vs in-process", f"{100 * (s1 / s0 - 1):+.1f}%")
        row("TP=1 worker path throughput vs in-process", f"{100 * (r1 / r0 - 1):+.1f}%")
        summary["tp1"] = {"tokens_equal": t0 == t1, "bs1_ms": [s0, s1], "tok_s": [r0, r1]}


def _allreduce_rank(rank: int, world: int, port: int, sizes: list[int], queue) -> None:
    from roofline.distributed.parallel_state import init_parallel

    device = torch.device("cuda", rank)
    from roofline.distributed.custom_allreduce import CustomAllReduce

    ctx = init_parallel(rank, world, f"tcp://127.0.0.1:{port}", device)
    # the engine's threshold is 512 KB; this one covers every size measured
    ca = CustomAllReduce.create(ctx.group, device, max_bytes=max(sizes))
    out = {"custom": ca is not None, "rows": []}
    import torch.distributed as dist

    for num_bytes in sizes:
        n = num_bytes // 2
        x = torch.randn(n, device=device, dtype=torch.bfloat16, generator=None) * (rank + 1)
        ref = x.clone()
        dist.all_reduce(ref)
        r = {"bytes": num_bytes}
        for name in ("nccl", "custom"):
            if name == "custom" and (ca is None or not ca.applies(x)):
                continue

            def op(t=x, name=name):
                if name == "nccl":
                    y = t.clone()
                    dist.all_reduce(y)
                    return y
                return ca.all_reduce(t)

            got = op()
            r[f"{name}_exact"] = bool(torch.equal(got, ref)) or bool(
                torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
            )
            for _ in range(20):
                op()
            torch.cuda.synchronize()
            iters = 200
            t0 = time.perf_counter()
            for _ in range(iters):
                op()
            torch.cuda.synchronize()
            r[f"{name}_eager_us"] = 1e6 * (time.perf_counter() - t0) / iters
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                op()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                outs = [op() for _ in range(50)]
            g.replay()
            torch.cuda.synchronize()
            # back-to-back reductions through one staging buffer: every result must hold
            r[f"{name}_graph_exact"] = all(
                torch.allclose(o.float(), ref.float(), rtol=1e-2, atol=1e-2) for o in outs
            )
            t0 = time.perf_counter()
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            r[f"{name}_graph_us"] = 1e6 * (time.perf_counter() - t0) / 500
        out["rows"].append(r)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def section_allreduce(summary: dict) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, 2, port, sizes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get(timeout=180)
    for p in procs:
        p.join(30)
    row("custom all-reduce available", str(out["custom"]))
    for r in out["rows"]:
        kb = r["bytes"] >> 10
        for name in ("nccl", "custom"):
            if f"{name}_eager_us" in r:
                row(
                    f"all-reduce {kb} KB {name}",
                    f"eager {r[f'{name}_eager_us']:.1f} us, graph {r[f'{name}_graph_us']:.1f} us, "
                    f"sum ok {r[f'{name}_exact']} / in graph {r[f'{name}_graph_exact']}",
                )
    summary["allreduce"] = out


def section_tp2(ckpt: Path, ceil, quick: bool, summary: dict) -> None:
    prompts = [[100 + i * 7 + j for j in range(40 + 10 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        box: list = []
        try:
            box.append(
                LLM(str(ckpt), device="cuda", tensor_parallel_size=tp, gpu_memory_utilization=0.6)
            )
            llm = box[0]
            got[tp] = [
                o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)
            ]
            wl = small_workload(llm.llm_engine.model_config.vocab_size, 64 if quick else 256)
            res = throughput.run(llm, ceil, wl, use_tqdm=False)
            row(f"qwen3-0.6b TP={tp} offline out tok/s", f"{res.output_tok_s:,.0f}")
        finally:
            llm = None
            free(box)
    if len(got) == 2:
        same = sum(a == b for a, b in zip(got[1], got[2]))
        row("qwen3-0.6b TP=2 vs TP=1 greedy (bf16, reductions reordered)", f"{same}/4 identical")
    for tp in (1, 2):
        box = []
        try:
            box.append(
                LLM(
                    "llama-3.1-8b",
                    load_format="dummy",
                    device="cuda",
                    tensor_parallel_size=tp,
                    max_model_len=4096,
                )
            )
            llm = box[0]
            rows = latency.run(llm.llm_engine, ceil, [1] if quick else [1, 32], 512, 128)
            for r in rows:
                row(f"llama-3.1-8b TP={tp} bs{r.batch_size} step ms", f"{r.step_ms_p50:.3f}")
            summary[f"llama8b_tp{tp}"] = latency.as_dicts(rows)
        finally:
            llm = None
            free(box)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    summary: dict = {}
    ceil = measure(torch.device("cuda"), torch.bfloat16)
    row("ceilings", f"{ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s copy")
    work = Path(tempfile.mkdtemp(prefix="gpu_tp_"))
    ckpt = None
    try:
        ckpt = write_checkpoint("qwen3-0.6b", work / "qwen3-0.6b")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    for name, fn in (("tp1", lambda: section_tp1(ckpt, ceil, args.quick, summary)),):
        try:
            fn()
        except Exception:  # noqa: BLE001
            print(f"section {name} failed:")
            traceback.print_exc()
    if torch.cuda.device_count() >= 2:
        for name, fn in (
            ("allreduce", lambda: section_allreduce(summary)),
            ("tp2", lambda: section_tp2(ckpt, ceil, args.quick, summary)),
        ):
            try:
                fn()
            except Exception:  # noqa: BLE001
                print(f"section {name} failed:")
                traceback.print_exc()
    else:
        row("multi-GPU section", "skipped (1 GPU)")
    print("\n== summary ==")
    width = max(len(n) for n, _ in ROWS)
    for name, value in ROWS:
        print(f"{name:<{width}}  {value}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_tp.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()

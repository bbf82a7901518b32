"""Host work per step on the GPU: the Llama-3.1-8B config (random bf16 weights), its steady
decode at 256 running requests, and two offline workloads, each with the engine's measured host
share of the step time. Prints a short table last.

    python scripts/gpu_hostpath.py [--quick]

1. Parity: a tiny fp32 Llama, async (CUDA graphs) vs sync vs async over cached prefixes on the
   GPU, and vs the CPU; then 32 greedy requests of the 8B with async scheduling on and off, each
   from an empty prefix cache (same shapes: identical tokens expected); counted, not asserted.
2. Steady decode at 256 running (prompts 100-1024), heap frozen as in ``LLM.generate``:
   milliseconds per step, the engine's host share (``StepTiming``: 1 - waiting-for-the-device
   / step time; goal < 15%), the host pieces per step (schedule, launch incl. input building,
   update + outputs) and the process's CPU use, with the DeviceWaiter and with spinning; then
   streamed (a delta output per request per step, as the server) at 256 and at 64 running.
3. ``roofline bench throughput``-style offline runs: 256 requests, in 100-1024, out 512; and
   1000 short requests, in 20-300, out 20-300: output tok/s, % of the workload roofline and host
   share, each from an empty prefix cache (the hit tokens are printed). ``--quick`` shortens
   every section (under 90 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
import traceback

import torch

from roofline import LLM, SamplingParams
from roofline.bench import throughput, workloads
from roofline.bench.ceilings import measure
from roofline.engine.heap import frozen_heap

ROWS: list[tuple[str, str]] = []


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name}: {value}", flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parity(llm: LLM, n: int) -> None:
    """Async vs sync scheduling on the same prompts, each from an empty prefix cache (same
    batch shapes, so even bf16 random weights must agree)."""
    engine = llm.llm_engine
    wl = workloads.synthetic(n, (20, 200), (32, 32), engine.model_config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for mode in (True, False):
        engine.async_scheduling = mode
        engine.kv_manager.reset_prefix_cache()
        res = llm.generate(wl.prompts, params, use_tqdm=False)
        outs[mode] = [o.outputs[0].token_ids for o in res]
    engine.async_scheduling = True
    engine.kv_manager.reset_prefix_cache()
    same = sum(a == b for a, b in zip(outs[True], outs[False]))
    row("parity 8B bf16 async vs sync (greedy, identical)", f"{same}/{n}")


TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}


def tiny_parity(device: str, n: int) -> None:
    """A tiny random Llama in fp32: async (with CUDA graphs), sync, and async again over a warm
    prefix cache must give identical greedy tokens on the device; the CPU's are counted."""
    import json
    import tempfile
    from pathlib import Path

    wl = workloads.synthetic(n, (5, 300), (40, 40), TINY["vocab_size"], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(TINY))
        runs = {}
        for dev in dict.fromkeys([device, "cpu"]):
            llm = LLM(folder, load_format="dummy", device=dev, dtype="float32", max_num_seqs=32,
                      max_model_len=512, kv_cache_memory_bytes=256 << 20)  # fmt: skip
            engine = llm.llm_engine
            modes = [("async", True), ("sync", False), ("async, cached prefixes", True)]
            for name, mode in modes if dev == device else modes[:1]:
                engine.async_scheduling = mode
                if name != "async, cached prefixes":
                    engine.kv_manager.reset_prefix_cache()
                res = llm.generate(wl.prompts, params, use_tqdm=False)
                runs[(dev, name)] = [o.outputs[0].token_ids for o in res]
            del llm, engine
            gc.collect()
    ref = runs[(device, "async")]
    for (dev, name), toks in runs.items():
        if (dev, name) != (device, "async"):
            same = sum(a == b for a, b in zip(ref, toks))
            row(f"parity tiny fp32 {device} async vs {dev} {name}", f"{same}/{n} identical")


def steady_decode(
    llm: LLM, num_reqs: int, steps: int, wait: str = "sleep", stream: bool = False
) -> None:
    """Decode steps at ``num_reqs`` running, after every prompt is in: host share, host pieces
    and the process's CPU use (``wait``: ``sleep`` = the runner's DeviceWaiter, ``spin`` =
    plain cudaEventSynchronize). ``stream=False`` as ``LLM.generate`` adds requests, True as
    the server does (a delta output per request per step). The heap is frozen as in
    ``LLM.generate`` and the server's engine core."""
    engine = llm.llm_engine
    engine.kv_manager.reset_prefix_cache()
    runner = engine.runner
    waiter = runner.device_waiter
    if wait == "spin":
        runner.device_waiter = None
    sched = engine.scheduler
    vocab = engine.model_config.vocab_size
    wl = workloads.synthetic(num_reqs, (100, 1024), (1, 1), vocab, seed=11 + num_reqs)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i, prompt in enumerate(wl.prompts):
        engine.add_request(f"steady-{i}", prompt, params, stream=stream, delta=True)
    while sched.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    pieces = {
        "schedule": 0.0,
        "launch": 0.0,
        "update": 0.0,
        "fold-in+outputs": 0.0,
        "gc (within)": 0.0,
    }
    originals = []

    def wrap(obj, name: str, key: str, minus_wait: bool = False) -> None:
        fn = getattr(obj, name)
        originals.append((obj, name, fn))

        def timed(*a, **k):
            t0, w0 = time.perf_counter(), engine.step_timing.wait_s
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                pieces[key] += dt - (engine.step_timing.wait_s - w0 if minus_wait else 0.0)

        setattr(obj, name, timed)

    wrap(sched, "schedule", "schedule")
    wrap(engine.runner, "launch", "launch")
    wrap(sched, "update", "update")
    wrap(engine, "_finish_step", "fold-in+outputs", minus_wait=True)
    gc_t0 = [0.0]

    def gc_pause(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            pieces["gc (within)"] += time.perf_counter() - gc_t0[0]

    gc.callbacks.append(gc_pause)
    _sync()
    t0 = dataclasses.replace(engine.step_timing)
    running = []
    with frozen_heap():
        start, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            engine.step()
            running.append(sched.num_running)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    gc.callbacks.remove(gc_pause)
    pieces["fold-in+outputs"] -= pieces["update"]  # update runs inside the fold-in
    for obj, name, _fn in originals:
        delattr(obj, name)
    runner.device_waiter = waiter
    timing = engine.step_timing.since(t0)
    ms = 1e3 * elapsed / steps
    row(
        f"steady decode at {statistics.median(running):.0f} running, wait={wait}"
        + (", streamed" if stream else ""),
        f"{ms:.2f} ms/step, host share {100 * timing.host_fraction:.1f}% (goal < 15%), "
        f"process CPU {100 * cpu / elapsed:.0f}% of a core",
    )
    row(
        "  host pieces per step (ms)",
        ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in pieces.items()),
    )
    engine.abort_request([f"steady-{i}" for i in range(num_reqs)])
    while engine.has_unfinished_requests():
        engine.step()


def batch1(llm: LLM, num_out: int) -> None:
    """Batch-1 decode tok/s (512-token prompt) with the DeviceWaiter and with spinning: what
    sleeping through the wait costs the latency."""
    engine = llm.llm_engine
    runner = engine.runner
    waiter = runner.device_waiter
    prompt = workloads.synthetic(1, (512, 512), (1, 1), engine.model_config.vocab_size).prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=num_out, ignore_eos=True)
    result = {}
    for wait in ("spin", "sleep", "spin", "sleep"):
        runner.device_waiter = None if wait == "spin" else waiter
        rid = f"b1-{wait}-{len(result)}"
        engine.add_request(rid, prompt, params)
        for _ in range(3):  # the prefill, then two decode steps in flight
            engine.step()
        done = engine.scheduler.get_request(rid).num_output_tokens  # type: ignore[union-attr]
        t0, cpu0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
        dt = time.perf_counter() - t0
        result[wait] = (num_out - done) / dt, 100 * (time.process_time() - cpu0) / dt
    runner.device_waiter = waiter
    for wait, (tok_s, cpu) in result.items():
        row(f"batch-1 decode, wait={wait}", f"{tok_s:.1f} tok/s, process CPU {cpu:.0f}%")


def offline(llm: LLM, ceil, name: str, wl: workloads.Workload) -> None:
    kv = llm.llm_engine.kv_manager
    kv.reset_prefix_cache()  # nothing an earlier section computed may count here
    hits0 = kv.prefix_hits
    res = throughput.run(llm, ceil, wl, use_tqdm=False)
    row(f"  prefix-cache hit tokens in {name}", f"{kv.prefix_hits - hits0}")
    row(
        f"throughput {name}",
        f"{res.output_tok_s:.0f} out tok/s, {res.total_tok_s:.0f} total tok/s, "
        f"{res.roofline_pct:.1f}% of roofline ({res.elapsed_s:.1f} s vs {res.roofline_s:.1f} s), "
        f"host share {100 * res.host_fraction:.1f}%, max running {res.max_running}, "
        f"{res.num_preemptions} preemptions",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="every section shorter (< 90 s)")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev = torch.device(args.device)
    ceil = measure(dev, torch.bfloat16)
    row(
        "ceilings",
        f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
    )
    try:
        tiny_parity(args.device, 16 if args.quick else 32)
    except Exception:
        traceback.print_exc()
        row("parity tiny fp32", "FAILED (see above)")
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        device=args.device,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
    )
    _sync()
    row(f"{args.model} start-up (dummy weights)", f"{time.perf_counter() - t0:.1f} s")
    for name, fn in _sections(llm, ceil, args.quick):
        try:
            fn()
        except Exception:  # report and go on with the next section
            print(f"[{name} failed]", flush=True)
            traceback.print_exc()
            row(name, "FAILED (see above)")
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"\n=== gpu_hostpath summary ({time.perf_counter() - t_start:.0f} s) ===")
    width = max(len(n) for n, _ in ROWS)
    for name, value in ROWS:
        print(f"{name.ljust(width)}  {value}")


def _sections(llm: LLM, ceil, quick: bool) -> list:
    vocab = llm.llm_engine.model_config.vocab_size
    return [
        ("parity", lambda: parity(llm, 16 if quick else 32)),
        ("steady decode", lambda: steady_decode(llm, 256, 30 if quick else 100)),
        ("steady decode spin", lambda: steady_decode(llm, 256, 30 if quick else 60, "spin")),
        ("steady decode streamed", lambda: steady_decode(llm, 256, 30, stream=True)),
        ("steady decode 64", lambda: steady_decode(llm, 64, 40 if quick else 100, stream=True)),
        (
            "steady decode 64 spin",
            lambda: steady_decode(llm, 64, 40 if quick else 100, "spin", stream=True),
        ),
        ("batch-1 decode", lambda: batch1(llm, 64 if quick else 128)),
        (
            "offline 256 x (100-1024 in, 512 out)",
            lambda: offline(
                llm,
                ceil,
                "256 x in 100-1024, out " + ("128" if quick else "512"),
                workloads.synthetic(
                    256, (100, 1024), (128, 128) if quick else (512, 512), vocab, seed=0
                ),
            ),
        ),
        (
            "offline short",
            lambda: offline(
                llm,
                ceil,
                f"{300 if quick else 1000} short (in 20-300, out 20-300)",
                workloads.synthetic(300 if quick else 1000, (20, 300), (20, 300), vocab, seed=1),
            ),
        ),
    ]


if __name__ == "__main__":
    main()

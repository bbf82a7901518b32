"""Server vs offline on the same workload and engine settings (issue 4's targets):

1. offline: ``LLM.generate`` throughput on a synthetic token-id workload, and the decode step
   time at a few batch sizes up to ``--concurrency`` (``bench latency``'s measurement);
2. ``roofline serve`` in a subprocess with the same engine flags, then the serving benchmark's
   client: all requests at once (saturation) -> output tok/s vs offline; then Poisson arrivals
   at the rate that keeps about ``--concurrency`` requests running (Little's law, with the
   offline step time), capped at 80% of the request rate the server sustained at saturation
   (where prefill makes that many running requests unsustainable, as on a small CPU) -> TPOT
   p50 vs the offline decode step at the batch size the server actually held (requests in
   flight, time-averaged; interpolated between the measured sizes). The server's own step time
   (its engine core's inter-token latency) is reported beside them.

    python scripts/serve_compare.py --model smollm2 --num-prompts 64 --input-len 32:256 \
        --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time

import httpx

from roofline import LLM
from roofline.bench import latency, serve, throughput, workloads
from roofline.bench.ceilings import measure
from roofline.bench.cli import parse_range
from roofline.bench.serve_load import BenchRequest, RequestResult, run_requests, served_model


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server did not become healthy")


def engine_itl(base: str) -> tuple[float, float]:
    """(sum, count) of the server's inter-token-latency histogram: the core's own time between
    steps that gave a request tokens, i.e. the server's step time as the engine saw it."""
    values = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        for key in values:
            if line.startswith(f"roofline:inter_token_latency_seconds_{key}{{"):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) used so far by ``pid`` and each of its child processes
    (Linux /proc; empty elsewhere): shows whether the API process or the engine core ran out
    of its one core."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(c) for c in f.read().split()]
        for p in pids:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[p] = (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        pass
    return out


def cpu_share(before: dict[int, float], after: dict[int, float], wall_s: float, pid: int):
    """(API process, busiest child) CPU use over the window, in cores."""
    used = {p: (after[p] - before.get(p, 0.0)) / wall_s for p in after}
    api = used.pop(pid, None)
    return api, (max(used.values()) if used else None)


def mean_in_flight(results: list[RequestResult]) -> float | None:
    """Time-averaged number of requests between their start and end, over the middle half of
    the run (the ramp-up and the drain left out)."""
    ok = [r for r in results if r.ok]
    if not ok:
        return None
    t0, t1 = min(r.start for r in ok), max(r.end for r in ok)
    lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
    busy = sum(max(0.0, min(r.end, hi) - max(r.start, lo)) for r in ok)
    return busy / (hi - lo) if hi > lo else None


def interpolate(step_ms: dict[int, float], batch: float) -> float:
    """Step time at a (fractional) batch size, linear between the measured sizes (and beyond
    them along the nearest segment)."""
    sizes = sorted(step_ms)
    if len(sizes) == 1:
        return step_ms[sizes[0]]
    i = next((k for k in range(1, len(sizes) - 1) if batch <= sizes[k]), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return step_ms[lo] + (step_ms[hi] - step_ms[lo]) * (batch - lo) / (hi - lo)


def _step_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return 1000.0 * (after[0] - before[0]) / count if count else None


def trace_summary(steps: list, start: float, end: float, adds: list | None = None) -> dict:
    """Where a window of wall time went, from an engine's step trace (``LLMEngine.step_trace``:
    (start, end, cumulative device wait, tokens, requests) per step, ``time.perf_counter``):
    the steps inside it, their time in ``step()`` (of it waiting for the device) split into
    decode-only and mixed steps, the gaps between steps (the loop around ``step()``), and the
    lead-in before the first step and the tail after the last (arrivals, the last outputs'
    way to the client)."""
    inside = [s for s in steps if s[0] >= start and s[1] <= end and s[4] > 0]
    if not inside:
        return {"steps": 0}
    total = end - start
    decode = [s for s in inside if s[3] == s[4]]
    mixed = [s for s in inside if s[3] != s[4]]
    first = steps.index(inside[0])
    wait_before = steps[first - 1][2] if first else 0.0

    def busy(rows: list) -> float:
        return sum(s[1] - s[0] for s in rows)

    gaps = sum(b[0] - a[1] for a, b in zip(inside, inside[1:]))
    adds = [t for t in adds or [] if start <= t <= end]
    return {
        # when the engine took the first and the last request, from the window's start
        "first_add_s": adds[0] - start if adds else None,
        "last_add_s": adds[-1] - start if adds else None,
        "window_s": total,
        "steps": len(inside),
        "decode_steps": len(decode),
        "decode_s": busy(decode),
        "decode_ms_per_step": 1e3 * busy(decode) / len(decode) if decode else None,
        "mean_decode_rows": sum(s[4] for s in decode) / len(decode) if decode else None,
        "mixed_steps": len(mixed),
        "mixed_s": busy(mixed),
        "mixed_tokens": sum(s[3] for s in mixed),
        "wait_s": inside[-1][2] - wait_before,
        "gaps_s": gaps,
        "lead_in_s": inside[0][0] - start,
        "tail_s": end - inside[-1][1],
    }


def _offline(model, kwargs, num_prompts, input_len, output_len, concurrency) -> dict:
    llm = LLM(model, **kwargs)
    engine = llm.llm_engine
    ceil = measure(engine.runner.device, engine.runner.dtype)
    wl = workloads.synthetic(
        num_prompts, input_len, (output_len,) * 2, engine.model_config.vocab_size, seed=1
    )
    engine.step_trace = []
    first: list[float] = []  # when the first step of the measured run was scheduled

    def observe(_out) -> None:
        if not first:
            first.append(time.perf_counter())

    res = throughput.run(llm, ceil, wl, use_tqdm=False, observe=observe)
    steps = engine.step_trace
    start = next((s[0] for s in steps if s[0] <= first[0] <= s[1]), first[0]) if first else 0.0
    trace = trace_summary(steps, start, start + res.elapsed_s)
    engine.step_trace = None
    sizes = sorted({max(1, concurrency // 4), max(1, concurrency // 2), concurrency})
    step_ms = {
        b: latency.run_batch(engine, ceil, b, sum(input_len) // 2, output_len).step_ms_p50
        for b in sizes
    }
    return {
        "out_tok_s": res.output_tok_s,
        "preemptions": res.num_preemptions,
        "max_running": res.max_running,
        "host_fraction": res.host_fraction,
        "jit_compiles": sorted(set(res.jit_compiles)),
        "trace": trace,
        "step_ms": step_ms,
        "prompts": wl.prompts,
        "output_lens": wl.output_lens,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=parse_range, default=(32, 256))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument(
        "--engine-args",
        default="",
        help="extra flags for LLM and serve, e.g. '--load-format dummy --max-model-len 2048'",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from roofline.engine.args import EngineArgs

    eparser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(eparser)
    eargs = EngineArgs.from_cli_args(eparser.parse_args(args.engine_args.split()))
    kwargs = {k: v for k, v in vars(eargs).items() if k != "model"}

    # the offline half runs in a child process, so its GPU memory is gone before the server starts
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        off = pool.apply(
            _offline,
            (
                args.model,
                kwargs,
                args.num_prompts,
                args.input_len,
                args.output_len,
                args.concurrency,
            ),
        )
    steps = ", ".join(f"{ms:.2f} ms at {b}" for b, ms in off["step_ms"].items())
    print(
        f"offline: {off['out_tok_s']:.1f} out tok/s; decode step {steps} "
        f"({off['preemptions']} preemptions, "
        f"at most {off['max_running']} running; host work {100 * off['host_fraction']:.0f}% "
        f"of step time; JIT compiles during the run: {off['jit_compiles']})",
        flush=True,
    )
    prompts, output_lens = off["prompts"], off["output_lens"]

    base = f"http://127.0.0.1:{args.port}"
    cmd = [
        sys.executable,
        "-m",
        "roofline.entrypoints.cli",
        "serve",
        args.model,
        "--port",
        str(args.port),
        *args.engine_args.split(),
    ]
    log = open(os.path.join(os.environ.get("OUT", "/tmp"), "serve_compare_server.log"), "w")
    trace_path = os.path.join(os.environ.get("OUT", "/tmp"), "serve_compare_steps.json")
    if os.path.exists(trace_path):
        os.remove(trace_path)
    env = {**os.environ, "ROOFLINE_NO_PROGRESS": "1", "ROOFLINE_STEP_TRACE": trace_path}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(base, proc)
        model = served_model(base, None)
        reqs = [BenchRequest(p, n) for p, n in zip(prompts, output_lens)]
        asyncio.run(run_requests(base, model, reqs[:4], ignore_eos=True))  # warm-up
        itl0, cpu0 = engine_itl(base), cpu_seconds(proc.pid)
        client0 = time.process_time()
        sat_t0 = time.perf_counter()
        results, dur = asyncio.run(run_requests(base, model, reqs, ignore_eos=True))
        sat_t1 = time.perf_counter()
        client_sat = (time.process_time() - client0) / dur
        sat = serve.summarize(results, dur)
        itl1, cpu1 = engine_itl(base), cpu_seconds(proc.pid)
        # Little's law: concurrency = rate x E2E, E2E ~ output_len x step time at that batch;
        # at most 80% of the request rate sustained at saturation
        step_n = off["step_ms"][args.concurrency]
        little = args.concurrency / (args.output_len * step_n / 1000.0)
        rate = min(little, 0.8 * sat["request_throughput"])
        # 4 x concurrency arrivals span ~4 E2E times: most requests run in the steady state
        num_rate = 4 * args.concurrency
        reqs_rate = [reqs[i % len(reqs)] for i in range(num_rate)]
        results, dur = asyncio.run(
            run_requests(base, model, reqs_rate, request_rate=rate, ignore_eos=True, seed=3)
        )
        at_rate = serve.summarize(results, dur)
        in_flight = mean_in_flight(results)
        itl2, cpu2 = engine_itl(base), cpu_seconds(proc.pid)
    except Exception:
        log.flush()
        with open(log.name) as f:
            print("server log tail:\n" + f.read()[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    server_trace = None
    for _ in range(50):  # the core writes its trace as it exits
        if os.path.exists(trace_path):
            try:
                with open(trace_path) as f:
                    trace = json.load(f)
                server_trace = trace_summary(trace["steps"], sat_t0, sat_t1, trace["adds"])
                break
            except ValueError:  # still being written
                pass
        time.sleep(0.2)
    tpot = at_rate["tpot_ms"]["p50"]
    step_at = None if in_flight is None else interpolate(off["step_ms"], in_flight)
    engine_step_at_rate = _step_ms(itl1, itl2)
    summary = {
        "offline_out_tok_s": off["out_tok_s"],
        "offline_preemptions": off["preemptions"],
        "server_saturation_out_tok_s": sat["output_throughput"],
        "server_vs_offline": sat["output_throughput"] / off["out_tok_s"],
        "rate_req_s": rate,
        "rate_littles_law_req_s": little,
        "server_tpot_p50_ms": tpot,
        # requests in flight at the client (running + queued), time-averaged over the
        # middle half of the rate phase: the batch size the TPOT above was measured at
        "server_mean_in_flight_at_rate": in_flight,
        "offline_step_ms": off["step_ms"],
        "offline_step_ms_at_in_flight": step_at,
        "tpot_vs_step": (tpot / step_at) if tpot and step_at else None,
        "server_ttft_p50_ms": at_rate["ttft_ms"]["p50"],
        "server_itl_p50_ms": at_rate["itl_ms"]["p50"],
        # the server's step time as its engine core measured it (mean time between steps that
        # gave a request tokens): on a shared CPU it shows what the client and the API process
        # cost the engine, apart from what the API adds on top of the step
        "server_engine_step_ms_saturation": _step_ms(itl0, itl1),
        "server_engine_step_ms_at_rate": engine_step_at_rate,
        # what the API process adds on top of its engine's own steps at that load
        "tpot_vs_engine_step": tpot / engine_step_at_rate if tpot and engine_step_at_rate else None,
        # cores busy in the API process and in the engine core during each phase
        "cpu_cores_api_core_saturation": cpu_share(cpu0, cpu1, sat["duration_s"], proc.pid),
        "cpu_cores_api_core_at_rate": cpu_share(cpu1, cpu2, at_rate["duration_s"], proc.pid),
        "cpu_cores_client_saturation": client_sat,
        "failed": sat["failed"] + at_rate["failed"],
        # where the saturation run's wall time went, server vs offline (trace_summary)
        "trace_saturation_server": server_trace,
        "trace_offline": off["trace"],
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"summary": summary, "saturation": sat, "at_rate": at_rate},
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()

"""Host work per step on the H100 (issue 13, "Host work per step"): the Llama-3.1-8B config
with random bf16 weights and the engine's default settings. Prints a short table last.

    python scripts/gpu_host.py [--serve] [--quick] [--short] [--final]

1. Parity: a tiny fp32 Llama, async (CUDA graphs) vs sync vs async over cached prefixes on the
   GPU, and vs the CPU (``gpu_hostpath.tiny_parity``); 32 greedy requests of the 8B with async
   scheduling on and off; 256 greedy requests with steady decode (``core/steady.py``,
   ``worker/steady_inputs.py``) on and off, the decode graphs' buffers and input ids checked
   against the step's host lists after steady steps. Then the host's syncs by call site in
   prefill-sized steps (sync debug mode) and the allocator's retries.
2. Steady decode at 256 running (prompts 100-1024, ``stream=False`` as ``LLM.generate``, heap
   frozen): ms per step, the engine's host share (``StepTiming``; goal < 15%) with the default
   DeviceWaiter, with steady decode off (the general loops every step) and spinning, host ms per
   step by piece ("launch own": launch minus the pieces inside it) and the device's idle time
   between steps (CUDA events around each launch); then streamed at 64 running, outputs as the
   server's core takes them (``step_rows``); then a cProfile of 40 steady steps and the callees
   of the runner's launch.
3. Batch-1 decode of the 8B (512-token prompt): tok/s, spinning and sleeping.
4. The default preset (256 x in 100-1024, out 512) twice (cold, warm): % of its roofline, host
   share, device idle between steps, allocator retries; ``--short``: the short preset too,
   profiled.
5. ``--serve``: ``scripts/serve_compare.py`` on the 8B at 64 requests in flight (256 prompts,
   in 100-1024, out 256; ``--serve-quick``: out 128): server vs offline throughput at saturation
   (goal >= 0.95) with where each run's wall time went (step traces), TPOT p50 vs the offline
   step (goal <= 1.1) and the engine core's CPU use at the rate phase (goal < 0.70 of a core).

``--final`` (the run on merged main, ~2 min with ``--serve``): the parities, the host syncs,
steady decode at 256 (default wait, steady on and off), batch-1 (steady decode on and off), the
default preset cold and warm, and serve.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import subprocess
import sys
import time
import traceback
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_hostpath as hp  # noqa: E402

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.bench import throughput, workloads  # noqa: E402
from roofline.bench.ceilings import measure  # noqa: E402
from roofline.core.scheduler import Scheduler  # noqa: E402
from roofline.engine.heap import frozen_heap  # noqa: E402
from roofline.worker.host_batch import HostBatch  # noqa: E402

row = hp.row


def _add_steady(engine, num_reqs: int, steps: int, stream: bool, seed: int) -> list[str]:
    """``num_reqs`` decoding requests, every prompt in (prompts 100-1024)."""
    engine.kv_manager.reset_prefix_cache()
    vocab = engine.model_config.vocab_size
    wl = workloads.synthetic(num_reqs, (100, 1024), (1, 1), vocab, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    ids = [f"steady-{seed}-{i}" for i in range(num_reqs)]
    for rid, prompt in zip(ids, wl.prompts):
        engine.add_request(rid, prompt, params, stream=stream, delta=True)
    sched = engine.scheduler
    while sched.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
    ):
        engine.step()
    for _ in range(8):  # the waiter learns its estimate
        engine.step()
    return ids


def _drain(engine, ids: list[str]) -> None:
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def steady(llm: LLM, num_reqs: int, steps: int, stream: bool = False, spin: bool = True) -> None:
    """Host share and host pieces at ``num_reqs`` decoding, default wait then spinning, one
    window of ``steps`` steps each over the same running batch."""
    engine = llm.llm_engine
    runner, sched = engine.runner, engine.scheduler
    waiter = runner.device_waiter
    num_windows = 2 if stream else 4  # the variants below, each 4 + ``steps`` steps
    ids = _add_steady(engine, num_reqs, num_windows * (steps + 8) + 64, stream, seed=11 + num_reqs)
    pieces: dict[str, float] = defaultdict(float)
    patched: list[tuple[object, str]] = []

    def timed(obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*a, **k):
            t0, w0 = time.perf_counter(), engine.step_timing.wait_s
            try:
                return fn(*a, **k)
            finally:
                pieces[key] += time.perf_counter() - t0 - (engine.step_timing.wait_s - w0)

        setattr(obj, attr, wrapper)
        patched.append((obj, attr))

    graphs = runner.graphs
    build = HostBatch.__dict__["build"]
    try:
        timed(sched, "schedule", "schedule")
        timed(runner, "launch", "launch")
        timed(HostBatch, "build", "  build")
        timed(runner, "_upload", "  upload")
        for graphs in (runner.graphs, runner.cascade_graphs):
            if graphs is not None:
                timed(graphs, "stage_inputs", "  stage")
                timed(graphs, "replay", "  replay")
        timed(runner.model, "compute_logits", "  LM head")
        timed(runner, "_sample", "  sample")
        timed(runner, "_advance_staged", "  advance")
        timed(engine, "_fold", "fold-in")
        timed(sched, "update", "  update")
        timed(engine, "_emit", "outputs")
        variants = [
            ("default wait", waiter, True),
            ("default wait, steady decode off (general loops every step)", waiter, False),
            ("spin", None, True),
        ]
        if stream:
            variants = variants[::2]
        elif not spin:
            variants = variants[:2]
        for name, wait, steady_on in variants:
            runner.device_waiter = wait
            Scheduler.steady_decode = steady_on
            sched._steady = None
            for _ in range(4):
                engine.step()
            pieces.clear()
            t0 = dataclasses.replace(engine.step_timing)
            step = engine.step_rows if stream else engine.step  # streamed: as the server core
            cuda = runner.device.type == "cuda"
            gaps = DeviceGaps(runner) if cuda else None
            with frozen_heap(), gaps if gaps is not None else contextlib.nullcontext():
                start, cpu0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
            timing = engine.step_timing.since(t0)
            row(
                f"steady decode {sched.num_running}{', streamed' if stream else ''}, {name}",
                f"{1e3 * elapsed / steps:.2f} ms/step, host share "
                f"{100 * timing.host_fraction:.1f}% (goal < 15%), host "
                f"{1e3 * (timing.total_s - timing.wait_s) / timing.steps:.2f} ms/step, "
                f"CPU {100 * cpu / elapsed:.0f}% of a core",
            )
            inner = ("  build", "  upload", "  stage", "  replay", "  LM head", "  sample",
                     "  advance")  # fmt: skip
            pieces["  launch own"] = pieces.get("launch", 0.0) - sum(
                pieces.get(k, 0.0) for k in inner
            )
            row(
                "  host ms/step",
                ", ".join(f"{k.strip()} {1e3 * v / steps:.3f}" for k, v in pieces.items()),
            )
            if gaps is not None:
                row("  device", gaps.summary())
    finally:
        Scheduler.steady_decode = True
        HostBatch.build = build  # type: ignore[method-assign]
        for obj, attr in patched:
            if obj is not HostBatch:
                obj.__dict__.pop(attr, None)
        runner.device_waiter = waiter
        _drain(engine, ids)


def staging_parity() -> None:
    """The pinned staging ring against a fresh pinned tensor per upload: random lists of
    growing and shrinking sizes (the ring wraps and grows), every value identical."""
    import random

    from roofline.worker.host_batch import upload
    from roofline.worker.staging import PinnedStaging

    dev = torch.device("cuda")
    ring = PinnedStaging(dev)
    rng = random.Random(0)
    bad = 0
    for i in range(200):
        n = rng.choice([1, 7, 300, 2049, 40000]) if i % 3 else rng.randrange(1, 5000)
        lists = [[rng.randrange(-(1 << 40), 1 << 40) for _ in range(n)], [i] * 3]
        got = upload(lists, dev, ring)
        want = upload(lists, dev)
        bad += any(not torch.equal(a, b) for a, b in zip(got, want))
    torch.cuda.synchronize()
    row("parity pinned staging ring vs fresh pinned upload", f"{200 - bad}/200 identical")


def full_head_parity(llm: LLM) -> None:
    """The largest decode bucket's graph-captured LM head (``graph_head.full_head``) against
    the eager head: 256 greedy requests (in 100-300, out 24) with it and without it, each from
    an empty prefix cache (identical tokens expected), and one step's logits compared."""
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    if graphs is None:
        row("parity full graph head", "no decode graphs (not CUDA)")
        return
    top = graphs.buckets[-1]
    head = graphs.heads.get(top)
    if head is None:
        row("parity full graph head", f"no head captured in bucket {top}")
        return
    print(f"full head in bucket {top}: logits {tuple(head.logits.shape)} {head.logits.dtype}")
    with torch.inference_mode():
        eager = engine.runner.model.compute_logits(graphs.outputs[top], upcast=False)
    diff = (eager.float() - head.logits.float()).abs().max().item()
    same_ids = torch.equal(eager.argmax(-1), head.token_ids)
    wl = workloads.synthetic(top, (100, 300), (24, 24), engine.model_config.vocab_size, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    for use_head in (True, False):
        graphs.heads[top] = head if use_head else None
        engine.kv_manager.reset_prefix_cache()
        runs.append(
            [o.outputs[0].token_ids for o in llm.generate(wl.prompts, params, use_tqdm=False)]
        )
    graphs.heads[top] = head
    same = sum(a == b for a, b in zip(*runs))
    row(
        "parity full graph head vs eager head",
        f"{same}/{top} identical; last replay's logits max|diff| {diff:.1e}, ids equal {same_ids}",
    )


def steady_parity(llm: LLM, num_reqs: int = 256) -> None:
    """Steady decode (``core/steady.py``, ``worker/steady_inputs.py``) on and off: the same
    greedy tokens for ``num_reqs`` requests (in 100-300, out 48: the largest bucket, its graph
    head), each from an empty prefix cache; and, mid-run, the decode graphs' buffers after a
    steady step against the step's host lists (positions, slots, context lengths, block-table
    rows, padding rows)."""
    engine = llm.llm_engine
    runner = engine.runner
    wl = workloads.synthetic(num_reqs, (100, 300), (48, 48), engine.model_config.vocab_size, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs, checks = [], []
    advance = runner._advance_staged
    counts = {"steady": 0}

    def checked(batch, staged):
        check = counts["steady"] % 7 == 3  # compare the buffers with the host lists at times
        prev = runner._prev_sampled.clone() if check else None  # this step's input ids
        out = advance(batch, staged)
        counts["steady"] += 1
        if check:
            n = batch.num_reqs
            ok = torch.equal(runner.graphs.input_ids[:n], prev[:n])
            checks.append(_buffers_match(runner, batch, staged[1]) and ok)
        return out

    try:
        for steady_on in (True, False):
            Scheduler.steady_decode = steady_on
            runner._advance_staged = checked
            engine.kv_manager.reset_prefix_cache()
            res = llm.generate(wl.prompts, params, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in res])
            if steady_on:
                num_steady = counts["steady"]
    finally:
        Scheduler.steady_decode = True
        runner.__dict__.pop("_advance_staged", None)
    same = sum(a == b for a, b in zip(*runs))
    row(
        f"parity steady decode on vs off ({num_reqs} greedy)",
        f"{same}/{num_reqs} identical; {num_steady} steady device steps (off: "
        f"{counts['steady'] - num_steady}); buffers match host lists in "
        f"{sum(checks)}/{len(checks)} checked steps",
    )


def _buffers_match(runner, batch, bucket: int) -> bool:
    """The decode graphs' static buffers after a steady step against the step's host lists."""
    g, n = runner.graphs, batch.num_reqs
    dev = g.positions.device
    rows = torch.tensor(batch.table_rows, device=dev)
    want_table = runner.block_tables.table.index_select(0, rows)
    ok = (
        g.positions[:n].tolist() == batch.positions
        and g.slot_mapping[:n].tolist() == batch.slots
        and g.seq_lens[:n].tolist() == batch.seq_lens
        and torch.equal(g.block_table[:n], want_table)
        and bool((g.slot_mapping[n:bucket] == -1).all())
        and bool((g.seq_lens[n:bucket] == 1).all())
    )
    if not ok:
        print(f"steady buffers differ at n={n} bucket={bucket}", flush=True)
    return ok


def profile_steady(llm: LLM, num_reqs: int, steps: int) -> None:
    """cProfile of ``steps`` steady decode steps (default wait): own time by function."""
    engine = llm.llm_engine
    ids = _add_steady(engine, num_reqs, steps + 64, False, seed=5)
    prof = cProfile.Profile()
    try:
        with frozen_heap():
            prof.enable()
            for _ in range(steps):
                engine.step()
            prof.disable()
    finally:
        _drain(engine, ids)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    print(f"cProfile, {steps} steps at {num_reqs} decoding (own time; divide by {steps}):")
    print("\n".join(buf.getvalue().splitlines()[4:52]), flush=True)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_callees(
        r"model_runner.py:\d+\((launch|launch_batch|_advance_staged)\)"
    )
    print("callees of the runner's launch (cumulative):")
    print("\n".join(buf.getvalue().splitlines()[:60]), flush=True)


class DeviceGaps:
    """The device's idle time between steps: a CUDA event recorded as each ``runner.launch``
    begins and another as it ends; the time from one step's end event to the next step's
    begin event is time the device had nothing queued (the host was late), split by whether
    the next step is decode-only. Installed on the runner while in a ``with`` block."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []

    def __enter__(self) -> DeviceGaps:
        self._own = self.runner.__dict__.get("launch")  # a wrapper already installed
        launch = self.runner.launch

        def marked(sched_out, *a, **k):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                return launch(sched_out, *a, **k)
            finally:
                end.record()
                decode = sched_out.num_batched_tokens == len(sched_out.requests)
                self.marks.append((begin, end, decode))

        self.runner.launch = marked
        return self

    def __exit__(self, *exc) -> None:
        if self._own is None:
            self.runner.__dict__.pop("launch", None)
        else:
            self.runner.launch = self._own

    def summary(self) -> str:
        torch.cuda.synchronize()
        gaps = {True: [], False: []}
        for (_, end, _), (begin, _, decode) in zip(self.marks, self.marks[1:]):
            gaps[decode].append(end.elapsed_time(begin))
        parts = []
        for decode, name in ((True, "before decode steps"), (False, "before other steps")):
            g = gaps[decode]
            if g:
                parts.append(f"{name} {sum(g):.1f} ms over {len(g)} (max {max(g):.2f} ms)")
        return "device idle between steps: " + ("; ".join(parts) or "no steps")


def sync_points(llm: LLM) -> None:
    """Where the host waits for the device, besides the step's one read of its sampled ids:
    prefill-sized steps (16 prompts of 900-1000 tokens, two chunks of 8192) and a few decode
    steps under ``torch.cuda.set_sync_debug_mode("warn")``, each warning's roofline call site
    counted (the waiter's own wait excluded), and the allocator's retries (a retry frees the
    cache: a device sync the debug mode does not see)."""
    import traceback
    import warnings
    from collections import Counter

    engine = llm.llm_engine
    if engine.runner.device.type != "cuda":
        row("sync points, prefill-sized steps", "n/a (not CUDA)")
        return
    wl = workloads.synthetic(16, (900, 1000), (4, 4), engine.model_config.vocab_size, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack() if "/roofline/" in f.filename]
        key = " <- ".join(f"{f.filename.split('/roofline/')[-1]}:{f.lineno}({f.name})"
                          for f in frames[::-1][:3])  # fmt: skip
        sites[key or f"{filename}:{lineno}"] += 1

    engine.kv_manager.reset_prefix_cache()
    mem0 = _alloc_counters()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(wl.prompts, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    retries = _alloc_counters()["num_alloc_retries"] - mem0["num_alloc_retries"]
    waits = [k for k in sites if "device_wait.py" in k or "model_runner.py" in k and "_wait" in k]
    for key in waits:
        sites.pop(key)
    print("host syncs by call site (16 prompts of ~1k tokens, 4 tokens each):", flush=True)
    for key, count in sites.most_common(12):
        print(f"  {count:4d}  {key}", flush=True)
    row("sync points, prefill-sized steps", f"{sum(sites.values())} syncs at {len(sites)} sites "
        f"besides the waiter's; allocator retries {retries}")  # fmt: skip


def _alloc_counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
    return {k: int(stats.get(k, 0)) for k in keys}


def default_preset(llm: LLM, ceil, run: int = 1, name: str = "default", top: int = 0) -> None:
    """A ``bench throughput`` preset: % of its roofline, host share, the device's idle time
    between steps; ``top``: also a cProfile of the run (the functions with the most own
    time)."""
    engine = llm.llm_engine
    engine.kv_manager.reset_prefix_cache()
    wl = workloads.preset(name, engine.model_config.vocab_size)
    cuda = engine.runner.device.type == "cuda"
    gaps = DeviceGaps(engine.runner) if cuda else None
    prof = cProfile.Profile() if top else None
    mem0 = _alloc_counters() if cuda else {}
    with gaps if gaps is not None else contextlib.nullcontext():
        if prof is not None:
            prof.enable()
        try:
            res = throughput.run(llm, ceil, wl, use_tqdm=False)
        finally:
            if prof is not None:
                prof.disable()
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        print(f"cProfile of preset {name} (own time, whole run):")
        print("\n".join(buf.getvalue().splitlines()[4 : top + 10]), flush=True)
    jit = sorted(set(res.jit_compiles))
    row(
        f"preset {name} (run {run}{', JIT ' + ','.join(jit) if jit else ''})",
        f"{res.elapsed_s:.3f} s, {res.output_tok_s:,.0f} out tok/s, {res.roofline_pct:.1f}% of "
        f"roofline ({res.roofline_s:.3f} s), host {100 * res.host_fraction:.1f}%, max running "
        f"{res.max_running}, {res.num_preemptions} preemptions",
    )
    if gaps is not None:
        mem = {k: v - mem0[k] for k, v in _alloc_counters().items()}
        row(
            f"  preset {name} (run {run})",
            f"{gaps.summary()}; allocator: {mem['num_alloc_retries']} retries (each frees the "
            f"cache: a device sync), {mem['num_device_alloc']} cudaMalloc, "
            f"{mem['num_device_free']} cudaFree",
        )


def serve(quick: bool) -> None:
    """``serve_compare.py`` on the 8B (a subprocess: the server needs the GPU to itself)."""
    out = os.environ.get("OUT", "/tmp")
    path = os.path.join(out, "serve_compare_host.json")
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_compare.py"),
        "--model", "llama-3.1-8b", "--num-prompts", "256",
        "--input-len", "100:1024", "--output-len", "128" if quick else "256",
        "--concurrency", "64", "--engine-args=--load-format dummy --max-model-len 2048",
        "--json", path,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    print(proc.stdout[-4000:], proc.stderr[-3000:], sep="\n", flush=True)
    if proc.returncode:
        row("serve_compare", f"FAILED rc={proc.returncode} ({time.perf_counter() - t0:.0f} s)")
        return
    with open(path) as f:
        s = json.load(f)["summary"]
    api, core = s["cpu_cores_api_core_at_rate"]
    api_sat, core_sat = s["cpu_cores_api_core_saturation"]
    row(
        "server vs offline at saturation",
        f"{s['server_vs_offline']:.3f}x (goal >= 0.95; {s['server_saturation_out_tok_s']:.0f} "
        f"vs {s['offline_out_tok_s']:.0f} out tok/s)",
    )
    row(
        "server TPOT p50 vs offline step",
        f"{_f(s['tpot_vs_step'])}x (goal <= 1.1; {_f(s['server_tpot_p50_ms'])} ms vs "
        f"{_f(s['offline_step_ms_at_in_flight'])} ms at "
        f"{_f(s['server_mean_in_flight_at_rate'], 1)} in flight)",
    )
    for name, key in (("server", "trace_saturation_server"), ("offline", "trace_offline")):
        t = s.get(key) or {}
        if not t.get("steps"):
            row(f"saturation trace, {name}", "n/a")
            continue
        row(
            f"saturation trace, {name}",
            f"{t['window_s']:.3f} s: requests taken {_f(t.get('first_add_s'))}-"
            f"{_f(t.get('last_add_s'))}, lead-in {t['lead_in_s']:.3f}, {t['steps']} steps, decode "
            f"{t['decode_steps']} x {_f(t['decode_ms_per_step'], 2)} ms (mean rows "
            f"{_f(t['mean_decode_rows'], 1)}), mixed {t['mixed_steps']} = {t['mixed_s']:.3f} s "
            f"({t['mixed_tokens']} tokens), waiting {t['wait_s']:.3f} s, gaps "
            f"{t['gaps_s']:.3f} s, tail {t['tail_s']:.3f} s",
        )
    row(
        "server engine-core CPU at rate",
        f"{_f(core)} of a core (goal < 0.70; API process {_f(api)}; at saturation core "
        f"{_f(core_sat)}, API {_f(api_sat)}); rate {_f(s['rate_req_s'], 1)} req/s",
    )


def _f(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def batch1_steady_off(llm: LLM, num_out: int) -> None:
    """Batch-1 decode with steady decode off (the general path every step): the A/B of what
    the steady path costs or saves at batch 1, in the same run."""
    start = len(hp.ROWS)
    Scheduler.steady_decode = False
    try:
        hp.batch1(llm, num_out)
    finally:
        Scheduler.steady_decode = True
    hp.ROWS[start:] = [(f"{name}, steady decode off", v) for name, v in hp.ROWS[start:]]


def _run_sections(llm: LLM, ceil, args: argparse.Namespace, dev: torch.device) -> None:
    sections = [
        ("parity staging", staging_parity),
        ("parity 8B", lambda: hp.parity(llm, 32)),
        ("parity steady", lambda: steady_parity(llm)),
        ("sync points", lambda: sync_points(llm)),
        ("steady 256", lambda: steady(llm, 256, 40 if args.quick else 80)),
        ("steady 64 streamed", lambda: steady(llm, 64, 60, stream=True)),
        ("profile", lambda: profile_steady(llm, 256, 40)),
        ("batch-1", lambda: hp.batch1(llm, 64 if args.quick else 128)),
        ("preset default", lambda: default_preset(llm, ceil)),
        ("preset default, warm", lambda: default_preset(llm, ceil, 2)),
    ]
    if args.final:  # the final run on merged main (~2 min with --serve): the figures
        keep = ("parity 8B", "parity steady", "sync points", "batch-1", "preset default",
                "preset default, warm")  # fmt: skip
        sections = [(n, f) for n, f in sections if n in keep]
        sections.insert(3, ("steady 256", lambda: steady(llm, 256, 40, spin=False)))
        sections.insert(5, ("batch-1 steady off", lambda: batch1_steady_off(llm, 64)))
    if args.short:  # the many-short-requests preset: its host work, profiled (~25 s)
        sections.append(("preset short", lambda: default_preset(llm, ceil, 1, "short", 30)))
    if dev.type == "cpu":  # the smoke run: the preset alone takes minutes there
        sections = sections[1:-2]
    for name, fn in sections:
        try:
            t1 = time.perf_counter()
            fn()
            print(f"({name}: {time.perf_counter() - t1:.1f} s)", flush=True)
        except Exception:
            traceback.print_exc()
            row(name, "FAILED (see above)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--serve", action="store_true", help="also run serve_compare on the 8B")
    ap.add_argument("--serve-quick", action="store_true", help="serve_compare with out 128")
    ap.add_argument("--short", action="store_true", help="also the short preset, profiled")
    ap.add_argument("--final", action="store_true", help="only the issue's figures (~2 min)")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = ap.parse_args()
    dev = torch.device(args.device)
    t_start = time.perf_counter()
    ceil = measure(dev, torch.bfloat16)
    row(
        "ceilings",
        f"copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s",
    )
    try:
        hp.tiny_parity(args.device, 16)
    except Exception:
        traceback.print_exc()
        row("parity tiny fp32", "FAILED (see above)")
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", device=args.device)
    hp._sync()
    row(f"{args.model} start-up (dummy weights)", f"{time.perf_counter() - t0:.1f} s")
    _run_sections(llm, ceil, args, dev)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.serve:
        try:
            serve(args.serve_quick)
        except Exception:
            traceback.print_exc()
            row("serve_compare", "FAILED (see above)")
    print(f"\n=== gpu_host summary ({time.perf_counter() - t_start:.0f} s) ===")
    width = max(len(n) for n, _ in hp.ROWS)
    for name, value in hp.ROWS:
        print(f"{name.ljust(width)}  {value}")


if __name__ == "__main__":
    main()

"""Issue 13, start-up and prefill: cold and warm start-up of the Llama-3.1-8B engine, broken down,
with the parallel kernel compiles on and off; then (``gpu_startup_prefill.py``) the 8192-token
prefill and 2,048-token chunks over an 8k cached prefix as % of the matmul rate, and batch-1
decode (regression).

    python scripts/gpu_startup.py [--quick]

Start-up runs in fresh processes (``--child``), each with its own Triton cache directory: "cold"
starts from an empty one, "warm" reuses the one its cold run filled. Each child prints one
``STARTUP {json}`` line: seconds per phase (exclusive of nested phases, the device synchronised
at each phase's end), the engine's construction time (what BENCHMARKS.md reports as start-up),
the process's whole time, compile counts and the greedy tokens of two prompts (on and off must
agree). The parent then loads the engine once more (warm cache) for the prefill and decode
figures. Sections print their errors and go on; a table closes the run.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from gpu_startup_prefill import (  # noqa: E402 - beside this script
    SUMMARY,
    chunk_attention_section,
    decode_section,
    fresh_attention_section,
    gemm_section,
    prefill_section,
)

ENGINE_KW = dict(
    max_model_len=8448, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.55
)  # gpu_suite.py's 8B start-up
PROMPTS = [[1, 450, 7483, 310, 278, 4799], list(range(100, 164))]


# ------------------------------------------------------------------------- start-up (child)
class Phases:
    """Wall seconds per phase, each exclusive of the phases nested in it; phases nested in the
    dry run are named "dry run: ..."."""

    def __init__(self) -> None:
        self.stack: list[list] = []
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.results: dict[str, object] = {}

    def wrap(self, owner, attr: str, label=None) -> None:  # noqa: ANN001
        import torch

        fn = getattr(owner, attr)

        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003
            name = label(args) if callable(label) else (label or attr)
            if any(s[0] == "parallel compile" for s in self.stack):
                name = f"dry run: {name}"
            self.stack.append([name, 0.0])
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                self.results[name] = out
                return out
            finally:
                dt = time.perf_counter() - t0
                _, nested = self.stack.pop()
                self.seconds[name] += dt - nested
                if self.stack:
                    self.stack[-1][1] += dt

        setattr(owner, attr, wrapped)


def child(parallel: bool) -> None:
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    t0 = time.perf_counter()
    import roofline.engine.llm_engine as le
    import roofline.worker.model_runner as mr
    from roofline import LLM, SamplingParams
    from roofline.kernels import count_jit_compiles
    from roofline.worker import cuda_graph, graph_mode, startup

    t_roofline = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    t_cuda = time.perf_counter() - t0

    ph = Phases()
    ph.wrap(le, "load_tokenizer", "tokenizer")
    ph.wrap(mr.ModelRunner, "__init__", "runner: KV pool, rest")
    ph.wrap(mr.ModelRunner, "_build_model", "model build (meta)")
    ph.wrap(mr, "materialize", "model on device (empty)")
    ph.wrap(mr, "init_dummy_weights", "weight init (random)")
    ph.wrap(startup.StartupCompiles, "run", "parallel compile")
    ph.wrap(mr.ModelRunner, "warmup", "warm-up forwards")
    ph.wrap(mr.ModelRunner, "capture_cuda_graphs", "capture: rest")
    ph.wrap(cuda_graph.DecodeGraphs, "capture", lambda a: f"capture: {type(a[0]).__name__}")
    ph.wrap(graph_mode.MixedStepPath, "capture", "capture: MixedGraphs")
    t0 = time.perf_counter()
    with count_jit_compiles() as compiled:
        llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **ENGINE_KW)
        torch.cuda.synchronize()
    t_engine = time.perf_counter() - t0
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with count_jit_compiles() as late:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = ph.results.get("parallel compile")
    report = {
        "parallel": parallel,
        "engine_s": t_engine,
        "process_s": time.perf_counter() - T_PROCESS,
        "phases": {
            "import torch": t_torch,
            "import roofline": t_roofline,
            "CUDA init": t_cuda,
            **ph.seconds,
            "engine, other": t_engine - sum(ph.seconds.values()),
        },
        "jit_compiles": len(compiled),
        "late_compiles": sorted(set(late)),
        "precompiled": None if stats is None else stats.num_kernels,
        "precompile_failed": None if stats is None else stats.num_failed,
        "compile_wait_s": None if stats is None else stats.wait_s,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "threads": os.cpu_count(),
    }
    print("STARTUP " + json.dumps(report), flush=True)


def run_child(cache_dir: str, parallel: bool, label: str) -> dict | None:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, ROOFLINE_PARALLEL_COMPILE=str(int(parallel)))
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(int(parallel))],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("STARTUP "):
            rep = json.loads(line[len("STARTUP ") :])
            rep["wall_s"] = wall
            print(f"  {label}: engine {rep['engine_s']:.1f} s, process {rep['process_s']:.1f} s "
                  f"(wall {wall:.1f} s), {rep['jit_compiles']} kernels compiled/loaded, "
                  f"precompiled {rep['precompiled']} ({rep['precompile_failed']} failed, "
                  f"waited {rep['compile_wait_s'] or 0:.2f} s after the dry run), "
                  f"late compiles {rep['late_compiles']}", flush=True)  # fmt: skip
            return rep
    print(f"  {label}: FAILED rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return None


def startup_section(quick: bool, baseline: bool = True) -> tuple[dict, str]:
    print("\n=== start-up: Llama-3.1-8B, dummy weights, fresh processes", flush=True)
    root = tempfile.mkdtemp(prefix="roofline-startup-")
    off_dir, on_dir = os.path.join(root, "off"), os.path.join(root, "on")
    runs = {}
    if baseline:
        runs["cold, before (sequential)"] = run_child(off_dir, False, "cold, sequential compiles")
    runs["cold, parallel"] = run_child(on_dir, True, "cold, parallel compiles")
    runs["warm, parallel"] = run_child(on_dir, True, "warm, parallel compiles")
    if not quick and baseline:
        runs["warm, before (sequential)"] = run_child(off_dir, False, "warm, sequential")
    good = {k: v for k, v in runs.items() if v is not None}
    names: list[str] = []
    for rep in good.values():
        names += [n for n in rep["phases"] if n not in names]
    cols = list(good)
    print(f"  {'phase (s)':>34} " + " ".join(f"{c[:16]:>16}" for c in cols))
    for n in names:
        vals = [good[c]["phases"].get(n) for c in cols]
        print(f"  {n[:34]:>34} " + " ".join(f"{'' if v is None else f'{v:.2f}':>16}" for v in vals))
    print(
        f"  {'engine construction':>34} " + " ".join(f"{good[c]['engine_s']:>16.2f}" for c in cols)
    )
    print(f"  {'whole process':>34} " + " ".join(f"{good[c]['process_s']:>16.2f}" for c in cols))
    toks = [tuple(map(tuple, r["tokens"])) for r in good.values()]
    same = len(set(toks)) == 1
    print(f"  greedy tokens identical across runs: {same}", flush=True)
    for c in cols:
        SUMMARY.append((f"8B start-up, {c}", f"{good[c]['engine_s']:.1f} s engine, "
                        f"{good[c]['process_s']:.1f} s process"))  # fmt: skip
    SUMMARY.append(("start-up tokens identical", str(same)))
    return good, on_dir


# ------------------------------------------------------------------------------ prefill
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the sequential start-ups")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(bool(args.child))
        return
    t_all = time.perf_counter()
    cache = None
    try:
        _, cache = startup_section(args.quick, not args.no_baseline)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        SUMMARY.append(("start-up", "FAILED"))
    if cache is not None:
        os.environ["TRITON_CACHE_DIR"] = cache  # warm: the parallel cold run filled it
    import torch

    from roofline import LLM
    from roofline.bench.ceilings import measure

    ceil = measure(torch.device("cuda"), torch.bfloat16)
    print(f"\nceilings: copy {ceil.bandwidth_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    try:
        kw = dict(ENGINE_KW, max_model_len=12288, gpu_memory_utilization=0.6)
        llm = LLM("llama-3.1-8b", load_format="dummy", device="cuda", **kw)
        prefill_section(llm, ceil, args.quick)
        chunk_attention_section()
        fresh_attention_section(args.quick)
        gemm_section(ceil)
        decode_section(llm, ceil)
    finally:
        print(f"\n=== summary ({time.perf_counter() - t_all:.0f} s)")
        for name, val in SUMMARY:
            print(f"  {name:>48}: {val}")


if __name__ == "__main__":
    main()

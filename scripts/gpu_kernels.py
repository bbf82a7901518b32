"""Issue 13's kernel work on one GPU: parity of the new kernels, the prefill attention sweep beside
torch SDPA, the whole-model 8192-token prefill against the matmul rate, and batch-1 decode of
Qwen3-0.6B and Llama-3.1-8B with the fused decode layer and PDL launches on and off (tok/s and
kernels per step). Every section runs in try/except and the summary table comes last.

    python scripts/gpu_kernels.py --quick   # ~2 min: 8k sweep, Qwen3-0.6B and 8B decode, 8B prefill
    python scripts/gpu_kernels.py           # < 4 min: 1k-16k sweep, chunked prefill, fp32 HF parity
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import itertools
import time
import traceback

import torch
import torch.nn.functional as F

from roofline.bench.ceilings import measure, time_fn
from roofline.kernels import gemv
from roofline.kernels import prefill_attention as pa
from roofline.kernels.prefill_attention import causal_attention_flops, prefill_attention
from roofline.layers import fused_decode

SUMMARY: list[tuple[str, str]] = []
DEV = torch.device("cuda")


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            print(f"\n=== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 - report and go on to the next section
                traceback.print_exc()
                SUMMARY.append((name, "FAILED"))
            finally:
                print(f"--- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
                gc.collect()
                torch.cuda.empty_cache()

        return run

    return wrap


# ---------------------------------------------------------------- parity
@section("parity: skinny GEMM norm prologue / residual epilogue / PDL")
def parity_gemv(shapes: list[tuple[int, int]], pdl_modes: tuple[bool, ...]) -> None:
    from roofline.kernels.gemv import skinny_gemm
    from roofline.kernels.rmsnorm import rms_norm

    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in shapes:
            gen = torch.Generator(device="cuda").manual_seed(n + k)
            x = 3 * torch.randn(1, k, device=DEV, generator=gen).to(dtype)
            w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(dtype)
            nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=gen)).to(dtype)
            res = torch.randn(1, n, device=DEV, generator=gen).to(dtype)
            unfused = skinny_gemm(rms_norm(x, nw, 1e-6), w)
            for pdl in pdl_modes:
                gemv.set_pdl(pdl)
                fused = skinny_gemm(x, w, norm=(nw, 1e-6))
                added = skinny_gemm(x, w, residual=res)
                plain = skinny_gemm(x, w)
                diff = (fused.float() - unfused.float()).abs().max().item()
                scale = unfused.float().abs().max().item()
                exact = torch.equal(fused, unfused)
                add_exact = torch.equal(added, plain + res)
                good = diff <= 2e-2 * scale and add_exact
                ok &= good
                print(f"  {str(dtype)[6:]:>8} N={n:>5} K={k:>5} pdl={int(pdl)}: norm-fused vs "
                      f"rms_norm+gemm max|d| {diff:.3g} (bit-exact {exact}), residual add "
                      f"bit-exact {add_exact}")  # fmt: skip
    gemv.set_pdl(False)
    SUMMARY.append((f"skinny GEMM fused parity, pdl {pdl_modes}", "ok" if ok else "MISMATCH"))


@section("parity: prefill attention (paged, chunked, GQA) vs torch reference")
def parity_prefill(configs: list[tuple]) -> None:
    from roofline.kernels.prefill_attention import prefill_attention_ref

    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        q_lens, ctx_lens, h, hk, d, ps = [300, 1, 77, 512], [0, 40, 1000, 257], 32, 8, 128, 16
        seq = [c + q for c, q in zip(ctx_lens, q_lens)]
        pages_per = [(s + ps - 1) // ps for s in seq]
        num_pages = sum(pages_per) + 3
        gen = torch.Generator(device="cuda").manual_seed(1)
        kc = torch.randn(num_pages, ps, hk, d, device=DEV, generator=gen).to(dtype)
        vc = torch.randn(num_pages, ps, hk, d, device=DEV, generator=gen).to(dtype)
        perm = torch.randperm(num_pages, device=DEV, generator=gen).to(torch.int32)
        bt = torch.zeros(len(seq), max(pages_per), dtype=torch.int32, device=DEV)
        off = 0
        for i, np_ in enumerate(pages_per):
            bt[i, :np_] = perm[off : off + np_]
            off += np_
        q = torch.randn(sum(q_lens), h, d, device=DEV, generator=gen).to(dtype)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq, dtype=torch.int32, device=DEV)
        ref = prefill_attention_ref(q, kc, vc, bt, qsl, sl, d**-0.5)
        # this step's own K/V rows, as the backend passes them to the "tma" variants
        k_new = torch.cat([kc[bt[i].long()].flatten(0, 1)[c : c + ql]
                           for i, (c, ql) in enumerate(zip(ctx_lens, q_lens))])  # fmt: skip
        v_new = torch.cat([vc[bt[i].long()].flatten(0, 1)[c : c + ql]
                           for i, (c, ql) in enumerate(zip(ctx_lens, q_lens))])  # fmt: skip
        new = dict(k_new=k_new, v_new=v_new)
        runs = [("default, no k_new (paged only)", {}), ("default", new),
                ("default config, tma", dict(new, variant="tma"))]  # fmt: skip
        if dtype == torch.bfloat16:  # fp32 takes its own (smaller) default tiles only
            runs += [(cfg_name(cfg), dict(cfg_kwargs(cfg), **new)) for cfg in configs]
        for name, kw in runs:
            out = prefill_attention(q, kc, vc, bt, qsl, sl, d**-0.5, max(q_lens), **kw)
            err = (out.float() - ref.float()).abs().max().item()
            good = err < (2e-2 if dtype == torch.bfloat16 else 1e-4)
            ok &= good
            print(f"  {str(dtype)[6:]:>8} {name}: max err {err:.3g} {'' if good else 'BAD'}")
    SUMMARY.append(("prefill attention parity", "ok" if ok else "MISMATCH"))


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn`` replayed ``reps`` times back to back in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return time_fn(g.replay, DEV, iters=10) / reps * 1e6


def _shape_us(n: int, k: int, kind: str) -> tuple[float, float, float]:
    """(plain, unfused, fused) us per call; 8 weights in rotation, so each call reads HBM."""
    from roofline.kernels.gemv import skinny_gemm
    from roofline.kernels.rmsnorm import fused_add_rms_norm

    dt = torch.bfloat16
    ws = [torch.randn(n, k, device=DEV, dtype=dt) / k**0.5 for _ in range(8)]
    x = torch.randn(1, k, device=DEV, dtype=dt)
    nw = torch.ones(k, device=DEV, dtype=dt)
    res = torch.randn(1, n, device=DEV, dtype=dt)
    it = itertools.cycle(ws)  # advanced at capture: the graph's calls rotate over the weights
    if kind == "norm":
        unfused = graph_us(lambda: skinny_gemm(fused_add_rms_norm(x, x, nw, 1e-6)[0], next(it)))
        fused = graph_us(lambda: skinny_gemm(x, next(it), norm=(nw, 1e-6)))
    else:
        unfused = graph_us(lambda: skinny_gemm(x, next(it)) + res)
        fused = graph_us(lambda: skinny_gemm(x, next(it), residual=res))
    return graph_us(lambda: skinny_gemm(x, next(it))), unfused, fused


@section("skinny GEMM micro-timings in CUDA graphs (us per call, bf16, M = 1)")
def gemv_timings(pdl_modes: tuple[bool, ...]) -> None:
    from roofline.kernels.gemv import TUNED_CONFIGS, skinny_gemm

    dt = torch.bfloat16
    # (N, K, kind): qkv / gate_up read a normed input, o / down produce a residual add
    shapes = [(4096, 1024, "norm"), (6144, 1024, "norm"), (1024, 2048, "add"),
              (1024, 3072, "add"), (6144, 4096, "norm"), (28672, 4096, "norm"),
              (4096, 4096, "add"), (4096, 14336, "add")]  # fmt: skip
    for pdl in pdl_modes:
        gemv.set_pdl(pdl)
        for n, k, kind in shapes:
            plain, unfused, fused = _shape_us(n, k, kind)
            tuned = (n, k, 1) in TUNED_CONFIGS
            other = "rmsnorm" if kind == "norm" else "add"
            print(f"  pdl={int(pdl)} N={n:>5} K={k:>5} {kind:>4}: plain {plain:6.2f}, unfused "
                  f"(+{other}) {unfused:6.2f}, fused {fused:6.2f} us "
                  f"({n * k * 2 / plain / 1e3:.0f} GB/s plain; tuned {tuned})")  # fmt: skip
    gemv.set_pdl(False)
    if True in pdl_modes:
        return
    # Qwen3-0.6B's LM head (no tuned config: cuBLAS today) against the skinny GEMM
    n, k = 151936, 1024
    w = torch.randn(n, k, device=DEV, dtype=dt) / k**0.5
    x = torch.randn(1, k, device=DEV, dtype=dt)
    row = [f"cuBLAS {graph_us(lambda: F.linear(x, w), reps=5):.1f}"]
    for bn, bk, nw_, st, dot in [(32, 512, 4, 5, False), (64, 256, 4, 4, True),
                                 (32, 256, 4, 4, True), (16, 512, 4, 4, False)]:  # fmt: skip
        t = graph_us(lambda c=(bn, bk, nw_, st, dot): skinny_gemm(
            x, w, block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3], use_dot=c[4]),
            reps=5)  # fmt: skip
        row.append(f"{bn}/{bk}/{nw_}/{st}/{'dot' if dot else 'fma'} {t:.1f}")
    print(f"  LM head 151936 x 1024, us ({n * k * 2 / 1e6:.0f} MB): " + " | ".join(row))


# ---------------------------------------------------------------- prefill attention sweep
# (BLOCK_M, BLOCK_N, num_warps, num_stages, variant); variant: see prefill_attention VARIANTS.
CONFIGS = [
    (128, 128, 8, 3, "base"), (128, 64, 4, 3, "base"), (128, 128, 8, 3, "tma"),
    (128, 128, 8, 3, "tma_hf"), (128, 64, 8, 3, "tma_hf"), (128, 128, 8, 2, "tma_hf"),
    (128, 64, 4, 3, "tma_hf"), (128, 64, 8, 4, "tma_hf"), (128, 128, 8, 3, "tma_ws"),
]  # fmt: skip
QUICK = [
    (128, 128, 8, 3, "base"), (128, 128, 8, 3, "tma"), (128, 128, 8, 3, "tma_hf"),
    (128, 64, 8, 3, "tma_hf"), (128, 128, 8, 2, "tma_hf"),
]  # fmt: skip
MODEL_CONFIGS = [(128, 128, 8, 3, "base"), (128, 128, 8, 3, "tma")]  # beside the default


def cfg_kwargs(cfg: tuple) -> dict:
    bm, bn, w, st, variant = cfg
    kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    if variant != "base":
        kw["variant"] = variant
    return kw


def cfg_name(cfg: tuple | None) -> str:
    if cfg is None:
        return "default config"
    if cfg[0] == 0:
        return cfg[4]
    bm, bn, w, st, variant = cfg
    return f"{bm}x{bn} w{w} s{st} {variant}"


def paged(n: int, h: int, hk: int, d: int, ps: int, dtype: torch.dtype):
    q = torch.randn(n, h, d, device=DEV, dtype=dtype)
    k = torch.randn(n, hk, d, device=DEV, dtype=dtype)
    v = torch.randn(n, hk, d, device=DEV, dtype=dtype)
    pages = torch.randperm(n // ps, device=DEV, dtype=torch.int32)
    kc = torch.empty(n // ps, ps, hk, d, device=DEV, dtype=dtype)
    vc = torch.empty_like(kc)
    kc[pages.long()] = k.view(n // ps, ps, hk, d)
    vc[pages.long()] = v.view(n // ps, ps, hk, d)
    return q, k, v, kc, vc, pages[None]


def tflops_of(fn, flops: int) -> float:
    return flops / time_fn(fn, DEV, iters=5) / 1e12


def sdpa_tflops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flops: int, backend) -> float:
    """torch SDPA on contiguous [1, H, N, D] tensors, K/V repeated to every query head."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None].contiguous()
    kh, vh = (t.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous() for t in (k, v))

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    if backend is None:
        return tflops_of(run, flops)
    with torch.nn.attention.sdpa_kernel(backend):
        return tflops_of(run, flops)


def ours_tflops(args: tuple, kw: dict, flops: int) -> float:
    return tflops_of(lambda: prefill_attention(*args, **kw), flops)


@section("prefill attention: configs x lengths beside SDPA (bf16, 32/8 heads, d 128, page 16)")
def sweep_prefill(lengths: list[int], configs: list[tuple]) -> None:
    h, hk, d, ps = 32, 8, 128, 16
    table: dict[str, list[str]] = collections.defaultdict(list)
    best_at_8k: tuple[float, str] = (0.0, "")
    for n in lengths:
        q, k, v, kc, vc, bt = paged(n, h, hk, d, ps, torch.bfloat16)
        qsl = torch.tensor([0, n], device=DEV, dtype=torch.int32)
        sl = torch.tensor([n], device=DEV, dtype=torch.int32)
        flops = causal_attention_flops([n], [n], h, d)
        backends = torch.nn.attention.SDPBackend
        for name, backend in (
            ("SDPA default (contiguous)", None),
            ("SDPA flash (contiguous)", backends.FLASH_ATTENTION),
            ("SDPA cudnn (contiguous)", backends.CUDNN_ATTENTION),
        ):
            try:
                table[name].append(f"{sdpa_tflops(q, k, v, flops, backend):.0f}")
            except Exception as e:  # noqa: BLE001
                table[name].append("err")
                print(f"  {name} at {n}: {type(e).__name__}: {e}"[:200])
        args = (q, kc, vc, bt, qsl, sl, d**-0.5, n)
        new = dict(k_new=k, v_new=v)
        table["shipped default"].append(f"{ours_tflops(args, new, flops):.0f}")
        table["default, paged only"].append(f"{ours_tflops(args, {}, flops):.0f}")
        for cfg in configs:
            kw = dict(cfg_kwargs(cfg), k_new=k, v_new=v)
            try:
                tf = ours_tflops(args, kw, flops)
                table[cfg_name(cfg)].append(f"{tf:.0f}" if tf >= 1 else f"{tf:.2g}")
                if n == 8192 and tf > best_at_8k[0]:
                    best_at_8k = (tf, cfg_name(cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                table[cfg_name(cfg)].append("err")
                print(f"  {cfg_name(cfg)} at {n}: {type(e).__name__}: {e}"[:300])
        del q, k, v, kc, vc
    print(f"  TFLOP/s (causal, useful FLOPs) at {lengths} tokens:")
    for name, cols in table.items():
        print(f"  {name:>28}: " + " ".join(f"{c:>6}" for c in cols))
    if best_at_8k[0]:
        SUMMARY.append(("best prefill config at 8k", f"{best_at_8k[1]}: {best_at_8k[0]:.0f} TF/s"))
    for name in ("SDPA default (contiguous)", "SDPA flash (contiguous)", "shipped default"):
        if name in table and 8192 in lengths:
            SUMMARY.append((f"{name} at 8k", f"{table[name][lengths.index(8192)]} TF/s"))


@section("chunked prefill over a cached prefix (paged): 2 x 4096-token chunks of an 8k prompt")
def chunked_prefill(configs: list[tuple]) -> None:
    h, hk, d, ps, n, chunk = 32, 8, 128, 16, 8192, 4096
    q, k, v, kc, vc, bt = paged(n, h, hk, d, ps, torch.bfloat16)
    for ctx in (0, 4096):
        qsl = torch.tensor([0, chunk], device=DEV, dtype=torch.int32)
        sl = torch.tensor([ctx + chunk], device=DEV, dtype=torch.int32)
        flops = causal_attention_flops([ctx + chunk], [chunk], h, d)
        args = (q[ctx : ctx + chunk], kc, vc, bt, qsl, sl, d**-0.5, chunk)
        new = dict(k_new=k[ctx : ctx + chunk], v_new=v[ctx : ctx + chunk])
        row = []
        for cfg in [None, *configs]:
            kw = new if cfg is None else dict(cfg_kwargs(cfg), **new)
            try:
                row.append(f"{cfg_name(cfg)} {ours_tflops(args, kw, flops):.0f}")
            except Exception as e:  # noqa: BLE001
                row.append(f"{cfg_name(cfg)} err {type(e).__name__}")
        print(f"  chunk at context {ctx}: TFLOP/s " + " | ".join(row))


# ---------------------------------------------------------------- engine measurements
def load(model: str, **kw):
    from roofline import LLM

    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", device="cuda", **kw)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - t0


def kernels_per_step(engine, steps: int = 10, top_n: int = 8) -> tuple[float, float, list[str]]:
    """(kernels per step, kernel-busy ms per step, top kernels) of decode steps, torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
    count = sum(len(v) for v in per_name.values()) / steps
    busy = sum(sum(v) for v in per_name.values()) / steps / 1e3
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    lines = [f"{sum(t) / steps:8.1f} us/step {len(t) / steps:5.0f}x {sum(t) / len(t):6.1f} us  "
             f"{n[:90]}" for n, t in top]  # fmt: skip
    return count, busy, lines


def _step_logprobs(lp: dict) -> list[tuple[int, float]]:
    """A step's {token: Logprob} as sorted (token, logprob) pairs."""
    return sorted((int(t), float(getattr(v, "logprob", v))) for t, v in lp.items())


MODES = {  # name -> (fused decode layer, PDL launches)
    "baseline": (False, False),
    "fused": (True, False),
    "fused+pdl": (True, True),
}


def set_mode(engine, mode: str) -> None:
    fused, pdl = MODES[mode]
    fused_decode.set_enabled(fused)
    gemv.set_pdl(pdl)
    engine.runner.capture_cuda_graphs()  # the graphs hold the kernels of the mode


def load_8b():
    return load("llama-3.1-8b", max_model_len=8448, max_num_seqs=8, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.6)  # fmt: skip


@section("batch-1 decode: fused decode layer and PDL on/off")
def decode(model: str, ceil, out_len: int, modes: list[str], loaded=None):
    from roofline import SamplingParams
    from roofline.bench import latency

    if loaded is None:
        loaded = load(model, max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.6)
    llm, t_load = loaded
    engine = llm.llm_engine
    print(f"  {model}: start-up {t_load:.1f} s (dummy weights, graphs captured)")
    for mode in modes:
        try:
            set_mode(engine, mode)
            rows = latency.run(engine, ceil, [1], 128, out_len)
            r = rows[0]
            engine.add_request(f"prof-{mode}", list(range(10, 138)),
                               SamplingParams(max_tokens=40, temperature=0.0,
                                              ignore_eos=True))  # fmt: skip
            engine.step()  # prefill
            count, busy, top = kernels_per_step(engine, top_n=30 if "qwen3" in model else 10)
            while engine.has_unfinished_requests():
                engine.step()
            print(f"  {model} {mode:>10}: {r.step_ms_p50:.3f} ms/step p50, "
                  f"{r.output_tok_s:.1f} tok/s, {r.roofline_pct:.1f}% of roofline "
                  f"({r.roofline_step_ms:.3f} ms), {count:.0f} kernels/step, "
                  f"{busy:.3f} ms kernel-busy/step")  # fmt: skip
            for line in top:
                print("      " + line)
            SUMMARY.append((f"{model} bs1 {mode}", f"{r.output_tok_s:.1f} tok/s, "
                            f"{count:.0f} kernels/step"))  # fmt: skip
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            SUMMARY.append((f"{model} bs1 {mode}", "FAILED"))
    # greedy tokens (and their logprobs, bit for bit) of the modes against each other, each
    # from an empty prefix cache so every mode runs the same prefill
    try:
        outs = {}
        params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=1, ignore_eos=True)
        for mode in dict.fromkeys(["baseline", "fused", *modes]):
            set_mode(engine, mode)
            engine.kv_manager.reset_prefix_cache()
            res = llm.generate([list(range(20, 84))], params, use_tqdm=False)[0].outputs[0]
            outs[mode] = (res.token_ids, [_step_logprobs(lp) for lp in res.logprobs or []])
        for mode in outs:
            ref = "fused" if mode == "fused+pdl" else "baseline"
            same_tokens = outs[mode][0] == outs[ref][0]
            same_lps = outs[mode][1] == outs[ref][1]
            print(f"  {model} {mode} vs {ref}: greedy 32 tokens equal {same_tokens}, "
                  f"logprobs bit-equal {same_lps}")  # fmt: skip
            if mode == "fused+pdl":
                SUMMARY.append((f"{model} PDL vs no PDL logprobs", "bit-equal" if same_lps else
                                "DIFFERENT"))  # fmt: skip
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    fused_decode.set_enabled(True)
    gemv.set_pdl(False)
    engine.runner.capture_cuda_graphs()


@section("whole-model prefill: Llama-3.1-8B, one 8192-token prompt, % of matmul rate")
def model_prefill(ceil, configs: list[tuple], llm) -> None:
    from roofline import SamplingParams
    from roofline.planner.roofline import step_cost

    engine = llm.llm_engine
    prompt = list(range(100, 100 + 8192))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt[:512]], params, use_tqdm=False)
    cost = step_cost(engine.model_config, ceil.as_gpu_spec(), num_prefill_tokens=8192)
    original = pa._pick_config
    default_variant = pa.DEFAULT_VARIANT
    backend_mod = importlib.import_module("roofline.attention.triton_backend")
    backend_fn = backend_mod.prefill_attention

    def sdpa_prefill(q, k_cache, v_cache, block_table, qsl, seq_lens, scale, max_query_len, **kw):  # noqa: ANN001, ANN003 - measuring stick: torch SDPA on one fresh prompt
        k_new, v_new = kw.get("k_new"), kw.get("v_new")
        if qsl.shape[0] != 2 or max_query_len != q.shape[0] or k_new is None:
            return backend_fn(q, k_cache, v_cache, block_table, qsl, seq_lens, scale,
                              max_query_len, **kw)  # fmt: skip
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k_new, v_new))  # [1, H, N, D] views
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=True)  # fmt: skip
        return o[0].transpose(0, 1)

    print(f"  default variant: {default_variant}, default bf16 tiles: "
          f"{original(torch.bfloat16, 128, 8192)}")  # fmt: skip
    for cfg in [None, *configs, (0, 0, 0, 0, "torch SDPA (reference point, not shipped)")]:
        if cfg is not None and cfg[0] == 0:
            backend_mod.prefill_attention = sdpa_prefill
        elif cfg is not None:
            bm, bn, w, st, variant = cfg

            def pick(dtype, head_dim, max_query_len, _c=(bm, bn, w, st)):  # noqa: ANN001
                return _c if max_query_len >= 128 else original(dtype, head_dim, max_query_len)

            pa._pick_config = pick
            pa.DEFAULT_VARIANT = variant
        try:
            llm.generate([prompt[:1024]], params, use_tqdm=False)  # compiles this config
            times = []
            for i in range(3):
                engine.kv_manager.reset_prefix_cache()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate([[5 + i] + prompt[1:]], params, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            t = sorted(times)[1]
            pct = 100 * cost.flops / t / ceil.matmul_flops_per_s
            print(f"  {cfg_name(cfg)}: {t * 1e3:.1f} ms, {cost.flops / t / 1e12:.0f} TFLOP/s "
                  f"= {pct:.1f}% of matmul")  # fmt: skip
            SUMMARY.append((f"8B prefill 8192, {cfg_name(cfg)}", f"{t * 1e3:.0f} ms, {pct:.1f}%"))
        finally:
            pa._pick_config = original
            pa.DEFAULT_VARIANT = default_variant
            backend_mod.prefill_attention = backend_fn


@section("where the 8192-token prefill goes (Llama-3.1-8B, torch.profiler, default variant)")
def prefill_profile(llm) -> None:
    from torch.profiler import ProfilerActivity, profile

    from roofline import SamplingParams

    engine = llm.llm_engine
    prompt = [7] + list(range(101, 101 + 8191))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.kv_manager.reset_prefix_cache()
    llm.generate([prompt], params, use_tqdm=False)
    engine.kv_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    per_name: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] += e.device_time
            calls[e.name] += 1
    groups = {"attention": ("_prefill",), "rmsnorm": ("rms_norm",),
              "rope+kv store": ("rotary", "kv_store", "store_kv"), "silu*mul": ("silu",),
              "GEMM": ("gemm", "nvjet", "cutlass", "sm90", "xmma", "skinny")}  # fmt: skip
    totals: dict[str, float] = collections.defaultdict(float)
    for name, us in per_name.items():
        low = name.lower()
        group = next((g for g, keys in groups.items() if any(k in low for k in keys)), "other")
        totals[group] += us
    total = sum(totals.values())
    print(f"  kernel time {total / 1e3:.1f} ms: " + ", ".join(
        f"{g} {t / 1e3:.1f} ms ({100 * t / total:.0f}%)"
        for g, t in sorted(totals.items(), key=lambda kv: -kv[1])))  # fmt: skip
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:14]:
        print(f"    {us / 1e3:7.2f} ms {calls[name]:4d}x  {name[:100]}")
    # the prefill's GEMM shapes on their own (cuBLAS through torch), against the ceiling's square
    dt, rows = torch.bfloat16, 8192
    for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                       ("down", 4096, 14336)]:  # fmt: skip
        a = torch.randn(rows, k, device=DEV, dtype=dt)
        w = torch.randn(n, k, device=DEV, dtype=dt)
        t = time_fn(lambda a=a, w=w: F.linear(a, w), DEV, iters=10)
        print(f"    GEMM {name:>7} [{rows} x {k}] x [{k} x {n}]: {t * 1e3:.3f} ms, "
              f"{2 * rows * n * k / t / 1e12:.0f} TFLOP/s")  # fmt: skip
        del a, w
    by_op = sorted(totals.items(), key=lambda kv: -kv[1])
    SUMMARY.append(
        ("8B prefill kernel time by op", ", ".join(f"{g} {t / 1e3:.0f} ms" for g, t in by_op))
    )


@section("parity tests on the GPU (pytest)")
def gpu_tests(files: list[str]) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *files], capture_output=True, text=True, timeout=150)  # fmt: skip
    print("\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:]))
    SUMMARY.append(("pytest " + " ".join(f.rsplit("/", 1)[-1] for f in files),
                    "passed" if proc.returncode == 0 else f"rc {proc.returncode}"))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceil = measure(DEV, torch.bfloat16)
    bw, mm = ceil.bandwidth_bytes_per_s / 1e12, ceil.matmul_flops_per_s / 1e12
    print(f"{torch.cuda.get_device_name()}: copy {bw:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s, "
          f"torch {torch.__version__}")  # fmt: skip
    SUMMARY.append(("matmul ceiling", f"{ceil.matmul_flops_per_s / 1e12:.0f} TF/s"))
    quick = args.quick
    shapes = [(4096, 1024), (6144, 4096)]
    shapes = shapes if quick else [*shapes, (1000, 4100)]
    parity_gemv(shapes, (False,))
    gemv_timings((False,))
    parity_prefill([] if quick else QUICK)
    sweep_prefill([8192] if quick else [1024, 4096, 8192, 16384], QUICK if quick else CONFIGS)
    if not quick:
        chunked_prefill(QUICK)
    out_len = 128 if quick else 256
    decode("qwen3-0.6b", ceil, out_len, ["baseline", "fused"])
    gc.collect()
    torch.cuda.empty_cache()
    loaded = None
    try:
        loaded = load_8b()
        print(f"llama-3.1-8b start-up {loaded[1]:.1f} s (dummy weights, graphs captured)")
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if loaded is not None:
        decode("llama-3.1-8b", ceil, out_len, ["baseline", "fused"], loaded)
        model_prefill(ceil, MODEL_CONFIGS, loaded[0])
        prefill_profile(loaded[0])
        # PDL last: a launch problem there cannot cost the figures above
        parity_gemv(shapes, (True,))
        decode("llama-3.1-8b", ceil, out_len, ["fused+pdl"], loaded)
        del loaded
    gc.collect()
    torch.cuda.empty_cache()
    decode("qwen3-0.6b", ceil, out_len, ["fused+pdl"])
    gc.collect()
    torch.cuda.empty_cache()
    if not quick:
        gpu_tests(["tests/e2e/test_gpu_parity.py"])  # fp32 greedy = HF, the default variants
    print(f"\n=== summary ({time.perf_counter() - t_start:.0f} s)")
    for name, value in SUMMARY:
        print(f"  {name:<48} {value}")


if __name__ == "__main__":
    main()

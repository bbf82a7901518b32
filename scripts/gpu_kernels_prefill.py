"""The prefill half of ``scripts/gpu_kernels.py`` (imported by it, not run alone): prefill
attention parity and tile/variant sweep beside torch SDPA, chunked prefill over a cached prefix,
the whole-model 8192-token prefill per variant and where its kernel time goes. Also the shared
section runner and summary table."""

from __future__ import annotations

import collections
import importlib
import itertools
import time

import torch
import torch.nn.functional as F
from gpu_common import sections  # scripts/ is on sys.path when run as a script

from roofline.bench.ceilings import time_fn
from roofline.kernels import prefill_attention as pa
from roofline.kernels.prefill_attention import causal_attention_flops, prefill_attention

SUMMARY: list[tuple[str, str]] = []
DEV = torch.device("cuda")


section = sections(
    lambda name, e: SUMMARY.append((name, "FAILED")),
    footer="--- {name}: {seconds:.1f} s",
    free_cuda=True,
)


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

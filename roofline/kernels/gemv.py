"""Skinny GEMM for decode: ``out[M, N] = x[M, K] @ weight[N, K]^T (+ bias)`` for M <= 16.

At decode batch sizes a linear layer is a pure weight read (M * K activations against N * K
weights), so the figure of merit is HBM bandwidth. One launch, no split-K and no reduction
kernel: program ``p`` owns the output columns ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` for BLOCK_M
rows of x (a second grid axis takes further row blocks when M > 16) and walks the whole of K in
``[BLOCK_N, BLOCK_K]`` weight tiles, each tile row a contiguous run of BLOCK_K elements (16-byte
vectors, whole 128-byte lines per warp). The loop is a ``tl.range(num_stages=...)``, so Triton
copies the next ``num_stages - 1`` tiles to shared memory (``cp.async``) while it reduces the
current one: a program keeps several tiles in flight without holding them in registers. The
weight loads are hinted ``evict_first`` (read once; the hint only reaches plain loads, not
``cp.async``); x, re-read by every program, stays in L2.

Two ways to reduce a tile (``use_dot``):

* tensor cores (default for bf16/fp16): ``tl.dot(x_tile, w_tile^T)``, fp32 accumulation. Triton
  (3.6) pads M or N below 16 itself, so any power-of-two BLOCK_M / BLOCK_N works and small N
  can still spread over every SM.
* CUDA cores (always for fp32, which must not round through TF32): with one row of x the
  products are accumulated elementwise in a ``[BLOCK_N, BLOCK_K]`` fp32 tile and reduced over K
  once after the loop; with more rows, a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` product is summed over
  K at every step.

Each output is reduced by one program in a fixed order: deterministic, independent of the grid,
and capturable in a CUDA graph (no host sync; nothing is allocated but ``out``). Weight rows past
N and x rows past M are clamped to the last valid row rather than masked (their results are
never stored), so the main loop carries no masks; a K that is not a multiple of BLOCK_K gets one
peeled, masked step. Accumulation is fp32; the bias is added in fp32; the result is rounded once
to x's dtype.

With ``silu_mul=True`` (``SILU_MUL``), x is an MLP's gate/up GEMM output ``[M, 2K]`` and the
kernel multiplies the weight by ``silu(x[:, :K]) * x[:, K:]``, computed for each K tile as it is
loaded (a prologue: decode runs no separate ``silu_and_mul`` launch). It rounds exactly as
``kernels.activation.silu_and_mul`` does (SiLU in fp32 with libdevice's ``expf``, an IEEE add and
division, rounded to x's dtype; the product rounded again), so the result has the bits of
``silu_and_mul`` followed by ``skinny_gemm`` with the same config. ``silu_and_mul`` is compiled
without FP fusion and this kernel with it (its FMAs), so the one add a fusion could touch (``1 +
expf``, whose ``expf`` ends with a multiply) is written as PTX ``add.rn.f32``, never contracted.
The SiLU runs once per loaded element, in the load layout (see ``_silu_mul``).

Configs: ``TUNED_CONFIGS[(N, K, m_bucket(M))]``, measured on an H100 by ``scripts/gemv_bench.py``,
else ``heuristic_config``: at least 1.5 programs per SM, 4 to 32 KiB weight tiles.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.activation import _expf, silu_and_mul_ref
from roofline.kernels.pdl import pdl_enabled, prefetch_l2

MAX_BLOCK_M = 16  # rows of x per program; larger M takes a second grid axis (re-reading W)
NORM_UNROLL = os.environ.get("ROOFLINE_GEMV_NORM_UNROLL", "1") != "0"
"""The RMSNorm prologue's statistic loads unrolled (all in flight before the first add; at
K / BLOCK_K = 16 steps a loop waits for one L2 round trip per step)."""


def _norm_steps(k: int, block_k: int) -> int:
    """The unrolled statistic's steps (0: the loop), at most 64."""
    steps = triton.cdiv(k, block_k)
    return steps if NORM_UNROLL and steps <= 64 else 0


MIN_PROGRAMS_PER_SM = 1.5  # the heuristic's BLOCK_N keeps at least this many programs per SM

# (N, K, m_bucket) -> (block_n, block_k, num_warps, num_stages, use_dot), measured on an H100
# (bf16, CUDA graph of back-to-back calls, weights not in L2) by scripts/gemv_bench.py.
# Llama-3.1-8B (qkv, o, gate_up, down, lm_head) and Qwen3-0.6B (qkv, o, gate_up, down), 2026-11-22.
TUNED_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, bool]] = {
    (6144, 4096, 1): (8, 256, 4, 3, False),
    (6144, 4096, 2): (32, 256, 4, 3, True),
    (6144, 4096, 4): (16, 256, 4, 4, True),
    (6144, 4096, 8): (16, 256, 4, 3, True),
    (4096, 4096, 1): (8, 512, 4, 3, False),
    (4096, 4096, 2): (32, 256, 4, 5, True),
    (4096, 4096, 4): (32, 256, 4, 5, True),
    (4096, 4096, 8): (32, 256, 4, 5, True),
    (28672, 4096, 1): (32, 512, 4, 5, False),
    (28672, 4096, 2): (128, 256, 4, 3, True),
    (28672, 4096, 4): (128, 256, 4, 3, True),
    (28672, 4096, 8): (32, 256, 4, 3, True),
    (4096, 14336, 1): (8, 512, 4, 3, False),
    (4096, 14336, 2): (32, 256, 4, 5, True),
    (4096, 14336, 4): (32, 256, 4, 5, True),
    (4096, 14336, 8): (16, 256, 4, 5, True),
    (128256, 4096, 1): (32, 512, 4, 5, False),
    (128256, 4096, 2): (32, 512, 4, 5, True),
    (128256, 4096, 4): (32, 512, 4, 5, True),
    (128256, 4096, 8): (32, 512, 8, 5, True),
    (4096, 1024, 1): (8, 512, 4, 3, False),
    (4096, 1024, 2): (32, 256, 4, 5, True),
    (4096, 1024, 4): (32, 256, 4, 5, True),
    (4096, 1024, 8): (32, 256, 4, 5, True),
    (1024, 2048, 1): (4, 512, 4, 5, False),
    (1024, 2048, 2): (8, 512, 4, 3, True),
    (1024, 2048, 4): (8, 256, 4, 5, True),
    (1024, 2048, 8): (8, 512, 4, 3, True),
    (6144, 1024, 1): (8, 512, 4, 3, False),
    (6144, 1024, 2): (32, 256, 4, 3, True),
    (6144, 1024, 4): (16, 256, 4, 3, True),
    (6144, 1024, 8): (16, 256, 4, 3, True),
    (1024, 3072, 1): (4, 512, 4, 5, False),
    (1024, 3072, 2): (8, 512, 4, 3, True),
    (1024, 3072, 4): (8, 256, 4, 5, True),
    (1024, 3072, 8): (8, 512, 4, 3, True),
    # Qwen3-0.6B's LM head and Qwen3-30B-A3B's attention, router and head (2026-11-24)
    (151936, 1024, 1): (128, 256, 4, 3, True),
    (151936, 1024, 2): (128, 256, 4, 3, True),
    (151936, 1024, 4): (128, 256, 4, 3, True),
    (151936, 1024, 8): (128, 256, 4, 3, True),
    (5120, 2048, 1): (8, 512, 4, 3, False),
    (5120, 2048, 2): (32, 256, 4, 3, True),
    (5120, 2048, 4): (16, 256, 4, 4, True),
    (5120, 2048, 8): (16, 256, 4, 3, True),
    (2048, 4096, 1): (4, 512, 4, 5, False),
    (2048, 4096, 2): (16, 256, 4, 5, True),
    (2048, 4096, 4): (16, 256, 4, 5, True),
    (2048, 4096, 8): (16, 256, 4, 5, True),
    (128, 2048, 1): (2, 512, 4, 5, False),
    (128, 2048, 2): (1, 512, 4, 3, True),
    (128, 2048, 4): (2, 512, 4, 3, True),
    (128, 2048, 8): (1, 512, 4, 3, True),
    (151936, 2048, 1): (64, 512, 4, 3, True),
    (151936, 2048, 2): (32, 512, 4, 5, True),
    (151936, 2048, 4): (64, 512, 4, 3, True),
    (151936, 2048, 8): (64, 512, 4, 3, True),
}


class SkinnyConfig(NamedTuple):
    block_n: int  # output columns (weight rows) per program, a power of two
    block_k: int  # reduction elements per step, a power of two; >= 64 for 16-byte vectors
    num_warps: int
    num_stages: int  # K-loop software pipelining: num_stages - 1 weight tiles in flight
    use_dot: bool  # tensor cores (tl.dot) vs CUDA-core FMAs; ignored (False) for fp32


def skinny_gemm_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """fp32 matmul of the (exactly widened) inputs, bias added in fp32, rounded once."""
    out = x.float() @ weight.float().T  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def silu_mul_skinny_gemm_ref(
    gate_up: torch.Tensor,  # [M, 2K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in gate_up's dtype
    """``F.silu(gate) * up`` in the input dtype (eager rounding), then ``skinny_gemm_ref``."""
    return skinny_gemm_ref(silu_and_mul_ref(gate_up), weight, bias)


@triton.jit
def _one_plus(e, LIBDEVICE: tl.constexpr):
    """fp32 ``1 + e`` as ``silu_and_mul`` (compiled without FP fusion) computes it: PTX
    ``add.rn.f32``, which is never contracted with the multiply ending ``expf`` into an FMA (this
    kernel keeps FP fusion on for its own FMAs). A plain add in the interpreter."""
    if LIBDEVICE:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, 0f3F800000;", "=r,r", [e], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 + e


@triton.jit
def _first(a, b):
    return a


@triton.jit
def _silu_mul(gate, up, LIBDEVICE: tl.constexpr, USE_DOT: tl.constexpr):
    """``silu(gate) * up`` in gate's dtype, op for op as ``_silu_and_mul_kernel`` rounds it: the
    SiLU ``g / (1 + expf(-g))`` in fp32 rounded to the dtype, then the product in fp32, rounded.

    gate, up: [BM, BK]. For tl.dot, the reduction over an axis of one element at the end (the
    identity: it never calls its combine function) is there for the compiler: Triton would
    otherwise compute the whole prologue in the dot's operand layout, where every value is
    replicated over warps and lanes (16 times the exp and division work at BLOCK_M = 2). Layout
    propagation does not cross a reduction, so the SiLU runs once per element, in the load
    layout, and only its result is converted. The CUDA-core paths compute it once per element
    without it, and must go without: on the H100 their M > 1 path's bits changed with it (the
    same [BM, BN, BK] layout, so most likely FMAs contracted from other products); the
    interpreter has no layouts."""
    g = gate.to(tl.float32)
    act = tl.math.div_rn(g, _one_plus(_expf(-g, LIBDEVICE), LIBDEVICE))
    act = act.to(gate.dtype).to(tl.float32)
    x = (act * up.to(tl.float32)).to(gate.dtype)
    if LIBDEVICE and USE_DOT:
        x = tl.reduce(tl.reshape(x, (x.shape[0], 1, x.shape[1])), 1, _first)
    return x


@triton.jit
def _accumulate(acc, x, w, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """acc += x @ w^T for one K step; x: [BLOCK_M, BLOCK_K], w: [BLOCK_N, BLOCK_K].

    acc is [BLOCK_M, BLOCK_N] fp32, except on CUDA cores with BLOCK_M == 1, where it is the
    unreduced [BLOCK_N, BLOCK_K] fp32 tile of products (summed over K after the loop)."""
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w), acc)
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)  # [BN, BK] * [1, BK]
    else:
        prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
        acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _mul_rn(a, b, LIBDEVICE: tl.constexpr):
    """fp32 ``a * b`` rounded on its own (PTX ``mul.rn.f32``: never contracted into an FMA with
    the add that follows, as the RMSNorm kernel, compiled without FP fusion, computes squares)."""
    if LIBDEVICE:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _rms_norm_tile(x, w_ptrs, rstd, mask_k, MASKED: tl.constexpr):
    """``weight * (x * rstd).to(dtype)`` for one [BM, BK] tile, rounded as ``rms_norm`` does."""
    if MASKED:
        w = tl.load(w_ptrs, mask=mask_k, other=0.0).to(tl.float32)  # [1, BK]
    else:
        w = tl.load(w_ptrs).to(tl.float32)
    normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
    return (normed * w).to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] ([M, 2K] gate | up if SILU_MUL), rows stride_xm apart, contiguous
    w_ptr,  # [N, K], rows stride_wn apart, contiguous
    bias_ptr,  # [N] (read only if HAS_BIAS)
    out_ptr,  # [M, N], rows stride_om apart, contiguous
    norm_w_ptr,  # [K] RMSNorm weight (read only if RMS_NORM)
    residual_ptr,  # [M, N] added to the result (read only if ADD_RESIDUAL)
    M,  # not specialized: M = 1 and M = 3 share a compiled kernel of the same BLOCK_M
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    inv_k,  # fp32(1 / K): RMSNorm's mean factor
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no tail step (and fewer registers)
    SILU_MUL: tl.constexpr,  # x holds [gate | up]; the GEMM's x is silu(gate) * up
    LIBDEVICE: tl.constexpr,  # compiled SILU_MUL: libdevice expf, PTX add (not interpreted)
    RMS_NORM: tl.constexpr,  # x is the residual stream; the GEMM's x is rms_norm(x) * norm_w
    ADD_RESIDUAL: tl.constexpr,  # out = residual + (x @ w^T) rounded, as a separate add stores
    PDL: tl.constexpr,  # launched as a programmatic dependent: prefetch, then wait
    PREFETCH_LINES: tl.constexpr,  # 128-byte weight lines per row prefetched before the wait
    LINE_ELEMS: tl.constexpr,  # weight elements per 128-byte line
    NORM_STEPS: tl.constexpr = 0,  # RMS_NORM: cdiv(K, BLOCK_K) unrolled statistic steps; 0: a loop
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: padding re-reads row N - 1
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if PDL:
        # The weight does not depend on the previous kernel: pull the start of this program's
        # rows into L2 while that kernel finishes, let the next kernel's programs launch, and
        # only then wait for the previous kernel's writes (x, residual).
        offs_l = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE_ELEMS, K - 1)  # [LINES]
        prefetch_l2(w_ptr + rows_n[:, None] * stride_wn + offs_l[None, :])  # [BN, LINES]
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # [BM, BN] outputs
    if ADD_RESIDUAL:  # loaded now, with x: not a second round trip after the loop
        r_ptrs = residual_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
    if RMS_NORM:  # the rows' fp32 statistic, as rms_norm: sum of rounded squares * (1 / K)
        sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        if NORM_STEPS > 0:  # unrolled, the same order: every load in flight at once
            for k0 in tl.static_range(0, NORM_STEPS * BLOCK_K, BLOCK_K):
                xk = tl.load(x_ptrs + k0, mask=offs_k[None, :] < K - k0, other=0.0)
                sq += _mul_rn(xk.to(tl.float32), xk.to(tl.float32), LIBDEVICE)
        else:  # one dependent L2 round trip a step
            for k0 in range(0, K, BLOCK_K):
                xk = tl.load(x_ptrs + k0, mask=offs_k[None, :] < K - k0, other=0.0).to(tl.float32)
                sq += _mul_rn(xk, xk, LIBDEVICE)
        rstd = tl.rsqrt(tl.sum(sq, axis=1) * inv_k + eps)  # [BM]
        nw_ptrs = norm_w_ptr + offs_k[None, :]  # [1, BK]

    if USE_DOT or BLOCK_M > 1:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_main = K - K % BLOCK_K
    for _ in tl.range(0, k_main, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs, eviction_policy="evict_first")  # [BN, BK]
        if SILU_MUL:
            x = _silu_mul(tl.load(x_ptrs), tl.load(x_ptrs + K), LIBDEVICE, USE_DOT)  # [BM, BK]
        elif RMS_NORM:
            x = _rms_norm_tile(tl.load(x_ptrs), nw_ptrs, rstd, None, False)
            nw_ptrs += BLOCK_K
        else:
            x = tl.load(x_ptrs)  # [BM, BK]
        acc = _accumulate(acc, x, w, BLOCK_M, USE_DOT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not EVEN_K:
        mask_k = offs_k[None, :] < K - k_main  # [1, BK]
        w = tl.load(w_ptrs, mask=mask_k, other=0.0)
        if SILU_MUL:  # silu(0) * 0 = 0 past K, as a zero-padded x
            gate = tl.load(x_ptrs, mask=mask_k, other=0.0)
            up = tl.load(x_ptrs + K, mask=mask_k, other=0.0)
            x = _silu_mul(gate, up, LIBDEVICE, USE_DOT)
        elif RMS_NORM:  # weight 0 past K: normed x 0 there
            x = _rms_norm_tile(tl.load(x_ptrs, mask=mask_k, other=0.0), nw_ptrs, rstd, mask_k, True)
        else:
            x = tl.load(x_ptrs, mask=mask_k, other=0.0)
        acc = _accumulate(acc, x, w, BLOCK_M, USE_DOT)

    if USE_DOT or BLOCK_M > 1:
        result = acc  # [BM, BN]
    else:
        result = tl.sum(acc, axis=1)[None, :]  # [1, BN]
    if HAS_BIAS:
        result += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]  # [BM, BN]
    result = result.to(out_ptr.dtype.element_ty)
    if ADD_RESIDUAL:  # the GEMM's output rounded, then the add rounded: two eager ops' bits
        result = (result.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, result, mask=mask)


def m_bucket(m: int) -> int:
    """The TUNED_CONFIGS key (and BLOCK_M) for M rows: the next power of two, at most 16."""
    return min(MAX_BLOCK_M, triton.next_power_of_2(max(m, 1)))


def heuristic_config(n: int, k: int, sms: int) -> SkinnyConfig:
    """A config for shapes the bench has not measured.

    BLOCK_N: the largest power of two up to 64 that leaves at least MIN_PROGRAMS_PER_SM
    programs per SM (N = 4096 on 132 SMs: 16, 256 programs; N = 1024: 4). BLOCK_K: 256, or 512
    when BLOCK_N <= 8, so a step reads 4 to 32 KiB of weights; never far beyond K, and halved
    (down to 64) until it divides K where that is possible: the masked tail step holds its tile
    in registers and roughly triples the kernel's register count. Four stages: three tiles in
    flight per program."""
    block_n = 64
    while block_n > 1 and triton.cdiv(n, block_n) < MIN_PROGRAMS_PER_SM * sms:
        block_n //= 2
    block_k = min(512 if block_n <= 8 else 256, max(64, triton.next_power_of_2(k)))
    divisor = block_k
    while divisor > 64 and k % divisor:
        divisor //= 2
    if k % divisor == 0:
        block_k = divisor
    return SkinnyConfig(block_n, block_k, num_warps=4, num_stages=4, use_dot=True)


def pick_config(m: int, n: int, k: int, device: torch.device) -> SkinnyConfig:
    """The tuned config of M's bucket, else of the largest smaller bucket measured for this
    (N, K) (M = 16 runs M = 8's), else the heuristic's."""
    bucket = m_bucket(m)
    while bucket >= 1:
        tuned = TUNED_CONFIGS.get((n, k, bucket))
        if tuned is not None:
            return SkinnyConfig(*tuned)
        bucket //= 2
    return heuristic_config(n, k, num_sms(device))


class _Launch(NamedTuple):
    grid: tuple[int, int]
    args: tuple
    meta: dict


def _prepare(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    overrides: dict[str, int | bool | None],
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
) -> _Launch:
    """Config (picked, then any non-None override applied), grid and kernel arguments."""
    m = x.shape[0]
    n, k = weight.shape
    cfg = pick_config(m, n, k, x.device)
    cfg = cfg._replace(**{name: v for name, v in overrides.items() if v is not None})
    use_dot = cfg.use_dot and x.dtype != torch.float32  # fp32 must not round through TF32
    block_m = m_bucket(m)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    norm_w, eps = norm if norm is not None else (weight, 0.0)
    res = residual if residual is not None else out
    args = (x, weight, bias if bias is not None else weight, out, norm_w, res, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0), res.stride(0), 1.0 / max(k, 1),
            eps)  # fmt: skip
    compiled = not is_interpret()
    pdl = compiled and pdl_enabled()
    line_elems = 128 // weight.element_size()
    # Prefetch at most ~16 KiB of each program's weight rows before waiting.
    lines = min(triton.cdiv(k, line_elems), max(1, 16384 // (128 * cfg.block_n)))
    meta = dict(
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, USE_DOT=use_dot, EVEN_K=k % cfg.block_k == 0,
        SILU_MUL=silu_mul, LIBDEVICE=(silu_mul or norm is not None) and compiled,
        RMS_NORM=norm is not None, ADD_RESIDUAL=residual is not None, PDL=pdl,
        PREFETCH_LINES=triton.next_power_of_2(lines) if pdl else 1, LINE_ELEMS=line_elems,
        NORM_STEPS=_norm_steps(k, cfg.block_k) if norm is not None else 0,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    if pdl:
        meta["launch_pdl"] = True
    return _Launch(grid, args, meta)


def _check_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    silu_mul: bool,
) -> None:
    """Refuse shapes, dtypes and layouts the kernel cannot take, saying which and why."""
    check_device(x, weight)
    name = "gate_up" if silu_mul else "x"
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"skinny_gemm: {name} and weight must be 2-D, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.shape[1] != (2 * k if silu_mul else k):
        want = f"[M, 2 * {k}] (gate | up)" if silu_mul else f"[M, {k}]"
        raise ValueError(
            f"skinny_gemm: weight {tuple(weight.shape)} needs {name} {want}, got {tuple(x.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"skinny_gemm: {name} is {x.dtype} but weight is {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_gemm: the rows of {name} and weight must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"skinny_gemm: bias must be contiguous [{n}], got {tuple(bias.shape)}")
    m = x.shape[0]
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(
            f"skinny_gemm: out must be [{m}, {n}] {x.dtype} with contiguous rows, got "
            f"{tuple(out.shape)} {out.dtype}"
        )


def skinny_gemm(
    x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul), rows contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous (the nn.Linear layout)
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, rows contiguous
    *,
    silu_mul: bool = False,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T (+ bias)`` in one launch, fp32 accumulation, rounded once to x's dtype.

    With ``silu_mul``, x is a gate/up GEMM's output ``[M, 2K]`` and the product is
    ``silu_and_mul(x) @ weight.T (+ bias)``, with the bits of ``kernels.activation.silu_and_mul``
    followed by ``skinny_gemm`` (same config) but without the intermediate ``[M, K]`` tensor or
    its launch.

    With ``norm = (norm_weight [K], eps)``, x is a residual stream and the product is
    ``rms_norm(x, norm_weight, eps) @ weight.T``: each program takes the rows' fp32 statistic
    itself (a pre-pass over x, which stays in L2) and normalises every K tile as it loads it,
    rounding as ``kernels.rmsnorm.rms_norm`` does (only the fp32 sum's order differs). With
    ``residual [M, N]``, the result is ``residual + (x @ weight.T)``, the GEMM's output rounded
    to x's dtype and the sum rounded again, the bits of the separate add: a decoder layer's
    o_proj / down_proj writes the next residual stream.

    Meant for M <= 16 (larger M works, re-reading the weight once per 16 rows). The keyword
    arguments override single fields of the picked config (sweeps); block sizes must be powers
    of two, block_k >= 16. Bad shapes, dtypes or layouts raise ValueError."""
    _check_args(x, weight, bias, out, silu_mul)
    m = x.shape[0]
    n, k = weight.shape
    if norm is not None and (silu_mul or norm[0].shape != (k,) or norm[0].dtype != x.dtype):
        raise ValueError(f"skinny_gemm: norm weight must be [{k}] {x.dtype}, without silu_mul")
    if residual is not None and (
        residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(1) != 1
    ):
        raise ValueError(f"skinny_gemm: residual must be [{m}, {n}] {x.dtype}, rows contiguous")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        if bias is not None:
            out.copy_(bias.expand(m, n))
        else:
            out.zero_()
        return out if residual is None else out.copy_(out + residual)
    overrides = dict(
        block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
        use_dot=use_dot,
    )  # fmt: skip
    launch = _prepare(x, weight, bias, out, overrides, silu_mul, norm, residual)
    _skinny_gemm_kernel[launch.grid](*launch.args, **launch.meta)
    return out

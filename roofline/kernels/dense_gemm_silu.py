"""The MLP's gate_up GEMM with the SiLU-and-mul in its epilogue:
``out[M, I] = silu(x @ w[:I]^T) * (x @ w[I:]^T)`` for ``w = [gate; up]`` of shape ``[2I, K]``,
so the ``[M, 2I]`` gate_up activation is never written to memory nor read back.

Each program owns one ``[BLOCK_M, BLOCK_N]`` tile of the output: two accumulators, the gate's
(weight rows ``n .. n + BLOCK_N``) and the up's (rows ``I + n ..``), fed by the same x box
through tensor descriptors as in ``dense_gemm.py`` (no repack of the merged weight). The
epilogue rounds each to the input dtype (what the unfused GEMM stores), then computes what
``kernels/activation.py`` computes from those values: ``g / (1 + expf(-g))`` rounded to the
dtype, times ``u`` in fp32, rounded once more. So the result equals the unfused path's up to the
GEMM's own rounding (its summation order). ``persistent`` as in ``DenseGemmConfig`` (0 or 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.kernels import check_device, is_interpret, num_sms
from roofline.kernels.activation import _expf
from roofline.kernels.dense_gemm import _tile_offsets, dense_gemm_applies
from roofline.kernels.dense_gemm_configs import DenseGemmConfig


@triton.jit(do_not_specialize=["M", "num_programs"])
def _dense_gemm_silu_kernel(
    x_desc,  # [M, K] boxes [BLOCK_M, BLOCK_K]
    w_desc,  # [2 INTER, K] boxes [BLOCK_N, BLOCK_K]: gate rows, then up rows
    out_desc,  # [M, INTER] boxes [BLOCK_M, BLOCK_N]
    M,
    INTER,
    K,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(INTER, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
        off_m, off_n = _tile_offsets(tile, num_pid_m, per_group, GROUP_M, BLOCK_M, BLOCK_N)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([off_m, kk * BLOCK_K])  # [BLOCK_M, BLOCK_K]
            g = w_desc.load([off_n, kk * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            u = w_desc.load([INTER + off_n, kk * BLOCK_K])
            acc_g = tl.dot(a, g.T, acc_g)
            acc_u = tl.dot(a, u.T, acc_u)
        dtype = out_desc.dtype
        gate = acc_g.to(dtype).to(tl.float32)  # what the unfused GEMM would store
        act = tl.math.div_rn(gate, 1.0 + _expf(-gate, LIBDEVICE)).to(dtype).to(tl.float32)
        out = act * acc_u.to(dtype).to(tl.float32)
        out_desc.store([off_m, off_n], out.to(dtype))


def dense_gemm_silu_applies(x: torch.Tensor, weight: torch.Tensor, block_n: int) -> bool:
    """``dense_gemm_applies`` and an intermediate size ``I = N / 2`` that is a multiple of the
    tile width (a tile never straddles gate and up)."""
    n = weight.shape[0]
    return dense_gemm_applies(x, weight) and n % 2 == 0 and (n // 2) % block_n == 0


def dense_gemm_silu(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2I, K]: gate rows, then up rows
    config: DenseGemmConfig,
    num_programs: int | None = None,
) -> torch.Tensor:  # [M, I]
    """``silu(x @ weight[:I].T) * (x @ weight[I:].T)`` in one launch (see the module docstring);
    ``config.persistent`` 0 or 1, ``split_k`` 1."""
    check_device(x, weight)
    c = config
    if not dense_gemm_silu_applies(x, weight, c.block_n) or c.split_k != 1 or c.persistent > 1:
        raise ValueError(
            f"dense_gemm_silu needs contiguous 16-bit x {tuple(x.shape)} / weight "
            f"{tuple(weight.shape)} of one dtype, N / 2 a multiple of {c.block_n}, and a config "
            "without split-K"
        )
    m, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    out_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    num_tiles = triton.cdiv(m, c.block_m) * (inter // c.block_n)
    programs = min(num_tiles, num_programs or num_sms(x.device)) if c.persistent else num_tiles
    _dense_gemm_silu_kernel[(programs,)](
        x_desc, w_desc, out_desc, m, inter, k, programs,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        FLATTEN=c.persistent == 1, LIBDEVICE=not is_interpret(),
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return out


def dense_gemm_silu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused path's values: the GEMM (fp32 sums, rounded once), then torch's SiLU-and-mul
    (``F.silu`` rounded to the dtype, times up in fp32, rounded)."""
    gate_up = (x.float() @ weight.float().T).to(x.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)

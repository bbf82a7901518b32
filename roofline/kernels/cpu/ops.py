"""Python side of the CPU quantized GEMMs: ``y[M, N] = x[M, K] @ W[N, K]^T`` with W kept
quantized, beside plain-torch dequantize-then-matmul references.

Two weight forms:

* :class:`GGUFRows`: rows of GGUF ``Q4_0`` / ``Q4_1`` / ``Q8_0`` blocks read where they lie
  (typically the memory-mapped file), addressed by one pointer per output row, so packed
  (q/k/v, gate/up) and row-permuted weights cost no copy.
* the canonical layouts of ``roofline.quantization`` (int4: ``qweight`` uint8 [N, K / 2], even
  element in the low nibble; int8: ``qweight`` int8 [N, K]; fp32 ``scales`` / ``offsets``
  [N, K / group], group a multiple of 32): :func:`canonical_gemm`.

The compiled path quantizes the activations per block of 32 (:func:`quantize_rows`) and runs
the library's integer dot products (``isa`` forces a path for tests; by default the widest this
CPU runs). ``act_bits`` 16 (the default, ``ACT_BITS``) keeps 15 bits per block: greedy tokens
then follow the fp32 reference (10/10 prompts on SmolLM2's Q4_1, against 6/10 with 8 bits);
8 bits (llama.cpp's choice, ``ROOFLINE_CPU_ACT_BITS=8``) halves the arithmetic. Without the
library every entry point falls back to the references.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roofline.kernels.cpu.build import ISA_NAMES, load_library, loaded_library

GGUF_FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QK = 32
ACT_BITS = int(os.environ.get("ROOFLINE_CPU_ACT_BITS", "16"))
if ACT_BITS not in (8, 16):
    raise ValueError(f"ROOFLINE_CPU_ACT_BITS must be 8 or 16, got {ACT_BITS}")


@dataclass
class GGUFRows:
    """An [N, K] weight as GGUF blocks: row n's K / 32 blocks start at ``row_ptrs[n]``."""

    fmt: str
    in_features: int
    row_ptrs: torch.Tensor
    """int64 [N] addresses (inside ``sources``)."""
    sources: list[torch.Tensor]
    """uint8 [rows, row_bytes] tensors the pointers point into (kept alive here)."""

    @classmethod
    def from_tensors(
        cls, fmt: str, in_features: int, parts: list[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> GGUFRows:
        """Rows of several uint8 [rows_i, row_bytes] block tensors stacked in order, each with
        an optional int64 row order (row j of the part is its stored row ``order[j]``)."""
        if fmt not in GGUF_FORMATS:
            raise ValueError(f"no CPU kernel for GGUF type {fmt}")
        if in_features % QK:
            raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
        row_bytes = in_features // QK * BLOCK_BYTES[fmt]
        ptrs = []
        for data, order in parts:
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes:
                raise ValueError(f"{fmt} rows of K={in_features} need uint8 [rows, {row_bytes}]")
            if data.stride(1) != 1:
                raise ValueError("block rows must be contiguous")
            rows = torch.arange(data.shape[0], dtype=torch.int64) if order is None else order
            ptrs.append(data.data_ptr() + rows * data.stride(0))
        return cls(fmt, in_features, torch.cat(ptrs), [d for d, _ in parts])

    @property
    def out_features(self) -> int:
        return self.row_ptrs.shape[0]

    def nbytes(self) -> int:
        return self.out_features * self.in_features // QK * BLOCK_BYTES[self.fmt]


_FORMAT_CODES = GGUF_FORMATS
_BEST = len(ISA_NAMES) - 1  # the library falls back to what the CPU runs


def _isa_code(isa: str | None) -> int:
    return len(ISA_NAMES) - 1 if isa is None else ISA_NAMES.index(isa)


def quantize_rows(
    x: torch.Tensor, even_odd: bool = False, act_bits: int = ACT_BITS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 [M, K] -> (xq int8/int16 [M, K], dx [M, K / 32], dsx [M, K / 32]): per block of
    32 the scale ``dx = max|x| / (2^(bits-1) - 1)`` and ``dx * sum(xq)``. ``even_odd`` stores
    each block's even elements first (the canonical int4 nibble order)."""
    lib = load_library()
    assert lib is not None
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int16 if act_bits == 16 else torch.int8)
    dx = torch.empty(m, k // QK, dtype=torch.float32)
    dsx = torch.empty(m, k // QK, dtype=torch.float32)
    lib.rl_quantize_rows(
        x.data_ptr(),
        m,
        k,
        x.stride(0),
        int(even_odd),
        act_bits,
        xq.data_ptr(),
        dx.data_ptr(),
        dsx.data_ptr(),
    )
    return xq, dx, dsx


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def gguf_gemm(
    x: torch.Tensor,
    w: GGUFRows,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
    act_bits: int = ACT_BITS,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] over GGUF blocks (reference path without the library). With
    ``silu_mul`` x is [M, 2K] (gate | up) and the GEMM's input ``silu(gate) * up``."""
    lib = load_library()
    if lib is None:
        if silu_mul:
            gate, up = x.float().chunk(2, dim=-1)
            x = F.silu(gate) * up
        return gguf_gemm_ref(x, w, bias)
    x = _as_rows(x)
    m = x.shape[0]
    n = w.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    status = lib.rl_linear_gguf(
        _FORMAT_CODES[w.fmt],
        w.row_ptrs.data_ptr(),
        n,
        w.in_features,
        x.data_ptr(),
        m,
        x.stride(0),
        act_bits,
        int(silu_mul),
        y.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        _BEST if isa is None else ISA_NAMES.index(isa),
    )
    if status != 0:
        raise MemoryError("the CPU GEMM could not allocate its scratch buffers")
    return y


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.argmax(-1)`` of fp32 CPU logits [R, V] on the kernels' thread pool (first index
    of the max, a NaN counting as the max: torch's answer), when that pool owns the cores (the
    library loaded and torch's intra-op pool down to one thread, as ``take_cores`` leaves them,
    where torch's argmax would run on one core); None otherwise."""
    lib = loaded_library()
    if (
        lib is None
        or torch.get_num_threads() != 1
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
    ):
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.rl_argmax_rows(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr())
    return out


def gguf_dequantize(w: GGUFRows, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [len(rows), K] of the given rows (all rows by default), e.g. an embedding lookup."""
    ptrs = w.row_ptrs if rows is None else w.row_ptrs.index_select(0, rows.reshape(-1))
    lib = load_library()
    if lib is None:
        return _dequantize_ref(w.fmt, _gather_blocks(w, ptrs), w.in_features)
    out = torch.empty(ptrs.shape[0], w.in_features, dtype=torch.float32)
    lib.rl_dequant_gguf_rows(
        GGUF_FORMATS[w.fmt], ptrs.data_ptr(), ptrs.shape[0], w.in_features, out.data_ptr()
    )
    return out


def canonical_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    bias: torch.Tensor | None = None,
    isa: str | None = None,
    act_bits: int = ACT_BITS,
) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] over the canonical int4 (``bits=4``, w = q * s + offset) or int8
    (``bits=8``, w = q * s) layout; ``scales`` / ``offsets`` [N, K / group] in fp32 or fp16
    (bf16 ones go through fp32: convert them once after loading, not per call)."""
    lib = load_library()
    if scales.dtype not in (torch.float32, torch.float16):
        scales = scales.float()
    if offsets is not None and offsets.dtype != scales.dtype:
        offsets = offsets.to(scales.dtype)
    scales = scales.contiguous()
    offsets = None if offsets is None else offsets.contiguous()
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    group = k // scales.shape[1]
    if lib is None or group % QK or k % QK:
        return canonical_gemm_ref(x, qweight, scales, offsets, bits, bias)
    x = _as_rows(x)
    m = x.shape[0]
    xq, dx, dsx = quantize_rows(x, even_odd=bits == 4, act_bits=act_bits)
    y = torch.empty(m, n, dtype=torch.float32)
    lib.rl_gemm_canonical(
        bits,
        qweight.data_ptr(),
        scales.data_ptr(),
        None if offsets is None else offsets.data_ptr(),
        int(scales.dtype == torch.float16),
        group,
        n,
        k,
        xq.data_ptr(),
        act_bits,
        dx.data_ptr(),
        dsx.data_ptr(),
        m,
        y.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        _isa_code(isa),
    )
    return y


# ---------------------------------------------------------------- plain-torch references


def _gather_blocks(w: GGUFRows, ptrs: torch.Tensor) -> torch.Tensor:
    """uint8 [len(ptrs), row_bytes] copies of the rows at ``ptrs`` (found in ``w.sources``)."""
    row_bytes = w.in_features // QK * BLOCK_BYTES[w.fmt]
    out = torch.empty(ptrs.shape[0], row_bytes, dtype=torch.uint8)
    for src in w.sources:
        start = src.data_ptr()
        inside = (ptrs >= start) & (ptrs < start + src.shape[0] * src.stride(0))
        idx = inside.nonzero().flatten()
        if idx.numel():
            out[idx] = src.index_select(0, (ptrs[idx] - start) // src.stride(0))
    return out


def _dequantize_ref(fmt: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes] GGUF rows -> fp32 [N, K]."""
    n = blocks.shape[0]
    b = blocks.reshape(n, k // QK, BLOCK_BYTES[fmt])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if fmt == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()  # [N, nb, 32]
        return (q * d).reshape(n, k)
    qs = b[..., 4:] if fmt == "Q4_1" else b[..., 2:]  # [N, nb, 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # [N, nb, 32]
    off = b[..., 2:4].contiguous().view(torch.float16).float() if fmt == "Q4_1" else -8 * d
    return (q * d + off).reshape(n, k)


def gguf_gemm_ref(x: torch.Tensor, w: GGUFRows, bias: torch.Tensor | None = None) -> torch.Tensor:
    weight = _dequantize_ref(w.fmt, _gather_blocks(w, w.row_ptrs), w.in_features)
    return F.linear(x.float(), weight, None if bias is None else bias.float())


def dequantize_canonical(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """Canonical int4/int8 -> fp32 [N, K]."""
    if bits == 4:
        q = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)
    else:
        q = qweight
    n, k = q.shape
    group = k // scales.shape[1]
    w = q.float().reshape(n, -1, group) * scales.float().unsqueeze(-1)  # [N, groups, group]
    if offsets is not None:
        w = w + offsets.float().unsqueeze(-1)
    return w.reshape(n, k)


def canonical_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    weight = dequantize_canonical(qweight, scales, offsets, bits)
    return F.linear(x.float(), weight, None if bias is None else bias.float())

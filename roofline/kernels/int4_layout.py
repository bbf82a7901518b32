"""The repacked weight layouts ``kernels.int4_gemv`` reads, made once after loading from the
canonical ones (``quantization.formats``), and the plain-torch reference of the GEMV.

* int4 (``repack_int4``): each row's K is cut into 128-element tiles of 16 int32 words; nibble
  ``4h + i`` of word ``w`` holds element ``32 i + 2 w + h`` of the tile, so one ``lop3`` per
  word and nibble pair i leaves the two 16-bit floats of elements ``32 i + 2 w`` and
  ``32 i + 2 w + 1``: an MMA A-fragment register (see ``kernels.int4_gemv``).
* int8 (``repack_int8``): ``u = q + 128`` as two nibble planes per tile (16 words of low
  nibbles, then 16 of high nibbles), each laid out as int4's.
* Scales and offsets (``pack_scales``): ``[N, groups, 2]`` pairs in the scales' dtype, one
  32-bit load per row and group for 16-bit scales.

Repacking works on ``REPACK_ROWS`` rows at a time, so loading holds at most that many rows of
int32/int64 temporaries beyond the weights.
"""

from __future__ import annotations

import torch

from roofline.quantization import formats

TILE_K = 128  # K elements per repacked tile (16 int32 words per row and nibble plane)
TILE_WORDS = TILE_K // 8


def weight_k(words: torch.Tensor, bits: int) -> int:
    """K of a weight in one of ``kernels.int4_gemv``'s layouts: repacked int32 words of 8 (int4)
    or 4 (int8 planes) elements, the canonical int4 bytes (uint8, two elements each), or one
    canonical int8 / e4m3 byte per element."""
    if words.dtype == torch.uint8:
        return 2 * words.shape[1]
    if words.dtype in (torch.int8, torch.float8_e4m3fn):
        return words.shape[1]
    return words.shape[1] * 32 // bits


def can_repack(k: int, group: int) -> bool:
    """Whether a weight with K inputs and this group size can take the repacked layout."""
    return k % TILE_K == 0 and (group in (32, 64) or group % TILE_K == 0) and k % group == 0


def _plane_words(q: torch.Tensor) -> torch.Tensor:  # [N, K // 128, 16] int32
    """Values 0..15 ``[N, K]`` -> per 128-element tile, 16 words: nibble ``4h + i`` of word
    ``w`` = element ``32 i + 2 w + h``."""
    n, k = q.shape
    if k % TILE_K:
        raise ValueError(f"int4_gemv: K = {k} is not a multiple of {TILE_K}")
    q = q.to(torch.int32).reshape(n, k // TILE_K, 4, TILE_WORDS, 2)  # [N, T, i, w, h]
    q = q.permute(0, 1, 3, 4, 2).reshape(n, k // TILE_K, TILE_WORDS, 8)  # [N, T, w, 4h + i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)  # [8]
    words = (q << shifts).sum(dim=-1, dtype=torch.int64)  # [N, T, w], < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _plane_values(words: torch.Tensor) -> torch.Tensor:  # [N, K] int64 values 0..15
    """The inverse of ``_plane_words`` (``words``: ``[N, T, 16]``)."""
    n, num_tiles, _ = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)  # [8]
    nib = (words.to(torch.int64)[..., None] >> shifts) & 0xF  # [N, T, w, 8]
    nib = nib.reshape(n, num_tiles, TILE_WORDS, 2, 4)  # [N, T, w, h, i]
    return nib.permute(0, 1, 4, 2, 3).reshape(n, num_tiles * TILE_K)


REPACK_ROWS = 2048  # rows repacked at a time: the int32 temporaries stay ~2048 x K x 8 bytes


def _by_rows(fn, qweight: torch.Tensor, words_per_row: int) -> torch.Tensor:
    out = torch.empty(qweight.shape[0], words_per_row, dtype=torch.int32, device=qweight.device)
    for r in range(0, qweight.shape[0], REPACK_ROWS):
        out[r : r + REPACK_ROWS] = fn(qweight[r : r + REPACK_ROWS])
    return out


def repack_int4(qweight: torch.Tensor) -> torch.Tensor:  # [N, K // 8] int32
    """Canonical int4 ``[N, K // 2]`` uint8 (low nibble = even k) -> the kernel's int32 words:
    per 128-element tile, nibble ``4h + i`` of word ``w`` = element ``32 i + 2 w + h``."""

    def rows(q: torch.Tensor) -> torch.Tensor:
        return _plane_words(formats.unpack_int4(q)).reshape(q.shape[0], -1)

    return _by_rows(rows, qweight, qweight.shape[1] // 4)


def unrepack_int4(words: torch.Tensor) -> torch.Tensor:  # [N, K // 2] uint8
    """The inverse of ``repack_int4``: the canonical nibble layout."""
    tiles = words.reshape(words.shape[0], -1, TILE_WORDS)
    return formats.pack_int4(_plane_values(tiles).to(torch.uint8))


def repack_int8(qweight: torch.Tensor) -> torch.Tensor:  # [N, K // 4] int32
    """Canonical int8 ``[N, K]`` -> two nibble planes of ``u = q + 128`` per 128-element tile
    (16 words of low nibbles, then 16 of high nibbles), each laid out as ``repack_int4``'s."""

    def rows(q: torch.Tensor) -> torch.Tensor:
        u = (q.to(torch.int32) + 128).to(torch.uint8)  # [rows, K]
        lo, hi = _plane_words(u & 15), _plane_words(u >> 4)  # [rows, T, 16] each
        return torch.cat([lo, hi], dim=-1).reshape(q.shape[0], -1)

    return _by_rows(rows, qweight, qweight.shape[1] // 4)


def unrepack_int8(words: torch.Tensor) -> torch.Tensor:  # [N, K] int8
    """The inverse of ``repack_int8``."""
    tiles = words.reshape(words.shape[0], -1, 2 * TILE_WORDS)
    lo = _plane_values(tiles[..., :TILE_WORDS].contiguous())
    hi = _plane_values(tiles[..., TILE_WORDS:].contiguous())
    return (lo + 16 * hi - 128).to(torch.int8)


def pack_scales(scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """``[N, G]`` scales and offsets (None: zero, int8) -> ``[N, G, 2]`` pairs (scale, offset)
    in the scales' dtype."""
    if offsets is None:
        offsets = torch.zeros_like(scales)
    return torch.stack([scales, offsets.to(scales.dtype)], dim=-1).contiguous()


def int4_gemv_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # canonical [N, K // 2]
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """x (fp32) times the exactly dequantized weight (fp32), bias in fp32, rounded once."""
    q = formats.unpack_int4(qweight).float()  # [N, K]
    k = q.shape[1]
    group = k // scales.shape[1]
    w = q * scales.float().repeat_interleave(group, 1) + offsets.float().repeat_interleave(group, 1)
    out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

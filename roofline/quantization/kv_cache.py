"""The KV cache's storage dtype: what a page holds, what a token costs, how values round-trip.

``kv_cache_dtype`` is ``auto`` (pages in the model's dtype, no scales), ``fp8`` (float8 e4m3)
or ``int8``. Quantized pages carry one fp32 scale per (token, KV head) for K and one for V,
computed when the token is stored: ``scale = amax(|x|) / qmax`` over the head's ``head_dim``
values, ``q = x / scale`` (clamped to +-qmax; int8 rounds half away from zero, fp8 to
nearest even), ``x ~ q * scale``. Why per token and per head rather than one scale per tensor:
roofline's checkpoints (GGUF, bf16 safetensors) carry no calibrated KV scales, a per-tensor
scale fixed ahead of time either clips outlier tokens or wastes int8's 8 bits on them, and a
dynamic per-token scale needs no calibration run. It costs 4 bytes per head per token (3% of an
fp8 page at head_dim 128, 6% at 64), and nothing per element in the kernels: K's scale
multiplies a score column after ``q @ k^T`` and V's scale multiplies a probability column
before ``p @ v``, so the attention kernels read the 1-byte values, convert them in registers and
never write a dequantized copy of the cache. The store kernel (``kernels/kv_store.py``)
quantizes; :func:`quantize` / :func:`dequantize` here are the reference both the torch backend
and the kernel tests use.

Layout: data ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` in the page
dtype; scales ``[num_layers, 2, num_pages, page_size, num_kv_heads]`` fp32 (head stride 1).
A layer's entry in ``ForwardContext.kv_caches`` is ``(k_cache, v_cache)`` for ``auto`` and
``(k_cache, v_cache, k_scale, v_scale)`` for a quantized cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from roofline.worker import host_memory

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric: -127..127
SCALE_BYTES = 4  # one fp32 scale per (token, kv head), for K and for V


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    return name


def qmax_of(page_dtype: torch.dtype) -> float:
    return FP8_MAX if page_dtype == torch.float8_e4m3fn else INT8_MAX


def quantize(
    x: torch.Tensor,  # [..., head_dim]
    page_dtype: torch.dtype,  # torch.float8_e4m3fn or torch.int8
) -> tuple[torch.Tensor, torch.Tensor]:  # (q [..., head_dim] page_dtype, scale [...] fp32)
    """Reference quantization of each head vector with its own scale (the store kernel's
    arithmetic: fp32 amax, ``x / scale``, clamp, round)."""
    qmax = qmax_of(page_dtype)
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # [...]
    y = (xf / scale[..., None]).clamp(-qmax, qmax)  # [..., head_dim]
    if page_dtype == torch.int8:
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)  # half away from zero, as the kernel
    return y.to(page_dtype), scale


def dequantize(
    q: torch.Tensor,  # [..., head_dim] page dtype
    scale: torch.Tensor,  # [...] fp32
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., head_dim] dtype
    return (q.float() * scale[..., None]).to(dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV pool's storage strategy for one engine (model dtype + ``kv_cache_dtype``)."""

    kv_cache_dtype: str
    model_dtype: torch.dtype
    half_pages: bool = False
    """``auto`` pages in fp16 rather than the model's fp32: the CPU decoder's opt-in
    (``kernels/cpu/decoder.py``), half the bytes its decode attention reads."""

    @classmethod
    def create(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheSpec:
        return cls(check_kv_cache_dtype(kv_cache_dtype), model_dtype)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def page_dtype(self) -> torch.dtype:
        auto = torch.float16 if self.half_pages else self.model_dtype
        return {"auto": auto, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[self.kv_cache_dtype]

    def with_half_pages(self) -> KVCacheSpec:
        """This spec with fp16 ``auto`` pages (a quantized spec is returned unchanged)."""
        return self if self.quantized else replace(self, half_pages=True)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token across all layers, scales included."""
        per_head = head_dim * self.page_dtype.itemsize + (SCALE_BYTES if self.quantized else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def allocate(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(data [L, 2, pages, page_size, heads, head_dim], scales [L, 2, pages, page_size,
        heads] fp32 or None), zero-filled."""
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads)
        data = host_memory.zeros(*shape, head_dim, dtype=self.page_dtype, device=device)
        scales = None
        if self.quantized:
            scales = torch.ones(*shape, dtype=torch.float32, device=device)
        return data, scales

    @staticmethod
    def layer_views(data: torch.Tensor, scales: torch.Tensor | None) -> list[tuple]:
        """Per layer ``(k_cache, v_cache)`` or ``(k_cache, v_cache, k_scale, v_scale)``."""
        if scales is None:
            return [(layer[0], layer[1]) for layer in data]
        return [(d[0], d[1], s[0], s[1]) for d, s in zip(data, scales)]

    def check_backend(self, backend: object, device: torch.device) -> None:
        """ValueError unless ``backend`` reads this KV dtype on ``device`` (called before any
        weight is loaded)."""
        supported = getattr(backend, "kv_cache_dtypes", ("auto",))
        name = getattr(backend, "name", type(backend).__name__)
        if self.kv_cache_dtype not in supported:
            raise ValueError(
                f"the {name} attention backend does not read kv_cache_dtype="
                f"{self.kv_cache_dtype!r} (it reads: {', '.join(supported)})"
            )
        if self.kv_cache_dtype == "fp8" and device.type == "cuda":
            if torch.cuda.get_device_capability(device) < (8, 9):
                raise ValueError(
                    "kv_cache_dtype='fp8' needs a GPU with fp8 conversions (compute capability "
                    ">= 8.9: Ada, Hopper); use kv_cache_dtype='int8' on this GPU"
                )


def store_quantized_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim] page dtype
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [num_pages, page_size, num_kv_heads] fp32
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 = skip
) -> None:
    """Quantize and store new K/V rows at their slots (the torch path of the store kernel).
    fp8 pages are written through uint8 views (CPU torch has no fp8 index_copy)."""
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize(x[keep], cache.dtype)  # [n, heads, head_dim], [n, heads]
        heads, head_dim = cache.shape[2], cache.shape[3]
        raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
        raw.view(-1, heads, head_dim).index_copy_(0, slots, q.view(raw.dtype))
        scale.view(-1, heads).index_copy_(0, slots, s)


def gather_dequantized(
    cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim] page dtype
    scale: torch.Tensor,  # [num_pages, page_size, num_kv_heads] fp32
    page_ids: torch.Tensor,  # [n] int
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, page_size, num_kv_heads, head_dim] dtype
    """The given pages dequantized (a per-call copy of those pages only: the torch reference)."""
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    q = raw.index_select(0, page_ids).view(cache.dtype)
    return dequantize(q, scale.index_select(0, page_ids), dtype)

"""The descriptor dense GEMM (``kernels/dense_gemm.py``) against its fp32 reference: row counts
below, at and past a tile (the descriptor's zero-filled rows, the clipped store), every tile
order (one program per tile, persistent with a flattened loop, grouped row blocks that end in a
partial group), and the refusal of tensors the descriptors cannot take."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.dense_gemm import (
    DenseGemmConfig,
    dense_gemm,
    dense_gemm_applies,
    dense_gemm_ref,
)

N, K = (384, 512) if ON_GPU else (96, 64)
CONFIGS = (
    [
        DenseGemmConfig(64, 128, 64, 8, 4, 3, 0),
        DenseGemmConfig(128, 128, 64, 4, 8, 3, 1),
        DenseGemmConfig(64, 128, 64, 8, 4, 3, 0, 3),
    ]
    if ON_GPU
    else [
        DenseGemmConfig(16, 32, 32, 8, 4, 1, 0),
        DenseGemmConfig(32, 16, 16, 2, 4, 1, 1),
        DenseGemmConfig(16, 32, 16, 2, 4, 1, 0, 3),  # 4 K tiles over 3 slices
    ]
)


@pytest.mark.parametrize("rows", [1, 37, 100])
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}p{c.persistent}s{c.split_k}"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(rows: int, config: DenseGemmConfig, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).to(DEVICE)
    out = dense_gemm(x, w, config)
    assert out.shape == (rows, N) and out.dtype == dtype
    assert_close(out, dense_gemm_ref(x, w), dtype)
    if config.split_k > 1:  # the counters are back at zero: a second launch (a replay) agrees
        assert torch.equal(dense_gemm(x, w, config), out)


def test_writes_into_out_rows_only() -> None:
    """``out`` given: its rows are written, a neighbour buffer past them is not touched."""
    x = torch.randn(20, K).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(N, K) / K**0.5).to(torch.bfloat16).to(DEVICE)
    big = torch.full((32, N), 7.0, dtype=torch.bfloat16, device=DEVICE)
    dense_gemm(x, w, CONFIGS[0], out=big[:20])
    assert_close(big[:20], dense_gemm_ref(x, w), torch.bfloat16)
    assert bool((big[20:] == 7.0).all())


def test_refuses_what_descriptors_cannot_take() -> None:
    x = torch.randn(8, K).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(N, K).to(torch.bfloat16).to(DEVICE)
    assert dense_gemm_applies(x, w)
    assert not dense_gemm_applies(x.float(), w.float())
    assert not dense_gemm_applies(x, w.half())
    assert not dense_gemm_applies(x.t().contiguous().t()[:, : K - 8], w[:, : K - 8])
    assert not dense_gemm_applies(x[:, :-3], w[:, :-3])
    with pytest.raises(ValueError, match="dense_gemm needs"):
        dense_gemm(x[:, :-3], w[:, :-3], CONFIGS[0])


def test_row_dispatch_bands_and_actions() -> None:
    """``layers.gemm_rows``: the band lookup, and each action's result equals ``F.linear``'s
    rows (the padded rows cut off; the descriptor GEMM within bf16 rounding)."""
    from roofline.layers.gemm_rows import Band, Chunks, Lt, Pad, Tiles, choose, find_band, run

    plan = [Band(1, 8, Pad(16)), Band(33, 40, Tiles(CONFIGS[0])), Band(41, 64, Pad(72)),
            Band(90, 200, Chunks(32)), Band(300, 310, Lt())]  # fmt: skip
    assert find_band(plan, 1) is plan[0] and find_band(plan, 8) is plan[0]
    assert find_band(plan, 9) is None and find_band(plan, 32) is None
    assert find_band(plan, 33) is plan[1] and find_band(plan, 64) is plan[2]
    assert find_band(plan, 65) is None and find_band([], 5) is None
    assert find_band(plan, 100) is plan[3] and find_band(plan, 201) is None
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert find_band(plan, 305) is plan[4]
    cases = [(5, plan[0]), (37, plan[1]), (50, plan[2]), (100, plan[3])]
    for rows, band in cases + ([(301, plan[4])] if ON_GPU else []):  # cuBLASLt: CUDA only
        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        out = run(x, w, bias, band)
        assert out.shape == (rows, N) and out.is_contiguous()
        assert_close(out, torch.nn.functional.linear(x, w, bias), torch.bfloat16)
    if not ON_GPU:  # CPU tensors are never re-routed
        assert choose(torch.zeros(448, K, dtype=torch.bfloat16), w) is None


def test_warm_up_runs_each_tiles_band_of_the_model(monkeypatch) -> None:
    """``gemm_rows.warm_up`` launches each ``Tiles`` config of a model's layers once (two layers
    of one shape: once), at the band's smallest count; ``Pad`` bands need no warm-up."""
    from roofline.layers import gemm_rows
    from roofline.layers.linear import Linear

    layers = torch.nn.Sequential(Linear(K, N), Linear(K, N), Linear(K, 2 * N))
    layers = layers.to(torch.bfloat16).to(DEVICE)
    tiles, pad = gemm_rows.Tiles(CONFIGS[0]), gemm_rows.Pad(24)
    plan = [gemm_rows.Band(3, 8, tiles), gemm_rows.Band(9, 16, pad), gemm_rows.Band(17, 20, tiles)]
    monkeypatch.setitem(gemm_rows.PLANS, (N, K), plan)
    # every device as Hopper: the bands of PLANS apply
    monkeypatch.setattr(gemm_rows, "choose", lambda x, w: gemm_rows.find_band(
        gemm_rows.PLANS.get(tuple(w.shape), []), x.shape[0]))  # fmt: skip
    calls = []
    monkeypatch.setattr(gemm_rows, "run", lambda x, w, b, band: calls.append((x.shape[0], band)))
    gemm_rows.warm_up(layers)
    assert calls == [(3, plan[0])]


def test_shipped_plans_are_well_formed() -> None:
    """Every shipped band: sorted, not overlapping, padding up (never down), configs the
    kernel takes (power-of-two tiles, split-K only without persistence)."""
    from roofline.layers.gemm_rows import PLANS, Chunks, Pad, Tiles

    for (n, k), bands in PLANS.items():
        assert n % 8 == 0 and k % 8 == 0
        for a, b in zip(bands, bands[1:]):
            assert a.hi < b.lo, (a, b)
        for band in bands:
            assert 1 <= band.lo <= band.hi
            act = band.action
            if isinstance(act, Pad):
                assert act.rows > band.hi
            elif isinstance(act, Chunks):
                assert 0 < act.rows < band.hi
            elif isinstance(act, Tiles):
                c = act.config
                for size in (c.block_m, c.block_n, c.block_k):
                    assert size >= 16 and size & (size - 1) == 0
                assert c.split_k == 1 or c.persistent == 0


@pytest.mark.parametrize("rows", [1, 37, 100])
@pytest.mark.parametrize("persistent", [0, 1])
def test_silu_epilogue_matches_reference(rows: int, persistent: int) -> None:
    """The gate_up GEMM with the SiLU-and-mul in its epilogue: the unfused path's values (the
    GEMM rounded to bf16, torch's SiLU-and-mul) within bf16 rounding; refuses a tile that
    would straddle gate and up."""
    from roofline.kernels.dense_gemm_silu import dense_gemm_silu, dense_gemm_silu_ref

    inter = 128 if ON_GPU else 64
    cfg = (
        DenseGemmConfig(64, 64, 64, 8, 4, 3, persistent)
        if ON_GPU
        else DenseGemmConfig(16, 32, 16, 2, 4, 1, persistent)
    )
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(2 * inter, K, generator=gen) / K**0.5).to(torch.bfloat16).to(DEVICE)
    out = dense_gemm_silu(x, w, cfg, num_programs=3)
    assert out.shape == (rows, inter)
    assert_close(out, dense_gemm_silu_ref(x, w), torch.bfloat16)
    with pytest.raises(ValueError, match="N / 2 a multiple"):
        dense_gemm_silu(x, w[: 2 * inter - 16], cfg)


def test_merged_gate_up_takes_the_silu_epilogue_in_its_bands(monkeypatch) -> None:
    """``MergedLinear.fuses_silu_mul_out``: only a bias-free two-shard layer whose row count has
    a ``SILU_PLANS`` band; ``forward_silu_mul_out`` then equals the SiLU-and-mul of its output."""
    from roofline.layers import gemm_rows
    from roofline.layers.linear import MergedLinear

    inter = 64
    cfg = (
        DenseGemmConfig(64, 64, 64, 8, 4, 3, 0) if ON_GPU else DenseGemmConfig(16, 32, 16, 2, 4, 1)
    )
    band = gemm_rows.Band(2, 40, gemm_rows.Tiles(cfg))
    monkeypatch.setitem(gemm_rows.SILU_PLANS, (2 * inter, K), [band])
    # every device as Hopper: the bands of SILU_PLANS apply
    monkeypatch.setattr(gemm_rows, "choose_silu", lambda x, w: gemm_rows.find_band(
        gemm_rows.SILU_PLANS.get(tuple(w.shape), []), x.shape[0]))  # fmt: skip
    layer = MergedLinear(K, [inter, inter]).to(torch.bfloat16).to(DEVICE)
    torch.nn.init.normal_(layer.weight, std=K**-0.5)
    x = torch.randn(30, K).to(torch.bfloat16).to(DEVICE)
    assert layer.fuses_silu_mul_out(x) and not layer.fuses_silu_mul_out(x[:1])
    gate, up = layer(x).float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    assert_close(layer.forward_silu_mul_out(x), want, torch.bfloat16)
    biased = MergedLinear(K, [inter, inter], bias=True).to(torch.bfloat16).to(DEVICE)
    three = MergedLinear(K, [inter, inter // 2, inter // 2]).to(torch.bfloat16).to(DEVICE)
    assert not biased.fuses_silu_mul_out(x) and not three.fuses_silu_mul_out(x)

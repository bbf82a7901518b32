"""The stream-K weight-only GEMM (``kernels.wo_gemm_sk``, Gluon: no interpreter, so its numbers are
checked on the GPU by ``scripts/gpu_wonly.py``'s smoke test and sweep): here, the schedule and the
partial-sum protocol the kernel follows, replayed in plain Python and torch. Its sm_90 compile
(register-A wgmma, no spills, no register races) is in ``test_wo_gemm.py``'s Hopper report."""

from __future__ import annotations

import itertools

import pytest
import torch

from roofline.kernels import wo_gemm as wg
from roofline.kernels import wo_gemm_sk as sk

SHAPES = [  # (tiles, K tiles, programs)
    (tiles, k_tiles, programs)
    for tiles, k_tiles, programs in itertools.product(
        (1, 3, 32, 64, 96, 131, 132, 133, 200, 264, 300, 448),
        (1, 2, 7, 32, 112),
        (1, 5, 132),
    )
]


@pytest.mark.parametrize(("tiles", "k_tiles", "programs"), SHAPES)
def test_every_unit_once_and_owners_agree(tiles: int, k_tiles: int, programs: int) -> None:
    grid, dp = sk.schedule(tiles, k_tiles, programs)
    assert 1 <= grid <= min(programs, tiles * k_tiles)
    assert dp % grid == 0 and dp <= tiles
    units = (tiles - dp) * k_tiles
    seen: dict[tuple[int, int], int] = {}
    for p in range(grid):
        for t, k0, k1 in sk.segments(tiles, k_tiles, programs, p):
            assert 0 <= k0 < k1 <= k_tiles
            for k in range(k0, k1):
                assert (t, k) not in seen
                seen[(t, k)] = p
            if t >= dp:  # the kernel's owner arithmetic finds the same program
                assert sk.owner((t - dp) * k_tiles + k0, grid, units) == p
                assert sk.owner((t - dp) * k_tiles + k1 - 1, grid, units) == p
    assert len(seen) == tiles * k_tiles


@pytest.mark.parametrize(("tiles", "k_tiles", "programs"), SHAPES)
def test_partial_tiles_never_wait_on_later_work(tiles: int, k_tiles: int, programs: int) -> None:
    """A tile's first part is the last segment of its program and every later part is the first
    stream-K segment of its own, later program (the dealt tiles come before them): so the waiting
    program waits only for work that comes first in other programs (no cycle), and each program
    fills at most its one slot."""
    grid, dp = sk.schedule(tiles, k_tiles, programs)
    parts: dict[int, list[tuple[int, int, int, int]]] = {}
    for p in range(grid):
        segs = [seg for seg in sk.segments(tiles, k_tiles, programs, p) if seg[0] >= dp]
        for i, (t, k0, k1) in enumerate(segs):
            if (k0, k1) != (0, k_tiles):
                parts.setdefault(t, []).append((p, i, len(segs), k0))
    for t, got in parts.items():
        got.sort()
        (p0, i0, n0, k0), *later = got
        assert k0 == 0 and i0 == n0 - 1, (t, got)  # first part: its program's last segment
        for p, i, _, k in later:
            assert p > p0 and i == 0 and k > 0, (t, got)  # later parts: first segments
        assert len({p for p, *_ in got}) == len(got)
    slot_users = [p for got in parts.values() for p, _, _, k in got if k > 0]
    assert len(slot_users) == len(set(slot_users))


def test_partial_sums_in_program_order_are_deterministic() -> None:
    """The kernel's sum: the first part's fp32 product plus the later parts in program order
    equals the whole K product up to fp32 rounding, and the same schedule gives the same bits."""
    gen = torch.Generator().manual_seed(0)
    n_tiles, k_tiles, bk = 6, 9, 16
    x = torch.randn(8, k_tiles * bk, generator=gen)
    w = torch.randn(n_tiles * 4, k_tiles * bk, generator=gen)

    def run(programs: int) -> torch.Tensor:
        out = torch.zeros(8, n_tiles * 4)
        firsts: dict[int, torch.Tensor] = {}
        later: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for p in range(sk.schedule(n_tiles, k_tiles, programs)[0]):
            for t, k0, k1 in sk.segments(n_tiles, k_tiles, programs, p):
                cols = slice(t * 4, t * 4 + 4)
                ks = slice(k0 * bk, k1 * bk)
                part = x[:, ks] @ w[cols, ks].T
                if (k0, k1) == (0, k_tiles):
                    out[:, cols] = part
                elif k0 == 0:
                    firsts[t] = part
                else:
                    later.setdefault(t, []).append((p, part))
        for t, part in firsts.items():
            for _, more in sorted(later.get(t, []), key=lambda e: e[0]):
                part = part + more
            out[:, t * 4 : t * 4 + 4] = part
        return out

    want = x @ w.T
    for programs in (1, 4, 7, 13, 54):
        got = run(programs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got, run(programs))


def test_stream_k_config_checks() -> None:
    x = torch.empty(256, 4096, dtype=torch.bfloat16)
    q = torch.empty(4096, 4096, dtype=torch.int8)
    s = torch.empty(4096, dtype=torch.bfloat16)
    assert wg.fits("int8", x, q, s, wg.WoConfig(128, 128, 128, 1, 4, 8, 2))
    assert wg.fits("int8", x, q, s, wg.WoConfig(256, 128, 64, 1, 4, 8, 2))  # two halves
    assert not wg.fits("int8", x, q, s, wg.WoConfig(32, 128, 128, 1, 4, 8, 2))
    assert not wg.fits("int8", x, q, s, wg.WoConfig(128, 64, 128, 1, 4, 8, 2))
    with pytest.raises(ValueError, match="64, 128 or 256 rows"):
        sk.sk_gemm("int8", x, q, s, None, None, wg.WoConfig(32, 128, 64, 1, 4, 8, 2))


def test_table_stream_k_entries_are_launchable() -> None:
    for (kind, n, k, bucket), cfg in wg.WO_CONFIGS.items():
        c = wg.WoConfig(*cfg)
        if c.ws == 2:
            assert c.block_n == 128 and c.block_m in (64, 128, 256), (kind, n, k)
            assert k % c.block_k == 0
            assert kind in ("int8", "int4", "int4s", "fp8")
            tiles = -(-bucket // c.block_m) * -(-n // c.block_n)
            assert tiles <= wg.MAX_TILES // 2, (kind, n, k, bucket)  # sk_gemm's counter limit

"""Fused MoE: the device-side grouping against a host-side one, routing, and both Triton paths
(decode GEMV, sorted grouped GEMM) against the plain-torch loop over experts."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close

from roofline.kernels.fused_moe import fused_moe, fused_moe_ref, route, route_ref
from roofline.kernels.moe_align import max_padded_rows, moe_align


def _host_grouping(ids: torch.Tensor, num_experts: int, block_m: int) -> dict[int, list[int]]:
    """expert -> its pairs in ascending order (what every padded run must hold)."""
    groups: dict[int, list[int]] = {}
    for pair, expert in enumerate(ids.reshape(-1).tolist()):
        groups.setdefault(expert, []).append(pair)
    return groups


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k", [(1, 8, 2), (5, 16, 4), (33, 8, 2), (3, 64, 8), (40, 4, 1)]
)
def test_moe_align_groups_pairs_by_expert(num_tokens, num_experts, top_k, block_m) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    # only the lower half of the experts is ever chosen: the upper half receives no token
    pool = max(top_k, num_experts // 2)
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(num_tokens)])
    align = moe_align(ids.to(DEVICE), num_experts, block_m)
    sorted_ids = align.sorted_pair_ids.cpu().tolist()
    block_expert = align.block_expert_ids.cpu().tolist()
    num_padded = int(align.num_padded.item())
    num_pairs = num_tokens * top_k
    assert len(sorted_ids) == max_padded_rows(num_pairs, num_experts, block_m)
    assert len(sorted_ids) % block_m == 0 and num_padded % block_m == 0
    got: dict[int, list[int]] = {}
    for b in range(num_padded // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        real = [p for p in rows if p < num_pairs]
        assert real, "a block of padding only"
        assert rows == real + [num_pairs] * (block_m - len(real)), "padding only at a run's end"
        got.setdefault(block_expert[b], []).extend(real)
    assert got == _host_grouping(ids, num_experts, block_m)
    assert all(p == num_pairs for p in sorted_ids[num_padded:])
    assert all(e == num_experts for e in block_expert[num_padded // block_m :])


def test_moe_align_same_expert_across_batch() -> None:
    """Every token picks experts 3 and 5: two runs of all tokens, nothing else."""
    ids = torch.tensor([[3, 5]] * 9)
    align = moe_align(ids.to(DEVICE), 8, 4)
    assert int(align.num_padded.item()) == 24  # 9 -> 12 rows per expert
    rows = align.sorted_pair_ids.cpu().tolist()
    assert rows[:12] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 18, 18]
    assert rows[12:24] == [1, 3, 5, 7, 9, 11, 13, 15, 17, 18, 18, 18]
    assert align.block_expert_ids.cpu().tolist()[:6] == [3, 3, 3, 5, 5, 5]


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_softmax_topk(renormalize) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(7, 24, generator=gen)).to(DEVICE)
    weights, ids = route(logits, 4, renormalize)
    ref_w, ref_ids = route_ref(logits, 4, renormalize)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert_close(weights, ref_w, torch.float32)


def test_route_ties_go_to_the_lowest_expert() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0], [2.0] * 6]).to(DEVICE)
    weights, ids = route(logits, 3, renormalize=False)
    assert ids.cpu().tolist() == [[1, 2, 4], [0, 1, 2]]
    probs = torch.softmax(logits.float(), -1)
    assert_close(weights, probs.gather(1, ids), torch.float32)


# (tokens, experts, top_k, hidden, inter); the last two reach the 64- and 128-row tiles
SHAPES = [(1, 8, 2, 64, 48), (3, 16, 4, 64, 32), (37, 8, 2, 32, 48), (100, 2, 1, 32, 16)]
SHAPES += [(200, 2, 1, 32, 16)]
if ON_GPU:
    SHAPES += [(1, 128, 8, 2048, 768), (256, 128, 8, 2048, 768), (64, 8, 2, 4096, 1024)]


CASES = [(*shape, path) for shape in SHAPES for path in ("gemv", "grouped")]
CASES = [c for c in CASES if c[-1] == "grouped" or c[0] <= 40]  # GEMV: decode sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,path", CASES)
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, hidden, inter, dtype, path):
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    w13, w2 = w13.to(DEVICE), w2.to(DEVICE)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    logits[:, num_experts // 2 :] -= 100.0  # the upper experts never chosen
    weights, ids = route_ref(logits, top_k, renormalize=True)
    weights = weights.to(dtype)
    out = fused_moe(x, w13, w2, weights, ids, force_path=path)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("path", ["gemv", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_is_the_separate_add(path, dtype) -> None:
    """``residual=h``: h + fused_moe(x) bit for bit (the GEMV path adds in its down store)."""
    gen = torch.Generator().manual_seed(7)
    num_experts, top_k, hidden, inter = 8, 2, 64, 48
    x = torch.randn(1, hidden, generator=gen).to(dtype).to(DEVICE)
    h = (4 * torch.randn(1, hidden, generator=gen)).to(dtype).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 8).to(dtype).to(DEVICE)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / 7).to(dtype).to(DEVICE)
    weights, ids = route_ref(torch.randn(1, num_experts, generator=gen).to(DEVICE), top_k, True)
    weights = weights.to(dtype)
    plain = fused_moe(x, w13, w2, weights, ids, force_path=path)
    fused = fused_moe(x, w13, w2, weights, ids, force_path=path, residual=h)
    assert torch.equal(fused, h + plain)
    with pytest.raises(ValueError, match="residual"):
        fused_moe(x, w13, w2, weights, ids, residual=h[:, :-1])


def test_gemv_pdl_variants_compile_for_hopper() -> None:
    """sm_90 compile of the decode GEMVs as PDL launches (the GPU-only variant): gate/up waits
    before it lets the down launch start; down prefetches its rows, then waits."""
    from hopper_variants import compile_for_hopper

    base = dict(BLOCK_N=8, BLOCK_K=256, NUM_STAGES=3, QUANT=0, GROUP=0, WIDEN=0, PDL=True,
                LINE_BYTES=128, FAST_FP8=True, LATE_TRIGGER=False)  # fmt: skip
    gate_up = dict(base, PAIRS_PER_PROGRAM=1, A_PER_PAIR=8, SILU_MUL=True, MUL_WEIGHT=False,
                   RESIDUAL=False, PREFETCH_LINES=1)  # fmt: skip
    down = dict(base, PAIRS_PER_PROGRAM=8, A_PER_PAIR=1, SILU_MUL=False, MUL_WEIGHT=True,
                RESIDUAL=True, PREFETCH_LINES=16)  # fmt: skip
    down_int8 = dict(down, QUANT=1, BLOCK_K=512, PREFETCH_LINES=8, WIDEN=2)
    pointers = {n: "bf16" for n in ("a_ptr", "w_ptr", "s_ptr", "o_ptr", "out_ptr", "weights_ptr",
                                    "res_ptr")}  # fmt: skip
    pointers["ids_ptr"] = "i64"
    ptxs = compile_for_hopper("roofline.kernels.fused_moe", "_moe_gemv_kernel",
                              [gate_up, down, dict(down, LATE_TRIGGER=True)], pointers, (),
                              dict(num_warps=4))  # fmt: skip
    assert all("griddepcontrol.wait" in p and "launch_dependents" in p for p in ptxs)
    assert "prefetch.global.L2" in ptxs[1] and "prefetch.global.L2" not in ptxs[0]
    pointers["w_ptr"] = "i8"
    (ptx,) = compile_for_hopper("roofline.kernels.fused_moe", "_moe_gemv_kernel", [down_int8],
                                pointers, (), dict(num_warps=4))  # fmt: skip
    assert "prefetch.global.L2" in ptx
    down_int4 = dict(down, QUANT=2, GROUP=128, BLOCK_N=16, BLOCK_K=256, NUM_STAGES=4)
    pointers["w_ptr"] = "u8"
    (ptx,) = compile_for_hopper("roofline.kernels.fused_moe", "_moe_gemv_kernel", [down_int4],
                                pointers, (), dict(num_warps=4))  # fmt: skip
    assert "prefetch.global.L2" in ptx
    pointers["w_ptr"] = "fp8e4nv"  # fp8 through mixed_gemm's bit moves (WIDEN 2)
    (ptx,) = compile_for_hopper("roofline.kernels.fused_moe", "_moe_gemv_kernel",
                                [dict(gate_up, QUANT=1, BLOCK_K=512, WIDEN=2)], pointers, (),
                                dict(num_warps=4))  # fmt: skip
    assert "prmt.b32" in ptx


def test_warm_up_runs_each_variant_once() -> None:
    from roofline.kernels import fused_moe as mod

    w13 = torch.zeros(4, 2 * 16, 32, device=DEVICE)
    w2 = torch.zeros(4, 32, 16, device=DEVICE)
    x = torch.zeros(1, 32, device=DEVICE)
    mod.warm_up(x, w13, w2, 2)
    key = next(k for k in mod._WARMED if k[0] == (4, 32, 32))
    assert key[4] == 2
    mod.warm_up(x, w13, w2, 2)  # a no-op the second time
    assert sum(k[0] == (4, 32, 32) for k in mod._WARMED) == 1


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_fused_moe_replays_in_a_cuda_graph(num_tokens) -> None:
    """Routing, grouping and both GEMM paths captured once, replayed on new inputs (no host
    sync inside, or the capture raises): the eager result on those inputs."""
    num_experts, top_k, hidden, inter = 16, 4, 256, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) / 16
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) / 11
    router = torch.randn(num_experts, hidden, device="cuda", generator=gen)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    w13, w2, router = w13.bfloat16(), w2.bfloat16(), router.bfloat16()

    def layer():
        weights, ids = route(x @ router.T, top_k, True)
        return fused_moe(x, w13, w2, weights, ids)

    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    x.copy_(torch.randn(num_tokens, hidden, device="cuda", generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer())


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(3, 129, 8, 16), (50, 9, 2, 64)])
def test_moe_align_kernel_equals_torch_ops(num_tokens, num_experts, top_k, block_m, monkeypatch):
    """The one-launch grouping and the torch-op sequence (beyond MAX_PAIRS_ONE_LAUNCH) agree."""
    from roofline.kernels import moe_align as mod

    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    ids[0, 0] = num_experts - 1  # the NOT_LOCAL sentinel's run
    one = moe_align(ids.to(DEVICE), num_experts, block_m)
    monkeypatch.setattr(mod, "MAX_PAIRS_ONE_LAUNCH", 0)
    ops = moe_align(ids.to(DEVICE), num_experts, block_m)
    num_padded = int(ops.num_padded.item())
    assert int(one.num_padded.item()) == num_padded
    assert torch.equal(
        one.sorted_pair_ids[:num_padded].cpu(), ops.sorted_pair_ids[:num_padded].cpu()
    )
    assert torch.equal(one.block_expert_ids.cpu(), ops.block_expert_ids.cpu())


def test_moe_align_kernel_compiles_for_hopper() -> None:
    """sm_90 compile of the grouping at its largest size (4096 pairs, 129 experts)."""
    from hopper_variants import compile_for_hopper

    pointers = dict(ids_ptr="i64", sorted_ptr="i32", block_expert_ptr="i32", num_padded_ptr="i64",
                    shift_ptr="i32")  # fmt: skip
    variant = dict(BLOCK_M=16, BLOCK_P=4096, BLOCK_E=256, CHUNK=256)
    (ptx,) = compile_for_hopper("roofline.kernels.moe_align", "_align_kernel", [variant], pointers,
                                (), dict(num_warps=8))  # fmt: skip
    assert "bar.sync" in ptx

"""Expert-parallel dispatch and combine on random routings, 2 gloo ranks on the CPU: both
dispatches (replicated + all-reduce, all-to-all with split sizes) give every rank the
single-process MoE output, including experts that receive no token, every pair sent to one
rank's experts, a batch of one token (the second rank's token share is empty) and a token
picking the same expert twice across a batch; plus the placement arithmetic and the sharded
loader reading only a rank's experts."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time

import pytest
import torch

from roofline.distributed.expert_parallel import (
    ExpertPlacement,
    check_expert_split,
    parse_expert_tensor,
)

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 12


def _case_ids(case: str, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] global expert ids for a named routing."""
    if case == "random":
        return torch.stack(
            [torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)]
        )
    if case == "idle_experts":  # experts 2, 3, 6, 7 never chosen (one idle pair on each rank)
        pool = torch.tensor([0, 1, 4, 5])
        return torch.stack(
            [pool[torch.randperm(4, generator=gen)[:TOP_K]] for _ in range(num_tokens)]
        )
    if case == "all_to_rank0":
        return torch.stack([torch.randperm(4, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    if case == "all_to_rank1":
        return torch.stack(
            [4 + torch.randperm(4, generator=gen)[:TOP_K] for _ in range(num_tokens)]
        )
    raise ValueError(case)


CASES = [
    ("random", 7),
    ("idle_experts", 5),
    ("all_to_rank0", 6),
    ("all_to_rank1", 3),
    ("random", 1),
]


DISPATCH_NAMES = ("replicated", "all_to_all")


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from roofline.distributed.expert_parallel import make_dispatch
    from roofline.distributed.parallel_state import ParallelContext
    from roofline.kernels.fused_moe import fused_moe_ref

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ctx = ParallelContext(rank, 2, dist.group.WORLD)
        placement = ExpertPlacement(NUM_EXPERTS, rank, 2)
        gen = torch.Generator().manual_seed(0)  # the same model and batches on both ranks
        w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen)
        w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
        local = slice(placement.start, placement.start + placement.num_local)

        def experts(x, weights, local_ids):  # this rank's experts only
            return fused_moe_ref(x, w13[local], w2[local], weights, local_ids)

        errors = []
        for case, num_tokens in CASES:
            x = torch.randn(num_tokens, HIDDEN, generator=gen)
            ids = _case_ids(case, num_tokens, gen)
            weights = torch.rand(num_tokens, TOP_K, generator=gen)
            expected = fused_moe_ref(x, w13, w2, weights, ids)
            for name in DISPATCH_NAMES:
                got = make_dispatch(name, placement, ctx)(experts, x, weights, ids)
                errors.append((name, case, num_tokens, float((got - expected).abs().max())))
        results.put((rank, errors))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dispatch_and_combine_match_single_process() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, list] = {}
    try:
        deadline = time.monotonic() + 120
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, errors = results.get(timeout=1.0)
                got[rank] = errors
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank failed: its traceback is in the captured output
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs) and len(got) == 2
    for rank in (0, 1):
        assert len(got[rank]) == len(CASES) * len(DISPATCH_NAMES)
        for name, case, num_tokens, err in got[rank]:
            assert err < 1e-4, f"{name}, rank {rank}, {case} T={num_tokens}: max error {err}"


def test_placement() -> None:
    p = ExpertPlacement(8, 1, 2)
    assert (p.start, p.num_local) == (4, 4)
    assert p.owns(4) and p.owns(7) and not p.owns(3)
    ids = torch.tensor([[0, 4], [7, 3]])
    assert p.localize(ids).tolist() == [[4, 0], [3, 4]]  # 4 = NOT_LOCAL on this rank
    assert p.owner_of(ids).tolist() == [[0, 1], [1, 0]]
    with pytest.raises(ValueError, match="do not split evenly"):
        check_expert_split(6, 4)
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement(8, 2, 2)


def test_parse_expert_tensor() -> None:
    one = parse_expert_tensor("model.layers.3.mlp.experts.7.gate_proj.weight")
    assert (one.layer, one.expert, one.proj) == (3, 7, "gate")
    mixtral = parse_expert_tensor("model.layers.0.block_sparse_moe.experts.2.w2.weight")
    assert (mixtral.expert, mixtral.proj) == (2, "down")
    stacked = parse_expert_tensor("model.layers.1.mlp.experts.gate_up_proj")
    assert (stacked.expert, stacked.proj) == (None, "gate_up")
    assert parse_expert_tensor("model.layers.1.mlp.gate.weight") is None  # the router
    assert parse_expert_tensor("model.layers.1.mlp.down_proj.weight") is None
    with pytest.raises(KeyError, match="unknown expert projection"):
        parse_expert_tensor("model.layers.1.mlp.experts.0.w9.weight")


def test_sharded_loader_reads_only_local_experts(tmp_path) -> None:
    from roofline.distributed.loader import iter_sharded_weights
    from roofline.distributed.sharding import ShardLayout
    from roofline.models.weights import load_model_config, resolve_model
    from tests.e2e.hf_reference import tiny_hf_model

    tiny_hf_model("qwen3_moe", tmp_path, num_hidden_layers=2)  # 8 experts, layer 1 dense
    source = resolve_model(str(tmp_path))
    cfg = load_model_config(source)
    for rank in (0, 1):
        layout = ShardLayout.of(cfg, rank, 2, expert_parallel=True)
        names = dict(iter_sharded_weights(source, cfg, layout))
        experts = {parse_expert_tensor(n).expert for n in names if parse_expert_tensor(n)}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        assert names["model.layers.0.mlp.gate.weight"].shape == (8, 64)  # router whole
        assert names[
            "model.layers.0.mlp.experts.5.up_proj.weight"
            if rank
            else "model.layers.0.mlp.experts.1.up_proj.weight"
        ].shape == (48, 64)  # whole
        assert names["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # TP heads
    tp = ShardLayout.of(cfg, 1, 2)  # tensor-parallel experts: half of each expert's columns
    names = dict(iter_sharded_weights(source, cfg, tp))
    assert names["model.layers.0.mlp.experts.6.up_proj.weight"].shape == (24, 64)
    assert names["model.layers.0.mlp.experts.6.down_proj.weight"].shape == (64, 24)

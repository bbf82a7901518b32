"""The step roofline: literature examples, exact identities, TTFT/TPOT and parallelism."""

from __future__ import annotations

import pytest

from roofline.planner.hardware import custom_gpu, get_gpu
from roofline.planner.latency import (
    crossover_batch_size,
    decode_point,
    estimate_latency,
    prefill_time_s,
)
from roofline.planner.memory import KVLayout, kv_bytes_per_token, param_counts
from roofline.planner.parallel import (
    allreduce_time_per_layer_s,
    allreduce_time_s,
    pipeline_bubble_fraction,
    plan_parallel,
    ring_allreduce_time_s,
)
from roofline.planner.roofline import (
    Precision,
    decode_bytes_per_step,
    decode_flops,
    prefill_attention_pairs,
    prefill_flops,
    step_cost,
    step_time,
)


def test_70b_fp16_on_2tbs_gpu_is_about_14_tok_s(llama2_70b):
    gpu = custom_gpu("2 TB/s", memory_gib=192, bandwidth_gb_per_s=2000, bf16_tflops=1000)
    fp16 = Precision("fp16", "fp16")
    tok_s = 1.0 / step_time(llama2_70b, gpu, 1, 1, precision=fp16)
    assert tok_s == pytest.approx(14.0, rel=0.05)
    # the rule of thumb (every parameter, 2 bytes) gives 14.3; the exact count skips the
    # embedding table (one row read) and lands at 14.55
    rule = 2e12 / (2 * 70e9)
    assert rule == pytest.approx(14.29, abs=0.01)
    assert tok_s == pytest.approx(14.55, abs=0.01)


def test_decode_bytes_are_weights_plus_kv(llama3_8b):
    kv_tok = kv_bytes_per_token(KVLayout.from_model(llama3_8b), "bf16")
    pc = param_counts(llama3_8b)
    b1 = decode_bytes_per_step(llama3_8b, 1, 1000)
    weights = 2 * (pc.total - pc.embedding)  # the embedding table is not read, one row is
    assert b1 == pytest.approx(weights + 2 * 4096 + 1000 * kv_tok + kv_tok)
    # affine in batch and in context sum
    b8 = decode_bytes_per_step(llama3_8b, 8, 8000)
    b16 = decode_bytes_per_step(llama3_8b, 16, 16000)
    assert b16 - b8 == pytest.approx((b8 - b1) * 8 / 7)
    assert decode_bytes_per_step(llama3_8b, 8, 16000) - b8 == pytest.approx(8000 * kv_tok)


def test_context_list_equals_sum(llama3_8b):
    gpu = get_gpu("h100")
    a = step_cost(llama3_8b, gpu, decode_context_lens=[100, 300, 600])
    b = step_cost(llama3_8b, gpu, 3, 1000)
    assert a == b


def test_crossover_batch_identity(llama3_8b):
    gpu = get_gpu("h100")
    for prec, bytes_per_param in ((Precision(), 2.0), (Precision("fp32", "fp32"), 4.0)):
        expected = gpu.peak_flops_per_s(prec.gemm_dtype) / (
            2 * gpu.hbm_bandwidth_bytes_per_s / bytes_per_param
        )
        got = crossover_batch_size(llama3_8b, gpu, 1, prec)
        assert got == pytest.approx(expected, rel=0.03)
        below = decode_point(llama3_8b, gpu, int(got) - 5, 1, prec).cost
        above = decode_point(llama3_8b, gpu, int(got) + 5, 1, prec).cost
        assert below.bound == "memory" and above.bound == "compute"
    # fp8 blocks keep a 16-bit head and embedding: a little above the all-fp8 identity
    fp8 = crossover_batch_size(llama3_8b, gpu, 1, Precision("fp8", "fp8"))
    assert 1.0 < fp8 / (1978.9e12 / (2 * 3.35e12)) < 1.15


def test_long_context_decode_never_turns_compute_bound(llama3_8b):
    # GQA-4 bf16 attention does 4 x 32 x 128 FLOPs per 2 x 8 x 128 x 2 bytes = 4 FLOP/B << ridge
    assert crossover_batch_size(llama3_8b, get_gpu("h100"), 4096) is None


def test_prefill_flops_and_chunking(llama3_8b):
    pc = param_counts(llama3_8b)
    f = prefill_flops(llama3_8b, 1000)
    attn = 4 * 32 * 128 * 32 * (1000 * 1001 // 2)
    assert f == pytest.approx(2 * pc.linear * 1000 + attn + 2 * pc.lm_head)
    assert prefill_attention_pairs(300, 0) + prefill_attention_pairs(700, 300) == (
        prefill_attention_pairs(1000, 0)
    )
    # the rule of thumb 2 N per token over-counts the embedding at short prompts
    assert f < 2 * pc.total * 1000
    # decode = one-token chunk
    assert decode_flops(llama3_8b, 1, 1001) == pytest.approx(prefill_flops(llama3_8b, 1, 1000))


def test_prefill_is_compute_bound_and_ttft(llama3_8b):
    gpu = get_gpu("h100")
    cost = step_cost(llama3_8b, gpu, num_prefill_tokens=4096)
    assert cost.bound == "compute"
    assert cost.time_s == pytest.approx(prefill_flops(llama3_8b, 4096) / 989.4e12, rel=0.01)
    chunked = prefill_time_s(llama3_8b, gpu, 4096, max_num_batched_tokens=1024)
    assert chunked > cost.time_s  # chunks re-read the weights and the cached prefix
    est = estimate_latency(llama3_8b, gpu, 4096, 2, batch_size=1)
    assert est.ttft_s == pytest.approx(cost.time_s)
    assert est.tpot_s == pytest.approx(step_time(llama3_8b, gpu, 1, 4097))


def test_ring_allreduce_and_tp(llama3_8b):
    gpu = get_gpu("h100")
    n_bytes = 1e6
    t = ring_allreduce_time_s(n_bytes, 4, gpu)
    assert t == pytest.approx(1.5 * n_bytes / 450e9 + 6 * gpu.interconnect_latency_s)
    assert ring_allreduce_time_s(n_bytes, 1, gpu) == 0.0
    per_layer = allreduce_time_per_layer_s(llama3_8b, gpu, 2)
    # 8 KB per all-reduce: the one-shot algorithm (one hop) the engine uses at that size
    assert per_layer == 2 * allreduce_time_s(4096 * 2, 2, gpu)
    assert allreduce_time_s(4096 * 2, 4, gpu) < ring_allreduce_time_s(
        4096 * 2, 4, gpu
    )  # 2 vs 6 hops
    big = 64 << 20  # prefill-sized: the ring
    assert allreduce_time_s(big, 4, gpu) == ring_allreduce_time_s(big, 4, gpu)
    plan1 = plan_parallel(llama3_8b, gpu, 1, 1, 4096)
    plan2 = plan_parallel(llama3_8b, gpu, 2, 1, 4096)
    assert plan2.memory.weight_bytes == pytest.approx(plan1.memory.weight_bytes / 2, rel=0.001)
    assert plan2.allreduce_per_token_s == pytest.approx(32 * per_layer)
    # TP halves the per-rank bytes, so a batch-1 step gets faster despite the all-reduces
    assert step_time(llama3_8b, gpu, 1, 1000, tp=2) < step_time(llama3_8b, gpu, 1, 1000)
    assert pipeline_bubble_fraction(4, 12) == pytest.approx(3 / 15)
    with pytest.raises(ValueError):
        plan_parallel(llama3_8b, gpu, 3, 1, 4096)


def test_bad_step_inputs(llama3_8b):
    gpu = get_gpu("h100")
    with pytest.raises(ValueError):
        step_cost(llama3_8b, gpu, 4, 3)  # contexts include the new token
    with pytest.raises(ValueError):
        step_cost(llama3_8b, gpu, num_prefill_tokens=5, prefill_chunks=[(4, 0)])
    assert step_cost(llama3_8b, gpu).time_s == 0.0
    with pytest.raises(ValueError):
        Precision("int3")

"""KV cache and weight memory against worked examples and exact identities."""

from __future__ import annotations

import math

import pytest

from roofline.planner.hardware import GiB, get_gpu
from roofline.planner.memory import (
    KVLayout,
    kv_bytes,
    kv_bytes_per_token,
    max_context_len_for_batch,
    param_counts,
    plan_memory,
    weight_bytes,
    weight_bytes_per_gpu,
)
from roofline.planner.models import model_from_dims


def test_llama2_70b_gqa8_kv_per_sequence_fp16(llama2_70b):
    layout = KVLayout.from_model(llama2_70b)
    assert layout.attention_kind == "GQA-8"
    # 2 (K, V) x 80 layers x 8 heads x 128 dims x 2 bytes = 327,680 bytes per token
    assert kv_bytes_per_token(layout, "fp16") == 327_680
    per_seq = kv_bytes(layout, 4096, "fp16")
    assert per_seq == 1_342_177_280
    assert per_seq / 1e9 == pytest.approx(1.34, abs=0.005)  # "1.34 GB" is decimal GB


def test_param_count_matches_model_config(llama2_70b, llama3_8b):
    assert param_counts(llama2_70b).total == llama2_70b.num_params() == 68_976_648_192
    assert param_counts(llama3_8b).total == llama3_8b.num_params()


def test_mha_gqa_mqa_kinds_and_ratios():
    mha = model_from_dims(32, 4096, 32, 32, 11008, 32000)
    gqa = model_from_dims(32, 4096, 32, 8, 11008, 32000)
    mqa = model_from_dims(32, 4096, 32, 1, 11008, 32000)
    kinds = [KVLayout.from_model(m).attention_kind for m in (mha, gqa, mqa)]
    assert kinds == ["MHA", "GQA-8", "MQA"]
    per = [kv_bytes_per_token(KVLayout.from_model(m), "bf16") for m in (mha, gqa, mqa)]
    assert per[0] == 2 * 32 * 32 * 128 * 2 == 4 * per[1] == 32 * per[2]


def test_mla_deepseek_v3():
    layout = KVLayout.mla(num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, num_query_heads=128)
    assert layout.attention_kind == "MLA"
    assert kv_bytes_per_token(layout, "bf16") == 61 * 576 * 2 == 70_272
    # DeepSeek-V2 paper: MLA stores as much as GQA with 2.25 groups of head_dim 128.
    assert layout.elements_per_token_per_layer() == 2 * 2.25 * 128
    # The latent is not split by heads: tensor parallelism replicates it.
    assert kv_bytes_per_token(layout, "bf16", tp=8) == kv_bytes_per_token(layout, "bf16")


@pytest.mark.parametrize(
    # fp8 / int8 heads carry a 4-byte scale each (head_dim 128: 128 + 4 bytes vs 256)
    "dtype,ratio",
    [("fp16", 1.0), ("fp8", 132 / 256), ("int8", 132 / 256), ("int4", 0.25)],
)
def test_kv_precisions_and_linearity(llama3_8b, dtype, ratio):
    layout = KVLayout.from_model(llama3_8b)
    base = kv_bytes_per_token(layout, "bf16")
    assert kv_bytes_per_token(layout, dtype) == base * ratio
    one = kv_bytes(layout, 1000, dtype)
    assert kv_bytes(layout, 3000, dtype) == 3 * one
    assert kv_bytes(layout, 1000, dtype, batch_size=7) == 7 * one
    # page rounding: 1000 tokens take 63 pages of 16
    assert kv_bytes(layout, 1000, dtype, page_size=16) == 1008 / 1000 * one


def test_weight_bytes_per_precision(llama3_8b):
    pc = param_counts(llama3_8b)
    bf16 = weight_bytes(llama3_8b, "bf16")
    assert bf16.total == 2 * pc.total
    fp8 = weight_bytes(llama3_8b, "fp8")
    assert fp8.linear == pc.linear and fp8.embedding == bf16.embedding  # embeddings stay 16-bit
    int4 = weight_bytes(llama3_8b, "int4", quant_group_size=128)
    assert int4.linear == pytest.approx(pc.linear * (0.5 + 2 / 128))


def test_tp_halves_weights_and_kv(llama3_8b):
    one, two = weight_bytes(llama3_8b, tp=1), weight_bytes(llama3_8b, tp=2)
    assert two.linear == one.linear / 2
    assert two.embedding == one.embedding / 2 and two.lm_head == one.lm_head / 2
    layout = KVLayout.from_model(llama3_8b)  # 8 KV heads
    assert kv_bytes_per_token(layout, tp=2) == kv_bytes_per_token(layout) / 2
    # 16 ranks over 8 KV heads: each rank keeps one head (replicated), not half of one
    assert kv_bytes_per_token(layout, tp=16) == kv_bytes_per_token(layout, tp=8)


def test_pp_splits_layers(llama2_70b):
    whole = weight_bytes_per_gpu(llama2_70b, "bf16")
    half = weight_bytes_per_gpu(llama2_70b, "bf16", pp=2)
    assert half == pytest.approx(whole / 2, rel=0.01)
    layout = KVLayout.from_model(llama2_70b)
    assert kv_bytes_per_token(layout, pp=2) == kv_bytes_per_token(layout) / 2


def test_plan_memory_capacity(llama3_8b):
    gpu = get_gpu("h100")
    plan = plan_memory(llama3_8b, gpu, context_len=4096, gpu_memory_utilization=0.9)
    assert plan.usable_bytes == 0.9 * 80 * GiB
    assert plan.kv_pool_bytes == pytest.approx(
        plan.usable_bytes - plan.weight_bytes - plan.reserve_bytes
    )
    assert plan.max_num_seqs * plan.kv_bytes_per_seq <= plan.kv_pool_bytes
    assert (plan.max_num_seqs + 1) * plan.kv_bytes_per_seq > plan.kv_pool_bytes
    assert plan.num_pages == math.floor(plan.kv_pool_bytes / (plan.kv_bytes_per_token * 16))
    # the context that fits a batch, and back
    ctx = max_context_len_for_batch(plan, 64)
    assert ctx % 16 == 0
    assert plan_memory(llama3_8b, gpu, ctx).max_num_seqs >= 64
    assert plan_memory(llama3_8b, gpu, ctx + 16).max_num_seqs < 64


def test_plan_memory_does_not_fit(llama2_70b):
    plan = plan_memory(llama2_70b, get_gpu("h100"), 4096)
    assert not plan.fits and plan.max_num_seqs == 0
    assert plan_memory(llama2_70b, get_gpu("h100"), 4096, tp=2).fits
    assert plan_memory(llama2_70b, get_gpu("h100"), 4096, weight_dtype="int4").fits

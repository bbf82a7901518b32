"""Mixed steps with split attention and padded token buckets, on the CPU under
``TRITON_INTERPRET=1`` (on CUDA when present).

* ``SplitAttentionBackend`` on a decode-first mixed batch matches the dense reference, and the
  same batch padded to a bucket (``padding_lists``: a padding request, empty request slots, idle
  decode slots) gives its real rows the same values: prefill rows bit for bit.
* A tiny fp32 model through the runner's mixed path, with each bucket's staged forward run
  uncaptured (``MixedGraphs.stage_only``: exactly what the graph replays, minus the capture) and
  steps past the largest bucket run eagerly with split attention, generates the tokens of the
  reference torch backend, under arrivals that force mixed steps.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, ON_GPU, assert_close, make_paged

from roofline.attention.split_backend import SplitAttentionBackend, SplitMetadata
from roofline.attention.triton_backend import TritonAttentionBackend
from roofline.kernels.prefill_attention import prefill_attention_ref
from roofline.worker.host_batch import HostBatch
from roofline.worker.mixed_graph import eager_split_metadata
from roofline.worker.mixed_layout import padding_lists

HEAD_DIM = 128 if ON_GPU else 32


def _host(query_lens: list[int], seq_lens: list[int], page_size: int) -> HostBatch:
    b = HostBatch(page_size)
    for q, s in zip(query_lens, seq_lens, strict=True):
        b.input_ids.extend([0] * q)
        b.query_start.append(b.query_start[-1] + q)
        b.seq_lens.append(s)
    return b


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_matches_reference_and_padding_changes_nothing(
    dtype: torch.dtype, monkeypatch
) -> None:
    from roofline.kernels import prefill_attention_gqa as gqa

    # the per-head prefill kernel in both (a graph bucket never packs the GQA group's heads);
    # the packed kernel's eager result is checked against the reference below
    monkeypatch.setattr(gqa, "ENABLED", False)
    page_size, num_decodes = 16, 3
    # the last request has one row but comes after a prefill: the prefill kernel takes it
    query_lens, context_lens = [1, 1, 1, 9, 23, 1], [40, 17, 3, 0, 10, 5]
    b = make_paged(query_lens, context_lens, 8, 2, HEAD_DIM, page_size, dtype, seed=7)
    q, kc, vc = b.q.to(DEVICE), b.k_cache.to(DEVICE), b.v_cache.to(DEVICE)
    bt = b.block_table.to(DEVICE)
    scale = HEAD_DIM**-0.5
    host = _host(query_lens, b.seq_lens_list, page_size)
    n, r = host.num_tokens, host.num_reqs
    as_i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    no_store = torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
    eager = eager_split_metadata(
        host,
        num_decodes,
        as_i64(host.query_start),
        as_i64(host.seq_lens),
        no_store,
        bt[:num_decodes].clone(),
        bt[num_decodes:].clone(),
    )
    assert eager.num_reqs == 3 and eager.decode_slots == 3 and eager.max_query_len == 23
    backend = SplitAttentionBackend(TritonAttentionBackend())
    # the step's own K/V rows, as the model passes them (stored to slot -1 here: nowhere; the
    # descriptor kernel reads them from these tensors, the pages hold the same values)
    k_new = torch.cat([ks[c:] for ks, c in zip(b.k_seqs, context_lens, strict=True)]).to(DEVICE)
    v_new = torch.cat([vs[c:] for vs, c in zip(b.v_seqs, context_lens, strict=True)]).to(DEVICE)
    out = backend.forward(q, k_new, v_new, kc, vc, eager, scale)
    ref = prefill_attention_ref(q, kc, vc, bt, _i32(host.query_start), _i32(host.seq_lens), scale)
    assert_close(out, ref, dtype)
    monkeypatch.setattr(gqa, "ENABLED", True)
    packed = SplitAttentionBackend(TritonAttentionBackend()).forward(q, k_new, v_new, kc, vc,
                                                                     eager, scale)  # fmt: skip
    assert_close(packed, ref, dtype)
    monkeypatch.setattr(gqa, "ENABLED", False)

    bucket, max_num_seqs = 64, 8
    seq_lens, query_start, decode = padding_lists(host, num_decodes, bucket, max_num_seqs)
    p, d = len(seq_lens), len(decode)
    q_pad = torch.randn(bucket, *q.shape[1:], dtype=dtype, device=DEVICE)
    q_pad[:n] = q
    bt_pre = torch.zeros(p, bt.shape[1], dtype=torch.int32, device=DEVICE)  # padding: page 0
    bt_pre[: r - num_decodes] = bt[num_decodes:]
    bt_dec = torch.zeros(d, bt.shape[1], dtype=torch.int32, device=DEVICE)
    bt_dec[:num_decodes] = bt[:num_decodes]
    padded = SplitMetadata(
        num_reqs=p, num_tokens=bucket, query_start_loc=_i32(query_start),
        seq_lens=_i32(seq_lens), block_table=bt_pre,
        slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=bucket, max_seq_len=256, page_size=page_size, query_start_loc_cpu=[],
        query_lens_cpu=[], seq_lens_cpu=[], decode_slots=d, decode_seq_lens=_i32(decode),
        decode_block_table=bt_dec, decode_max_seq_len=256, decode_num_splits=4,
    )  # fmt: skip
    k_pad = torch.zeros(bucket, 2, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_pad = torch.zeros_like(k_pad)
    k_pad[:n], v_pad[:n] = k_new, v_new
    out_pad = backend.forward(q_pad, k_pad, v_pad, kc, vc, padded, scale)
    assert torch.isfinite(out_pad.float()).all()  # padding rows included
    assert_close(out_pad[:num_decodes], out[:num_decodes], dtype)  # another split count
    if not ON_GPU or dtype == torch.float32:  # same kernel, same rows, same order
        assert torch.equal(out_pad[num_decodes:n], out[num_decodes:n])


# --------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.e2e.hf_reference import tiny_hf_model

    path = tmp_path_factory.mktemp("llama_mixed")
    tiny_hf_model("llama", path, num_hidden_layers=1)
    return path


PROMPTS = [[5 + i % 300 for i in range(n)] for n in (3, 21, 9, 40, 2)]


def _generate(path, **kwargs) -> tuple[list[list[int]], object]:
    from roofline import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device=str(DEVICE), page_size=8, **kwargs)
    runner = llm.llm_engine.runner
    if kwargs.get("cuda_graph_mode") == "full" and not ON_GPU:
        runner.mixed.max_tokens = 16  # one bucket; bigger steps run eagerly (split)
        sched = llm.llm_engine.scheduler_config
        runner.mixed.build_graphs(runner.model, runner.kv_caches, sched, 8).stage_only()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], runner


def test_tiny_model_mixed_graph_path_matches_reference(tiny_path) -> None:
    # a 24-token budget: prompts are chunked and decode rows share steps with later chunks
    expected, _ = _generate(tiny_path, attention_backend="torch", max_num_batched_tokens=24)
    got, runner = _generate(
        tiny_path, attention_backend="triton", cuda_graph_mode="full", max_num_batched_tokens=24
    )
    assert got == expected
    graphs = runner.mixed.graphs
    assert graphs is not None and graphs.num_replays > 0  # mixed steps went through a bucket


def test_mixed_graph_inputs_are_staged_with_padding() -> None:
    """What a mixed step copies into a bucket's static buffers (no capture, no kernel): two
    decodes and two prefill requests (10 rows) in bucket 16, the pending id filled."""
    from roofline.request import Request
    from roofline.sampling_params import SamplingParams
    from roofline.worker.block_table import BlockTables, TableUpdates
    from roofline.worker.host_batch import upload
    from roofline.worker.mixed_graph import MixedGraphs
    from roofline.worker.pending import PendingInputs

    cpu = torch.device("cpu")
    graphs = MixedGraphs(None, [], None, 4, 16, 16, 4, cpu)  # type: ignore[arg-type]
    assert graphs.buckets == [16] and graphs.bucket_for(10, 2, 2) is None  # not ready
    graphs.stage_only()
    assert graphs.bucket_for(10, 2, 2) == 16 and graphs.bucket_for(17, 2, 2) is None
    tables, upd = BlockTables(8, 4, cpu), TableUpdates()
    pages = {"a": [3], "b": [1, 2, 5], "c": [9, 8], "d": [7]}
    rows = [tables.row_of(Request(r, [1], SamplingParams()), p, upd) for r, p in pages.items()]
    tables.apply(torch.tensor(upd.flat_index), torch.tensor(upd.page_ids))
    host = _host([1, 1, 5, 3], [3, 10, 6, 3], 4)
    lists = padding_lists(host, 2, 16, max_num_seqs=4)
    ids, pos, slots, table_rows, dst, *padded = upload(
        [[11, 0] + [5] * 8, list(range(10)), list(range(20, 30)), rows, [1], *lists], cpu
    )
    pending = PendingInputs(torch.tensor([40, 41]), torch.tensor([1]), dst)
    graphs.stage_inputs(16, 2, ids, pos, slots, padded, tables, table_rows, pending)
    assert graphs.input_ids[:3].tolist() == [11, 41, 5]
    assert graphs.slot_mapping[:16].tolist() == list(range(20, 30)) + [-1] * 6
    meta = graphs.metadata(16)
    assert meta.num_reqs == 9 and meta.decode_slots == 4 and meta.num_tokens == 16
    assert meta.seq_lens.tolist() == [6, 3, 6] + [0] * 6 and meta.seq_lens.dtype == torch.int32
    assert meta.query_start_loc.tolist() == [2, 7, 10] + [16] * 7
    assert meta.decode_seq_lens.tolist() == [3, 10, 0, 0]
    assert meta.decode_block_table[:2].tolist() == [[3, 0, 0, 0], [1, 2, 5, 0]]
    assert meta.block_table[:2].tolist() == [[9, 8, 0, 0], [7, 0, 0, 0]]


def test_unknown_cuda_graph_mode_is_refused_before_loading(tiny_path) -> None:
    from roofline import LLM

    with pytest.raises(ValueError, match="cuda_graph_mode must be one of full"):
        LLM(str(tiny_path), device="cpu", cuda_graph_mode="piecewise")


def test_eager_mixed_steps_run_their_decode_rows_through_the_cascade(tiny_path) -> None:
    """Requests behind a 24-token shared prefix, a 24-token step budget and one 16-token
    bucket: steps that carry chunks past the bucket run eagerly, and their decode rows (which
    share the prefix pages) attend the prefix once through the cascade kernels. Tokens equal
    the torch backend's."""
    from roofline import LLM, SamplingParams
    from roofline.attention.cascade import SharedPrefixDetector

    prefix = [7 + (5 * i) % 290 for i in range(24)]
    prompts = [prefix + [11 + (i * 7 + j) % 280 for j in range(9 + i % 3)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", device=str(DEVICE), page_size=8, max_num_batched_tokens=24)
    ref = LLM(str(tiny_path), attention_backend="torch", **kw)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_path), attention_backend="triton", cuda_graph_mode="full", **kw)
    runner = llm.llm_engine.runner
    if not ON_GPU:
        runner.mixed.max_tokens = 16
        sched = llm.llm_engine.scheduler_config
        runner.mixed.build_graphs(runner.model, runner.kv_caches, sched, 8).stage_only()
    runner.cascade = SharedPrefixDetector(8, 1, min_group=2, min_saved_bytes=1)
    seen = []
    cascade_plan = runner.mixed.cascade_plan

    def watched(sched_out, detector):
        plan = cascade_plan(sched_out, detector)
        seen.append((sched_out.num_batched_tokens > len(sched_out.scheduled), plan))
        return plan

    runner.mixed.cascade_plan = watched
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert any(mixed and plan is not None for mixed, plan in seen)  # an eager mixed step's


@pytest.mark.parametrize("page_dtype", [torch.float8_e4m3fn, torch.int8])
def test_split_fresh_prefill_over_1_byte_pages(page_dtype, monkeypatch) -> None:
    """A decode-first eager step over a quantized cache whose prefill part is fresh: the chunks
    attend their rows read back from the pages and dequantized (the descriptor kernel,
    ``triton_backend.fresh_rows_dequantized``), as the paged kernel reading the pages does."""
    from roofline.attention import triton_backend as tb
    from roofline.kernels import prefill_attention_gqa as gqa
    from roofline.quantization.kv_cache import quantize

    monkeypatch.setattr(gqa, "ENABLED", False)  # (mostly short chunks would take it)
    page_size, num_decodes = 16, 2
    query_lens, context_lens = [1, 1, 264, 8], [40, 17, 0, 0]
    b = make_paged(query_lens, context_lens, 8, 2, HEAD_DIM, page_size, torch.bfloat16, seed=9)
    q, bt = b.q.to(DEVICE), b.block_table.to(DEVICE)
    (kc, ks), (vc, vs) = quantize(b.k_cache, page_dtype), quantize(b.v_cache, page_dtype)
    kc, ks, vc, vs = (t.to(DEVICE) for t in (kc, ks, vc, vs))
    host = _host(query_lens, b.seq_lens_list, page_size)
    as_i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    meta = eager_split_metadata(host, num_decodes, as_i64(host.query_start),
                                as_i64(host.seq_lens), b.slot_mapping.to(DEVICE).long(),
                                bt[:num_decodes].clone(), bt[num_decodes:].clone())  # fmt: skip
    k_new = torch.cat([ks_[c:] for ks_, c in zip(b.k_seqs, context_lens, strict=True)])
    v_new = torch.cat([vs_[c:] for vs_, c in zip(b.v_seqs, context_lens, strict=True)])
    from roofline.attention import split_backend as sb

    outs, used = {}, []
    real = sb.fresh_rows_dequantized
    monkeypatch.setattr(sb, "fresh_rows_dequantized",
                        lambda *a: used.append(real(*a) is not None) or real(*a))  # fmt: skip
    for on in (False, True):
        monkeypatch.setattr(tb, "DEQUANT_FRESH", on)
        pages = [t.clone() for t in (kc, vc, ks, vs)]  # the store rewrites the step's rows
        outs[on] = SplitAttentionBackend(TritonAttentionBackend()).forward(
            q, k_new.to(DEVICE), v_new.to(DEVICE), pages[0], pages[1], meta, HEAD_DIM**-0.5,
            kv_scales=(pages[2], pages[3]),
        ).float()  # fmt: skip
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c)
                   for a, c in zip(pages, (kc, vc, ks, vs)))  # fmt: skip
    ref = prefill_attention_ref(q, kc, vc, bt, _i32(host.query_start), _i32(host.seq_lens),
                                HEAD_DIM**-0.5, ks, vs).float()  # fmt: skip
    assert used == [False, True]  # the paged kernel, then the dequantized rows
    for on in (False, True):
        torch.testing.assert_close(outs[on], ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[True], outs[False], atol=4e-3, rtol=4e-3)

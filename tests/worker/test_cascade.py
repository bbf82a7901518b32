"""Cascade (shared-prefix) decode: the detector's choice of group, and greedy tokens through the
engine identical with the cascade path on and off (tiny fp32 Llama on the CPU, torch backend:
the fp32 reference of the cascade kernels).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from roofline import LLM, SamplingParams
from roofline.attention.cascade import SharedPrefixDetector
from roofline.request import Request
from roofline.sampling_params import SamplingParams as SP

PAGE = 4


def _step(tables: list[list[int]], ends: list[int], reqs: list[Request] | None = None, n=1):
    reqs = reqs or [Request(f"r{i}", [0], SP()) for i in range(len(tables))]
    rows = [
        SimpleNamespace(request=r, num_new_tokens=n, block_ids=bt, start_position=e - 1)
        for r, bt, e in zip(reqs, tables, ends, strict=True)
    ]
    return SimpleNamespace(scheduled=rows), reqs


def _detector(**kw) -> SharedPrefixDetector:
    return SharedPrefixDetector(PAGE, 1, **{"min_group": 3, "min_saved_bytes": 1, **kw})


def test_finds_the_shared_run_of_a_group() -> None:
    shared = [7, 3, 9, 12]
    tables = [shared + [20 + i, 40 + i] for i in range(5)] + [[1, 2, 5, 6, 8, 10]]
    ends = [4 * PAGE + 5] * 6  # the newest token lies in the row's own fifth page
    sched, reqs = _step(tables, ends)
    plan = _detector().plan(sched)
    assert plan is not None and plan.prefix_pages == shared
    assert plan.prefix_len == 4 * PAGE and plan.num_members == 5
    assert plan.suffix_start == [4 * PAGE] * 5 + [0]
    assert plan.max_suffix_len == ends[-1]  # the non-member attends its whole context


def test_partial_last_page_and_newest_token_never_shared() -> None:
    # Rows share pages 0..2 but the third holds each row's newest token: only 2 can be shared.
    tables = [[5, 6, 7] for _ in range(4)]
    sched, _ = _step(tables, [2 * PAGE + 1] * 4)
    plan = _detector().plan(sched)
    assert plan is not None and plan.prefix_pages == [5, 6]


def test_too_small_a_group_or_saving_is_plain() -> None:
    tables = [[1, 2, 3 + i] for i in range(4)]
    sched, _ = _step(tables, [2 * PAGE + 2] * 4)
    assert _detector(min_group=5).plan(sched) is None
    assert _detector(min_saved_bytes=10**6).plan(sched) is None
    sched, _ = _step(tables, [2 * PAGE + 2] * 4, n=2)  # not decode-only
    assert _detector().plan(sched) is None


def test_members_are_incremental_and_dropped() -> None:
    det = _detector()
    tables = [[1, 2, 10 + i] for i in range(4)]
    sched, reqs = _step(tables, [2 * PAGE + 1] * 4)
    assert det.plan(sched).num_members == 4
    assert set(det.members) == {r.request_id for r in reqs}
    det.drop([reqs[0].request_id])
    # r0 preempted and back under new pages: not a member any more (its last shared page differs)
    tables[0] = [30, 31, 32]
    sched, _ = _step(tables, [2 * PAGE + 1] * 4, reqs)
    plan = det.plan(sched)
    assert plan.suffix_start == [0] + [2 * PAGE] * 3


PREFIX_LEN = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.e2e.hf_reference import tiny_hf_model

    path = tmp_path_factory.mktemp("cascade_llama")
    tiny_hf_model("llama", path)
    return path


def _generate(path, cascade: bool) -> tuple[list[list[int]], int]:
    rng = random.Random(5)
    prefix = [rng.randrange(3, 320) for _ in range(PREFIX_LEN)]
    prompts = [prefix + [rng.randrange(3, 320) for _ in range(n)] for n in range(1, 11)]
    llm = LLM(str(path), dtype="float32", device="cpu", page_size=PAGE)
    runner = llm.llm_engine.runner
    used = []
    if cascade:  # the torch backend runs the cascade only when given a detector
        det = SharedPrefixDetector(PAGE, kv_bytes_per_token=1, min_group=4, min_saved_bytes=1)
        plan = det.plan
        det.plan = lambda s: used.append(plan(s)) or used[-1]
        runner.cascade = det
    llm.generate([prefix + [5]], GREEDY, use_tqdm=False)  # the prefix pages now cached
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], sum(p is not None for p in used)


def test_engine_greedy_identical_with_cascade(tiny_llama) -> None:
    plain, _ = _generate(tiny_llama, cascade=False)
    got, num_cascade_steps = _generate(tiny_llama, cascade=True)
    assert num_cascade_steps >= 8  # most decode steps of the batch went through the cascade
    assert got == plain


def test_unshared_batches_cost_no_per_row_work_between_rescans() -> None:
    det = _detector()
    tables = [[10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(5)]
    sched, _ = _step(tables, [2 * PAGE + 1] * 5)
    assert det.plan(sched) is None and det.prefix == []  # scanned: nothing shared
    calls = []
    det._match = lambda s: calls.append(s)
    for _ in range(15):
        assert det.plan(sched) is None
    assert not calls  # no row was looked at until the next rescan is due


def test_group_found_when_the_first_and_last_rows_are_outside_it() -> None:
    shared = [4, 5, 6]
    tables = [[90, 91, 92, 93]] + [shared + [10 + i] for i in range(5)] + [[80, 81, 82, 83]]
    sched, _ = _step(tables, [3 * PAGE + 1] * 7)
    plan = _detector().plan(sched)
    assert plan is not None and plan.prefix_pages == shared
    assert plan.suffix_start == [0] + [3 * PAGE] * 5 + [0]


def test_cascade_graph_inputs_are_staged_with_padding() -> None:
    """The cascade graphs' static buffers after staging (CPU, no capture): the plan's pages,
    shared length and suffix starts; padding rows are not members; buckets from min_group."""
    import torch

    from roofline.attention.cascade import CascadePlan
    from roofline.worker.block_table import BlockTables, TableUpdates
    from roofline.worker.cascade_graphs import CascadeDecodeGraphs
    from roofline.worker.host_batch import upload

    cpu = torch.device("cpu")
    graphs = CascadeDecodeGraphs(
        None, [], None, 16, 64, PAGE, cpu, min_group=4, num_kv_heads=2, group=2
    )
    assert graphs.buckets == [4, 8, 16]
    tables, upd = BlockTables(16, 16, cpu), TableUpdates()
    reqs = [Request(f"r{i}", [0], SP()) for i in range(5)]
    rows = [tables.row_of(r, [7, 8, 20 + i], upd) for i, r in enumerate(reqs)]
    tables.apply(*upload([upd.flat_index, upd.page_ids], cpu))
    plan = CascadePlan([7, 8], 2 * PAGE, [2 * PAGE] * 4 + [0], 2 * PAGE + 1, 4)
    n = 5
    ids, pos, slots, seq_lens, table_rows, pages, plen, starts = upload(
        [[1] * n, [9] * n, [80 + i for i in range(n)], [10] * n, rows, *plan.lists()], cpu
    )
    graphs.suffix_start.fill_(7)  # stale values from an earlier step
    bs = graphs.stage_cascade(
        plan, pages, starts, plen, ids, pos, slots, seq_lens, tables, table_rows
    )
    assert bs == 8
    assert graphs.prefix_pages[:2].tolist() == [7, 8] and graphs.prefix_len.tolist() == [8]
    assert graphs.suffix_start[:8].tolist() == [8, 8, 8, 8, 0, 0, 0, 0]
    assert graphs.block_table[4, :3].tolist() == [7, 8, 24]
    meta = graphs._meta(8).cascade
    assert meta.suffix_start.shape == (8,) and meta.prefix_len is graphs.prefix_len
    assert meta.num_splits >= 1 and meta.prefix_splits >= 1


def test_cli_flag_turns_cascade_off() -> None:
    import argparse

    from roofline.engine.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args([]).cascade_attention is True
    assert parser.parse_args(["--no-cascade-attention"]).cascade_attention is False


def test_eager_metadata_is_fresh_int32_as_the_graph_buffers() -> None:
    """Views into a step's packed upload sit at offsets that change every step (each starts
    16-byte aligned: odd-length lists are padded); the eager metadata copies them into fresh
    int32 tensors (the dtype the cascade graphs compiled the kernels for), so an eager step
    never specializes a kernel again."""
    import torch

    from roofline.attention.cascade import CascadePlan, eager_metadata
    from roofline.worker.host_batch import upload

    plan = CascadePlan([4, 5, 6], 3 * PAGE, [3 * PAGE, 0, 3 * PAGE], 9, 2)
    views = upload([[1], [2, 3], *plan.lists()], torch.device("cpu"))
    *_, pages, length, starts = views
    # an odd list before them is padded: every view starts 16-byte aligned, at its own length
    assert all(v.data_ptr() % 16 == 0 for v in views) and pages.tolist() == [4, 5, 6]
    assert [len(v) for v in views[:2]] == [1, 2]
    meta = eager_metadata(plan, [pages, length, starts])
    for t in (meta.prefix_pages, meta.prefix_len, meta.suffix_start):
        assert t.dtype == torch.int32 and t.data_ptr() % 16 == 0
    assert meta.suffix_start.tolist() == plan.suffix_start and meta.prefix_len.item() == 3 * PAGE
    assert (meta.max_suffix_len, meta.max_prefix_len) == (9, 3 * PAGE)


def test_rescans_that_find_nothing_back_off() -> None:
    from roofline.attention import cascade

    det = _detector()
    scans = []
    rescan = det._rescan
    det._rescan = lambda rows: scans.append(len(scans)) or rescan(rows)
    unshared = [[10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(5)]
    sched, _ = _step(unshared, [2 * PAGE + 1] * 5)
    for _ in range(16 + 32 + 64 + 128 + 128):
        assert det.plan(sched) is None
    assert len(scans) == 5  # at once, then after 32, 64, 128 and 128 more steps
    assert det._rescan_interval == cascade.MAX_RESCAN_INTERVAL
    shared = [[4, 5, 6 + i] for i in range(5)]  # a group appears: found at the next rescan
    sched, _ = _step(shared, [2 * PAGE + 1] * 5)
    plans = [det.plan(sched) for _ in range(128)]
    assert plans[-1] is not None and det._rescan_interval == cascade.RESCAN_INTERVAL


def test_new_requests_are_scanned_at_once_after_a_back_off() -> None:
    """A batch that grew (new requests joined) is rescanned on its first step, whatever the
    interval a long unshared stretch backed off to."""
    from roofline.attention import cascade

    det = _detector()
    unshared = [[10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(5)]
    sched, _ = _step(unshared, [2 * PAGE + 1] * 5)
    for _ in range(16 + 32 + 64 + 128):
        assert det.plan(sched) is None
    assert det._rescan_interval == cascade.MAX_RESCAN_INTERVAL
    joined = unshared + [[4, 5, 60 + i] for i in range(5)]  # five requests sharing two pages
    sched, _ = _step(joined, [2 * PAGE + 1] * 10)
    plan = det.plan(sched)
    assert plan is not None and plan.num_members == 5
    assert det._rescan_interval == cascade.RESCAN_INTERVAL

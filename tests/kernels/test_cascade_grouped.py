"""The grouped cascade decode attention (``kernels/cascade_grouped.py``) against plain paged
decode over the same block tables: both kernels and the last-program merge, per dtype, GQA ratio
(3: units of whole requests with padding rows), prefix split count, with non-member rows (their
whole context in the suffix pass), a partial last unit, suffixes of one token and of many
blocks, the passes in turn and (on a GPU) side by side; a second launch over the same counters
(reset by the merging program); each pass alone completes its units (the timing mode)."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import ON_GPU, assert_close
from test_cascade_attention import HEAD_DIM, _plain, shared_batch

from roofline.kernels.cascade_grouped import GroupedTuning, grouped_cascade_attention


def _grouped(batch, scale, tuning: GroupedTuning, passes: str = "both"):
    q, kc, vc, table, seq_lens, pages, prefix_len, starts = batch
    return grouped_cascade_attention(
        q, kc, vc, table, seq_lens, pages, prefix_len, starts, scale, tuning, passes=passes
    )


SMALL = dict(block_m=16, prefix=(16, 4, 2), suffix=(16, 4, 2))


@pytest.mark.parametrize(
    "dtype,group,splits",
    [(torch.float32, 4, 1), (torch.float32, 1, 3), (torch.bfloat16, 4, 2), (torch.float16, 3, 1)],
)
def test_grouped_matches_plain_decode(dtype, group, splits) -> None:
    n = 11  # not a multiple of the unit's requests: a partial last unit
    suffix = [1, 33, 16, 7, 50, 2, 64, 19, 3, 40, 5]
    members = [i not in (4, 9) for i in range(n)]
    batch = shared_batch(n, 3, suffix, members, group, dtype, seed=group + splits)
    scale = HEAD_DIM**-0.5
    tuning = GroupedTuning(**SMALL, prefix_splits=splits, concurrent=False)
    assert_close(_grouped(batch, scale, tuning), _plain(batch, scale), dtype)


def test_second_launch_reuses_zeroed_counters() -> None:
    n = 6
    batch = shared_batch(n, 2, [4, 20, 1, 9, 30, 2], [True] * n, 4, torch.float32, seed=7)
    scale = HEAD_DIM**-0.5
    tuning = GroupedTuning(**SMALL, prefix_splits=2, concurrent=ON_GPU, prefix_maxnreg=168,
                           suffix_maxnreg=96)  # fmt: skip
    first = _grouped(batch, scale, tuning)
    second = _grouped(batch, scale, tuning)
    assert_close(first, _plain(batch, scale), torch.float32)
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_each_pass_alone_completes_its_units() -> None:
    """The timing mode: a pass launched alone merges its units from its own slots (so the
    counters are zero again) and the next full launch is still exact."""
    n = 9
    batch = shared_batch(n, 2, [3 + 5 * i for i in range(n)], [True] * n, 4, torch.float32)
    scale = HEAD_DIM**-0.5
    tuning = GroupedTuning(**SMALL, prefix_splits=2, concurrent=False)
    _grouped(batch, scale, tuning, "prefix")
    _grouped(batch, scale, tuning, "suffix")
    assert_close(_grouped(batch, scale, tuning), _plain(batch, scale), torch.float32)


def test_large_batches_take_the_grouped_kernels(monkeypatch) -> None:
    """``cascade_attention`` (what the Triton backend calls) hands a batch past
    ``grouped_applies`` to the grouped kernels: the result still matches plain decode, and the
    grouped launcher was the one called."""
    from roofline.kernels import cascade_attention as ca

    n = 12
    batch = shared_batch(n, 2, [5 + 3 * i for i in range(n)], [i != 2 for i in range(n)], 4,
                         torch.float32, seed=13)  # fmt: skip
    q, kc, vc, table, seq_lens, pages, prefix_len, starts = batch
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return grouped_cascade_attention(*args, **kwargs)

    monkeypatch.setattr(ca, "grouped_cascade_attention", spy)
    monkeypatch.setattr(ca, "grouped_applies", lambda *a: True)
    monkeypatch.setattr(ca, "TUNING", ca.CascadeTuning(grouped=GroupedTuning(**SMALL)))
    scale = HEAD_DIM**-0.5
    out = ca.cascade_attention(q, kc, vc, table, seq_lens, pages, prefix_len, starts, scale,
                               max_suffix_len=64, max_prefix_len=32)  # fmt: skip
    assert len(calls) == 1
    assert_close(out, _plain(batch, scale), torch.float32)


def test_grouped_applies_from_two_programs_per_sm() -> None:
    from roofline.kernels.cascade_attention import grouped_applies

    cpu = torch.device("cpu")  # the default SM count (132)
    assert grouped_applies(33, 8, cpu) and not grouped_applies(32, 8, cpu)


def test_prefix_splits_fill_the_sms() -> None:
    from roofline.kernels.cascade_grouped import MAX_PREFIX_SPLITS, choose_prefix_splits

    assert choose_prefix_splits(128, 132) == 1  # B = 256, 64-row units, 8 KV heads
    assert choose_prefix_splits(64, 132) == 2  # 128-row units
    assert choose_prefix_splits(1, 132) == MAX_PREFIX_SPLITS


def test_pipeline_stages_fit_the_shared_memory() -> None:
    """fp32 tiles are twice bf16's: the stages are cut so the tiles in flight fit."""
    from roofline.kernels.cascade_grouped import SMEM_BUDGET, fit_stages

    bf16_tile, fp32_tile = 2 * 64 * 128 * 2, 2 * 64 * 128 * 4  # K + V, 64 keys, d 128
    assert fit_stages(5, bf16_tile, 64 * 128 * 2) == 5  # 16 KiB + 4 x 32 KiB
    assert fit_stages(5, fp32_tile, 64 * 128 * 4) == 3
    assert fit_stages(3, fp32_tile, 0) == 3 and fit_stages(2, bf16_tile, 0) == 2
    assert fit_stages(4, SMEM_BUDGET, SMEM_BUDGET) == 1  # never below one stage


def hopper_report() -> dict:
    """sm_90 PTX of the two grouped kernels as the chained launch runs them (compiled without
    TRITON_INTERPRET): for each build, the offsets of its ``griddepcontrol.wait`` and
    ``griddepcontrol.launch_dependents`` instructions in the PTX."""
    import re

    from sm90_inspect import compile_sm90

    from roofline.kernels import cascade_grouped as cg

    ptrs = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", k_scale_ptr="*fp32",
                v_scale_ptr="*fp32", prefix_pages_ptr="*i32", prefix_len_ptr="*i32",
                suffix_start_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32",
                part_lse_ptr="*fp32", counter_ptr="*i32", block_table_ptr="*i32",
                seq_lens_ptr="*i32", scale_log2e="fp32")  # fmt: skip
    common = dict(NUM_SLOTS=2, NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16,
                  GROUP_REQS=16, MERGE_M=16, BLOCK_D=128, PRECISION="tf32", COUNT_SUFFIX=True,
                  KV_QUANT=False)  # fmt: skip
    t = cg.GroupedTuning()
    builds = {
        "prefix chained": (cg._grouped_prefix_kernel, t.prefix,
                           dict(NUM_SPLITS=1, BLOCK_M=64, BLOCK_N=t.prefix[0], PDL=True)),
        "suffix chained": (cg._grouped_suffix_kernel, t.suffix,
                           dict(BLOCK_H=16, BLOCK_N=t.suffix[0], PDL=True, PDL_WAIT=False)),
        "suffix alone": (cg._grouped_suffix_kernel, t.suffix,
                         dict(BLOCK_H=16, BLOCK_N=t.suffix[0], PDL=True)),
    }  # fmt: skip
    report = {}
    for name, (fn, (_, num_warps, num_stages), const) in builds.items():
        const = {**common, **const}
        sig = {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in const}
        kernel = compile_sm90(fn, sig, const, num_warps, num_stages=num_stages)
        ptx = kernel.asm["ptx"]
        report[name] = {
            op: [m.start() for m in re.finditer(rf"griddepcontrol\.{op}\b", ptx)]
            for op in ("wait", "launch_dependents")
        }
    return report


@pytest.mark.skipif(ON_GPU, reason="the GPU compiles the kernels itself")
def test_chained_launch_waits_once_at_the_prefix_kernel() -> None:
    """``GroupedTuning.chained``: the prefix kernel waits for the kernels before it and only
    then lets the suffix kernel launch; the chained suffix kernel does not wait (it would wait
    for the whole prefix pass, in turn); launched after the RoPE / store kernel alone, it does."""
    from sm90_inspect import report_in_subprocess

    pytest.importorskip("triton.backends.nvidia.compiler")
    report = report_in_subprocess("test_cascade_grouped")
    prefix = report["prefix chained"]
    assert len(prefix["wait"]) == 1 and prefix["launch_dependents"], report
    assert prefix["wait"][0] < min(prefix["launch_dependents"]), report
    chained = report["suffix chained"]
    assert not chained["wait"] and chained["launch_dependents"], report
    assert len(report["suffix alone"]["wait"]) == 1, report

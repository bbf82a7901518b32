"""CUDA graphs for cascade (shared-prefix) decode steps.

A second set of decode graphs, captured beside ``DecodeGraphs`` (sharing its memory pool) for
the batch buckets where a group can pay (``>= min_group`` rows). Their attention metadata
carries a :class:`CascadeMetadata` over static buffers: the shared page ids, the shared length
(one device int) and each row's suffix start. The kernels' grids depend only on the bucket (split
counts fixed at capture from ``max_model_len``; the prefix split length is derived from the
device length), so one graph replays for any prefix. A step without a plan replays the plain
graphs: steps that do not use cascade pay nothing.
"""

from __future__ import annotations

import torch

from roofline.attention.cascade import CascadeMetadata, CascadePlan
from roofline.attention.metadata import AttentionMetadata
from roofline.kernels import num_sms
from roofline.kernels.cascade_attention import (
    choose_prefix_splits,
    choose_suffix_splits,
    prefix_block_m,
)
from roofline.worker.block_table import BlockTables
from roofline.worker.cuda_graph import DecodeGraphs
from roofline.worker.pending import PendingInputs


class CascadeDecodeGraphs(DecodeGraphs):
    def __init__(self, *args, min_group: int, num_kv_heads: int, group: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buckets = [b for b in self.buckets if b >= min_group]
        self.num_kv_heads, self.group = num_kv_heads, group
        max_batch = self.input_ids.shape[0]
        i32 = torch.int32
        self.prefix_pages = torch.zeros(self.block_table.shape[1], dtype=i32, device=self.device)
        self.prefix_len = torch.zeros(1, dtype=i32, device=self.device)
        self.suffix_start = torch.zeros(max_batch, dtype=i32, device=self.device)

    def _meta(self, bs: int) -> AttentionMetadata:
        meta = super()._meta(bs)
        sms = num_sms(self.device)
        row_blocks = -(-bs * self.group // prefix_block_m(bs * self.group))
        meta.cascade = CascadeMetadata(
            prefix_pages=self.prefix_pages,
            prefix_len=self.prefix_len,
            suffix_start=self.suffix_start[:bs],
            max_suffix_len=self.max_model_len,
            max_prefix_len=self.max_model_len,
            num_splits=choose_suffix_splits(bs, self.num_kv_heads, self.max_model_len, sms),
            prefix_splits=choose_prefix_splits(
                row_blocks * self.num_kv_heads, self.max_model_len, sms
            ),
        )
        return meta

    def stage_cascade(
        self,
        plan: CascadePlan,
        prefix_pages: torch.Tensor,  # [num prefix pages] int64 on device
        suffix_start: torch.Tensor,  # [n] int64 on device
        prefix_len: torch.Tensor,  # [1] int64 on device
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: BlockTables,
        table_rows: torch.Tensor,
        pending: PendingInputs | None = None,
    ) -> int:
        """``stage_inputs`` plus the plan's buffers; padding rows are not members."""
        bs = self.stage_inputs(
            input_ids, positions, slot_mapping, seq_lens, block_tables, table_rows, pending
        )
        n = input_ids.shape[0]
        self.prefix_pages[: len(plan.prefix_pages)].copy_(prefix_pages)
        self.prefix_len.copy_(prefix_len)
        self.suffix_start[:n].copy_(suffix_start)
        if bs > n:
            self.suffix_start[n:bs].fill_(0)
        return bs

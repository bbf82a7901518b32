"""Attention metadata: everything a backend needs to attend one ragged batch over paged K/V.

Built once per step by the model runner and passed explicitly to every attention layer.

KV cache layout (one pair of tensors per layer)::

    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]

Token ``t`` of a request whose block table is ``bt`` lives in page ``bt[t // page_size]`` at
row ``t % page_size``; its flat slot is ``page * page_size + t % page_size``.

The ragged batch lays requests one after another: request ``i`` owns query rows
``query_start_loc[i] : query_start_loc[i + 1]``, which are the positions
``seq_lens[i] - query_len_i .. seq_lens[i] - 1`` of its sequence (the earlier
``context_len_i = seq_lens[i] - query_len_i`` positions are already cached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from roofline.attention.cascade import CascadeMetadata


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    """Rows of q/k/v in this step (sum of query lengths)."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32 on device: cumulative query lengths, starting at 0."""
    seq_lens: torch.Tensor
    """[num_reqs] int32 on device: context length of each request after this step."""
    block_table: torch.Tensor
    """[num_reqs, max_num_blocks] int32 on device: page ids per request; the columns past a
    request's own pages hold stale but valid page ids, which no kernel reads."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 on device: flat cache slot where each new token's K/V is stored."""
    max_query_len: int
    max_seq_len: int
    page_size: int
    query_start_loc_cpu: list[int]
    """Host copies of the above, so reference backends can loop without syncing."""
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    cascade: CascadeMetadata | None = None
    """A decode-only step's shared prefix (``attention/cascade.py``): attend it once for the
    group, then each row's own suffix. None: the plain path."""
    uniform_query_len: int = 0
    """> 1: every request has exactly this many query rows, causal after its context (padded
    verification steps, ``spec_decode/verify_graph.py``): multi-query decode attention."""

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

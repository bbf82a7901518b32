"""CUDA graphs for verification steps: every request padded to ``Q = 1 + k`` query rows.

A verification step (each running request brings its last token and up to ``k`` proposals)
and a draft model's catch-up round (the tokens it has not seen, at most ``1 + k``) have the same
shape: at most ``Q`` new tokens per request after a cached context. Run eagerly they cost
several graph-replayed decode steps (hundreds of launches, the varlen prefill kernel); here the
model's forward is captured once per batch bucket (the decode graphs' buckets) over static
buffers laid out ``Q`` rows per request, with attention metadata ``uniform_query_len = Q`` so
the Triton backend runs the multi-query split-K decode kernel (``kernels/verify_attention.py``).

A step is staged by scattering its ragged rows into the grid (row ``j`` of request ``i`` goes
to ``i * Q + j``; the host computes these indices and uploads them with the step's other
lists). Cells no real token fills are padding: slot -1 (nothing stored), position 0, and the
request's context length is ``start + Q`` so its real rows keep their causal positions; padding
requests of the bucket get context ``Q`` and slot -1. Padding rows attend stale keys and are
never read: sampled rows are gathered from their grid positions.
"""

from __future__ import annotations

import torch

from roofline.attention.metadata import AttentionMetadata
from roofline.layers.attention import AttentionBackend, ForwardContext
from roofline.worker.block_table import BlockTables
from roofline.worker.cuda_graph import batch_buckets
from roofline.worker.host_batch import HostBatch
from roofline.worker.pending import PendingInputs, fill_pending


def grid_layout(batch: HostBatch, query_len: int) -> tuple[list[int], list[int], list[int]]:
    """(grid row of each ragged row ``[num_tokens]``, padded context length of each request
    ``[num_reqs]``, grid row of each sampled row ``[num_sampled]``)."""
    qs = batch.query_start
    rows: list[int] = []
    seq_lens: list[int] = []
    for i in range(batch.num_reqs):
        n = qs[i + 1] - qs[i]
        base = i * query_len
        rows.extend(range(base, base + n))
        seq_lens.append(batch.seq_lens[i] - n + query_len)
    sample = [rows[r] for r in batch.sample_rows]
    return rows, seq_lens, sample


class VerifyGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        backend: AttentionBackend,
        max_batch: int,
        query_len: int,
        max_model_len: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        if query_len < 2:
            raise ValueError(f"verification graphs need at least 2 query rows, got {query_len}")
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.query_len = query_len
        self.max_model_len, self.page_size, self.device = max_model_len, page_size, device
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = -(-max_model_len // page_size)
        rows = max_batch * query_len
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=i64, device=device)
        self.seq_lens = torch.full((max_batch,), query_len, dtype=i32, device=device)
        # one spare row: a padding row near max_model_len may index a column past its row's end
        self.block_table = torch.zeros(max_batch + 1, self.max_blocks, dtype=i32, device=device)
        self.query_start_loc = torch.arange(0, rows + 1, query_len, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replay_bucket: dict[int, int] = {}
        """bucket -> the (larger or equal) bucket whose graph replays it: the cheapest measured
        (``step_costs.cheapest_buckets``); empty: each bucket its own."""

    def _meta(self, bs: int) -> AttentionMetadata:
        q = self.query_len
        return AttentionMetadata(
            num_reqs=bs,
            num_tokens=bs * q,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[: bs * q],
            max_query_len=q,
            max_seq_len=self.max_model_len,
            page_size=self.page_size,
            query_start_loc_cpu=list(range(0, bs * q + 1, q)),
            query_lens_cpu=[q] * bs,
            seq_lens_cpu=[q] * bs,
            uniform_query_len=q,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            ctx = ForwardContext(self._meta(bs), self.kv_caches, self.backend)
            n = bs * self.query_len
            ids, pos = self.input_ids[:n], self.positions[:n]
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self.model(ids, pos, ctx)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(ids, pos, ctx)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, batch: HostBatch) -> bool:
        """Whether the step can replay a graph: 2..Q rows for its longest request, at most the
        largest bucket of requests."""
        return (
            bool(self.graphs)
            and batch.num_reqs <= self.buckets[-1]
            and 1 < batch.max_query_len <= self.query_len
        )

    def stage(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, ragged
        positions: torch.Tensor,  # [num_tokens]
        slot_mapping: torch.Tensor,  # [num_tokens]
        grid_rows: torch.Tensor,  # [num_tokens] from grid_layout
        seq_lens: torch.Tensor,  # [num_reqs] padded, from grid_layout
        block_tables: BlockTables,
        table_rows: torch.Tensor,  # [num_reqs]
        pending: PendingInputs | None = None,
    ) -> int:
        """Fill the static buffers and return the bucket to replay."""
        n = seq_lens.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        bs = self.replay_bucket.get(bs, bs)
        cells = bs * self.query_len
        if pending is not None:
            fill_pending(input_ids, pending)
        self.input_ids[:cells].zero_()
        self.positions[:cells].zero_()
        self.slot_mapping[:cells].fill_(-1)
        self.input_ids.index_copy_(0, grid_rows, input_ids)
        self.positions.index_copy_(0, grid_rows, positions)
        self.slot_mapping.index_copy_(0, grid_rows, slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        if bs > n:
            self.seq_lens[n:bs].fill_(self.query_len)
        block_tables.gather(table_rows, self.max_blocks, out=self.block_table[:n])
        return bs

    def replay(self, bucket: int) -> torch.Tensor:
        """The grid's hidden states ``[bucket * Q, hidden]`` (the graph's output buffer)."""
        self.graphs[bucket].replay()
        return self.outputs[bucket]

    def time_replays(self, bucket: int, context_len: int, num_replays: int = 5) -> float:
        """Seconds per replay of ``bucket`` with every request at ``context_len`` tokens of
        context over distinct pages (nothing stored: slots -1)."""
        return _time_graph(self, bucket, self.query_len, context_len, num_replays)


def _time_graph(graphs, bucket: int, query_len: int, context_len: int, num_replays: int) -> float:
    """Time ``graphs.graphs[bucket]`` over distinct pages; leaves the buffers as padding."""
    page = graphs.page_size
    num_pages = graphs.kv_caches[0][0].shape[0]
    width = graphs.block_table.shape[1]
    blocks = -(-(context_len + query_len) // page)
    ids = torch.arange(bucket * width, device=graphs.device) % width
    ids = ids + torch.arange(bucket, device=graphs.device).repeat_interleave(width) * blocks
    graphs.block_table[:bucket].copy_((ids % num_pages).view(bucket, width))
    graphs.slot_mapping.fill_(-1)
    graphs.seq_lens[:bucket].fill_(context_len + query_len)
    graph = graphs.graphs[bucket]
    graph.replay()
    torch.cuda.synchronize(graphs.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_replays):
        graph.replay()
    end.record()
    end.synchronize()
    graphs.seq_lens.fill_(query_len)
    graphs.block_table.zero_()
    return start.elapsed_time(end) / 1e3 / num_replays


def time_decode_graph(graphs, bucket: int, context_len: int, num_replays: int = 5) -> float:
    """Seconds per replay of a ``DecodeGraphs`` bucket (one query row per request)."""
    return _time_graph(graphs, bucket, 1, context_len, num_replays)

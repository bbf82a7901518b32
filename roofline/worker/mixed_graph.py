"""CUDA graphs for mixed steps (prefill chunks beside decode rows), one per token-count bucket.

Under constant arrivals nearly every step carries a prefill chunk, so the decode-only graphs
(``cuda_graph.py``) never replay. Here the whole forward of a step of ``num_tokens <= T`` rows
is captured once per bucket ``T`` (``mixed_layout.token_buckets``) over static buffers, with
attention split by row kind (``attention/split_backend.py``): every per-request value (query
ranges, context lengths, block tables of the decode and of the prefill part) is read on the
device, and the grids depend only on the bucket. A decode-first step is staged into the buffers
(``stage_inputs``) and replayed; what lies past the real step is padding:

* query rows ``n .. T`` form one padding request in the first free prefill slot (context = its
  own rows, K/V to slot -1, its block-table row whatever a previous step left there: valid page
  ids, so its reads stay finite); the prefill slots after it are empty (range at ``T``);
* decode slots past the real decodes have context length 0 (the decode kernel writes zeros).

A bucket holds ``num_decode_slots`` decode rows and ``num_prefill_slots`` prefill requests
(``mixed_layout``); a step that exceeds them, or the largest bucket, runs eagerly with the same
split attention at its exact sizes (``eager_split_metadata``). All graphs share one memory pool
(largest captured first), which the runner counts in the KV budget (``mixed_layout.pool_bytes``).
"""

from __future__ import annotations

import bisect

import torch

from roofline.attention.split_backend import SplitMetadata
from roofline.layers.attention import AttentionBackend, ForwardContext
from roofline.worker.block_table import BlockTables
from roofline.worker.host_batch import HostBatch
from roofline.worker.mixed_layout import (
    fits_bucket,
    num_decode_slots,
    num_prefill_slots,
    token_buckets,
)
from roofline.worker.pending import PendingInputs, fill_pending


def eager_split_metadata(
    batch: HostBatch,
    num_decodes: int,
    query_start: torch.Tensor,  # [num_reqs + 1] int64 on device
    seq_lens: torch.Tensor,  # [num_reqs] int64 on device
    slot_mapping: torch.Tensor,  # [num_tokens] int64 on device
    decode_block_table: torch.Tensor,  # [num_decodes, num_pages] int32 on device
    prefill_block_table: torch.Tensor,  # [num_reqs - num_decodes, num_pages] int32 on device
) -> SplitMetadata:
    """A decode-first mixed step's split metadata at its exact sizes. Each part's tensors are
    their own allocations, never views at an offset: Triton specializes a kernel on whether
    each pointer is 16-byte aligned, and a view starting at request ``num_decodes`` would be
    aligned in some steps and not in others (a compile in the middle of serving)."""
    d = num_decodes
    qs = batch.query_start
    query_lens = [b - a for a, b in zip(qs[d:], qs[d + 1 :])]
    return SplitMetadata(
        num_reqs=batch.num_reqs - d,
        num_tokens=batch.num_tokens,
        query_start_loc=query_start[d:].to(torch.int32),  # .to copies: a fresh allocation
        seq_lens=seq_lens[d:].to(torch.int32),
        block_table=prefill_block_table,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens, default=1),
        max_seq_len=max(batch.seq_lens[d:], default=1),
        page_size=batch.page_size,
        query_start_loc_cpu=qs[d:],
        query_lens_cpu=query_lens,
        seq_lens_cpu=batch.seq_lens[d:],
        decode_slots=d,
        decode_seq_lens=seq_lens[:d].to(torch.int32),
        decode_block_table=decode_block_table,
        decode_max_seq_len=max(batch.seq_lens[:d], default=1),
        decode_num_splits=None,
    )


GRAPH_PREFILL_TILES = (64, 64, 4, 3)
"""The prefill launch's (BLOCK_M, BLOCK_N, num_warps, num_stages) inside a bucket's graph. Its
``max_query_len`` is the bucket, so the length-based choice would take 128 x 128 tiles for the
short prompts that ride in mixed steps; H100, a 768-row bucket with 253 decode rows and prompts
of 150/200/100/30 tokens: 29.9 us with those, 22.6 us with these (``scripts/gpu_presets.py``)."""


class MixedGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, ...]],
        backend: AttentionBackend,
        max_num_seqs: int,
        max_tokens: int,
        max_model_len: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.page_size, self.device = page_size, device
        self.buckets = token_buckets(max_tokens)
        t_max = self.buckets[-1]
        p_max, d_max = num_prefill_slots(t_max), num_decode_slots(t_max, max_num_seqs)
        max_blocks = -(-max_model_len // page_size)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(t_max, dtype=i64, device=device)
        self.positions = torch.zeros(t_max, dtype=i64, device=device)
        self.slot_mapping = torch.full((t_max,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(p_max, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(p_max + 1, dtype=i32, device=device)
        self.block_table = torch.zeros(p_max, max_blocks, dtype=i32, device=device)
        self.decode_seq_lens = torch.zeros(d_max, dtype=i32, device=device)
        self.decode_block_table = torch.zeros(d_max, max_blocks, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.ready = False
        """Steps may be staged here (``capture`` done, or ``stage_only`` for a CPU check)."""
        self.num_replays = 0

    def bucket_for(self, num_tokens: int, num_decodes: int, num_prefills: int) -> int | None:
        """The smallest bucket that holds the step, or None (run it eagerly)."""
        if not self.ready:
            return None
        for t in self.buckets[bisect.bisect_left(self.buckets, num_tokens) :]:
            if fits_bucket(t, num_tokens, num_decodes, num_prefills, self.max_num_seqs):
                return t
        return None

    def metadata(self, bucket: int) -> SplitMetadata:
        """The metadata a bucket's graph is captured with: views of the static buffers; the
        prefill tile size is that of a ``bucket``-row query, the decode split count that of a
        ``max_model_len`` context, both fixed at capture."""
        p, d = num_prefill_slots(bucket), num_decode_slots(bucket, self.max_num_seqs)
        return SplitMetadata(
            num_reqs=p,
            num_tokens=bucket,
            query_start_loc=self.query_start_loc[: p + 1],
            seq_lens=self.seq_lens[:p],
            block_table=self.block_table[:p],
            slot_mapping=self.slot_mapping[:bucket],
            max_query_len=bucket,
            max_seq_len=self.max_model_len,
            page_size=self.page_size,
            query_start_loc_cpu=[],
            query_lens_cpu=[],
            seq_lens_cpu=[],
            decode_slots=d,
            decode_seq_lens=self.decode_seq_lens[:d],
            decode_block_table=self.decode_block_table[:d],
            decode_max_seq_len=self.max_model_len,
            decode_num_splits=getattr(self.backend, "decode_num_splits", None),
            prefill_config=GRAPH_PREFILL_TILES if self.device.type == "cuda" else None,
        )

    def stage_inputs(
        self,
        bucket: int,
        num_decodes: int,
        input_ids: torch.Tensor,  # [n] int64 on device
        positions: torch.Tensor,  # [n]
        slot_mapping: torch.Tensor,  # [n]
        padded: list[torch.Tensor],  # ``mixed_layout.padding_lists`` on the device (int64)
        block_tables: BlockTables,
        table_rows: torch.Tensor,  # [num_reqs] int64
        pending: PendingInputs | None = None,
    ) -> None:
        """Fill the static buffers for one decode-first step of ``n`` rows in ``bucket``."""
        n, d = input_ids.shape[0], num_decodes
        seq_lens, query_start, decode = padded
        self.input_ids[:n].copy_(input_ids)
        if pending is not None:
            fill_pending(self.input_ids, pending)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        if bucket > n:
            self.slot_mapping[n:bucket].fill_(-1)
        p = seq_lens.shape[0]
        self.seq_lens[:p].copy_(seq_lens)
        self.query_start_loc[: p + 1].copy_(query_start)
        self.decode_seq_lens[: decode.shape[0]].copy_(decode)
        width = self.block_table.shape[1]
        if d:
            block_tables.gather(table_rows[:d], width, out=self.decode_block_table[:d])
        rest = table_rows[d:]
        block_tables.gather(rest, width, out=self.block_table[: rest.shape[0]])

    def _stage_empty(self, bucket: int) -> None:
        """Every row padding (capture and its warm-up): one prefill request over all rows, no
        K/V stored, reading page 0; no decode."""
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens.zero_()
        self.seq_lens[0] = bucket
        self.query_start_loc.fill_(bucket)
        self.query_start_loc[0] = 0
        self.block_table.zero_()
        self.decode_seq_lens.zero_()
        self.decode_block_table.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
            self._stage_empty(bucket)
            self.run_staged(bucket)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.run_staged(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        self.ready = True

    def stage_only(self) -> None:
        """Take steps without capturing: each replay runs the staged forward eagerly over the
        padded buffers (what the graph would replay; the CPU tests check it this way)."""
        self.ready = True

    @torch.inference_mode()
    def run_staged(self, bucket: int) -> torch.Tensor:  # [bucket, hidden]
        """The forward a bucket's graph holds, over the static buffers."""
        ctx = ForwardContext(self.metadata(bucket), self.kv_caches, self.backend)
        return self.model(self.input_ids[:bucket], self.positions[:bucket], ctx)

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        """Replay ``bucket``'s graph (staged by ``stage_inputs``); the hidden states of the
        ``n`` real rows, ``[n, hidden]`` (a view into the graph's output buffer)."""
        self.num_replays += 1
        graph = self.graphs.get(bucket)
        if graph is None:  # stage_only
            return self.run_staged(bucket)[:n]
        graph.replay()
        return self.outputs[bucket][:n]

"""CUDA graphs for decode-only steps.

Decode of a small model is launch-bound: hundreds of tiny kernels per step. At start-up the
model's forward for a decode step is captured once per batch-size bucket (1, 2, 4, 8, then
multiples of 16 up to ``max_num_seqs``) over static input buffers, all graphs sharing one memory
pool; a decode step then copies its inputs into the buffers (rows past the real batch are
padding: slot -1 so nothing is stored, context length 1) and replays the smallest bucket that
fits. Attention metadata inside a graph uses ``max_seq_len = max_model_len``, so the split-K
decode kernel's grid is fixed at capture; the kernel bounds each split by the true context length
read from ``seq_lens`` on the device.
"""

from __future__ import annotations

import torch

from roofline.attention.metadata import AttentionMetadata
from roofline.kernels import stage_decode
from roofline.layers.attention import AttentionBackend, ForwardContext
from roofline.worker.block_table import BlockTables
from roofline.worker.graph_head import MAX_ROWS, HeadOutputs, capture_head, full_head
from roofline.worker.pending import PendingInputs, fill_pending


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        max_batch: int,
        max_model_len: int,
        page_size: int,
        device: torch.device,
        heads: bool = False,
    ) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.capture_heads = heads
        """Capture the LM head + greedy ids in the small buckets' graphs (``graph_head.py``)."""
        self.max_model_len, self.page_size, self.device = max_model_len, page_size, device
        self.buckets = batch_buckets(max_batch)
        max_blocks = -(-max_model_len // page_size)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
        self.block_table = torch.zeros(max_batch, max_blocks, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.heads: dict[int, HeadOutputs | None] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=bs,
            num_tokens=bs,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            page_size=self.page_size,
            query_start_loc_cpu=list(range(bs + 1)),
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        """Capture every bucket into ``pool`` (None: a new pool, the largest bucket's)."""
        for bs in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
            ctx = ForwardContext(self._meta(bs), self.kv_caches, self.backend)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            # one eager forward first, as the mixed graphs do: Triton compiles (or finds) its
            # kernels, cuBLAS picks its own and allocates its workspace (a second one, as
            # before, only lengthened the start-up)
            hidden = self.model(ids, pos, ctx)
            # the head: the skinny-GEMM kernel for the small buckets, the model's own head in
            # the largest (graph_head.full_head); None in between
            head = full_head if bs == self.buckets[-1] and bs > MAX_ROWS else capture_head
            if self.capture_heads:
                head(self.model, hidden)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(ids, pos, ctx)
                if self.capture_heads:
                    self.heads[bs] = head(self.model, self.outputs[bs])
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, num_reqs: int) -> bool:
        return bool(self.graphs) and num_reqs <= self.buckets[-1]

    def stage_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: BlockTables,
        table_rows: torch.Tensor,
        pending: PendingInputs | None = None,
    ) -> int:
        """Fill the static buffers for ``n = len(input_ids)`` decode rows and return the bucket
        to replay. The inputs are int64 tensors on the device (``seq_lens`` is narrowed to
        int32 by the copy); the block table is gathered from ``block_tables`` rows
        ``table_rows``; ``pending`` fills the input ids sampled by the previous launch. Rows
        ``n..bucket`` are padding: slot -1 (nothing stored), context length 1."""
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        if stage_decode.applies(self.device) and (pending is None or pending.dst is None):
            static = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                      self.block_table)  # fmt: skip
            stage_decode.stage_decode(input_ids, positions, slot_mapping, seq_lens, table_rows,
                                      None if pending is None else pending.sampled,
                                      block_tables.table, static, bs)  # fmt: skip
            return bs  # one launch: kernels/stage_decode.py
        self.input_ids[:n].copy_(input_ids)
        if pending is not None:
            fill_pending(self.input_ids, pending)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.seq_lens[:n].copy_(seq_lens)
        block_tables.gather(table_rows, self.block_table.shape[1], out=self.block_table[:n])
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        return bs

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        """Replay the graph of ``bucket`` (from ``stage_inputs``); the hidden states of the
        ``n`` real rows, ``[n, hidden]`` (a view into the graph's output buffer)."""
        self.graphs[bucket].replay()
        out = self.outputs[bucket]
        return out if n == bucket else out[:n]

    def head(self, bucket: int, n: int) -> HeadOutputs | None:
        """The replayed graph's logits and greedy ids of its ``n`` real rows, where the graph
        computes them (None: the caller runs the LM head)."""
        head = self.heads.get(bucket)
        if head is None or n == bucket:
            return head
        return HeadOutputs(head.logits[:n], head.token_ids[:n])

"""The runner's CUDA-graph modes and its path for mixed steps.

``cuda_graph_mode`` (vLLM's ``CUDAGraphMode`` names, lower case):

* ``full`` (default): decode-only steps replay the decode graphs (``cuda_graph.py``); mixed
  steps are laid out decode-first, attend with the split backend
  (``attention/split_backend.py``) and replay a graph per token-count bucket
  (``mixed_graph.py``) when they fit one, else run eagerly with the same split attention;
* ``full_decode_only``: decode graphs only; a mixed step runs eagerly, its decode rows inside
  the prefill kernel (the behaviour before mixed graphs);
* ``none``: everything eager (what ``enforce_eager`` asks for).

``MixedStepPath`` is the runner's one object for ``full``: it reorders a step, plans it (decode
count, bucket, the host lists its padded buffers need, uploaded with the step's other lists in
one copy) and runs its forward. Decode-only steps never reach it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from roofline.attention.cascade import CascadePlan, SharedPrefixDetector, eager_metadata
from roofline.config import ModelConfig, SchedulerConfig
from roofline.core.outputs import SchedulerOutput
from roofline.layers.attention import AttentionBackend, ForwardContext
from roofline.worker.block_table import BlockTables
from roofline.worker.host_batch import HostBatch
from roofline.worker.mixed_layout import (
    DEFAULT_MAX_TOKENS,
    decode_first,
    num_leading_decodes,
    padding_lists,
    pool_bytes,
)
from roofline.worker.pending import PendingInputs, fill_pending

CUDA_GRAPH_MODES = ("full", "full_decode_only", "none")


@dataclass
class MixedPlan:
    """How one mixed step runs: its decode count, its bucket (None: eager) and the host lists
    to upload for it (``mixed_layout.padding_lists``; none when eager)."""

    num_decodes: int
    bucket: int | None
    lists: list[list[int]]


class MixedStepPath:
    def __init__(self, backend: AttentionBackend, device: torch.device) -> None:
        # Triton is imported only when this path is built (the Triton backend is in use).
        from roofline.attention.split_backend import SplitAttentionBackend
        from roofline.worker import mixed_graph

        self._mixed_graph = mixed_graph
        self.backend = SplitAttentionBackend(backend)
        self.device = device
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.graphs = None
        """``mixed_graph.MixedGraphs`` once captured (CUDA)."""
        self.max_tokens = DEFAULT_MAX_TOKENS
        self.capture_s = 0.0
        """Seconds the capture took (start-up cost of the mixed graphs)."""
        """Largest token bucket captured (capped by the step budget at capture)."""

    @classmethod
    def create(
        cls, mode: str, backend: AttentionBackend, device: torch.device
    ) -> MixedStepPath | None:
        """The path for ``mode == "full"`` with the Triton backend, else None."""
        if mode != "full" or getattr(backend, "name", None) != "triton":
            return None
        return cls(backend, device)

    def bind(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        self.model, self.kv_caches = model, kv_caches

    def pool_bytes(self, sched: SchedulerConfig, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Memory the graphs will hold (counted in the KV budget before the pool is sized)."""
        if self.device.type != "cuda":
            return 0
        return pool_bytes(
            self.largest_bucket(sched),
            cfg.hidden_size,
            cfg.intermediate_size,
            dtype.itemsize,
        )

    def capture(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, ...]],
        sched: SchedulerConfig,
        page_size: int,
    ) -> None:
        """Capture one graph per token bucket (CUDA; elsewhere nothing)."""
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            self.build_graphs(model, kv_caches, sched, page_size).capture()
            self.capture_s = time.perf_counter() - t0

    def build_graphs(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, ...]],
        sched: SchedulerConfig,
        page_size: int,
    ):
        """The bucket buffers, not captured yet (``MixedGraphs.capture`` or ``stage_only``)."""
        self.bind(model, kv_caches)
        self.graphs = self._mixed_graph.MixedGraphs(
            model,
            kv_caches,
            self.backend,
            sched.max_num_seqs,
            self.largest_bucket(sched),
            sched.max_model_len,
            page_size,
            self.device,
        )
        return self.graphs

    def largest_bucket(self, sched: SchedulerConfig) -> int:
        """``max_tokens`` within the step budget and the context length (the padding request
        attends over its own rows through a block-table row of ``max_model_len`` pages)."""
        return min(self.max_tokens, sched.max_num_batched_tokens, sched.max_model_len)

    @staticmethod
    def decode_first(sched_out: SchedulerOutput) -> SchedulerOutput:
        return decode_first(sched_out)

    def cascade_plan(
        self, sched_out: SchedulerOutput, detector: SharedPrefixDetector
    ) -> CascadePlan | None:
        """The shared-prefix plan of a decode-first step's decode rows: a decode-only step's
        (the cascade decode graphs), or an eagerly run mixed step's (its split attention);
        None for a mixed step that fits a graph bucket (checked before any per-row work)."""
        num_new = sched_out.num_new_tokens
        if sched_out.num_batched_tokens == len(num_new):  # decode-only
            return detector.plan_rows(sched_out.view())
        graphs = self.graphs
        if graphs is not None and sched_out.num_batched_tokens <= graphs.buckets[-1]:
            return None  # most such steps replay a bucket's graph, which has no cascade
        num_decodes = 0
        for n in num_new:
            if n != 1:
                break
            num_decodes += 1
        return detector.plan_rows(sched_out.view(num_decodes))

    def plan(self, batch: HostBatch) -> MixedPlan | None:
        """None for a decode-only step (the decode graphs' business)."""
        d = num_leading_decodes(batch.query_start)
        if d == batch.num_reqs:
            return None
        graphs = self.graphs
        bucket = None
        if graphs is not None:
            bucket = graphs.bucket_for(batch.num_tokens, d, batch.num_reqs - d)
        if bucket is None:
            return MixedPlan(d, None, [])
        return MixedPlan(d, bucket, padding_lists(batch, d, bucket, graphs.max_num_seqs))

    def forward(
        self,
        plan: MixedPlan,
        plan_dev: list[torch.Tensor],  # ``plan.lists`` on the device
        batch: HostBatch,
        dev,  # the runner's _DeviceInputs
        block_tables: BlockTables,
        pending: PendingInputs | None,
        cascade: CascadePlan | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """``cascade``: an eager step's decode-row plan; ``plan_dev`` then holds its lists."""
        if plan.bucket is not None:
            assert self.graphs is not None
            self.graphs.stage_inputs(
                plan.bucket,
                plan.num_decodes,
                dev.input_ids,
                dev.positions,
                dev.slots,
                plan_dev,
                block_tables,
                dev.table_rows,
                pending,
            )
            return self.graphs.replay(plan.bucket, batch.num_tokens)
        assert self.model is not None, "MixedStepPath.bind was not called"
        if pending is not None:
            fill_pending(dev.input_ids, pending)
        d, width = plan.num_decodes, batch.num_pages
        meta = self._mixed_graph.eager_split_metadata(
            batch,
            d,
            dev.query_start,
            dev.seq_lens,
            dev.slots,
            block_tables.gather(dev.table_rows[:d], width),
            block_tables.gather(dev.table_rows[d:], width),
        )
        if cascade is not None:
            meta.decode_cascade = eager_metadata(cascade, plan_dev)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        return self.model(dev.input_ids, dev.positions, ctx)  # [num_tokens, hidden]

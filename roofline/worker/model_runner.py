"""ModelRunner: loads the model, owns the KV pool, and executes one scheduled step.

``execute(SchedulerOutput)`` lays the scheduled requests out as one ragged batch (no padding):
``input_ids[num_tokens]``, ``positions[num_tokens]`` and an :class:`AttentionMetadata`, runs the
model, computes logits only for the rows that sample (the last row of each request whose chunk
reaches its end) and samples them. The only host synchronisation is reading the sampled ids.

``launch(SchedulerOutput)`` does the same without waiting: it returns a :class:`StepHandle`
whose ``result()`` waits for the sampled ids, which travel to pinned host memory behind the
step. With async scheduling the next step is launched before that: a decode row whose input
token is still pending (sampled by the previous launch) takes it from that launch's sampled ids
on the device, so the host never needs the value to feed the GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch

from roofline.attention import sdpa_prefill
from roofline.attention.cascade import CascadePlan, SharedPrefixDetector, eager_metadata
from roofline.attention.metadata import AttentionMetadata
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.config import CacheConfig, ModelConfig, SchedulerConfig
from roofline.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from roofline.distributed.parallel_state import SINGLE, ParallelContext
from roofline.layers import gemm_rows
from roofline.layers.attention import AttentionBackend, ForwardContext
from roofline.layers.linear import MergedLinear
from roofline.layers.moe import FusedMoE
from roofline.layers.sampler import Sampler, SamplerOutput
from roofline.models.registry import get_model_class
from roofline.quantization.base import QuantizationConfig
from roofline.quantization.common import quantized_warmup_rows
from roofline.quantization.kv_cache import KVCacheSpec
from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.device_verify import launch_verification, on_device_ok
from roofline.spec_decode.runner_step import verify_step
from roofline.spec_decode.verifier import Verifier
from roofline.spec_decode.verify_graph import VerifyGraphs, grid_layout
from roofline.worker.block_table import BlockTables
from roofline.worker.cuda_graph import DecodeGraphs
from roofline.worker.device_wait import DeviceWaiter
from roofline.worker.graph_head import greedy_ids_suffice
from roofline.worker.graph_mode import CUDA_GRAPH_MODES, MixedStepPath
from roofline.worker.host_batch import HostBatch, upload
from roofline.worker.pending import PendingInputs, fill_pending
from roofline.worker.prompt_logprobs import (
    PromptLogprobRow,
    compute_prompt_logprobs,
    prompt_logprob_rows,
)
from roofline.worker.staging import HostIdBuffers, PinnedStaging
from roofline.worker.steady_inputs import SteadyInputs
from roofline.worker.warmup import warmup_batches

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        dtype: torch.dtype,
        weights: Iterable[tuple[str, torch.Tensor]] | None,
        seed: int = 0,
        attention_backend: AttentionBackend | None = None,
        quant_config: QuantizationConfig | None = None,
        parallel: ParallelContext = SINGLE,
        cascade_attention: bool = True,
        cuda_graph_mode: str = "full_decode_only",
        max_sampled_rows: int | None = None,
    ) -> None:
        if cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graph_mode must be one of {CUDA_GRAPH_MODES}")
        self.parallel = parallel
        """This rank's tensor-parallel context (weights, KV heads and sampling follow it)."""
        self.max_sampled_rows = max_sampled_rows or scheduler_config.max_num_seqs
        """Logits rows one step may compute (speculative verification: 1 + k per request)."""
        self.model_config = model_config
        self.quant_config = quant_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = device
        self.dtype = dtype
        self.page_size = cache_config.page_size
        self.backend = attention_backend or TorchAttentionBackend()
        self.kv_spec = KVCacheSpec.create(cache_config.kv_cache_dtype, dtype)
        self.kv_spec.check_backend(self.backend, device)  # before any weight is loaded
        self.mixed = MixedStepPath.create(cuda_graph_mode, self.backend, device)
        """Mixed steps: decode-first, split attention, graphs per token bucket (None: off)."""
        torch.manual_seed(seed)
        self.model = self._build_model(weights, seed)
        decoder = getattr(self.model, "cpu_decoder", None)
        if decoder is not None and decoder.wants_half_pages(self.kv_spec):
            self.kv_spec = self.kv_spec.with_half_pages()  # kernels/cpu/decoder.py
        self.num_kv_heads = self.model.shard.num_kv_heads
        """KV heads of this rank's pool (all of them unless sharded)."""
        self.num_pages = self._num_pages()
        cfg = model_config
        # One pool for all layers: [num_layers, 2 (k, v), num_pages, page_size, kv_heads, head_dim]
        # in the page dtype; a quantized pool adds fp32 scales [num_layers, 2, num_pages,
        # page_size, kv_heads]. On the CPU the pages are committed lazily (host_memory).
        self.kv_cache, self.kv_scales = self.kv_spec.allocate(
            cfg.num_hidden_layers,
            self.num_pages,
            self.page_size,
            self.num_kv_heads,
            cfg.head_dim,
            device,
        )
        self.kv_caches = self.kv_spec.layer_views(self.kv_cache, self.kv_scales)
        if self.mixed is not None:
            self.mixed.bind(self.model, self.kv_caches)
        max_blocks = -(-scheduler_config.max_model_len // self.page_size)
        self.block_tables = BlockTables(scheduler_config.max_num_seqs, max_blocks, device)
        self._aranged = torch.arange(scheduler_config.max_num_seqs + 1, device=device)
        self.staging = PinnedStaging(device) if device.type == "cuda" else None
        self._id_buffers = HostIdBuffers() if device.type == "cuda" else None
        """Pinned buffers for the sampled ids' copy to the host, reused (``StepHandle``)."""
        """Reused pinned buffers for the step's upload (``worker/staging.py``; None: a fresh
        pinned tensor per step, or none on the CPU)."""
        self.sampler = Sampler()
        self.verifier = Verifier(self.sampler)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        """Graphs for steps of 2..1+k rows per request (verification, a draft's catch-up)."""
        self._prev_sampled: torch.Tensor | None = None
        """The previous launch's sampled ids on the device ([num_sampled] int64)."""
        self._prev_ids: list[str] = []
        """The request id of each row of ``_prev_sampled``."""
        self._last_built: tuple[SchedulerOutput | None, HostBatch | None] = (None, None)
        """The last step launched and its host batch (a steady decode step advances it)."""
        self.steady_inputs: SteadyInputs | None = None
        """Advance graphs over the decode graphs' buffers (``worker/steady_inputs.py``)."""
        self._staged: tuple | None = None
        """(batch, bucket, its block-table rows on the device or None, whether a steady run
        already started): what the decode graphs' static buffers hold, when a steady step
        may advance them."""
        self._advancing: HostBatch | None = None
        """Set by ``launch`` for ``launch_batch``: the batch this step's was advanced from."""
        self.cascade: SharedPrefixDetector | None = None
        """Shared-prefix decode (``attention/cascade.py``), where the backend runs it."""
        if cascade_attention and getattr(self.backend, "supports_cascade", False):
            kv_bytes = self.kv_spec.bytes_per_token(1, self.num_kv_heads, cfg.head_dim)
            self.cascade = SharedPrefixDetector(self.page_size, kv_bytes)
        self.cascade_graphs = None
        self.device_waiter: DeviceWaiter | None = DeviceWaiter() if device.type == "cuda" else None
        """How ``StepHandle.result`` waits for the device (None: spin, as cudaEventSynchronize)."""

    def _build_model(
        self, weights: Iterable[tuple[str, torch.Tensor]] | None, seed: int
    ) -> torch.nn.Module:
        cls = get_model_class(self.model_config)
        max_positions = max(self.scheduler_config.max_model_len, 1)
        quant = {} if self.quant_config is None else {"quant_config": self.quant_config}
        if self.parallel.is_parallel:
            quant["parallel"] = self.parallel
        # Built in the model dtype, so quantized tensors (int8, fp8, fp32 scales) keep theirs.
        with torch.device("meta"), _default_dtype(self.dtype):
            model = cls(self.model_config, max_positions, **quant)
        if self.quant_config is None:
            model = model.to(self.dtype)
        model = materialize(model, self.device)
        model.rotary.reset_cache()
        if weights is None:
            init_dummy_weights(model, seed, dtype=self.dtype)
        else:
            model.load_weights(weights)
        model.process_weights_after_loading()
        return model.eval()

    def _num_pages(self) -> int:
        cc, cfg = self.cache_config, self.model_config
        if cc.num_pages_override is not None:
            return cc.num_pages_override
        page_bytes = self.page_size * self.kv_spec.bytes_per_token(
            cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim
        )  # this rank's KV heads (all of them unless sharded)
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            budget = self._default_kv_budget()
        num_pages = budget // page_bytes
        needed = -(-self.scheduler_config.max_model_len // self.page_size)
        if num_pages < needed:
            raise ValueError(
                f"the KV budget holds {num_pages * self.page_size} tokens, fewer than "
                f"max_model_len={self.scheduler_config.max_model_len}: raise "
                "kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"
            )
        return int(num_pages)

    def _default_kv_budget(self) -> int:
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        cfg = self.model_config
        # Activations of the largest step: a few hidden-sized and MLP-sized buffers per token,
        # plus fp32 logits for every sampled row; 512 MiB of slack for the allocator.
        tokens = self.scheduler_config.max_num_batched_tokens
        act = tokens * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * self.dtype.itemsize
        logits = self.max_sampled_rows * cfg.vocab_size * 4 * 3
        if self.mixed is not None:  # the mixed graphs' memory pool
            act += self.mixed.pool_bytes(self.scheduler_config, cfg, self.dtype)
        budget = int(total * self.cache_config.gpu_memory_utilization) - used_by_others
        budget -= torch.cuda.memory_allocated(self.device) + act + logits + (512 << 20)
        if budget <= 0:
            raise ValueError("no GPU memory left for the KV cache: raise gpu_memory_utilization")
        return budget

    @torch.inference_mode()
    def warmup(self, num_tokens: int = 32) -> None:
        """Prefill-shaped forwards and LM heads on dummy tokens, so that kernel selection, JIT
        compilation and allocator growth happen at start-up rather than in a request's latency.

        On CUDA it runs one forward per attention kernel variant a step can pick
        (``worker/warmup.py``: short and long chunks, fresh and over a cached prefix, beside
        decode rows, decode-first too), as serving steps are; the shape-dependent launch
        arguments are left unspecialized in the kernels, so these compile everything a step can
        need. Elsewhere one small prefill. K/V go to the first pages only, which no request
        holds yet."""
        limit = min(self.num_pages * self.page_size, self.scheduler_config.max_model_len)
        shapes = [[(0, max(1, min(num_tokens, limit)))]]
        if self.device.type == "cuda":
            shapes = warmup_batches(num_tokens, limit, self.page_size, self.num_pages,
                                    split=self.mixed is not None)  # fmt: skip
        for shape in shapes:
            self._warmup_forward(shape)
        if self.device.type == "cuda":
            # The LM head once per skinny-GEMM row block: graphs end at the hidden states, so
            # a step sampling 2 or 5-8 rows compiled it mid-run (seen on the H100).
            hidden = torch.zeros(8, self.model_config.hidden_size, dtype=self.dtype)
            hidden = hidden.to(self.device)  # [8, hidden]
            for m in (1, 2, 4, 8):
                self.model.compute_logits(hidden[:m])
            gemm_rows.warm_up(self.model)  # descriptor-GEMM bands eager steps may reach
            max_rows = min(limit, self.scheduler_config.max_num_batched_tokens)
            sdpa_prefill.warm_up_model(self.backend, self.model, self.dtype, self.device, max_rows)
            # a quantized model's GEMM kernels by row bucket (eager steps reach any of them)
            for rows in quantized_warmup_rows(self.model, max_rows):
                if -(-rows // self.page_size) <= self.num_pages:
                    self._warmup_forward([(0, rows)])

    @torch.inference_mode()
    def _warmup_forward(self, shape: list[tuple[int, int]]) -> None:
        page = self.page_size
        batch = HostBatch(page)
        next_page = 0
        ids = [f"warmup-{i}" for i in range(len(shape))]
        for rid, (start, n) in zip(ids, shape):
            num_pages = -(-(start + n) // page)
            row = list(range(next_page, next_page + num_pages))
            next_page += num_pages
            batch.input_ids.extend([0] * n)
            batch.positions.extend(range(start, start + n))
            batch.slots.extend(row[p // page] * page + p % page for p in range(start, start + n))
            batch.query_start.append(batch.query_start[-1] + n)
            batch.seq_lens.append(start + n)
            request = Request(rid, [0], SamplingParams())
            batch.table_rows.append(self.block_tables.row_of(request, row, batch.table_updates))
            batch.sample_rows.append(batch.query_start[-1] - 1)
        try:
            plan = None if self.mixed is None else self.mixed.plan(batch)
            dev = self._upload(batch, batch.sample_rows)
            if plan is not None:  # eager split attention, never a graph
                plan.bucket = None
                hidden = self.mixed.forward(plan, [], batch, dev, self.block_tables, None)
            else:
                meta = self._metadata(batch, dev)
                ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
                hidden = self.model(dev.input_ids, dev.positions, ctx)
            rows = dev.extra[0]
            self.model.compute_logits(hidden.index_select(0, rows)).argmax(dim=-1).tolist()
        finally:
            self.block_tables.drop(ids)

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs (CUDA only); decode-only steps replay them from then on."""
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.backend,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_model_len,
            self.page_size,
            self.device,
            heads=True,
        )
        self.graphs.capture()
        self.steady_inputs = None  # (a dry run's stand-in graphs must never replay)
        if self.graphs.graphs:
            try:
                steady = SteadyInputs(self.graphs, self.block_tables, self.page_size)
                steady.capture(next(iter(self.graphs.graphs.values())).pool())
                self.steady_inputs = steady
            except Exception:  # noqa: BLE001 - steady steps then take the general path
                logger.exception("steady decode graphs could not be captured")
        if self.cascade is not None and self.graphs.graphs:
            from roofline.worker.cascade_graphs import CascadeDecodeGraphs

            cfg = self.model_config
            self.cascade_graphs = CascadeDecodeGraphs(
                self.model,
                self.kv_caches,
                self.backend,
                self.scheduler_config.max_num_seqs,
                self.scheduler_config.max_model_len,
                self.page_size,
                self.device,
                min_group=self.cascade.min_group,
                num_kv_heads=self.num_kv_heads,
                group=cfg.num_attention_heads // cfg.num_key_value_heads,
            )
            self.cascade_graphs.capture(next(iter(self.graphs.graphs.values())).pool())
        if self.mixed is not None:
            self.mixed.capture(self.model, self.kv_caches, self.scheduler_config, self.page_size)

    def capture_verify_graphs(self, query_len: int, max_batch: int) -> None:
        """Capture graphs for steps of up to ``query_len`` rows per request (CUDA only)."""
        self.verify_graphs = VerifyGraphs(
            self.model,
            self.kv_caches,
            self.backend,
            min(max_batch, self.scheduler_config.max_num_seqs),
            query_len,
            self.scheduler_config.max_model_len,
            self.page_size,
            self.device,
        )
        self.verify_graphs.capture()

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.launch(sched_out).result()

    @torch.inference_mode()
    def launch(
        self,
        sched_out: SchedulerOutput,
        prompt_logprobs: bool = False,
        mask_logits: Callable[[torch.Tensor, list[Request]], None] | None = None,
    ) -> StepHandle:
        """Queue one step on the device; the sampled ids arrive through the handle. With
        ``prompt_logprobs`` (some request in flight asks for them) the step also computes the
        prompt logprobs of the requests that asked (a host sync: their values go to the host).
        ``mask_logits(logits, requests)``, if given, edits the sampled rows' logits in place
        between the LM head and the sampler (structured outputs; it may wait for the host)."""
        if sched_out.finished_request_ids:
            self.sampler.remove(sched_out.finished_request_ids)
            self.block_tables.drop(sched_out.finished_request_ids)
        if sched_out.preempted_request_ids:  # recomputed later under new pages
            self.block_tables.drop(sched_out.preempted_request_ids)
        cascade = None
        if self.cascade is not None:
            self.cascade.drop(sched_out.finished_request_ids)
            self.cascade.drop(sched_out.preempted_request_ids)
            if self.mixed is None:
                cascade = self.cascade.plan(sched_out)
        if sched_out.is_empty:
            return StepHandle([], None, [])
        planned = sched_out
        if self.mixed is not None:
            sched_out = self.mixed.decode_first(sched_out)
            if self.cascade is not None:  # decode-only, or an eager mixed step's decode rows
                cascade = self.mixed.cascade_plan(sched_out, self.cascade)
        batch = None
        last_out, last_batch = self._last_built
        if sched_out.advances is not None and sched_out.advances is last_out:
            if sched_out.inputs_pending:  # a steady decode step (core/steady.py)
                batch = last_batch.advanced(sched_out, self.block_tables)
            self._advancing = last_batch if batch is not None else None
        if batch is None:
            batch = HostBatch.build(sched_out, self.page_size, self.block_tables)
        self._last_built = (sched_out, batch)
        rows = prompt_logprob_rows(sched_out) if prompt_logprobs else None
        handle = self.launch_batch(batch, rows, mask_logits, cascade=cascade)
        handle.waiter, handle.num_tokens = self.device_waiter, batch.num_tokens
        handle.in_order = sched_out is planned  # the sampled rows in the step's own order
        return handle

    def launch_batch(
        self,
        batch: HostBatch,
        prompt_logprobs_of: list[PromptLogprobRow] | None = None,
        mask_logits: Callable[[torch.Tensor, list[Request]], None] | None = None,
        cascade: CascadePlan | None = None,
    ) -> StepHandle:
        """Queue one built step (``HostBatch``; a tensor-parallel worker gets it from the engine
        with its block-table rows already assigned). ``prompt_logprobs_of``: the step's rows
        that predict prompt tokens, when some request in flight asks for prompt logprobs.
        ``cascade``: the shared prefix of a decode-only step, or of an eager mixed step's
        decode rows (``attention/cascade.py``)."""
        src, dst = self._pending_sources(batch)
        # rows to sample from, unless every row samples (pure decode: no gather)
        gather = batch.sample_rows if len(batch.sample_rows) < batch.num_tokens else []
        vgraphs = self.verify_graphs  # speculative verification: the padded 1 + k grid
        use_grid = vgraphs is not None and not prompt_logprobs_of and vgraphs.fits(batch)
        grid = grid_layout(batch, vgraphs.query_len) if use_grid else ()  # type: ignore[union-attr]
        # None: decode-only
        mixed_ok = self.mixed is not None and not grid
        plan = self.mixed.plan(batch) if mixed_ok else None  # type: ignore[union-attr]
        if grid:
            gather, extra = grid[2], list(grid)  # the sampled rows' places in the padded grid
        elif plan is not None:  # an eager mixed step uploads its decode rows' cascade plan
            if plan.bucket is not None:
                cascade = None
            extra = cascade.lists() if cascade is not None else plan.lists
        else:
            extra = cascade.lists() if cascade else []  # a decode-only step's shared prefix
        other = bool(src or gather or grid or prompt_logprobs_of)
        other = other or plan is not None or cascade is not None
        # a steady decode step moves the decode graphs' buffers on: nothing to upload
        advanced = self._advance_if_staged(batch, other)
        dev = self._upload(batch, gather, src, dst, *extra) if advanced is None else _NO_INPUTS
        sample_rows, src_t, dst_t, *extra_t = dev.extra
        pending = self._pending_inputs(batch, src_t, dst_t) if advanced is None else None
        graphs = self.graphs
        cgraphs = self.cascade_graphs
        head = None  # the decode graph's own logits and greedy ids (worker/graph_head.py)
        if advanced is not None:
            hidden, head = advanced
        elif grid:  # 2..1+k rows per request: the padded multi-query graphs
            bucket = vgraphs.stage(  # type: ignore[union-attr]
                dev.input_ids, dev.positions, dev.slots, extra_t[0], extra_t[1],
                self.block_tables, dev.table_rows, pending,
            )  # fmt: skip
            hidden = vgraphs.replay(bucket)  # type: ignore[union-attr]
        elif plan is not None:  # a mixed step: its bucket's graph, else eager split attention
            hidden = self.mixed.forward(
                plan, extra_t, batch, dev, self.block_tables, pending, cascade
            )
        elif cascade is not None and cgraphs is not None and cgraphs.fits(batch.num_reqs):
            pages_t, len_t, starts_t = extra_t
            bucket = cgraphs.stage_cascade(
                cascade, pages_t, starts_t, len_t, dev.input_ids, dev.positions, dev.slots,
                dev.seq_lens, self.block_tables, dev.table_rows, pending,
            )  # fmt: skip
            hidden = cgraphs.replay(bucket, batch.num_reqs)
        elif graphs is not None and batch.max_query_len == 1 and graphs.fits(batch.num_reqs):
            bucket = graphs.stage_inputs(
                dev.input_ids,
                dev.positions,
                dev.slots,
                dev.seq_lens,
                self.block_tables,
                dev.table_rows,
                pending,
            )
            hidden = graphs.replay(bucket, batch.num_reqs)
            head = None if gather else graphs.head(bucket, batch.num_reqs)
            self._note_staged(batch, bucket, dev.table_rows)
        else:
            if pending is not None:
                fill_pending(dev.input_ids, pending)
            meta = self._metadata(batch, dev)
            if cascade is not None:
                meta.cascade = eager_metadata(cascade, extra_t)
            ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, backend=self.backend)
            hidden = self.model(dev.input_ids, dev.positions, ctx)  # [num_tokens, hidden]
        prompt_lps = (
            compute_prompt_logprobs(self.model, hidden, prompt_logprobs_of)
            if prompt_logprobs_of
            else {}
        )
        if gather:
            hidden = hidden.index_select(0, sample_rows)  # [num_sampled, hidden]
        if not batch.sample_rows:
            self._prev_sampled, self._prev_ids = None, []
            return StepHandle([], None, [], prompt_lps)
        requests = batch.sample_requests
        # float32 logits where something edits or verifies them; else the head's dtype (the
        # sampler casts only what needs it: a greedy step skips a [rows, vocab] copy)
        upcast = mask_logits is not None or batch.verifies or self.parallel.is_parallel
        if head is not None and upcast and head.logits.dtype != torch.float32:
            head = None  # the largest bucket's 16-bit head: these rows need fp32 logits
        if head is None:
            logits = self.model.compute_logits(hidden, upcast)  # [num_sampled, vocab]
        else:
            logits = head.logits  # computed in the decode graph (fp32, or 16-bit: see above)
        if mask_logits is not None:  # with verification: 1 + k rows per speculating request
            mask_logits(logits, requests)
        if batch.verifies:  # speculative decoding: no pending ids follow it
            self._prev_sampled, self._prev_ids = None, []
            if on_device_ok(requests):  # accept/reject on the device, one copy to the host
                return launch_verification(logits, requests)  # type: ignore[return-value]
            return verify_step(self.sampler, self.verifier, logits, requests)
        if head is not None and mask_logits is None and greedy_ids_suffice(requests):
            out = SamplerOutput(head.token_ids, [None] * len(requests))
        else:
            out = self._sample(logits, requests)
        self._prev_sampled = out.token_ids
        if batch.pending_rows == batch.sample_rows:  # steady decode: the same rows, so the
            ids = batch.pending_requests  # pending rows' ids are the sampled rows' (no pass)
        else:
            ids = [r.request_id for r in requests]
        self._prev_ids = ids
        return StepHandle(requests, out.token_ids, out.logprobs, prompt_lps, ids, self._id_buffers)

    def _advance_if_staged(
        self, batch: HostBatch, other: bool
    ) -> tuple[torch.Tensor, object] | None:
        """A steady decode step's forward (hidden states, head outputs) when the decode graphs'
        buffers hold the step ``batch`` was advanced from (``launch``), else None; ``other``:
        the step needs anything else (a gather, a grid, prompt logprobs, a mixed or cascade
        plan, pending rows out of order)."""
        staged, self._staged = self._staged, None
        source, self._advancing = self._advancing, None
        if (
            source is None
            or other
            or staged is None
            or staged[0] is not source
            or self.steady_inputs is None
            or not self.steady_inputs.usable(staged[1])
            or self._prev_sampled is None
            or len(batch.pending_rows) != batch.num_reqs
        ):
            return None
        try:
            return self._advance_staged(batch, staged)
        except Exception:  # noqa: BLE001 - the general path stages the step from scratch
            logger.exception("a steady decode step failed: steady steps are off from now")
            self.steady_inputs = None
            return None

    def _note_staged(self, batch: HostBatch, bucket: int, table_rows: torch.Tensor) -> None:
        """The decode graphs' buffers now hold ``batch`` (a steady run may start from it)."""
        steady = self.steady_inputs
        if steady is not None and steady.usable(bucket):
            self._staged = (batch, bucket, table_rows, False)

    def _advance_staged(self, batch: HostBatch, staged: tuple) -> tuple[torch.Tensor, object]:
        """A steady decode step (``worker/steady_inputs.py``): the decode graphs' buffers hold
        the step ``batch`` advances; move them on a token and replay the same bucket. Only the
        block-table updates are uploaded."""
        _, bucket, table_rows, started = staged
        steady, graphs = self.steady_inputs, self.graphs
        n = batch.num_reqs
        flat, pages = batch.table_updates.flat_index, batch.table_updates.page_ids
        if len(flat) > steady.capacity:  # (a steady step adds at most a page per row)
            self.block_tables.apply(*upload([flat, pages], self.device, self.staging))
            flat = []
        if not flat:  # the graph writes one update at least: a page id as it is
            flat, pages = self.block_tables.unchanged_entry()
        if not started:
            steady.start(n, table_rows)
        prev = self._prev_sampled
        steady.advance(bucket, prev if prev.shape[0] == n else prev[:n], flat, pages)
        self._staged = (batch, bucket, None, True)
        return graphs.replay(bucket, n), graphs.head(bucket, n)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Rank 0 samples; under tensor parallelism the other ranks receive its ids (they feed
        the next step's pending input tokens on every rank)."""
        if not self.parallel.is_parallel:
            return self.sampler.sample(logits, requests)
        if self.parallel.rank == 0:
            out = self.sampler.sample(logits, requests)
        else:
            ids = torch.empty(len(requests), dtype=torch.int64, device=logits.device)
            out = SamplerOutput(ids, [None] * len(requests))
        self.parallel.broadcast_from_first(out.token_ids)
        return out

    def _upload(self, batch: HostBatch, *extra: list[int]) -> _DeviceInputs:
        """A step's inputs on the device in one copy (and the block-table updates applied);
        one int64 tensor per ``extra`` list besides."""
        # one row per request: query_start is 0..n, a view of a device arange (not uploaded)
        one_row_each = batch.one_row_each
        ids, pos, slots, seq_lens, query_start, table_rows, flat, pages, *rest = upload(
            [
                batch.input_ids,
                batch.positions,
                batch.slots,
                batch.seq_lens,
                [] if one_row_each else batch.query_start,
                batch.table_rows,
                batch.table_updates.flat_index,
                batch.table_updates.page_ids,
                *extra,
            ],
            self.device,
            self.staging,
        )
        self.block_tables.apply(flat, pages)
        if one_row_each:
            query_start = self._arange(len(batch.query_start))
        return _DeviceInputs(ids, pos, slots, seq_lens, query_start, table_rows, rest)

    def _arange(self, n: int) -> torch.Tensor:
        """``torch.arange(n)`` (int64) on the device, a view of one kept tensor (read-only)."""
        if self._aranged.shape[0] < n:
            self._aranged = torch.arange(max(n, 2 * self._aranged.shape[0]), device=self.device)
        return self._aranged[:n]

    def _metadata(self, batch: HostBatch, dev: _DeviceInputs) -> AttentionMetadata:
        """An eager step's attention metadata (its block table gathered on the device)."""
        query_lens = [b - a for a, b in zip(batch.query_start, batch.query_start[1:])]
        return AttentionMetadata(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc=dev.query_start.to(torch.int32),
            seq_lens=dev.seq_lens.to(torch.int32),
            block_table=self.block_tables.gather(dev.table_rows, batch.num_pages),
            slot_mapping=dev.slots,
            max_query_len=max(query_lens),
            max_seq_len=max(batch.seq_lens),
            page_size=self.page_size,
            query_start_loc_cpu=batch.query_start,
            query_lens_cpu=query_lens,
            seq_lens_cpu=batch.seq_lens,
        )

    def _pending_sources(self, batch: HostBatch) -> tuple[list[int], list[int]]:
        """Where each pending input token of ``batch`` lies in the previous launch's ids:
        (rows there, rows here); both empty when nothing is pending or when both are rows
        0..k-1 (steady decode: no index tensors needed)."""
        dst = batch.pending_rows
        if not dst:
            return [], []
        prev_ids = self._prev_ids
        num_pending = len(dst)
        if dst[-1] == num_pending - 1 and prev_ids[:num_pending] == batch.pending_requests:
            return [], []  # rows 0..k-1 on both sides (dst is increasing from 0)
        rows = {rid: i for i, rid in enumerate(prev_ids)}
        try:
            src = list(map(rows.__getitem__, batch.pending_requests))
        except KeyError as e:
            raise RuntimeError(f"request {e} has a pending token no launch sampled") from e
        return src, dst

    def _pending_inputs(
        self, batch: HostBatch, src: torch.Tensor, dst: torch.Tensor
    ) -> PendingInputs | None:
        """The pending input ids as the device finds them (``src``/``dst`` uploaded from
        ``_pending_sources``: empty for steady decode)."""
        if not batch.pending_rows:
            return None
        prev = self._prev_sampled
        assert prev is not None
        if not dst.numel():  # rows 0..k-1 on both sides
            return PendingInputs(prev[: len(batch.pending_rows)], None, None)
        return PendingInputs(prev, src, dst)


class _DeviceInputs(NamedTuple):
    """A step's host lists on the device (int64 views of one uploaded tensor)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slots: torch.Tensor  # [num_tokens]
    seq_lens: torch.Tensor  # [num_reqs]
    query_start: torch.Tensor  # [num_reqs + 1]
    table_rows: torch.Tensor  # [num_reqs]
    extra: list[torch.Tensor]
    """One tensor per extra list given to ``ModelRunner._upload``."""


_NO_INPUTS = _DeviceInputs(*[None] * 6, [None, None, None])  # type: ignore[arg-type]
"""A steady decode step's stand-in: nothing uploaded (no sampled-row, pending index tensors)."""


class StepHandle:
    """A launched step's sampled ids on their way to the host.

    The ids are copied into pinned memory behind the step and an event marks their arrival, so
    the host can schedule and launch the next step meanwhile; ``result()`` waits for them."""

    def __init__(
        self,
        requests: list[Request],
        token_ids: torch.Tensor | None,
        logprobs: list[TokenLogprobs | None],
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
        request_ids: list[str] | None = None,
        buffers: HostIdBuffers | None = None,
    ) -> None:
        self._requests = requests
        self._request_ids = request_ids
        """``[r.request_id for r in requests]`` if the caller has it at hand."""
        self.in_order = False
        """Set by ``ModelRunner.launch``: the rows are the step's sampling requests in its
        ``SchedulerOutput`` order, so ``result`` hands the ids over as a list."""
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs or {}
        self._event: torch.cuda.Event | None = None
        self.waiter: DeviceWaiter | None = None
        """Set by ``ModelRunner.launch``: sleep through most of the wait (None: spin)."""
        self.num_tokens = 0
        """Rows of the launched step (the waiter's estimate is kept per step size)."""
        self._host = token_ids
        self._ids: list[int] | None = None
        """The ids once read (the pinned buffer then goes back to ``buffers``)."""
        self._buffers, self._slot = buffers, None
        if token_ids is not None and token_ids.is_cuda:
            n = token_ids.shape[0]
            if buffers is not None and token_ids.dim() == 1:
                self._slot = buffers.take(n, token_ids.dtype)
                self._host, self._event = self._slot[0][:n], self._slot[1]
            else:
                self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(token_ids, non_blocking=True)
            self._event.record()

    def _wait(self) -> None:
        if self._event is None:
            return
        if self.waiter is None:
            self._event.synchronize()
        else:
            self.waiter.wait(self._event, self.num_tokens)

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting for the device."""
        return self._ids is not None or self._event is None or self._event.query()

    def _read(self) -> list[int]:
        """The ids (waits for them once; the pinned buffer goes back to the pool then)."""
        if self._ids is None:
            self._wait()  # the step's one host sync
            self._ids = self._host.tolist()  # type: ignore[union-attr]
            if self._slot is not None:
                self._buffers.give_back(self._slot)  # type: ignore[union-attr]
                self._slot = self._host = None
        return self._ids

    def token_ids(self) -> list[int]:
        """The sampled ids in row order (waits for them)."""
        if self._host is None and self._ids is None:
            return []
        return list(self._read())

    def logprobs(self) -> list[TokenLogprobs | None]:
        return self._logprobs

    def prompt_logprobs(self) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        return self._prompt_logprobs

    def result(self) -> ModelRunnerOutput:
        if self._host is None and self._ids is None:
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=self._prompt_logprobs)
        token_ids = list(self._read())
        request_ids = self._request_ids
        if request_ids is None:
            request_ids = [r.request_id for r in self._requests]
        logprobs = {}
        if self._logprobs.count(None) != len(self._logprobs):  # some request asked
            logprobs = {rid: lp for rid, lp in zip(request_ids, self._logprobs) if lp is not None}
        if self.in_order:  # the dict is built only if someone reads it
            return ModelRunnerOutput(
                None,
                logprobs,
                prompt_logprobs=self._prompt_logprobs,
                token_ids=token_ids,
                request_ids=request_ids,
            )
        sampled = dict(zip(request_ids, token_ids))
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs=self._prompt_logprobs)


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)`` for a model built on the meta device, without going
    through ``empty_like`` on meta tensors: that path imports sympy and torch's symbolic
    shapes (0.55 s of a 2 s CLI start on the 2-core dev machine)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(empty, param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_dummy_weights(
    model: torch.nn.Module, seed: int, std: float = 0.02, dtype: torch.dtype | None = None
) -> None:
    """Random weights for benchmarks: N(0, std) matrices, unit norms, zero biases. A quantized
    linear layer gets its N(0, std) weight one output shard at a time through its method's
    ``load`` (quantized as a checkpoint in ``dtype`` would be)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    quantized = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, MergedLinear | FusedMoE) and module.method.quantized
    }
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        if owner in quantized:
            if kind == "bias":
                param.zero_()
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)
    for module in quantized.values():
        if isinstance(module, FusedMoE):  # its experts, through its method (the router above)
            module.init_dummy_weights(gen, std, dtype)
            continue
        for shard, size in enumerate(module.output_sizes):
            weight = torch.empty(
                size, module.in_features, dtype=dtype or torch.float32, device=device
            )
            module.load(shard, "weight", weight.normal_(0.0, std, generator=gen))

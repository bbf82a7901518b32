"""LLMEngine: the step loop that ties scheduler, model runner and detokenizers together.

``step()`` = ``scheduler.schedule()`` -> ``runner.launch()`` -> ``scheduler.update()`` ->
detokenize, check stop strings, and build one :class:`RequestOutput` per user request that
changed (cumulative, or only what is new with ``delta=True``).

With async scheduling (default on CUDA) one step stays in flight: ``step()`` schedules and
launches step N+1 *before* it waits for step N's sampled ids and does N's host work (update,
detokenize, outputs), so that host work runs while the GPU computes N+1 and the GPU never waits
for Python. The scheduler counts N's sampled tokens as pending; N+1's decode rows read them on
the device. A request that finishes at N (EOS, stop string) has one wasted token computed at
N+1, which is dropped. Requests whose sampling needs their previous token on the host
(repetition/presence/frequency penalties, ``min_tokens``) switch the engine to synchronous
steps while they run. A user request with ``n > 1`` is ``n`` scheduler requests (a *group*);
the 2nd..nth fork from the first so they share its prompt pages. Input is validated here, before
it reaches the scheduler, so a bad request is refused with a ``ValueError`` and never enters the
loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from roofline.config import ModelConfig
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import RequestUpdate, SchedulerOutput, TokenLogprobs
from roofline.core.scheduler import Scheduler
from roofline.distributed.expert_parallel import check_moe_parallel
from roofline.engine.args import EngineArgs
from roofline.engine.core_messages import pack_outputs
from roofline.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from roofline.engine.prompt import tokenize_prompt
from roofline.models.weights import (
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from roofline.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from roofline.quantization.registry import resolve_quantization
from roofline.request import Request, RequestStatus
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.build import build_spec_decoder
from roofline.spec_decode.config import SpeculativeConfig
from roofline.spec_decode.decoder import SpecDecoder
from roofline.structured_output.engine_hooks import GrammarWaits
from roofline.worker.graph_mode import CUDA_GRAPH_MODES
from roofline.worker.model_runner import ModelRunner, StepHandle
from roofline.worker.startup import StartupCompiles

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    kv_cache_capacity_tokens: int = 0
    """Tokens the KV pool holds (pages x page size): about 2x with fp8/int8 pages."""
    spec_decode_num_drafts_total: int = 0
    """Verification rows: one per speculating request per step."""
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_emitted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class StepTiming:
    """Where ``step()``'s time went: the steps taken, their seconds in all, and the part spent
    waiting for the device's sampled ids. The rest is host work (scheduling, inputs, updates,
    outputs); when it nears the total, the device waits for the host, not the other way."""

    steps: int = 0
    total_s: float = 0.0
    wait_s: float = 0.0

    @property
    def host_fraction(self) -> float:
        return 1.0 - self.wait_s / self.total_s if self.total_s > 0 else 0.0

    def since(self, earlier: StepTiming) -> StepTiming:
        return StepTiming(
            self.steps - earlier.steps,
            self.total_s - earlier.total_s,
            self.wait_s - earlier.wait_s,
        )


@dataclass
class _Group:
    """One user request: its prompt and the ``n`` sequences generated from it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    arrival_time: float
    logprobs: list[list[dict[int, Logprob]] | None] = field(default_factory=list)
    cumulative_logprob: list[float] = field(default_factory=list)
    stream: bool = True
    """Emit an output every step the request changes (False: only once it has finished)."""
    delta: bool = False
    """Outputs carry only what is new since the previous output of this request (text, token
    ids, logprobs); ``cumulative_logprob`` stays cumulative."""
    sent: list[tuple[int, int, int]] = field(default_factory=list)
    """Per completion, (chars of text, token ids, logprob entries) already reported."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``prompt_logprobs``: [None] then one dict per prompt token received so far."""
    prompt_logprobs_sent: bool = False
    constrained: bool = False
    """Its sequences have grammar matchers (structured outputs)."""

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].status.finished
        return all(s.status.finished for s in seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        spec_config = SpeculativeConfig.parse(args.speculative_config)
        structured_backend = args.resolve_structured_outputs_backend()
        source = resolve_model(args.model)
        self.model_name = source.name
        self.model_config: ModelConfig = load_model_config(source)
        device = args.resolve_device()
        dtype = args.resolve_dtype(self.model_config, device)
        self.scheduler_config = args.scheduler_config(self.model_config, device)
        self.max_model_len = self.scheduler_config.max_model_len
        quant_config = resolve_quantization(
            args.quantization,
            self.model_config,
            source.kind,
            device,
            args.quantize_lm_head,
            str(source.path) if source.kind == "gguf" else None,
        )
        experts = quant_config.get_moe_method("experts") if quant_config is not None else None
        check_moe_parallel(
            self.model_config,
            args.tensor_parallel_size,
            args.enable_expert_parallel,
            getattr(experts, "group_size", None),
        )
        self.tokenizer = load_tokenizer(source)
        dummy = args.load_format == "dummy" or source.kind == "config"
        if args.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {args.load_format!r}")
        if args.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise ValueError(
                f"cuda_graph_mode must be one of {', '.join(CUDA_GRAPH_MODES)}, "
                f"got {args.cuda_graph_mode!r}"
            )
        if spec_config is not None and (
            args.tensor_parallel_size != 1 or args.distributed_executor_backend is not None
        ):
            raise ValueError("speculative decoding under tensor parallelism is not supported yet")
        # Triton's set-up (and a known start-up's kernels) on a thread pool from here on
        compiles = StartupCompiles.begin(args, device, self.model_config, self.scheduler_config)
        self.spec: SpecDecoder | None = None
        """Speculative decoding (None: off); built before the target so that, on CUDA, the
        target's KV budget sees the draft's memory."""
        if spec_config is not None:
            self.spec = build_spec_decoder(
                spec_config,
                args,
                self.model_config,
                self.tokenizer,
                self.scheduler_config,
                device,
                dtype,
            )
        if args.tensor_parallel_size != 1 or args.distributed_executor_backend is not None:
            from roofline.distributed.executor import build_executor  # workers per rank

            self.runner = build_executor(
                args, source, self.model_config, device, dtype, dummy, quant_config
            )
        else:
            weights = None if dummy else iter_weights(source, quant_config)
            cpu_gguf = source.kind == "gguf" and device.type == "cpu" and args.gguf_keep_quantized
            if quant_config is None and cpu_gguf:  # the fused CPU kernels read the blocks
                from roofline.quantization.gguf_cpu import cpu_gguf_checkpoint

                quant_config, weights = cpu_gguf_checkpoint(source.path, dummy)
            sampled_rows = None  # speculative verification samples 1 + k rows per request
            if self.spec is not None:
                graphs = device.type == "cuda" and not args.enforce_eager
                max_seqs = self.scheduler_config.max_num_seqs
                sampled_rows = self.spec.max_sampled_rows(max_seqs, graphs)
            self.runner = ModelRunner(
                self.model_config,
                args.cache_config(),
                self.scheduler_config,
                device,
                dtype,
                weights=weights,
                seed=args.seed,
                attention_backend=_make_backend(args.attention_backend, device),
                quant_config=quant_config,
                cascade_attention=args.cascade_attention,
                cuda_graph_mode="none" if args.enforce_eager else args.cuda_graph_mode,
                max_sampled_rows=sampled_rows,
            )
            graphs = device.type == "cuda" and not args.enforce_eager
            graphs = graphs and args.cuda_graph_mode != "none"
            if device.type != "cpu":  # nothing to compile on the CPU: a first answer sooner
                compiles.run(self.runner, graphs)  # every kernel it needs, on the pool
                self.runner.warmup()
            if graphs:
                self.runner.capture_cuda_graphs()
                if self.spec is not None:  # verification graphs, the adaptive switch
                    self.spec.prepare(self.runner)
        self.kv_manager = KVCacheManager(
            self.runner.num_pages, args.page_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager, args.page_size)
        self.eos_token_ids = self._eos_ids()
        self.step_timing = StepTiming()
        self._groups: dict[str, _Group] = {}
        self._seq_owner: dict[str, tuple[_Group, int]] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None
        """Called with each step's SchedulerOutput before it runs (tracing, calibration)."""
        async_scheduling = args.async_scheduling
        self.async_scheduling = (
            device.type == "cuda" if async_scheduling is None else bool(async_scheduling)
        )
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self._wire_outputs = False
        """Within ``step_rows``: outputs as wire rows, not ``RequestOutput`` objects."""
        self._deferred: list[RequestUpdate] | None = None
        """A speculative step's folded updates whose outputs the next step builds (while the
        device runs it)."""
        self.step_trace: list[tuple[float, float, float, int, int]] | None = None
        """If a list: one entry per ``step()``, (start, end (``time.perf_counter``), the
        cumulative wait for the device, scheduled tokens, scheduled requests) (benchmarks)."""
        self._num_sync_groups = 0
        """Unfinished user requests whose sampling needs host-side history (no overlap)."""
        self._num_prompt_logprob_groups = 0
        """Unfinished user requests that asked for prompt logprobs (the runner computes them
        only while this is > 0)."""
        self.grammars = GrammarWaits(self, structured_backend)
        """Structured outputs: requests waiting for their grammar, matchers, masking."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_id)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return frozenset(ids)

    # ----------------------------------------------------------------- requests in
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        stream: bool = True,
        delta: bool = False,
    ) -> int:
        """Queue a request; ``prompt_text`` labels a token-id prompt in the outputs; with
        ``stream=False`` step() reports the request only once, when it has finished; with
        ``delta=True`` each output holds only what is new since the request's previous one
        (what a streaming server sends), instead of everything so far. Returns the prompt's
        length in tokens."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        text = text if prompt_text is None else prompt_text
        self._validate(token_ids, params)
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs: list[Request] = []
        for i in range(params.n):
            seed = params.seed
            if seed is not None and i > 0:  # each completion its own stream, within uint64
                seed = (seed + i) % 2**64
            # (n == 1: the params as given; a copy per request cost ~20 us of an idle GPU each)
            seq_params = params if params.n == 1 else dataclasses.replace(params, n=1, seed=seed)
            seqs.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                    prompt_token_ids=list(token_ids),
                    sampling_params=seq_params,
                    eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
                    max_tokens=max_tokens,
                    arrival_time=arrival,
                    priority=priority,
                    parent=seqs[0] if i > 0 else None,
                )
            )
        group = _Group(
            request_id,
            text,
            list(token_ids),
            seqs,
            [self._detokenizer(token_ids, params) for _ in seqs],
            arrival,
            [[] if params.logprobs is not None else None for _ in seqs],
            [0.0] * len(seqs),
            stream,
            delta,
            [(0, 0, 0)] * len(seqs),
        )
        if not stream and not params.stop and params.logprobs is None:
            if params.prompt_logprobs is None and params.structured_outputs is None:
                for seq in seqs:  # nobody reads its tokens before it finishes
                    seq.quiet = True
        if params.structured_outputs is not None:
            self.grammars.add(group, params.structured_outputs)  # scheduled once compiled
        else:
            self._schedule_group(group)
        self._groups[request_id] = group
        if _needs_sync(params):
            self._num_sync_groups += 1
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
            self._num_prompt_logprob_groups += 1
        for i, seq in enumerate(seqs):
            self._seq_owner[seq.request_id] = (group, i)
        return len(token_ids)

    def _schedule_group(self, group: _Group) -> None:
        added: list[str] = []
        try:
            for seq in group.seqs:
                self.scheduler.add_request(seq)
                added.append(seq.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = []
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # (C-level passes: the common case)
            bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (dummy weights)")
        if self.args.tensor_parallel_size > 1:
            if params.structured_outputs is not None:
                raise ValueError(
                    "structured outputs are not supported with tensor_parallel_size > 1"
                )
        max_tokens = params.max_tokens or 1
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in the "
                f"prompt, {max_tokens} in the completion)."
            )

    def _detokenizer(
        self, token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort user requests (all their completions); unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            self.scheduler.finish_requests(
                [s.request_id for s in group.seqs], RequestStatus.FINISHED_ABORTED
            )
            self.grammars.discard(group)
            self._drop(group)

    def has_unfinished_requests(self) -> bool:
        """Requests are unfinished, or a launched step still has to be folded in."""
        return bool(self._groups) or self._in_flight is not None

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Launch the next step and return the outputs of the one that completed: this one
        (synchronous), or the previous one (async scheduling, which keeps one in flight)."""
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        if self.grammars.waiting:
            outputs += self.grammars.admit_ready(idle=not self.scheduler.has_unfinished_requests())
        prev, self._in_flight = self._in_flight, None
        spec = self.spec
        num_running = self.scheduler.num_running
        speculate = spec is not None and spec.active(num_running, self.scheduler.running)
        overlap = self.async_scheduling and self._num_sync_groups == 0 and not speculate
        drained = prev is not None and not overlap
        if drained:
            outputs += self._finish_step(*prev)  # drain: this step needs the host up to date
            prev = None
        deferred, self._deferred = self._deferred, None
        if deferred is not None and not speculate:
            outputs += self._emit(deferred)  # a speculative step's outputs, before this step
            deferred = None
        if speculate:  # proposals need every token on the host: speculative steps are sync
            spec.propose(self.scheduler.running)  # type: ignore[union-attr]
            if self.grammars.has_matchers:  # cut proposals at their first forbidden token
                self.grammars.check_proposals(self.scheduler.running)
        elif spec is not None:
            spec.withdraw()
        sched_out = self.scheduler.schedule()
        decode_only = spec is not None and spec.is_decode_step(sched_out, speculate)
        if spec is not None and sched_out.finished_request_ids:
            spec.remove(sched_out.finished_request_ids)
        if self.on_schedule is not None:
            self.on_schedule(sched_out)
        mask = None
        if self.grammars.has_matchers:
            # Constrained rows need every earlier token accepted: fold the previous step in
            # after this step's forward is queued, then fill and apply the bitmask.
            def mask(logits, requests) -> None:
                nonlocal prev
                if prev is not None:
                    outputs.extend(self._finish_step(*prev))
                    prev = None
                self.grammars.mask_logits(logits, requests)

        handle = self.runner.launch(
            sched_out, prompt_logprobs=self._num_prompt_logprob_groups > 0, mask_logits=mask
        )
        if prev is not None:
            outputs += self._finish_step(*prev)  # runs while the device computes sched_out
        if deferred is not None:  # the previous speculative step's detokenization and
            outputs += self._emit(deferred)  # stop strings, while the device verifies
        if overlap and not sched_out.is_empty:
            self._in_flight = (sched_out, handle)
        elif speculate:  # the next proposals need the ids; the outputs can wait a step
            self._deferred = self._fold(sched_out, handle)
        else:
            outputs += self._finish_step(sched_out, handle)
        timing = self.step_timing
        timing.steps += 1
        t1 = time.perf_counter()
        timing.total_s += t1 - t0
        if self.step_trace is not None:
            self.step_trace.append(
                (t0, t1, timing.wait_s, sched_out.num_batched_tokens, sched_out.num_reqs)
            )
        if spec is not None:  # the switch's online step cost (prefill chunks or a drained
            steady = decode_only and not drained  # step would blur it)
            spec.observe(speculate, num_running, time.perf_counter() - t0 if steady else None)
        return outputs

    def step_rows(self) -> list[tuple]:
        """``step()`` with its outputs in the wire form of ``core_messages.pack_outputs``, made
        straight from the engine's state: no ``RequestOutput`` per request per step to build
        and then take apart (the server's engine core sends these)."""
        self._wire_outputs = True
        try:
            outputs: list = self.step()
        finally:
            self._wire_outputs = False
        return [o if type(o) is tuple else pack_outputs([o])[0] for o in outputs]

    def _finish_step(self, sched_out: SchedulerOutput, handle: StepHandle) -> list[RequestOutput]:
        """Wait for a launched step's sampled ids and fold them in; the step's outputs."""
        return self._emit(self._fold(sched_out, handle))

    def _fold(self, sched_out: SchedulerOutput, handle: StepHandle) -> list[RequestUpdate]:
        """Wait for a launched step's ids and fold them into the scheduler."""
        t0 = time.perf_counter()
        run_out = handle.result()
        self.step_timing.wait_s += time.perf_counter() - t0
        if run_out.prompt_logprobs:
            self._add_prompt_logprobs(run_out.prompt_logprobs)
        updates = self.scheduler.update(sched_out, run_out)
        unreported = self.scheduler.num_unreported_tokens  # quiet requests' tokens
        if unreported:
            self._generation_tokens_total += unreported
            self.scheduler.num_unreported_tokens = 0
        if run_out.verified and self.spec is not None:
            self.spec.record(run_out.verified)
        if self.grammars.has_matchers:  # matchers advance at once (a speculative step's outputs
            for upd in updates:  # may wait a step; the next proposals and masks may not)
                owner = self._seq_owner.get(upd.request.request_id)
                if owner is not None and owner[0].constrained:
                    self.grammars.accept(upd.request.request_id, upd.new_token_ids)
            self.grammars.start_fill()  # the masks fill while the outputs are built
        return updates

    def _emit(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Detokenize folded updates, apply stop strings, build the outputs."""
        changed: dict[str, _Group] = {}
        now = time.monotonic()
        seq_owner = self._seq_owner
        num_generated = 0
        for upd in updates:  # once per request per step: kept lean
            request, new_ids = upd.request, upd.new_token_ids
            owner = seq_owner.get(request.request_id)
            if owner is None:
                continue
            group, index = owner
            num_new = len(new_ids)
            num_generated += num_new
            if num_new and len(request.output_token_ids) == num_new:
                # first token: the prompt is done (counted once, cached tokens included, as vLLM)
                self._prompt_tokens_total += len(request.prompt_token_ids)
            if group.detoks[index] is not None or group.logprobs[index] is not None:
                self._apply_update(group, index, new_ids, upd.new_logprobs, upd.finished)
            request.last_token_time = now
            changed[group.request_id] = group
        self._generation_tokens_total += num_generated
        outputs = []
        make = self._make_row if self._wire_outputs else self._make_output
        for group in changed.values():
            finished = group.finished
            if group.stream or finished:
                outputs.append(make(group))
            if finished:
                self._drop(group)
        return outputs

    def _apply_update(
        self,
        group: _Group,
        index: int,
        new_ids: list[int],
        new_logprobs: list[TokenLogprobs],
        finished: bool,
    ) -> None:
        seq = group.seqs[index]
        detok = group.detoks[index]
        if detok is not None:
            if seq.quiet:  # with the tokens Scheduler.update did not report: text is decoded
                # only when reported (first token, finish), in one window (the text is the same
                # for any split of the tokens over updates: tests/core/test_detokenizer.py)
                new_ids = seq.output_token_ids[len(detok.token_ids) :]
            if len(new_ids) > 1 and seq.sampling_params.stop:  # a verified run: cut at the stop
                delta, kept = _update_until_stop(detok, new_ids, finished)
                if kept < len(new_ids):  # the tokens after the stop string are not output
                    del seq.output_token_ids[kept - len(new_ids) :]
                    new_logprobs = new_logprobs[:kept]
                    self._generation_tokens_total -= len(new_ids) - kept
            else:
                delta = detok.update(new_ids, finished=finished)
            if delta.stop_string is not None and not finished:
                self.scheduler.finish_requests([seq.request_id], RequestStatus.FINISHED_STOPPED)
            if delta.stop_string is not None:
                seq.status = RequestStatus.FINISHED_STOPPED
                seq.stop_reason = delta.stop_string
        if group.logprobs[index] is not None:
            for lp in new_logprobs:
                group.logprobs[index].append(self._convert_logprobs(lp))
                group.cumulative_logprob[index] += lp.logprob

    def _add_prompt_logprobs(self, new: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        """Append each request's new prompt-token entries; entries of positions already held
        (recomputed after a preemption, or by the 2nd..nth sequence) are dropped."""
        for rid, (first, entries) in new.items():
            owner = self._seq_owner.get(rid)
            if owner is None or owner[0].prompt_logprobs is None:
                continue
            held = owner[0].prompt_logprobs
            for i, lp in enumerate(entries, start=first):
                if i == len(held):
                    held.append(self._convert_logprobs(lp))

    def _convert_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        out = {
            tid: Logprob(val, rank + 1, self._decode_one(tid))
            for rank, (tid, val) in enumerate(lp.top)
        }
        if lp.token_id not in out:
            out[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))
        return out

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, group: _Group) -> RequestOutput:
        request_id, finished, completions, metrics, num_cached, _error, prompt_lps = self._make_row(
            group
        )
        return RequestOutput(
            request_id,
            group.prompt,
            group.prompt_token_ids,
            [CompletionOutput(*c) for c in completions],
            finished,
            RequestMetrics(*metrics),
            num_cached,
            None,
            prompt_lps,
        )

    def _make_row(self, group: _Group) -> tuple:
        """The group's output in the wire form of ``core_messages.pack_outputs`` (what the
        server's engine core sends): built once per streaming request per step, so plain
        tuples, positional, no re-reads; ``_make_output`` makes the ``RequestOutput`` of it."""
        completions = []
        delta = group.delta
        for i, seq in enumerate(group.seqs):
            detok = group.detoks[i]
            text = detok.output_text if detok is not None else ""
            lps = group.logprobs[i]
            output_ids = seq.output_token_ids
            if delta:
                n_text, n_tok, n_lp = group.sent[i]
                group.sent[i] = (len(text), len(output_ids), 0 if lps is None else len(lps))
                if n_text:
                    text = text[n_text:]
                token_ids = output_ids[n_tok:]
                lps = None if lps is None else lps[n_lp:]
            else:
                token_ids = list(output_ids)
                lps = None if lps is None else list(lps)
            status = seq.status
            completions.append(
                (
                    i,
                    text,
                    token_ids,
                    group.cumulative_logprob[i] if lps is not None else None,
                    lps,
                    status.value if status.finished else None,
                    seq.stop_reason,
                )
            )
        seqs = group.seqs
        first = seqs[0]
        finished = group.finished
        metrics = (
            group.arrival_time,
            first.first_scheduled_time,
            first.first_token_time,
            first.last_token_time,
            time.monotonic() if finished else None,
            first.num_cached_tokens,
            first.num_preemptions if len(seqs) == 1 else sum(s.num_preemptions for s in seqs),
        )
        prompt_lps = group.prompt_logprobs
        if prompt_lps is not None and len(prompt_lps) < len(group.prompt_token_ids):
            prompt_lps = None  # not all computed yet (an output before the prompt's end)
        elif prompt_lps is not None and delta:
            prompt_lps, group.prompt_logprobs_sent = (
                (None, True) if group.prompt_logprobs_sent else (prompt_lps, True)
            )
        return (
            group.request_id,
            finished,
            completions,
            metrics,
            first.num_cached_tokens,
            None,
            prompt_lps,
        )

    def _drop(self, group: _Group) -> None:
        if self._groups.pop(group.request_id, None) is not None:
            if _needs_sync(group.seqs[0].sampling_params):
                self._num_sync_groups -= 1
            if group.prompt_logprobs is not None:
                self._num_prompt_logprob_groups -= 1
        for seq in group.seqs:
            self._seq_owner.pop(seq.request_id, None)
        if group.constrained:
            self.grammars.remove(group)

    # ----------------------------------------------------------------- helpers
    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the in-process runner needs nothing)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def get_stats(self) -> EngineStats:
        kv = self.kv_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries_total=kv.prefix_queries,
            prefix_cache_hits_total=kv.prefix_hits,
            kv_cache_capacity_tokens=self.runner.num_pages * self.args.page_size,
            **(self.spec.stats.as_engine_stats() if self.spec is not None else {}),
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


def _needs_sync(params: SamplingParams) -> bool:
    """Whether sampling reads the request's previous token on the host (penalties over the
    output so far, min_tokens masking), which async scheduling has not received yet."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.min_tokens > 0
    )


def _update_until_stop(
    detok: IncrementalDetokenizer, new_ids: list[int], finished: bool
) -> tuple[DetokenizerDelta, int]:
    """Feed a verified run token by token: (the last delta, tokens fed up to a stop string)."""
    delta = DetokenizerDelta("", None)
    for i, token in enumerate(new_ids):
        delta = detok.update([token], finished=finished and i == len(new_ids) - 1)
        if delta.stop_string is not None:
            return delta, i + 1
    return delta, len(new_ids)


def _make_backend(name: str, device):
    if name in ("auto", "torch") and not (name == "auto" and device.type == "cuda"):
        return None  # the runner's default: the torch reference backend
    if name in ("auto", "triton"):
        try:
            from roofline.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"the triton attention backend is unavailable: {e}") from e
            return None
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")

"""Token-budget continuous batching: which requests run each step and how many tokens each.

There are no prefill or decode phases. Every step spends a budget of
``max_num_batched_tokens``: first on the running requests (each gets
``min(num_tokens - num_computed_tokens, remaining budget)`` new tokens, so a long prompt is
chunked over steps and decodes run beside prefill chunks), then on admitting waiting requests.
When pages run out a running request is preempted (its pages freed, recomputed from scratch
later). Once a step is decided its requests are advanced at once (``num_computed_tokens``,
plus one *pending* token for each that samples), so the next step can be scheduled while this
one still runs on the GPU (async scheduling); ``update()`` later turns the pending tokens into
the runner's sampled ids and applies the stop rules. Pure Python: requests, token ids and page
ids only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from roofline.config import SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager, PrefixHit
from roofline.core.outputs import (
    ModelRunnerOutput,
    RequestUpdate,
    SchedulerOutput,
    VerifiedTokens,
)
from roofline.core.steady import SteadyDecode, is_steady_step, schedule_steady
from roofline.request import Request, RequestStatus


class QueueFullError(Exception):
    """The waiting queue is at ``max_num_waiting``; retry later (the server answers 429)."""


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class _Step:
    """What one ``schedule()`` call has decided so far: the scheduled requests as parallel
    lists (``SchedulerOutput``'s rows)."""

    __slots__ = (
        "budget",
        "requests",
        "num_new_tokens",
        "block_ids",
        "start_positions",
        "samples",
        "preempted_ids",
        "num_tokens",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.requests: list[Request] = []
        self.num_new_tokens: list[int] = []
        self.block_ids: list[list[int]] = []
        self.start_positions: list[int] = []
        self.samples: list[bool] = []
        self.preempted_ids: list[str] = []
        self.num_tokens = 0
        """Sum of the scheduled requests' ``num_new_tokens``."""

    @property
    def rows(self) -> tuple[list[Request], list[int], list[list[int]], list[int], list[bool]]:
        return (
            self.requests,
            self.num_new_tokens,
            self.block_ids,
            self.start_positions,
            self.samples,
        )

    def add(
        self, request: Request, num_new_tokens: int, block_ids: list[int], num_tokens: int = -1
    ) -> None:
        """``num_tokens``: the request's ``num_tokens`` if the caller has it at hand."""
        start = request.num_computed_tokens
        if num_tokens < 0:
            num_tokens = request.num_tokens
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.block_ids.append(block_ids)
        self.start_positions.append(start)
        self.samples.append(start + num_new_tokens == num_tokens)
        self.budget -= num_new_tokens
        self.num_tokens += num_new_tokens

    def unschedule(self, request: Request) -> None:
        """Take back ``request``'s entry, if it has one (a preemption victim: rare, so a scan
        from the end, where the running list's last request usually sits)."""
        requests = self.requests
        for i in range(len(requests) - 1, -1, -1):
            if requests[i] is request:
                num_new = self.num_new_tokens[i]
                for values in self.rows:
                    del values[i]
                self.budget += num_new
                self.num_tokens -= num_new
                return


def _fit_proposals(request: Request, num_new: int) -> int:
    """Drop the proposals a short token budget cannot verify this step (a verification row
    must end on its last proposal); the request's ``num_new_tokens`` after that."""
    num_known_left = request.num_known_tokens - request.num_computed_tokens
    if num_new >= num_known_left + len(request.spec_token_ids):
        return num_new
    del request.spec_token_ids[max(num_new - num_known_left, 0) :]
    return min(request.num_tokens - request.num_computed_tokens, num_new)


class Scheduler:
    """Owns the waiting queue and the running list; the KV manager owns the pages.

    Invariants: a request is in exactly one of ``waiting`` (status WAITING or PREEMPTED, no
    pages) and ``running`` (status RUNNING, holds pages) until it finishes, when it leaves both
    and its pages are freed. ``running`` is in admission order, so under ``fcfs`` its last
    element is the most recently admitted request (the preemption victim).
    """

    steady_decode = True
    """Take steady decode steps in O(changes) (``core/steady.py``); False: always the general
    loop (the tests' reference)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, page_size: int) -> None:
        if page_size != kv.page_size:
            raise ValueError(f"page_size {page_size} differs from the KV manager's {kv.page_size}")
        self.config = config
        self.kv = kv
        self.page_size = page_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0
        self.num_unreported_tokens = 0
        """Tokens ``update`` appended to quiet requests without reporting them (the engine
        adds them to its counters and resets this)."""
        self._running_version = 0
        """Bumped whenever ``running`` changes (a steady decode run ends with it)."""
        self._steady: SteadyDecode | None = None
        self._decode_version: int | None = None
        """``_running_version`` after the last step, if that step was a steady-shaped decode."""

    # ----------------------------------------------------------------- introspection

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (None once it has finished or if unknown)."""
        return self._requests.get(request_id)

    # ----------------------------------------------------------------- admission

    def add_request(self, request: Request) -> None:
        """Validate and enqueue. ValueError for a request that can never run, QueueFullError
        when the waiting queue is full."""
        max_len = request.num_prompt_tokens + request.max_tokens
        if max_len > self.config.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) = {max_len} exceeds max_model_len "
                f"({self.config.max_model_len})"
            )
        if not self.kv.can_ever_fit(max_len):
            raise ValueError(
                f"prompt + max_tokens = {max_len} tokens needs {self.kv.pages_needed(max_len)} "
                f"KV pages but the whole pool has {self.kv.num_pages}: it can never fit"
            )
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_num_waiting
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests)")
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    # ----------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first, then (if nobody was preempted and there
        is room under ``max_num_seqs``) waiting requests in policy order."""
        steady = self._steady
        if steady is not None:
            self._steady = None
            if (
                self.steady_decode
                and steady.version == self._running_version
                and (not self.waiting or len(self.running) >= self.config.max_num_seqs)
            ):
                out = schedule_steady(
                    steady, self.kv, self.config.max_num_batched_tokens, self._finished_ids
                )
                if out is not None:
                    self._steady = steady
                    self._finished_ids = []
                    return out
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted_ids:
            self._schedule_waiting(step)
        for request, num_new, samples in zip(step.requests, step.num_new_tokens, step.samples):
            request.num_computed_tokens += num_new  # decided: they count as computed from now
            if samples:
                request.num_pending_tokens += 1
        out = SchedulerOutput(
            None,
            step.num_tokens,
            step.preempted_ids,
            self._finished_ids,
            rows=step.rows,
        )
        self._finished_ids = []
        if self.steady_decode:
            self._note_decode(out)
        return out

    def _note_decode(self, out: SchedulerOutput) -> None:
        """Start a steady decode run after two steady-shaped decode steps in a row over the
        same running requests (one alone may be a transition: no O(n) set-up for it)."""
        if not is_steady_step(out, self.running):
            self._decode_version = None
            return
        version = self._running_version
        if self._decode_version == version:
            steady = SteadyDecode(out, version, self.page_size, self.config.max_model_len)
            self._steady = steady if steady.max_steps > 1 else None
        self._decode_version = version

    def _schedule_running(self, step: _Step) -> None:
        # The body runs once per running request per step: attribute lookups are hoisted and
        # ``Request.num_tokens`` / ``_finishes_on_pending`` are inlined (same rules), and so is
        # ``KVCacheManager.allocate``'s common case (the request's pages already cover the new
        # tokens: ``kv.covered``), with the entry appended here rather than by ``_Step.add``.
        running_status = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        kv = self.kv
        allocate = kv.allocate
        covered = kv.covered
        add_request, add_num_new = step.requests.append, step.num_new_tokens.append
        add_block_ids, add_start = step.block_ids.append, step.start_positions.append
        add_samples = step.samples.append
        budget, num_step_tokens = step.budget, step.num_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running_status:
                continue  # preempted earlier in this loop
            num_pending = request.num_pending_tokens
            num_output = len(request.output_token_ids)
            spec = request.spec_token_ids
            num_prompt = len(request.prompt_token_ids)
            num_tokens = num_prompt + num_output + num_pending + len(spec)
            if num_pending and (
                num_output + num_pending >= request.max_tokens or num_tokens >= max_model_len
            ):
                continue  # its pending token ends it (length): nothing more to compute
            start = request.num_computed_tokens
            num_new = num_tokens - start
            if num_new > budget:  # (not min(): a builtin call per request per step)
                num_new = budget
            if not spec:
                block_ids = covered(request, start + num_new, num_prompt + num_output)
                if block_ids is not None:  # no page to add (most decode steps)
                    add_request(request)
                    add_num_new(num_new)
                    add_block_ids(block_ids)
                    add_start(start)
                    add_samples(start + num_new == num_tokens)
                    budget -= num_new
                    num_step_tokens += num_new
                    continue
            step.budget, step.num_tokens = budget, num_step_tokens
            self._allocate_running(step, request, num_new, -1 if spec else num_tokens, allocate)
            budget, num_step_tokens = step.budget, step.num_tokens
        step.budget, step.num_tokens = budget, num_step_tokens

    def _allocate_running(
        self, step: _Step, request: Request, num_new: int, known_num_tokens: int, allocate
    ) -> None:
        """A running request that needs new pages (or carries proposals): allocate, dropping
        its proposals and then preempting from the back of the running list when pages run
        out."""
        if request.spec_token_ids:
            num_new = _fit_proposals(request, num_new)
        while True:
            block_ids = allocate(request, num_new)
            if block_ids is not None:
                step.add(request, num_new, block_ids, known_num_tokens)
                return
            if request.spec_token_ids:  # proposals are guesses: drop them, preempt no one
                request.spec_token_ids = []
                num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
                continue
            victim = self._running_victim()
            self._preempt(victim, step)
            if victim is request:
                return

    def _finishes_on_pending(self, request: Request) -> bool:
        """Whether the request's pending tokens (async scheduling) will take it to
        ``max_tokens`` or ``max_model_len``, so that it finishes when they land."""
        if not request.num_pending_tokens:
            return False
        return (
            request.num_output_tokens + request.num_pending_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        )

    def _running_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Free the victim's pages and put it at the front of the queue to recompute from 0."""
        step.unschedule(victim)
        self.kv.free(victim)  # before resetting num_computed_tokens: free() reads it
        self.running.remove(victim)
        self._running_version += 1
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.insert(0, victim)
        step.preempted_ids.append(victim.request_id)

    def _schedule_waiting(self, step: _Step) -> None:
        if self.config.policy == "priority":
            order = sorted(self.waiting, key=_priority_key)
        else:
            order = list(self.waiting)
        for request in order:
            if len(self.running) >= self.config.max_num_seqs or step.budget == 0:
                break
            if self._waits_for_parent(request) or request.num_pending_tokens:
                # do not block unrelated requests behind a fork; a request preempted while a
                # step was sampling for it comes back once that token has landed
                continue
            if not self._admit(request, step):
                break

    def _share_len(self, request: Request) -> int:
        """Tokens of the parent's prompt a fork can share: whole pages, one token left over."""
        parent = request.parent
        if parent is None:
            return 0
        return ((parent.num_prompt_tokens - 1) // self.page_size) * self.page_size

    def _waits_for_parent(self, request: Request) -> bool:
        parent = request.parent
        return (
            parent is not None
            and parent.status is RequestStatus.RUNNING
            and parent.num_computed_tokens < self._share_len(request)
        )

    def _fork_share_len(self, request: Request) -> int:
        """Tokens to take from the running parent's pages now (0: go through the cache)."""
        parent = request.parent
        share_len = self._share_len(request)
        if parent is None or share_len == 0 or parent.status is not RequestStatus.RUNNING:
            return 0
        if parent.num_computed_tokens < share_len:
            return 0
        if len(self.kv.get_block_ids(parent.request_id)) < share_len // self.page_size:
            return 0
        if request.prompt_token_ids[:share_len] != parent.prompt_token_ids[:share_len]:
            return 0
        return share_len

    def _admit(self, request: Request, step: _Step) -> bool:
        """Try to start a waiting request; False means stop admitting for this step."""
        count_lookup = True
        while True:
            share_len = self._fork_share_len(request)
            if share_len:
                self.kv.share_prefix(request.parent, request, share_len)  # type: ignore[arg-type]
                request.num_computed_tokens = share_len
                hit = PrefixHit([], 0)
            elif request.sampling_params.prompt_logprobs is not None:
                hit = PrefixHit([], 0)  # its prompt's logits are needed: recompute them all
            else:
                hit = self.kv.lookup_prefix(request, count=count_lookup)
                count_lookup = False
            num_cached = share_len or hit.num_cached_tokens
            remaining = request.num_tokens - num_cached
            num_new = min(remaining, step.budget)
            fits_budget = num_new == remaining or self.config.enable_chunked_prefill
            block_ids = self.kv.allocate(request, num_new, hit) if fits_budget else None
            if block_ids is not None:
                self._start(request, num_cached, num_new, block_ids, step)
                return True
            if share_len:  # undo the share; the pages stay with the parent
                self.kv.free(request)
                request.num_computed_tokens = 0
            victim = self._admission_victim(request) if fits_budget else None
            if victim is None:
                return False
            self._preempt(victim, step)  # then look up and allocate again

    def _admission_victim(self, request: Request) -> Request | None:
        """Under ``priority``: the running request of strictly lower priority (larger value)
        with the largest (priority, arrival_time), skipping any whose not-yet-written pages a
        request admitted this step already relies on. None under ``fcfs``."""
        if self.config.policy != "priority":
            return None
        candidates = [
            r
            for r in self.running
            if r.priority > request.priority and not self.kv.has_unwritten_shared_pages(r)
        ]
        return max(candidates, key=_priority_key, default=None)

    def _start(
        self,
        request: Request,
        num_cached: int,
        num_new: int,
        block_ids: list[int],
        step: _Step,
    ) -> None:
        self.waiting.remove(request)
        self.running.append(request)
        self._running_version += 1
        request.status = RequestStatus.RUNNING
        request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        step.add(request, num_new, block_ids)

    # ----------------------------------------------------------------- update

    def update(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Fold a step's results in: each sampling request's oldest pending token becomes the
        sampled id, then the stop rules apply (a finished request's pages are freed). Returns
        one update per request that got a token (a quiet request's only on its first token and
        when it finishes); requests finished or aborted since ``schedule()`` are skipped. A
        request preempted since (async scheduling) still gets its token: it was computed from
        the right prefix."""
        all_logprobs, verified = runner_out.logprobs, runner_out.verified
        token_ids = runner_out.token_ids  # in the step's order, or None: by request id
        if sched_out.changed_rows is not None and token_ids is not None:
            if not (all_logprobs or verified):  # a steady decode step: every row samples
                return self._update_steady(sched_out.requests, token_ids)
        updates: list[RequestUpdate] = []
        add_update = updates.append
        now = time.monotonic()
        sampled = runner_out.sampled_token_ids if token_ids is None else None
        index = -1  # of the sampling entry, in token_ids
        max_model_len = self.config.max_model_len
        num_unreported = 0
        for request, samples in zip(sched_out.requests, sched_out.samples):  # kept lean:
            if not samples:  # once per request per step
                continue  # a partial prefill chunk
            index += 1
            if request.status.finished:
                continue  # finished/aborted mid-step: stay so
            request.num_pending_tokens -= 1
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            rid = request.request_id
            if verified and rid in verified:
                add_update(self._update_verified(request, verified[rid]))
                continue
            token = sampled[rid] if token_ids is None else token_ids[index]  # type: ignore[index]
            output = request.output_token_ids
            output.append(token)
            num_output = len(output)
            # _check_stop decides only when some rule can fire (the common token skips it):
            # an EOS or stop token, or the length (max_tokens or max_model_len) reached
            if (
                token in request.stop_check_ids
                or num_output >= request.max_tokens
                or len(request.prompt_token_ids) + num_output >= max_model_len
            ):
                status = self._check_stop(request, token)
                if status is not None:
                    self._finish(request, status)
                    logprobs = [all_logprobs[rid]] if all_logprobs and rid in all_logprobs else []
                    add_update(RequestUpdate(request, [token], logprobs, True))
                    continue
            if request.quiet and num_output > 1:  # nobody reads it before it finishes
                num_unreported += 1
                continue
            logprobs = [all_logprobs[rid]] if all_logprobs and rid in all_logprobs else []
            add_update(RequestUpdate(request, [token], logprobs, False))
        self.num_unreported_tokens += num_unreported
        return updates

    def _update_steady(self, requests: list[Request], token_ids: list[int]) -> list[RequestUpdate]:
        """``update`` for a steady decode step (``core/steady.py``): one sampled token per row,
        in order, no logprobs or proposals; the same rules, fewer checks per row."""
        updates: list[RequestUpdate] = []
        add_update = updates.append
        now = time.monotonic()
        max_model_len = self.config.max_model_len
        num_unreported = 0
        for request, token in zip(requests, token_ids):
            if request.status.finished:
                continue  # finished/aborted mid-step: stay so
            request.num_pending_tokens -= 1
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            output = request.output_token_ids
            output.append(token)
            num_output = len(output)
            if (
                token in request.stop_check_ids
                or num_output >= request.max_tokens
                or len(request.prompt_token_ids) + num_output >= max_model_len
            ):
                status = self._check_stop(request, token)
                if status is not None:
                    self._finish(request, status)
                    add_update(RequestUpdate(request, [token], [], True))
                    continue
            if request.quiet and num_output > 1:
                num_unreported += 1
                continue
            add_update(RequestUpdate(request, [token], [], False))
        self.num_unreported_tokens += num_unreported
        return updates

    def _update_verified(self, request: Request, verified: VerifiedTokens) -> RequestUpdate:
        """A verification row: roll the rejected proposals back (their KV slots, and the pages
        that held only them), then append the emitted tokens one by one under the stop rules,
        so a stop token or ``max_tokens`` inside the accepted run ends it there."""
        num_rejected = verified.num_proposed - verified.num_accepted
        request.spec_token_ids = []
        request.num_computed_tokens -= num_rejected
        self.kv.trim(request, request.num_computed_tokens)
        new_ids: list[int] = []
        status = None
        for token in verified.token_ids:
            request.output_token_ids.append(token)
            new_ids.append(token)
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
                break
        logprobs = (verified.logprobs or [])[: len(new_ids)]
        return RequestUpdate(request, new_ids, logprobs, status is not None)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Stop rules, in order: EOS, stop token ids (both only after ``min_tokens`` outputs),
        then length (``max_tokens`` outputs or ``max_model_len`` tokens)."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        past_min = num_output >= params.min_tokens
        if token in request.eos_token_ids and past_min:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids and past_min:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if (
            num_output >= request.max_tokens
            or len(request.prompt_token_ids) + num_output >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._running_version += 1
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        self._requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string). Idempotent; unknown or already
        finished ids are ignored; waiting and running requests alike release their pages."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

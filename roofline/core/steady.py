"""Steady decode: ``Scheduler.schedule()`` in time proportional to what changes, not to the batch.

Once the same running requests have been scheduled for two decode steps in a row (one token
each, every row sampling, no proposals, nobody admitted, preempted or finished), the next step
is the previous one moved on by a token: the same requests in the same order, each start one
further. What can still differ for a request is decided by its start position alone, since
``num_tokens - num_computed_tokens`` stays 1 (``schedule`` adds a computed and a pending token,
``update`` turns a pending token into an output one):

* a new page, needed when the start reaches the end of its pages (start % page_size == 0);
* prefix-cache registration of a newly filled page, which happens when its known tokens
  (start + 1 - pending, pending 0 or 1) reach a page multiple (start % page_size is
  pending - 1; any of -1, 0, 1 on the step after the pending count changed);
* the length limit (``max_tokens`` or ``max_model_len``) near, where the general loop skips a
  request whose pending token ends it.

:class:`SteadyDecode` keeps the requests grouped by start residue modulo the page size, so a step
visits only the rows at one of those residues (1 of every ``page_size`` steps per request
under async scheduling),
through ``KVCacheManager.covered`` (the general loop's own call) or ``append_page``
(``allocate``'s one-page case without its general checks) in running order,
and hands back the steps whose plan it cannot vouch for (a length limit near, pages run out,
proposals, a waiting request that could be admitted) to the general loop. The plan it makes is
the general loop's, page for page (``tests/core/test_steady_decode.py``); the output says which
step it advances and which rows may have new pages (``SchedulerOutput.advances``), so the
runner can move its own per-row state on instead of rebuilding it.
"""

from __future__ import annotations

from operator import attrgetter

from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.outputs import SchedulerOutput
from roofline.request import Request

_SPEC = attrgetter("spec_token_ids")


class SteadyDecode:
    """The running requests of a steady decode run, grouped for the residue checks."""

    __slots__ = ("version", "prev", "page_size", "num_steps", "max_steps", "by_residue", "pending")

    def __init__(self, out: SchedulerOutput, version: int, page_size: int, max_model_len: int):
        self.version = version
        """``Scheduler._running_version`` when the run was recognised (any change ends it)."""
        self.prev = out
        """The last step scheduled (general or steady): the next one advances it."""
        self.page_size = page_size
        self.num_steps = 0
        """Steady steps taken since ``out``: request i's next start is its start there plus
        ``num_steps + 1``."""
        by_residue: list[list[int]] = [[] for _ in range(page_size)]
        max_steps = 1 << 62
        for i, (request, start) in enumerate(zip(out.requests, out.start_positions)):
            by_residue[start % page_size].append(i)
            # the start from which the general loop may skip it (its pending token ends it)
            limit = min(len(request.prompt_token_ids) + request.max_tokens, max_model_len) - 1
            if limit - start < max_steps:
                max_steps = limit - start
        self.by_residue = by_residue
        self.pending: int | None = None
        """The pending tokens each request had when the last steady step was scheduled (all
        alike: they were all in the same steps); None before the first."""
        self.max_steps = max_steps
        """Steady steps allowed: at ``max_steps`` some request's start reaches its limit."""

    def rows_to_check(self, num_steps: int, pending: int) -> list[int]:
        """Rows (in running order) whose start after ``num_steps`` steps is at a residue
        modulo the page size where a page or a cache registration can concern them: 0 (a new
        page) and ``pending - 1`` (known tokens, ``start + 1 - pending``, reach a page
        multiple), or -1, 0 and 1 when the pending count just changed (a drained step: the
        known count moved by 0 or 2)."""
        page, groups = self.page_size, self.by_residue
        if page <= 3:
            return list(range(len(self.prev.requests)))
        if pending == self.pending and pending in (0, 1):
            rows = groups[-num_steps % page]  # residue 0 (shared list: not modified below)
            if pending == 0:
                rows = rows + groups[(-1 - num_steps) % page]
                rows.sort()
            return rows
        rows = groups[(-1 - num_steps) % page] + groups[-num_steps % page]
        rows += groups[(1 - num_steps) % page]
        rows.sort()
        return rows


def is_steady_step(out: SchedulerOutput, running: list[Request]) -> bool:
    """Whether ``out`` is a decode step of exactly the running requests, in order, one token
    each, all sampling, without proposals or preemptions (what a steady run continues)."""
    requests = out.requests
    return (
        0 < out.num_batched_tokens == len(requests) == len(running)
        and not out.preempted_request_ids
        and requests == running
        and all(out.samples)
        and not any(map(_SPEC, requests))
    )


def schedule_steady(
    state: SteadyDecode,
    kv: KVCacheManager,
    budget: int,
    finished_ids: list[str],
) -> SchedulerOutput | None:
    """The next step of a steady run, or None (nothing changed: the general loop decides).
    Side effects as the general loop's for the same step (pages allocated and registered in
    running order; each request one computed and one pending token further)."""
    prev = state.prev
    requests = prev.requests
    n = len(requests)
    num_steps = state.num_steps + 1
    if num_steps >= state.max_steps or n > budget or any(map(_SPEC, requests)):
        return None
    starts = [s + 1 for s in prev.start_positions]
    block_ids = prev.block_ids
    pending = requests[0].num_pending_tokens
    changed = state.rows_to_check(num_steps, pending)
    if changed:
        block_ids = block_ids[:]
        covered, append_page = kv.covered, kv.append_page
        for i in changed:  # the general loop's page calls, in its order
            request = requests[i]
            start = starts[i]
            known = len(request.prompt_token_ids) + len(request.output_token_ids)
            blocks = covered(request, start + 1, known)
            if blocks is None:  # its pages end at ``start``: ``allocate(request, 1)``'s case
                blocks = append_page(request, start + 1, known)
                if blocks is None:  # pages ran out: preemption is the general loop's
                    return None
            block_ids[i] = blocks
    for request in requests:
        request.num_computed_tokens += 1
        request.num_pending_tokens += 1
    out = SchedulerOutput(
        None,
        n,
        None,
        finished_ids,
        rows=(requests, prev.num_new_tokens, block_ids, starts, prev.samples),
    )
    out.advances = prev
    out.changed_rows = changed
    out.inputs_pending = pending > 0
    prev.advances = None  # one link only: a long run must not chain every step it took
    state.prev = out
    state.num_steps = num_steps
    state.pending = pending
    return out

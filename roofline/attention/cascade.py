"""Shared-prefix detection for cascade decode attention, and the metadata it hands the backends.

``SharedPrefixDetector.plan(sched_out)`` looks at a decode-only step's block tables (the host
lists the scheduler already holds) and finds a run of leading page ids that a group of rows has
in common: a system prompt served from the prefix cache. Rows whose table begins with those
pages are *members*; their attention is split into the shared pages (computed once for the whole
group: ``kernels/cascade_attention.py``) and their own suffix, merged by log-sum-exp. It is
chosen only when it pays: at least ``min_group`` members and at least ``min_saved_bytes`` of
K/V reads saved per layer, ``(members - 1) x prefix_tokens x kv_bytes_per_token``.

The check is incremental: a request verified as a member stays one (its leading pages never
change while it runs; the runner drops it when it finishes or is preempted), so a steady decode
step costs one dictionary lookup and one page-id comparison per row. The shared run is searched
again only when too many rows fall outside it, at most every ``RESCAN_INTERVAL`` steps (an
interval that doubles, up to ``MAX_RESCAN_INTERVAL``, while rescans find nothing): for
every row, the common leading pages with each of three reference rows, then the length that
maximises the bytes saved over the rows that reach it. Between rescans a batch with nothing
shared costs no per-row work. A batch that grew by ``min_group`` rows or more since the last
rescan (new requests, which may share a prefix the old ones did not) is rescanned at once and
resets the interval, so a long stretch without sharing does not delay the next shared workload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from roofline.core.outputs import ScheduledRequest, SchedulerOutput
from roofline.request import Request

RESCAN_INTERVAL = 16
MAX_RESCAN_INTERVAL = 128
"""Rescans that find nothing double the interval up to this (a 256-row rescan costs about a
millisecond of host time; a workload without shared prefixes then pays it every 128 steps)."""
MIN_MEMBER_FRACTION = 0.9
"""Rescan (at most every ``RESCAN_INTERVAL`` steps) when fewer rows than this are members."""
DEFAULT_MIN_GROUP = 8
DEFAULT_MIN_SAVED_BYTES = 8 << 20
"""~3 us of HBM time on an H100 per layer: a cascade step adds two launches and the partials."""


@dataclass
class CascadePlan:
    """One decode step's shared prefix (host lists, uploaded with the step's inputs)."""

    prefix_pages: list[int]
    """The shared page ids, in order."""
    prefix_len: int
    """Shared tokens: ``len(prefix_pages) * page_size``."""
    suffix_start: list[int]
    """[num_reqs] ``prefix_len`` for a member row, 0 for the others."""
    max_suffix_len: int
    """Longest context a row attends outside the shared pages."""
    num_members: int

    def lists(self) -> list[list[int]]:
        return [self.prefix_pages, [self.prefix_len], self.suffix_start]


@dataclass
class CascadeMetadata:
    """The device side of a plan, as attention backends read it (``AttentionMetadata.cascade``)."""

    prefix_pages: torch.Tensor
    """[>= num prefix pages] int32/int64 on device."""
    prefix_len: torch.Tensor
    """[1] int32/int64 on device: shared tokens."""
    suffix_start: torch.Tensor
    """[num_reqs] int32/int64 on device: ``prefix_len`` (member) or 0."""
    max_suffix_len: int
    """Host upper bound of ``seq_len - suffix_start`` (sizes the suffix splits)."""
    max_prefix_len: int
    """Host upper bound of ``prefix_len`` (sizes the prefix splits)."""
    num_splits: int | None = None
    """Fixed split counts (CUDA graphs); None: chosen per step."""
    prefix_splits: int | None = None


def eager_metadata(
    plan: CascadePlan,
    lists_dev: list[torch.Tensor],  # ``plan.lists()`` on the device (int64 views of the upload)
) -> CascadeMetadata:
    """An eagerly run step's metadata. The tensors are fresh int32 allocations, as the cascade
    graphs' static buffers are: Triton specializes a kernel on each pointer's dtype and 16-byte
    alignment, and views into the step's packed upload sit at offsets that change every step
    (each combination would compile the kernels again in the middle of serving)."""
    pages, length, starts = (t.to(torch.int32) for t in lists_dev)
    return CascadeMetadata(pages, length, starts, plan.max_suffix_len, plan.prefix_len)


class SharedPrefixDetector:
    """Finds the decode batch's shared leading pages (module docstring)."""

    def __init__(
        self,
        page_size: int,
        kv_bytes_per_token: int,
        min_group: int = DEFAULT_MIN_GROUP,
        min_saved_bytes: int = DEFAULT_MIN_SAVED_BYTES,
    ) -> None:
        if min_group < 2:
            raise ValueError(f"a shared-prefix group needs at least 2 rows, got {min_group}")
        self.page_size = page_size
        self.kv_bytes_per_token = kv_bytes_per_token
        """K and V bytes of one token in one layer (all of this rank's KV heads)."""
        self.min_group = min_group
        self.min_saved_bytes = min_saved_bytes
        self.prefix: list[int] = []
        self.members: dict[str, Request] = {}
        """Requests verified to begin with ``prefix`` (the object: a reused id is another)."""
        self._steps_since_scan = RESCAN_INTERVAL
        self._rescan_interval = RESCAN_INTERVAL
        self._scan_ref = 0
        self._fewest_rows = 0  # the fewest decode rows of a step since the last rescan

    def drop(self, request_ids: list[str]) -> None:
        """Forget finished or preempted requests (their pages may change or be freed)."""
        members = self.members
        for rid in request_ids:
            members.pop(rid, None)

    def pays(self, num_members: int, prefix_len: int) -> bool:
        saved = (num_members - 1) * prefix_len * self.kv_bytes_per_token
        return num_members >= self.min_group and saved >= self.min_saved_bytes

    def plan(self, sched_out: SchedulerOutput) -> CascadePlan | None:
        """The step's cascade plan, or None (not decode-only, or no group that pays)."""
        return self.plan_rows(sched_out.scheduled)

    def plan_rows(self, scheduled: Sequence[ScheduledRequest]) -> CascadePlan | None:
        """The plan of these decode rows: a decode-only step's, or the leading decode rows of
        a decode-first mixed step (``attention/split_backend.py`` attends them apart)."""
        n = len(scheduled)
        self._fewest_rows = min(self._fewest_rows, n)
        if n < self.min_group:
            return None
        self._steps_since_scan += 1
        if n >= self._fewest_rows + self.min_group:  # new requests joined: look again now
            self._rescan_interval = RESCAN_INTERVAL
            self._steps_since_scan = max(self._steps_since_scan, RESCAN_INTERVAL)
        rescan_due = self._steps_since_scan >= self._rescan_interval
        if not self.prefix:  # nothing shared lately: no per-row work until a rescan is due
            if not rescan_due or not self._rescan(scheduled):
                return None
            rescan_due = False
        plan = self._match(scheduled)
        if plan is None:
            return None
        if plan.num_members < MIN_MEMBER_FRACTION * len(scheduled) and rescan_due:
            if not self._rescan(scheduled):
                return None
            plan = self._match(scheduled)
            if plan is None:
                return None
        return plan if self.pays(plan.num_members, plan.prefix_len) else None

    def _match(self, scheduled: Sequence[ScheduledRequest]) -> CascadePlan | None:
        prefix = self.prefix
        num_pages = len(prefix)
        prefix_len = num_pages * self.page_size
        last_index, last = num_pages - 1, prefix[-1]
        get, admit = self.members.get, self._admit
        starts: list[int] = []
        append = starts.append
        num_members = max_pos_member = max_pos_other = 0
        for s in scheduled:  # the hot loop of a steady step: keep it lean
            if s.num_new_tokens != 1:
                return None  # prefill or verification rows: the plain kernels
            pos, req = s.start_position, s.request  # pos: the row's newest token
            if (
                pos >= prefix_len  # (so its table covers the shared pages)
                and s.block_ids[last_index] == last
                and (get(req.request_id) is req or admit(req, s.block_ids))
            ):
                append(prefix_len)
                num_members += 1
                if pos > max_pos_member:
                    max_pos_member = pos
            else:
                append(0)
                if pos > max_pos_other:
                    max_pos_other = pos
        max_suffix = max(max_pos_member + 1 - prefix_len, max_pos_other + 1)
        return CascadePlan(prefix, prefix_len, starts, max_suffix, num_members)

    def _admit(self, req: Request, block_ids: list[int]) -> bool:
        if block_ids[: len(self.prefix)] != self.prefix:
            return False
        self.members[req.request_id] = req
        return True

    def _rescan(self, rows: Sequence[ScheduledRequest]) -> bool:
        """Choose the shared run that saves the most reads among these rows (decode rows
        only); whether one was found."""
        if any(s.num_new_tokens != 1 for s in rows):
            return bool(self.prefix)  # try again on a decode-only step
        self._steps_since_scan = 0
        page = self.page_size
        n = len(rows)
        self._fewest_rows = n
        # Reference rows: the first, the middle and the last, then others at each rescan (a
        # reference outside the group finds nothing; three make that unlikely).
        refs = {(self._scan_ref + i) % n for i in (0, n // 2, n - 1)}
        self._scan_ref += 1
        best, best_saved, ref_pages = 0, 0, []
        for r in sorted(refs):
            ref = rows[r]
            # Only full pages before the row's newest token can be shared.
            pages = ref.block_ids[: ref.start_position // page]
            common = sorted(
                (_common_len(pages, s.block_ids, s.start_position // page) for s in rows),
                reverse=True,
            )
            for k, num_pages in enumerate(common, start=1):
                saved = (k - 1) * num_pages
                if k >= self.min_group and saved > best_saved:
                    best, best_saved, ref_pages = num_pages, saved, pages
        new_prefix = ref_pages[:best]
        if new_prefix != self.prefix:
            self.prefix = new_prefix
            self.members = {}
        if best > 0:
            self._rescan_interval = RESCAN_INTERVAL
        else:
            self._rescan_interval = min(2 * self._rescan_interval, MAX_RESCAN_INTERVAL)
        return best > 0


def _common_len(ref: list[int], block_ids: list[int], limit: int) -> int:
    """Length of the common leading run of ``ref`` and ``block_ids[:limit]`` (binary search on
    slice comparisons: a few C-speed compares instead of a Python loop over pages)."""
    hi = min(len(ref), limit, len(block_ids))
    if not hi or block_ids[0] != ref[0]:
        return 0
    if block_ids[:hi] == ref[:hi]:
        return hi
    lo = 0  # ref[:lo] matches; ref[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if block_ids[:mid] == ref[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["CascadeMetadata", "CascadePlan", "SharedPrefixDetector", "eager_metadata"]

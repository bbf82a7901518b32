"""What the engine sends its tensor-parallel workers each step, in one message.

The engine builds the step's :class:`~roofline.worker.host_batch.HostBatch` itself (it owns the
block-table row assignment, ``BlockTables`` used host-side only), so every worker receives the
same finished host lists and only uploads them. A :class:`StepMessage` carries those lists as
one packed int64 buffer, the ids of pending rows, the finished and preempted request ids, and the
request id of each sampling row. Rank 0 samples from mirrors of the sampling requests: a mirror
is created from the request's sampling parameters the first time it samples, and is sent the
request's new output tokens only when its sampling reads them (penalties, ``min_tokens``), so a
plain decode step costs its id per request: no per-request object is pickled. It is pickled once
and the same bytes go to every worker.
"""

from __future__ import annotations

import pickle
from array import array
from dataclasses import dataclass, field

from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.block_table import TableUpdates
from roofline.worker.host_batch import HostBatch
from roofline.worker.prompt_logprobs import PromptLogprobRow

_LISTS = (
    "input_ids",
    "positions",
    "slots",
    "query_start",
    "seq_lens",
    "table_rows",
    "sample_rows",
    "pending_rows",
)


@dataclass
class StepMessage:
    packed: bytes
    """``array('q')`` of the lists in ``_LISTS`` order, then the table updates (index, page)."""
    lengths: tuple[int, ...]
    pending_requests: list[str]
    sample_ids: list[str]
    """The request id of each sampling row, in row order."""
    new_mirrors: dict[str, tuple[list[int], SamplingParams, frozenset[int]]] = field(
        default_factory=dict
    )
    """(prompt ids if the sampler reads them, params, EOS ids) of requests sampling for the
    first time."""
    new_output_ids: dict[str, list[int]] = field(default_factory=dict)
    """Output tokens a mirror lacks (only for requests whose sampling reads them)."""
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRow] = field(default_factory=list)
    """The step's rows that predict prompt tokens of requests asking for prompt logprobs."""


def needs_history(params: SamplingParams) -> bool:
    """Whether sampling reads the request's tokens (penalties, ``min_tokens``)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.min_tokens > 0
    )


class StepPacker:
    """Engine side: turns built steps into message bytes and tracks what the mirrors hold."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}
        """request id -> output tokens its mirror holds (-1: mirror without history)."""

    def pack(
        self,
        batch: HostBatch | None,
        finished: list[str],
        preempted: list[str],
        prompt_logprob_rows: list[PromptLogprobRow] | None = None,
    ) -> bytes:
        for rid in finished:
            self._sent.pop(rid, None)
        lists: list[list[int]] = []
        msg = StepMessage(b"", (), [], [], finished=finished, preempted=preempted)
        msg.prompt_logprob_rows = prompt_logprob_rows or []
        if batch is not None:
            lists = [getattr(batch, name) for name in _LISTS]
            lists += [batch.table_updates.flat_index, batch.table_updates.page_ids]
            msg.pending_requests = batch.pending_requests
            msg.sample_ids = [r.request_id for r in batch.sample_requests]
            sent_of = self._sent
            for r in batch.sample_requests:  # a plain decode row costs one dict lookup
                sent = sent_of.get(r.request_id)
                if sent is None or sent >= 0:
                    self._describe(r, sent, msg)
        buf = array("q")
        for values in lists:
            buf.extend(values)
        msg.packed, msg.lengths = buf.tobytes(), tuple(len(x) for x in lists)
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)

    def _describe(self, r: Request, sent: int | None, msg: StepMessage) -> None:
        """What a request's mirror needs: created the first time, its new output tokens when
        its sampling reads them (``sent`` >= 0); nothing for the others (``sent`` == -1)."""
        p = r.sampling_params
        history = needs_history(p)
        if sent is None:
            prompt = r.prompt_token_ids if p.repetition_penalty != 1.0 else []
            msg.new_mirrors[r.request_id] = (list(prompt), p, r.eos_token_ids)
            sent = 0 if history else -1
        if history:
            if r.num_output_tokens > sent:
                msg.new_output_ids[r.request_id] = r.output_token_ids[sent:]
            sent = r.num_output_tokens
        self._sent[r.request_id] = sent


class StepUnpacker:
    """Worker side: message bytes -> the step's ``HostBatch`` (with request mirrors)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.mirrors: dict[str, Request] = {}

    def unpack(self, payload: bytes) -> tuple[StepMessage, HostBatch | None]:
        msg: StepMessage = pickle.loads(payload)
        for rid in msg.finished:
            self.mirrors.pop(rid, None)
        if not msg.lengths:
            return msg, None
        flat = array("q")
        flat.frombytes(msg.packed)
        values = flat.tolist()
        parts: list[list[int]] = []
        start = 0
        for n in msg.lengths:
            parts.append(values[start : start + n])
            start += n
        batch = HostBatch(self.page_size)
        for name, part in zip(_LISTS, parts):
            setattr(batch, name, part)
        updates = TableUpdates()
        updates.flat_index, updates.page_ids = parts[len(_LISTS)], parts[len(_LISTS) + 1]
        batch.table_updates = updates
        batch.pending_requests = msg.pending_requests
        mirrors = self.mirrors
        for rid, (prompt, params, eos) in msg.new_mirrors.items():
            mirrors[rid] = Request(rid, prompt or [0], params, eos_token_ids=eos)
        for rid, ids in msg.new_output_ids.items():
            mirrors[rid].output_token_ids.extend(ids)
        try:
            batch.sample_requests = [mirrors[rid] for rid in msg.sample_ids]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]} samples with no mirror") from None
        return msg, batch

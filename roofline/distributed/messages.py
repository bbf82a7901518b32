"""What the engine sends its tensor-parallel workers each step, in one message.

The engine builds the step's :class:`~roofline.worker.host_batch.HostBatch` itself (it owns the
block-table row assignment, ``BlockTables`` used host-side only), so every worker receives the
same finished host lists and only uploads them. A :class:`StepMessage` carries those lists as
one packed int64 buffer, the ids of pending rows, the finished and preempted request ids, and one
:class:`SampleSpec` per sampling row. Rank 0 samples from mirrors of the sampling requests: a
mirror is created from the request's sampling parameters the first time it samples, and is sent
the request's new output tokens only when its sampling reads them (penalties, ``min_tokens``),
so a plain decode step costs a few bytes per request. It is pickled once and the same bytes go
to every worker.
"""

from __future__ import annotations

import pickle
from array import array
from dataclasses import dataclass, field

from roofline.request import Request
from roofline.sampling_params import SamplingParams
from roofline.worker.block_table import TableUpdates
from roofline.worker.host_batch import HostBatch

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
class SampleSpec:
    request_id: str
    new: tuple[list[int], SamplingParams, frozenset[int]] | None
    """(prompt ids if the sampler reads them, params, EOS ids) the first time the request
    samples; None afterwards."""
    new_output_ids: list[int]
    """Output tokens the mirror lacks (only for requests whose sampling reads them)."""


@dataclass
class StepMessage:
    packed: bytes
    """``array('q')`` of the lists in ``_LISTS`` order, then the table updates (index, page)."""
    lengths: tuple[int, ...]
    pending_requests: list[str]
    samples: list[SampleSpec]
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


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

    def pack(self, batch: HostBatch | None, finished: list[str], preempted: list[str]) -> bytes:
        for rid in finished:
            self._sent.pop(rid, None)
        lists: list[list[int]] = []
        samples: list[SampleSpec] = []
        pending: list[str] = []
        if batch is not None:
            lists = [getattr(batch, name) for name in _LISTS]
            lists += [batch.table_updates.flat_index, batch.table_updates.page_ids]
            pending = batch.pending_requests
            samples = [self._spec(r) for r in batch.sample_requests]
        buf = array("q")
        for values in lists:
            buf.extend(values)
        msg = StepMessage(
            buf.tobytes(), tuple(len(x) for x in lists), pending, samples, finished, preempted
        )
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)

    def _spec(self, r: Request) -> SampleSpec:
        sent = self._sent.get(r.request_id)
        p = r.sampling_params
        history = needs_history(p)
        new = None
        if sent is None:
            prompt = r.prompt_token_ids if p.repetition_penalty != 1.0 else []
            new = (list(prompt), p, r.eos_token_ids)
            sent = 0 if history else -1
        outputs: list[int] = []
        if history:
            outputs = r.output_token_ids[sent:]
            sent = r.num_output_tokens
        self._sent[r.request_id] = sent
        return SampleSpec(r.request_id, new, list(outputs))


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
        batch.sample_requests = [self._mirror(s) for s in msg.samples]
        return msg, batch

    def _mirror(self, spec: SampleSpec) -> Request:
        mirror = self.mirrors.get(spec.request_id)
        if mirror is None:
            if spec.new is None:
                raise RuntimeError(f"request {spec.request_id} samples with no mirror")
            prompt, params, eos = spec.new
            mirror = Request(spec.request_id, prompt or [0], params, eos_token_ids=eos)
            self.mirrors[spec.request_id] = mirror
        if spec.new_output_ids:
            mirror.output_token_ids.extend(spec.new_output_ids)
        return mirror

"""What a constrained step costs: the host filling the bitmask of ``num_rows`` matchers, the
copy to the device and the masking kernel, per step, over matchers walking a JSON schema.

Each step every matcher's bitmask is filled (timed: the host part), the bitmask copied and
applied to ``[num_rows, vocab]`` logits (timed, synchronised: the device part), then each row
takes a random allowed token (not timed) so matchers move through the grammar like a decode;
a matcher that completes its document starts over. ``synthetic_vocab`` builds a byte-level
vocabulary of any size (single bytes, JSON punctuation, then pseudo-words with and without a
leading space) for models whose tokenizer is not at hand, e.g. Llama-3.1-8B's 128,256 tokens.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from roofline.structured_output.backend import StructuredOutputBackend
from roofline.structured_output.params import StructuredOutputsParams

BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["person", "place", "thing"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
    },
    "required": ["id", "name", "tags", "kind", "address", "score"],
}
_PUNCT = ['{"', '":', '",', '"}', '["', '"]', ", ", ": ", "{", "}", "[", "]", '"', "\\n"]


def synthetic_vocab(vocab_size: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    for p in _PUNCT:
        if p.encode() not in seen:
            vocab.append(p.encode())
            seen.add(p.encode())
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(26)]
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(letters, weights, k=rng.randint(2, 9)))
        token = (" " + word if rng.random() < 0.5 else word).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab[:vocab_size]


def synthetic_backend(vocab_size: int, stop_token_id: int) -> StructuredOutputBackend:
    """An xgrammar backend over :func:`synthetic_vocab` (the stop token replaced in place)."""
    import xgrammar as xgr

    from roofline.structured_output.xgrammar_backend import XGrammarBackend

    vocab = synthetic_vocab(vocab_size)
    vocab[stop_token_id] = b"</s>"
    info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=[stop_token_id])
    return XGrammarBackend(info)


BENCH_CONSTRAINTS: dict[str, StructuredOutputsParams] = {
    "json": StructuredOutputsParams(json=BENCH_SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}( [a-z]{1,9}){4,30}[.!?]"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed"]),
}
"""What the benchmarks constrain with: a nested JSON schema, a sentence-shaped regex (bounded
repetitions: many tokens stay uncertain, the expensive case) and a label choice."""


class _ByteTokenizer:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer, over a synthetic vocabulary
    whose first 256 ids are the single bytes (so any text encodes byte by byte)."""

    def __init__(self, vocab: list[bytes], stop_token_id: int) -> None:
        self.tokens = vocab
        self.eos_token_id = stop_token_id
        self.bos_token_id = None
        self.special_token_ids = [stop_token_id]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def synthetic_llguidance_backend(vocab_size: int, stop_token_id: int) -> StructuredOutputBackend:
    """An llguidance backend over :func:`synthetic_vocab` (needs llguidance)."""
    import llguidance

    from roofline.structured_output.llguidance_backend import LLGuidanceBackend

    vocab = synthetic_vocab(vocab_size)
    vocab[stop_token_id] = b"</s>"
    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(vocab, stop_token_id))
    return LLGuidanceBackend(llguidance.LLTokenizer(wrapper, n_vocab=vocab_size), vocab_size)


@dataclass
class MaskCost:
    num_rows: int
    fill_ms: float
    """Host time per step filling the rows' bitmask (on the critical path)."""
    apply_ms: float
    """Copy to the device and the masking kernel, per step (synchronised)."""
    kind: str = "json"
    mode: str = "table"
    backend: str = "xgrammar"

    @property
    def total_ms(self) -> float:
        return self.fill_ms + self.apply_ms


def _baseline_fill(backend: StructuredOutputBackend, matchers: list, host: torch.Tensor) -> None:
    """The fill before the mask table: every row, one call on xgrammar's "auto" threads from 8
    rows on (one thread per host core), else row by row."""
    import xgrammar as xgr

    if len(matchers) < 8:
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(host, row)
        return
    batch = getattr(backend, "_baseline_batch", None)
    if batch is None:
        batch = backend._baseline_batch = xgr.BatchGrammarMatcher(max_threads="auto")  # type: ignore[attr-defined]
    batch.batch_fill_next_token_bitmask([m._m for m in matchers], host)


def mask_cost(
    backend: StructuredOutputBackend,
    num_rows: int,
    device: torch.device,
    num_steps: int = 50,
    schema: dict[str, Any] | None = None,
    seed: int = 0,
    kind: str = "json",
    mode: str = "table",
) -> MaskCost:
    """Per-step mask cost. ``mode="table"``: :class:`MaskTable` (slots refilled when moved,
    adaptive threads, one packed upload, the fused kernel on CUDA); ``"baseline"``: the
    previous path (fill every row, xgrammar's kernel on a copied bitmask)."""
    from roofline.structured_output.mask_table import MaskTable

    params = StructuredOutputsParams(json=schema) if schema else BENCH_CONSTRAINTS[kind]
    compiled = backend.compile(params)
    matchers = [backend.matcher(compiled) for _ in range(num_rows)]
    vocab_size = backend.vocab_size  # type: ignore[attr-defined]
    table = MaskTable(backend, initial_slots=max(16, num_rows))
    slots = [table.acquire(m) for m in matchers]
    host = backend.allocate_bitmask(num_rows)  # [rows, words] (baseline)
    logits = torch.randn(num_rows, vocab_size, device=device)  # [rows, V]
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    gen = torch.Generator().manual_seed(seed)
    rows = list(range(num_rows))
    fill_s = apply_s = 0.0
    for step in range(num_steps + 3):  # 3 warm-up steps
        t0 = time.perf_counter()
        if mode == "table":
            table.start_fill()
            table.finish_fill()
        else:
            _baseline_fill(backend, matchers, host)
        t1 = time.perf_counter()
        if mode == "table":
            table.apply(logits, rows, slots)
        else:
            backend.apply_bitmask(logits, host.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        if step >= 3:
            fill_s, apply_s = fill_s + t1 - t0, apply_s + t2 - t1
        words = table.bitmask[slots] if mode == "table" else host  # [R, words]
        bits = ((words.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab_size]  # [R, V]
        picks = torch.multinomial(bits.float() + 1e-12 * (bits == 0), 1, generator=gen)  # [R, 1]
        for i, matcher in enumerate(matchers):
            if not matcher.accept_token(int(picks[i])) or matcher.is_terminated():
                matcher = matchers[i] = backend.matcher(compiled)
            table.mark_dirty(slots[i], matcher)
    table.shutdown()
    fill_ms, apply_ms = 1e3 * fill_s / num_steps, 1e3 * apply_s / num_steps
    return MaskCost(num_rows, fill_ms, apply_ms, kind, mode, backend.name)


def format_costs(costs: list[MaskCost]) -> str:
    lines = [
        "backend    | grammar | path     | rows | fill ms/step | copy+apply ms/step | total ms/step"
    ]
    lines += [
        f"{c.backend:10s} | {c.kind:7s} | {c.mode:8s} | {c.num_rows:4d} | {c.fill_ms:12.3f} | "
        f"{c.apply_ms:18.3f} | {c.total_ms:13.3f}"
        for c in costs
    ]
    return "\n".join(lines)

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

import json
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


@dataclass
class MaskCost:
    num_rows: int
    fill_ms: float
    """Host time per step filling the rows' bitmask."""
    apply_ms: float
    """Copy to the device and the masking kernel, per step (synchronised)."""

    @property
    def total_ms(self) -> float:
        return self.fill_ms + self.apply_ms


def mask_cost(
    backend: StructuredOutputBackend,
    num_rows: int,
    device: torch.device,
    num_steps: int = 50,
    schema: dict[str, Any] | None = None,
    seed: int = 0,
) -> MaskCost:
    compiled = backend.compile(StructuredOutputsParams(json=schema or BENCH_SCHEMA))
    matchers = [backend.matcher(compiled) for _ in range(num_rows)]
    vocab_size = backend.vocab_size  # type: ignore[attr-defined]
    host = backend.allocate_bitmask(num_rows)  # [rows, words]
    logits = torch.randn(num_rows, vocab_size, device=device)  # [rows, V]
    shifts = torch.arange(32, dtype=torch.int32)  # [32]
    gen = torch.Generator().manual_seed(seed)
    fill_s = apply_s = 0.0
    for step in range(num_steps + 3):  # 3 warm-up steps
        t0 = time.perf_counter()
        backend.fill_rows(matchers, host)
        t1 = time.perf_counter()
        backend.apply_bitmask(logits, host.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        if step >= 3:
            fill_s, apply_s = fill_s + t1 - t0, apply_s + t2 - t1
        bits = ((host.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab_size]  # [R, V]
        picks = torch.multinomial(bits.float() + 1e-12 * (bits == 0), 1, generator=gen)  # [R, 1]
        for i, matcher in enumerate(matchers):
            if not matcher.accept_token(int(picks[i])) or matcher.is_terminated():
                matchers[i] = backend.matcher(compiled)
    return MaskCost(num_rows, 1e3 * fill_s / num_steps, 1e3 * apply_s / num_steps)


def format_costs(costs: list[MaskCost]) -> str:
    lines = ["constrained rows | fill ms/step | copy+apply ms/step | total ms/step"]
    lines += [
        f"{c.num_rows:16d} | {c.fill_ms:12.3f} | {c.apply_ms:18.3f} | {c.total_ms:13.3f}"
        for c in costs
    ]
    return "\n".join(lines)


def as_json(costs: list[MaskCost]) -> str:
    return json.dumps([{**vars(c), "total_ms": c.total_ms} for c in costs])

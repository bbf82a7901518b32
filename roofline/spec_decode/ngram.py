"""Prompt-lookup (n-gram) proposer: continue the request the way its own history continued.

For each request, the last ``n`` tokens (``n`` from ``prompt_lookup_min`` to
``prompt_lookup_max``, the longest that matches wins) are searched for earlier in its prompt and
output; the tokens that followed the most recent earlier occurrence are proposed. All requests
of a step are matched at once in numpy: their token histories sit in one persistent
``[rows, width]`` int32 buffer (a request's new tokens are appended as they arrive, never
recopied), and for ``j = 0 .. n - 1`` one vectorised comparison of the buffer shifted by ``j``
against each row's ``j``-th last token narrows the candidate end positions, so a step costs
``O(n x rows x longest history)`` numpy element operations and no Python per token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from torch import Tensor

from roofline.request import Request
from roofline.spec_decode.proposer import Proposals


class NgramProposer:
    needs_hidden_states = False
    shadows = True
    """Proposing costs host microseconds and no state: measured while speculation is off."""

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._buf = np.zeros((8, 1024), dtype=np.int32)  # [rows, width] token histories
        self._lens = np.zeros(8, dtype=np.int64)  # [rows] tokens held per row
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(7, -1, -1))

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self._lens[row] = 0
                self._free_rows.append(row)

    def _row(self, request: Request) -> int:
        """The request's buffer row with its known tokens appended (grows the buffer)."""
        row = self._rows.get(request.request_id)
        if row is None:
            if not self._free_rows:
                old = self._buf.shape[0]
                self._buf = np.concatenate([self._buf, np.zeros_like(self._buf)])
                self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self._free_rows.pop()
            self._rows[request.request_id] = row
        held = int(self._lens[row])
        num_known = request.num_known_tokens
        if num_known > held:
            if num_known > self._buf.shape[1]:
                width = max(num_known, 2 * self._buf.shape[1])
                grown = np.zeros((self._buf.shape[0], width), dtype=np.int32)
                grown[:, : self._buf.shape[1]] = self._buf
                self._buf = grown
            num_prompt = request.num_prompt_tokens
            if held < num_prompt:
                self._buf[row, held:num_prompt] = request.prompt_token_ids[held:]
                held = num_prompt
            self._buf[row, held:num_known] = request.output_token_ids[held - num_prompt :]
            self._lens[row] = num_known
        return row

    def propose(
        self, requests: list[Request], max_lens: list[int], hidden_states: Tensor | None = None
    ) -> Proposals:
        rows = np.array([self._row(r) for r in requests], dtype=np.int64)  # [B]
        lens = self._lens[rows]  # [B]
        ends = self.match(self._buf[rows, : int(lens.max())], lens)  # [B]
        out: list[list[int]] = []
        for b, (end, max_len) in enumerate(zip(ends.tolist(), max_lens)):
            k = min(self.k, max_len)
            if end < 0 or k <= 0:
                out.append([])
                continue
            stop = min(end + 1 + k, int(lens[b]))
            out.append(self._buf[rows[b], end + 1 : stop].tolist())
        return Proposals(out)

    def match(self, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """End position of the most recent earlier occurrence of each row's longest matching
        suffix (``lookup_min`` .. ``lookup_max`` tokens), or -1. ``tokens``: [B, L]."""
        num_rows, width = tokens.shape
        ar = np.arange(num_rows)
        # candidate end i must leave a following token inside the history: i < len - 1
        cand = np.arange(width)[None, :] < (lens - 1)[:, None]  # [B, L]
        best = np.full(num_rows, -1, dtype=np.int64)
        for j in range(self.lookup_max):
            n = j + 1
            if n > width:
                break
            last_j = tokens[ar, np.maximum(lens - 1 - j, 0)]  # [B] the j-th last token
            cand[:, j:] &= tokens[:, : width - j] == last_j[:, None]
            cand[:, :j] = False
            cand &= (lens > n)[:, None]  # the suffix itself needs n tokens before it
            if n >= self.lookup_min:
                has = cand.any(axis=1)  # [B]
                if not has.any():
                    break  # a longer suffix cannot match where this one does not
                last = width - 1 - np.argmax(cand[:, ::-1], axis=1)  # [B] most recent
                best = np.where(has, last, best)
        return best

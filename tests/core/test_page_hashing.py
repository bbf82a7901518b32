"""Page hashes and keys from a request's own token slices (``_token_slice``) equal those of the
whole-sequence copy they replaced, across the prompt/output boundary; distinct pages never share
a hash, equal prefixes always do."""

from __future__ import annotations

import random

from roofline.core.kv_cache_manager import KVCacheManager, _token_slice, hash_page
from roofline.request import Request
from roofline.sampling_params import SamplingParams

PS = 4


def _chain(tokens: list[int], num_pages: int) -> list[int]:
    hashes: list[int] = []
    for i in range(num_pages):
        hashes.append(
            hash_page(hashes[-1] if hashes else None, tuple(tokens[i * PS : (i + 1) * PS]))
        )
    return hashes


def test_token_slice_equals_the_copied_slice() -> None:
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        req = Request("r", prompt, SamplingParams())
        req.output_token_ids = [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
        tokens = req.all_token_ids
        start = rng.randrange(len(tokens) + 1)
        end = rng.randrange(start, len(tokens) + 3)
        assert _token_slice(req, start, end) == tuple(tokens[start:end])


def test_registered_pages_hash_the_whole_sequence_as_before() -> None:
    rng = random.Random(1)
    kv = KVCacheManager(400, PS, True)
    seen: dict[int, tuple] = {}
    for i in range(40):
        shared = [7, 7, 8, 9, 1, 2, 3, 4] if i % 2 else []
        prompt = shared + [rng.randrange(30) for _ in range(rng.randrange(1, 14))]
        req = Request(f"r{i}", prompt, SamplingParams(), max_tokens=40)
        assert kv.allocate(req, len(prompt), kv.lookup_prefix(req)) is not None
        req.num_computed_tokens = len(prompt)
        for _ in range(rng.randrange(1, 12)):  # decode steps: pages fill across the boundary
            req.output_token_ids.append(rng.randrange(30))
            assert kv.allocate(req, 1) is not None
            req.num_computed_tokens += 1
        tokens = req.all_token_ids
        num_full = min(req.num_computed_tokens, len(tokens)) // PS
        expected = _chain(tokens, num_full)
        assert kv._hashes[req.request_id][:num_full] == expected
        for j, h in enumerate(expected):  # one content per hash, over all requests
            content = tuple(tokens[: (j + 1) * PS])
            assert seen.setdefault(h, content) == content
        for page in kv.get_block_ids(req.request_id)[:num_full]:
            if page in kv._page_key:
                parent, key = kv._page_key[page]
                k = kv._blocks[req.request_id].index(page)
                assert key == tuple(tokens[k * PS : (k + 1) * PS])
                assert parent == (expected[k - 1] if k else None)
    assert len({h for h in seen}) == len(seen)

"""The batches a CUDA runner's start-up warm-up runs, one per kernel variant a serving step can
pick, so that no Triton kernel compiles in the middle of serving.

Shape-dependent launch arguments (row counts, request counts, block-table widths) are left
unspecialized in the kernels; what still selects a compiled variant is the launchers' choice of
kernel and tiles from the step's host lists, which these batches cover:

* the prefill attention kernel's tile rows from the longest chunk (``max_query_len`` up to 16,
  32, 64 and 128 rows, then 128-row tiles for anything longer);
* the GQA-packed kernel (``kernels/prefill_attention_gqa.py``) for steps of mostly short chunks
  (at most ``MAX_QUERY_LEN`` rows), which every batch of the first kind is;
* the descriptor (TMA) kernel for steps of mostly *long* chunks (the default preset's and every
  long prompt's steps), a variant each: fresh chunks only (no prefix code, ``HAS_PREFIX``),
  context read from the pages only, and a chunk over a cached prefix gathered into contiguous
  rows (``kernels/prefix_gather.py``) and read through descriptors too (``PREFIX_TMA``);
* each of those with decode rows first, the split (mixed-step) path's layout, when the runner has
  it (``worker/graph_mode.py``), besides the batches in arrival order; and there, decode rows
  over contexts of 2, 4, .. 64 splits: the decode kernel's split count follows the step's
  longest context, and its merge kernel's tile of partials (the next power of two) is a
  constexpr, so an eagerly run mixed step (one past the graph buckets, as the default preset's
  prefill steps are) with a longer decode context than the warm-up's could compile one mid-run
  unless a graph capture happened to (``tests/kernels/test_warmup_specializations.py``).

A batch is a list of ``(num_cached, num_new)`` per request. Decode rows and short chunks beside
the long chunk keep the step realistic (a 3-token fresh prompt, one-row decodes over 20 and 40
cached tokens) while leaving it "mostly long".
"""

from __future__ import annotations

WarmupBatch = list[tuple[int, int]]
"""(cached tokens, new tokens) per request of one warm-up step."""

SHORT_CHUNKS = (16, 32, 64, 128)
"""Longest chunk of each short warm-up step: one per tile size of ``prefill_attention``."""


def long_chunk_len() -> int:
    """New tokens of the long warm-up chunks: past the GQA-packed kernel's "short" bound, so
    the step takes the per-head (descriptor) kernel."""
    from roofline.kernels.prefill_attention_gqa import MAX_QUERY_LEN

    return MAX_QUERY_LEN + 17


def warmup_batches(
    num_tokens: int, max_len: int, page_size: int, num_pages: int, split: bool
) -> list[WarmupBatch]:
    """The CUDA warm-up's steps: one small fresh prefill of ``num_tokens``, then where a
    128-row chunk over 16 cached tokens fits ``max_len`` (the context bound), those of the
    module docstring that fit it and ``num_pages``. ``split``: the runner lays mixed steps out
    decode-first (its split path), so each batch runs in that order too."""
    first = [(0, max(1, min(num_tokens, max_len)))]
    if 16 + max(SHORT_CHUNKS) > max_len:
        return [first]
    long_len = long_chunk_len()
    chunks = list(SHORT_CHUNKS) + ([long_len] if 16 + long_len <= max_len else [])
    # (cached, new) per request: 16 cached tokens before the chunk, decode rows, a short prompt
    batches = [first] + [[(0, q)] for q in (128, long_len) if q <= max_len]
    batches += [[(16, q), (40, 1), (0, 3), (20, 1)] for q in chunks]
    if long_len in chunks:  # prefix code variants beside a long chunk (module docstring)
        batches += [
            [(40, 1), (0, long_len), (16, 3)],  # context, none gathered: paged prefix only
            [(16, long_len), (0, 3)],  # a gathered prefix alone (the split path's prefill part)
        ]
    if split:  # decode rows first: the split path's kernels too
        batches += [[(40, 1), (20, 1), (16, q), (0, 3)] for q in chunks]
        if long_len in chunks:
            batches.append([(40, 1), (0, long_len)])
        batches += [[(n - 1, 1), (0, 3)] for n in _split_contexts(max_len)]
    return [b for b in batches if _pages(b, page_size) <= num_pages]


def _split_contexts(max_len: int) -> list[int]:
    """Decode contexts whose split counts (``2, 4, ..`` up to the decode kernel's most) take
    every merge tile the decode kernel can pick."""
    from roofline.kernels.decode_attention import MAX_NUM_SPLITS, MIN_TOKENS_PER_SPLIT

    out, splits = [], 2
    while splits <= MAX_NUM_SPLITS and splits * MIN_TOKENS_PER_SPLIT <= max_len:
        out.append(splits * MIN_TOKENS_PER_SPLIT)
        splits *= 2
    return out


def _pages(batch: WarmupBatch, page_size: int) -> int:
    return sum(-(-(cached + new) // page_size) for cached, new in batch)

"""``echo`` and ``prompt_logprobs`` on ``/v1/completions``: the prompt (and its tokens'
logprobs) in front of a choice, as evaluation harnesses read it to score log-likelihoods.

With ``echo`` the choice's text starts with the prompt; with ``echo`` and ``logprobs`` its
legacy logprobs object starts with one entry per prompt token (``token_logprobs[0]`` and
``top_logprobs[0]`` are None: the first token has no distribution), then the completion's
entries, whose ``text_offset`` continue after the prompt. ``prompt_logprobs`` (vLLM's field)
adds each choice's ``prompt_logprobs``: per prompt token, token id -> ``{logprob, rank,
decoded_token}``. Both come from ``RequestOutput.prompt_logprobs`` (the engine computes them
when ``SamplingParams.prompt_logprobs`` is set, ``worker/prompt_logprobs.py``).
"""

from __future__ import annotations

from typing import Any

from roofline.entrypoints.openai.serving_base import ranked
from roofline.outputs import Logprob, RequestOutput


def prompt_text(state: Any, output: RequestOutput) -> str:
    """The prompt as text: the string the client sent, else its ids decoded."""
    if output.prompt is not None:
        return output.prompt
    tok = state.engine.tokenizer
    ids = output.prompt_token_ids
    return "".join(f"<{t}>" for t in ids) if tok is None else tok.decode(ids)


def _token_text(state: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return state.engine.decode_token(token_id)


def echo_logprobs(
    state: Any, output: RequestOutput, k: int, completion: dict[str, list] | None
) -> dict[str, list]:
    """The prompt tokens' legacy logprob entries followed by ``completion``'s (shifted)."""
    steps = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = 0
    for tid, step in zip(output.prompt_token_ids, steps, strict=True):
        if step is None:
            text, logprob, top = _token_text(state, tid, None), None, None
        else:
            names = {t: _token_text(state, t, lp) for t, lp in step.items()}
            (text, logprob), top_list = ranked(step, tid, k, names)
            top = dict(top_list) if k > 0 else None
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    out = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
    if completion is not None:
        shift = len(prompt_text(state, output))
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += completion[key]
        out["text_offset"] += [o + shift for o in completion["text_offset"]]
    return out


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in step.items()
        }
        for step in output.prompt_logprobs
    ]

"""The offline API, named after vLLM's so users switch without relearning.

``LLM(model=...)`` builds an engine; ``generate(prompts, SamplingParams | list)`` and
``chat(messages | list of conversations)`` run them to completion in one continuous batch and
return ``RequestOutput``s in the order of the prompts.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from roofline.engine.args import EngineArgs
from roofline.engine.heap import frozen_heap
from roofline.engine.llm_engine import LLMEngine
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {sorted(unknown)}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _broadcast_params(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")
        ids, early = self._add(prompt_list, params, priority)
        return self._run(ids, use_tqdm, early)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str = "auto",
    ) -> list[RequestOutput]:
        """Generate replies to conversations. With ``tools`` (OpenAI's function definitions)
        and ``tool_choice`` (``none``, ``auto``, ``required`` or a named function) the tools
        are rendered into the prompt as the server does, ``required`` / a named function
        constrain the output to parseable calls, and each completion carries the parsed
        ``tool_calls`` and its ``content`` (``roofline.entrypoints.chat_tools``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        engine = self.llm_engine
        prompts: list[PromptType] = []
        plans = []
        for conv in convs:
            if tools is None and tool_choice is None:
                text = engine.apply_chat_template(list(conv), add_generation_prompt)
                plans.append(None)
            else:
                from roofline.entrypoints.chat_tools import prepare_chat

                text, plan = prepare_chat(
                    engine,
                    list(conv),
                    tools,
                    tool_choice,
                    parallel_tool_calls,
                    add_generation_prompt,
                )
                plans.append(plan)
            ids = list(engine.tokenizer(text, add_special_tokens=False).input_ids)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        if not any(p is not None for p in plans):
            return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        from roofline.entrypoints.chat_tools import attach_tool_calls, tool_sampling_params

        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            given = [sampling_params or SamplingParams()] * len(prompts)
        else:
            given = list(sampling_params)
        template = getattr(engine.tokenizer, "chat_template", None)
        pairs = [
            tool_sampling_params(
                plan, p, tool_call_parser, template if isinstance(template, str) else None
            )
            for plan, p in zip(plans, given)
        ]
        outputs = self.generate(prompts, [p for p, _ in pairs], use_tqdm=use_tqdm)
        attach_tool_calls(outputs, [m for _, m in pairs])
        return outputs

    def _add(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
    ) -> tuple[list[str], list[RequestOutput]]:
        """Add the prompts; the ids and the outputs of a step taken meanwhile. With async
        scheduling (FCFS, no priorities) the first step is launched as soon as the prompts
        added fill a step's token budget, so the device computes it while the rest are added
        (adding 1,000 short prompts left the H100 idle ~0.3 s before its first step)."""
        engine = self.llm_engine
        ids: list[str] = []
        early: list[RequestOutput] = []
        start_at = None
        if engine.async_scheduling and priority is None:
            config = engine.scheduler.config
            start_at = config.max_num_batched_tokens if config.policy == "fcfs" else None
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                text, token_ids = _unpack(prompt)
                num_tokens = engine.add_request(
                    rid,
                    token_ids if token_ids is not None else text,
                    p,
                    priority=priority[i] if priority is not None else 0,
                    prompt_text=text,
                    stream=False,
                )
                ids.append(rid)
                if start_at is not None:
                    start_at -= num_tokens
                    if start_at <= 0 and i + 1 < len(prompts):  # the first step's prompts
                        early, start_at = engine.step(), None
        except Exception:
            engine.abort_request(ids)  # a bad prompt leaves nothing half-queued
            raise
        return ids, early

    def _run(
        self, ids: list[str], use_tqdm: bool, early: list[RequestOutput] | None = None
    ) -> list[RequestOutput]:
        """Step until every request in ``ids`` has finished (``early``: outputs of a step
        taken while they were added)."""
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids),
            desc="Processed prompts",
            unit="req",
            file=sys.stderr,
            disable=not use_tqdm or len(ids) < 2,
            dynamic_ncols=True,
        )
        start, out_tokens = time.perf_counter(), 0
        try:
            with frozen_heap():  # no full-heap GC pauses between steps
                outputs = early or []
                while pending:
                    for out in outputs:
                        if out.finished and out.request_id in pending:
                            pending.discard(out.request_id)
                            finished[out.request_id] = out
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                            bar.update(1)
                            bar.set_postfix_str(
                                f"out {out_tokens / (time.perf_counter() - start):.1f} tok/s"
                            )
                    if pending:
                        outputs = engine.step()
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single list of token ids
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _unpack(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), None if ids is None else list(ids)
    return None, list(prompt)


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(num_prompts)]
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return params

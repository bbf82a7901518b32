"""Pydantic models of the OpenAI API subset roofline serves, with validation at the edge.

Requests are parsed strictly (no string-to-number coercion, no NaN), unknown fields are
ignored, and every sampling field is checked again by ``SamplingParams`` when the request is
converted (:meth:`_SamplingRequest.to_sampling_params`). Features we do not implement
(``suffix``, ``best_of``, ``logit_bias``, non-text content) are refused with a 400 rather than
silently ignored. Output constraints (``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` fields) become ``SamplingParams.structured_outputs``; tools are validated by
:mod:`roofline.entrypoints.openai.tools`. Response models document the answers' shape in
the OpenAPI schema; streamed chunks are built as plain dicts by the handlers.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from roofline.entrypoints.openai.errors import OpenAIError
from roofline.sampling_params import MAX_LOGPROBS, SamplingParams
from roofline.structured_output.params import StructuredOutputsParams

MAX_PROMPTS = 256
"""Most prompts one completions request may batch."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: every chunk carries the usage so far (benchmarks count tokens with it,
    also where the text is empty, e.g. models without a tokenizer)."""


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for (at most one field may ask)."""
        asked: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise OpenAIError(
                    400,
                    "response_format json_schema needs json_schema.schema",
                    param="response_format",
                )
            asked.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                asked.append((f"guided_{name}", {name: value}))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(n for n, _ in asked)
            raise OpenAIError(
                400, f"set only one output constraint, got {names}", param=asked[1][0]
            )
        field, spec = asked[0]
        allowed = {"json", "regex", "choice", "grammar", "json_object"}
        unknown = set(spec) - allowed
        if unknown:
            raise OpenAIError(400, f"{field}: unknown keys {sorted(unknown)}", param=field)
        try:
            return StructuredOutputsParams(**spec, field_name=field)
        except (TypeError, ValueError) as e:
            raise OpenAIError(400, str(e), param=field) from e

    def _base_checks(self) -> None:
        if self.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        if self.stop_token_ids is not None and len(self.stop_token_ids) > 1024:
            raise OpenAIError(
                400, "stop_token_ids may hold at most 1024 ids", param="stop_token_ids"
            )

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build validated ``SamplingParams`` (raises ``ValueError`` naming the field)."""
        self._base_checks()

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=pick(self.stop, []),
            stop_token_ids=pick(self.stop_token_ids, []),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    """Return the prompt before the completion (with ``logprobs``: the prompt tokens' logprobs
    first, None for the first token), for log-likelihood scoring as evaluation harnesses do."""
    prompt_logprobs: int | None = None
    """vLLM's extension: each choice's ``prompt_logprobs``, one dict per prompt token."""
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, "best_of must equal n (or be omitted)", param="best_of")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        params = self.sampling_params(max_tokens, self.logprobs)
        wanted = [self.prompt_logprobs]
        if self.echo and self.logprobs is not None:
            wanted.append(self.logprobs)
        if any(w is not None for w in wanted):
            params.prompt_logprobs = max(w for w in wanted if w is not None)
            params.__post_init__()  # validates the prompt_logprobs range
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a string, ids, or a batch of either)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        elif isinstance(p[0], int):
            out = [p]  # type: ignore[list-item]
        else:
            out = list(p)  # type: ignore[arg-type]
        if len(out) > MAX_PROMPTS:
            raise OpenAIError(
                400, f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", param="prompt"
            )
        for one in out:
            if len(one) == 0:
                raise OpenAIError(
                    400, "prompt must not be empty", param="prompt", code="invalid_value"
                )
        return out


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    """Deprecated function calling: refused (``guards.refuse_legacy_functions``)."""
    function_call: Any | None = None
    parallel_tool_calls: bool | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise OpenAIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise OpenAIError(
                    400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs"
                )
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


# --------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    """vLLM's shape: per prompt token (None for the first), token id -> {logprob, rank,
    decoded_token}."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "roofline"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

"""Request and response bodies of the OpenAI-compatible API.

Requests are typed strictly (a string where a number belongs is a 422, not a silent
coercion) but stay open to fields we do not model: OpenAI's SDKs and agent frameworks
send plenty (``user``, ``metadata``, ``store``...), and vLLM ignores those too.
Values are range-checked later by ``SamplingParams.validate`` and the chat encoder,
whose messages name the field, so that there is one source of truth for each rule.
Fields that change what is generated but are not implemented are rejected (400) by
``unsupported()`` instead of being ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

# --- requests ----------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: StrictStr | None = None
    # "schema" shadows a BaseModel attribute; the wire name stays "schema".
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class _GenerationRequest(BaseModel):
    """Fields shared by both endpoints: OpenAI's, plus vLLM's sampling extensions."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) of the first field whose value we cannot honour."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def guided_fields(self) -> dict[str, Any]:
        """The vLLM structured-output extensions that were given."""
        names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # DeepSeek-API style switch: a bool or {"type": "enabled" | "disabled"} (chat_format checks it)
    thinking: StrictBool | dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        return super().unsupported()


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for this endpoint
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of must equal n ({self.n}); sampling more than n is not supported"
        return super().unsupported()


# --- responses -----------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsv4"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str


class ToolCall(BaseModel):
    index: int | None = None  # streaming deltas only
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message or a streaming delta; dumped with ``exclude_unset`` so that a delta
    carries only what changed while a message keeps its explicit nulls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage | None = None  # non-streaming
    delta: ChatMessage | None = None  # streaming
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

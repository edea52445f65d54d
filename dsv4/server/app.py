"""The OpenAI-compatible HTTP API (FastAPI) in front of an ``AsyncEngine``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Every error, including FastAPI's own validation
errors and unknown routes, has OpenAI's body ``{"error": {"message", "type", "param",
"code"}}`` so that the official clients raise their usual exceptions; ``param`` names
the offending request field.

Everything that can be refused is checked before the engine sees the request, so a
bad request is a 400 even when streaming (the SSE response starts only after the
engine admitted the request).

Forced tool calls (``tool_choice`` "required" or a named function) are steered with a
JSON-schema grammar, as vLLM does, not with DSML: the grammar only admits the
tokenizer's plain tokens, and DSML markers are added tokens. The model is made to write
the arguments object (named) or a list of ``{"name", "parameters"}`` (required), which
is converted to ``tool_calls``; the arguments therefore always validate against the
tool's schema. ``parallel_tool_calls: false`` limits "required" to one call; with
"auto" it is not enforced. With thinking on, every grammar (this one and
``response_format``) applies only after ``</think>``. JSON grammars admit only
``json.dumps``' one-line layout (see ``OpenAIServer.__init__``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4.engine.async_engine import (
    FINISH_ABORT,
    AsyncEngine,
    EngineClosedError,
    EngineStepError,
    RequestStream,
)
from dsv4.engine.detokenizer import TokenBytes
from dsv4.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.structured import (
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    StructuredOutputError,
    find_reasoning_end_token_ids,
    spec_from_openai,
)
from dsv4.server.chat_format import (
    chat_options_from_request,
    encode_chat,
    generation_starts_in_reasoning,
)
from dsv4.server.metrics import (
    STATUS_ABORT,
    STATUS_ERROR,
    STATUS_SUCCESS,
    RequestMetrics,
    ServerMetrics,
)
from dsv4.server.output_parser import (
    ContentDelta,
    ParsedOutput,
    ParserEvent,
    ReasoningDelta,
    StreamingOutputParser,
    ToolCallDelta,
    new_tool_call_id,
    tool_parsing_enabled,
)
from dsv4.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Logprobs are clamped like vLLM's: JSON has no -inf, and clients expect a number.
_MIN_LOGPROB = -9999.0
# "<field path>: <reason>", the convention of every ValueError raised for bad input.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _bad_request(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ``ValueError`` whose message starts with the offending field."""
    message = str(exc)
    match = _FIELD_PREFIX.match(message)
    param = match.group(1) if match else None
    if param is not None and rename and param in rename:
        param = rename[param]
        message = f"{param}: {message[match.end():]}"
    return APIError(400, message, param)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_error_type(status), param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(exclude_unset=True), media_type="application/json")


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


class _EngineStreamResponse(StreamingResponse):
    """Closes the body generator however the response ends.

    When a client disconnects, Starlette cancels the sending task, which can leave the
    generator suspended at a ``yield`` until garbage collection. Closing it here runs
    its ``finally`` (the engine abort) right away.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client goes away first; then cancel it (which aborts its
    engine requests). A non-streaming response would otherwise keep generating for
    nobody."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let its cleanup run before the caller's
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()


def _usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _release(streams: list[RequestStream], trackers: list[RequestMetrics]) -> None:
    """Abort what did not finish (the client left or an error cut in) and count it as
    aborted; both steps are no-ops for requests that already ended. Callers run this in
    ``finally``: a cancelled task may never have started the code that would clean up."""
    for stream in streams:
        stream.abort()
    for tracker in trackers:
        tracker.finish(STATUS_ABORT)


def _status(output: RequestOutput) -> str:
    return STATUS_ABORT if any(c.finish_reason == FINISH_ABORT for c in output.outputs) else STATUS_SUCCESS


@dataclass
class _ForcedToolCalls:
    """How to read the grammar-forced answer of ``tool_choice`` "required" or named."""

    function: str | None  # named: the answer is this function's arguments; None: a list of calls

    def events(self, text: str) -> list[ParserEvent]:
        """Tool-call events for the answer; the text itself if it is not a complete
        answer (generation cut short by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return [ContentDelta(text)] if text else []
        if self.function is not None:
            calls = [(self.function, value)]
        else:
            try:
                calls = [(c["name"], c["parameters"]) for c in value]
            except (KeyError, TypeError):  # only if the grammar was not applied
                return [ContentDelta(text)]
        events: list[ParserEvent] = []
        for index, (name, arguments) in enumerate(calls):
            events.append(ToolCallDelta(index, "", new_tool_call_id(), name))
            events.append(ToolCallDelta(index, json.dumps(arguments, ensure_ascii=False)))
        return events


class _ChatChoiceState:
    """One chat choice's output parsing, shared by streaming and non-streaming."""

    def __init__(self, starts_in_reasoning: bool, parse_tool_calls: bool, forced: _ForcedToolCalls | None) -> None:
        self._parser = StreamingOutputParser(
            starts_in_reasoning=starts_in_reasoning, parse_tool_calls=parse_tool_calls and forced is None
        )
        self._forced = forced
        self._answer = ""  # forced mode: the JSON answer, converted once complete
        self.has_tool_calls = False
        self.logprobs_sent = 0
        self.finished = False

    def feed(self, text: str, finished: bool) -> list[ParserEvent]:
        events = self._parser.feed(text) if text else []
        if finished:
            self.finished = True
            events += self._parser.finish()
        if self._forced is not None:
            self._answer += "".join(e.text for e in events if isinstance(e, ContentDelta))
            events = [e for e in events if not isinstance(e, ContentDelta)]
            if finished:
                events += self._forced.events(self._answer)
        self.has_tool_calls = self.has_tool_calls or any(isinstance(e, ToolCallDelta) for e in events)
        return events

    def finish_reason(self, completion: CompletionOutput) -> str | None:
        if completion.finish_reason == "stop" and self.has_tool_calls:
            return "tool_calls"
        return completion.finish_reason


def _chat_delta(events: list[ParserEvent]) -> ChatMessage | None:
    """One streaming delta holding all of a step's events (calls merged per index)."""
    if not events:
        return None
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[ToolCall] = []
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        if event.id is None and calls and calls[-1].index == event.index:
            calls[-1].function.arguments += event.arguments
        elif event.id is None:
            calls.append(ToolCall(index=event.index, function=FunctionCall(arguments=event.arguments)))
        else:
            function = FunctionCall(name=event.name, arguments=event.arguments)
            calls.append(ToolCall(index=event.index, id=event.id, type="function", function=function))
    delta = ChatMessage()
    if reasoning:
        delta.reasoning_content = reasoning
    if content:
        delta.content = content
    if calls:
        delta.tool_calls = calls
    return delta


class OpenAIServer:
    """Request handling; ``create_app`` wires it to routes."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(served_model_name, engine.stats)
        self.created = int(time.time())
        self._token_bytes = TokenBytes(self.tokenizer.backend)
        # JSON is held to json.dumps' one-line layout: the layout in which the chat encoder
        # shows the model every JSON value (tool schemas, arguments), and one in which a
        # weak or confused model cannot burn its token budget on whitespace.
        self._grammars = GrammarCompiler(
            self.tokenizer, engine.model_config.vocab_size, eos_token_id=self.tokenizer.eos_id, any_whitespace=False
        )
        self._reasoning_end_ids = find_reasoning_end_token_ids(self.tokenizer)

    def close(self) -> None:
        """Stop the grammar compile threads."""
        self._grammars.close()

    # ------------------------------------------------------------------ endpoints

    def models(self) -> ModelList:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len)
        return ModelList(object="list", data=[card])

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        tracker = self.metrics.track()
        self._check_common(req)
        forced = self._forced_tool_calls(req)
        try:
            options = chat_options_from_request(
                {k: getattr(req, k) for k in ("chat_template_kwargs", "thinking", "reasoning_effort")}
            )
            prompt = encode_chat(
                req.messages, req.tools, thinking=options.thinking, reasoning_effort=options.reasoning_effort
            )
        except ValueError as exc:
            raise _bad_request(exc) from None
        prompt_ids = self.tokenizer.encode(prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self._sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            rename={"logprobs": "top_logprobs", "max_tokens": max_tokens_field},
        )
        self._check_length(len(prompt_ids), max_tokens, "messages", max_tokens_field)
        starts_in_reasoning = generation_starts_in_reasoning(prompt)
        spec = forced[1] if forced is not None else self._spec(req)
        grammar = await self._grammar(spec, starts_in_reasoning)

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._admit(request_id, prompt_ids, params, req, grammar)
        parse_tools = tool_parsing_enabled(req.tool_choice, req.tools)
        states = [
            _ChatChoiceState(starts_in_reasoning, parse_tools, forced[0] if forced else None)
            for _ in range(params.n)
        ]
        created = int(time.time())
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = self._chat_events(request_id, created, stream, tracker, states, req.logprobs, include_usage)
            return _EngineStreamResponse(events, media_type="text/event-stream")
        try:
            final = await _cancel_on_disconnect(http, self._collect(stream, tracker))
        finally:
            _release([stream], [tracker])
        choices = []
        for completion in final.outputs:
            state = states[completion.index]
            message = ParsedOutput.from_events(state.feed(completion.text, True)).to_message()
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=ChatMessage(**message),
                    logprobs=self._chat_logprobs(completion.logprobs or []) if req.logprobs else None,
                    finish_reason=state.finish_reason(completion),
                    stop_reason=completion.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            object="chat.completion",
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage([final]),
        )
        return _json(response)

    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        self._check_common(req)
        prompts = self._completion_prompts(req.prompt)
        params = self._sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        for prompt_ids in prompts:
            self._check_length(len(prompt_ids), req.max_tokens, "prompt", "max_tokens")
        grammar = await self._grammar(self._spec(req), False)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        trackers = [self.metrics.track() for _ in prompts]
        try:
            for i, prompt_ids in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self._admit(sub_id, prompt_ids, params, req, grammar))
        except BaseException:
            _release(streams, trackers)
            raise
        created = int(time.time())
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            events = self._completion_events(request_id, created, streams, trackers, params.n, include_usage)
            return _EngineStreamResponse(events, media_type="text/event-stream")

        async def collect_all() -> list[RequestOutput]:
            return list(await asyncio.gather(*(self._collect(s, t) for s, t in zip(streams, trackers))))

        try:
            finals = await _cancel_on_disconnect(http, collect_all())
        finally:
            _release(streams, trackers)
        choices = [
            CompletionChoice(
                index=i * params.n + c.index,
                text=c.text,
                logprobs=self._completion_logprobs(c.logprobs or [], 0) if req.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, final in enumerate(finals)
            for c in final.outputs
        ]
        response = CompletionResponse(
            id=request_id,
            object="text_completion",
            created=created,
            model=self.model_name,
            choices=choices,
            usage=_usage(finals),
        )
        return _json(response)

    # ------------------------------------------------------------------ validation

    def _check_common(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model: the model {req.model!r} does not exist", "model", "model_not_found")
        problem = req.unsupported()
        if problem is not None:
            raise APIError(400, f"{problem[0]}: {problem[1]}", problem[0])

    def _sampling_params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        rename: dict[str, str] | None = None,
    ) -> SamplingParams:
        """vLLM's mapping of request fields; unset fields keep SamplingParams' defaults."""
        given = {
            name: getattr(req, name)
            for name in (
                "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
            )
            if getattr(req, name) is not None
        }
        try:
            return SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                **given,
            )
        except ValueError as exc:
            raise _bad_request(exc, rename) from None

    def _check_length(self, prompt_len: int, max_tokens: int | None, prompt_field: str, max_tokens_field: str) -> None:
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise APIError(400, f"{prompt_field}: the prompt is empty", prompt_field)
        if prompt_len >= limit:
            raise APIError(
                400,
                f"{prompt_field}: the prompt is {prompt_len} tokens; the model's maximum context length is "
                f"{limit} tokens, including at least one generated token",
                prompt_field,
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"{max_tokens_field}: the prompt ({prompt_len} tokens) plus {max_tokens_field} ({max_tokens}) "
                f"exceeds the model's maximum context length of {limit} tokens",
                max_tokens_field,
            )

    def _completion_prompts(self, prompt: str | list) -> list[list[int]]:
        """Token ids of each prompt: text is tokenised with BOS, as vLLM does; token-id
        prompts are taken as given (the caller owns BOS), after a range check."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = prompt
        token_ids = []
        vocab = self.engine.model_config.vocab_size
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                token_ids.append(self.tokenizer.encode(p, add_bos=True))
                continue
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt: token id {bad} (prompt {i}) is outside the vocabulary [0, {vocab})", "prompt")
            token_ids.append(list(p))
        return token_ids

    def _spec(self, req: ChatCompletionRequest | CompletionRequest) -> GrammarSpec | None:
        response_format = req.response_format.model_dump(by_alias=True) if req.response_format else None
        extra = req.guided_fields()
        if req.model_extra and "structured_outputs" in req.model_extra:
            extra["structured_outputs"] = req.model_extra["structured_outputs"]
        try:
            return spec_from_openai(response_format, extra)
        except StructuredOutputError as exc:
            raise _bad_request(exc) from None

    def _forced_tool_calls(self, req: ChatCompletionRequest) -> tuple[_ForcedToolCalls, GrammarSpec] | None:
        """The grammar and reader for "required" or a named tool; None otherwise."""
        tool_choice = req.tool_choice
        if tool_choice in (None, "none", "auto"):
            return None
        if not req.tools:
            raise APIError(400, "tool_choice: requires tools", "tool_choice")
        if req.response_format is not None or req.guided_fields():
            raise APIError(400, "tool_choice: cannot force a tool call together with a structured output", "tool_choice")
        schemas: dict[str, tuple[int, Any]] = {}
        for i, tool in enumerate(req.tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                schemas[function["name"]] = (i, function.get("parameters") or {"type": "object"})
        try:
            if tool_choice == "required":
                variants = [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": parameters},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for name, (_, parameters) in schemas.items()
                ]
                schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
                if req.parallel_tool_calls is False:
                    schema["maxItems"] = 1
                return _ForcedToolCalls(None), GrammarSpec("json_schema", schema, field="tools")
            name = tool_choice.function.name
            if name not in schemas:
                raise APIError(400, f"tool_choice.function.name: no tool named {name!r}", "tool_choice.function.name")
            index, parameters = schemas[name]
            spec = GrammarSpec("json_schema", parameters, field=f"tools[{index}].function.parameters")
            return _ForcedToolCalls(name), spec
        except StructuredOutputError as exc:
            raise _bad_request(exc) from None

    async def _grammar(
        self, spec: GrammarSpec | None, starts_in_reasoning: bool
    ) -> Callable[[], GrammarMatcher] | None:
        """Compile (off the event loop, cached per spec) and return a matcher factory."""
        if spec is None:
            return None
        try:
            compiled = await asyncio.wrap_future(self._grammars.compile_async(spec))
        except StructuredOutputError as exc:
            raise _bad_request(exc) from None
        end_ids = self._reasoning_end_ids
        return lambda: GrammarMatcher(compiled, reasoning_end_token_ids=end_ids, starts_in_reasoning=starts_in_reasoning)

    # ------------------------------------------------------------------ engine I/O

    async def _admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        req: ChatCompletionRequest | CompletionRequest,
        grammar: Callable[[], GrammarMatcher] | None,
    ) -> RequestStream:
        try:
            return await self.engine.add_request(
                request_id, prompt_ids, params, cache_salt=req.cache_salt, priority=req.priority, grammar=grammar
            )
        except EngineClosedError as exc:
            raise APIError(503, str(exc)) from None
        except ValueError as exc:
            raise _bad_request(exc) from None

    async def _collect(self, stream: RequestStream, tracker: RequestMetrics) -> RequestOutput:
        """Run a request to the end; returns its final output."""
        try:
            async for output in stream:
                tracker.on_output(output, stream.produced_at)
        except (EngineStepError, EngineClosedError) as exc:
            tracker.finish(STATUS_ERROR)
            raise APIError(500, str(exc)) from None
        tracker.finish(_status(output))
        return output

    async def _chat_events(
        self,
        request_id: str,
        created: int,
        stream: RequestStream,
        tracker: RequestMetrics,
        states: list[_ChatChoiceState],
        logprobs: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChoice], usage: Usage | None = None) -> str:
            response = ChatCompletionResponse(
                id=request_id, object="chat.completion.chunk", created=created, model=self.model_name, choices=choices
            )
            if usage is not None:
                response.usage = usage
            return _sse(response)

        try:
            yield chunk(
                [
                    ChatChoice(index=i, delta=ChatMessage(role="assistant", content=""), logprobs=None, finish_reason=None)
                    for i in range(len(states))
                ]
            )
            final = None
            async for output in stream:
                tracker.on_output(output, stream.produced_at)
                final = output
                for completion in output.outputs:
                    state = states[completion.index]
                    if state.finished:
                        continue
                    delta = _chat_delta(state.feed(completion.text_delta, completion.finished))
                    new_logprobs = None
                    if logprobs and completion.logprobs:
                        new_logprobs = self._chat_logprobs(completion.logprobs[state.logprobs_sent :])
                        state.logprobs_sent = len(completion.logprobs)
                    if delta is None and not completion.finished and not (new_logprobs and new_logprobs.content):
                        continue
                    choice = ChatChoice(
                        index=completion.index,
                        delta=delta or ChatMessage(),
                        logprobs=new_logprobs,
                        finish_reason=state.finish_reason(completion),
                    )
                    if completion.finished:
                        choice.stop_reason = completion.stop_reason
                    yield chunk([choice])
            tracker.finish(_status(final))
            if include_usage:
                yield chunk([], _usage([final]))
            yield _SSE_DONE
        except (EngineStepError, EngineClosedError) as exc:
            tracker.finish(STATUS_ERROR)
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(exc), type=_error_type(500))))
            yield _SSE_DONE
        finally:
            _release([stream], [tracker])

    async def _completion_events(
        self,
        request_id: str,
        created: int,
        streams: list[RequestStream],
        trackers: list[RequestMetrics],
        n: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            response = CompletionResponse(
                id=request_id, object="text_completion", created=created, model=self.model_name, choices=choices
            )
            if usage is not None:
                response.usage = usage
            return _sse(response)

        finals: list[RequestOutput | None] = [None] * len(streams)
        logprobs_sent = [[0] * n for _ in streams]
        text_sent = [[0] * n for _ in streams]
        try:
            async for i, output, produced_at in _merge(streams):
                trackers[i].on_output(output, produced_at)
                finals[i] = output
                for c in output.outputs:
                    if not c.text_delta and not c.token_ids_delta and not c.finished:
                        continue
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs = self._completion_logprobs(c.logprobs[logprobs_sent[i][c.index] :], text_sent[i][c.index])
                        logprobs_sent[i][c.index] = len(c.logprobs)
                    text_sent[i][c.index] += len(c.text_delta)
                    choice = CompletionChoice(
                        index=i * n + c.index,
                        text=c.text_delta,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                    )
                    if c.finished:
                        choice.stop_reason = c.stop_reason
                    yield chunk([choice])
                if output.finished:
                    trackers[i].finish(_status(output))
            if include_usage:
                yield chunk([], _usage(finals))
            yield _SSE_DONE
        except (EngineStepError, EngineClosedError) as exc:
            for tracker in trackers:
                tracker.finish(STATUS_ERROR)
            yield _sse(ErrorResponse(error=ErrorInfo(message=str(exc), type=_error_type(500))))
            yield _SSE_DONE
        finally:
            _release(streams, trackers)

    # ------------------------------------------------------------------ logprobs

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._token_bytes[token_id]
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text, raw = self._token_text(entry.token_id)
            top = []
            for token_id, logprob in entry.top:
                top_text, top_raw = self._token_text(token_id)
                top.append(TopLogprob(token=top_text, logprob=max(logprob, _MIN_LOGPROB), bytes=top_raw))
            content.append(
                ChatTokenLogprob(token=text, logprob=max(entry.logprob, _MIN_LOGPROB), bytes=raw, top_logprobs=top)
            )
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        """OpenAI's legacy layout; ``offset`` is where the first entry's text starts."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            text, _ = self._token_text(entry.token_id)
            tokens.append(text)
            logprobs.append(max(entry.logprob, _MIN_LOGPROB))
            tops.append({self._token_text(t)[0]: max(lp, _MIN_LOGPROB) for t, lp in entry.top})
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput, float]]:
    """Interleave several requests' outputs as they arrive: (prompt index, output, produced_at)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output, streams[0].produced_at
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None, float]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output, stream.produced_at))
        except Exception as exc:
            queue.put_nowait((i, exc, 0.0))
        queue.put_nowait((i, None, 0.0))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, produced_at = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item, produced_at
    finally:
        for task in tasks:
            task.cancel()


class _ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*``.

    Plain ASGI rather than a FastAPI dependency so that it answers before the body is
    parsed (a bad key is a 401 even for malformed JSON), and rather than Starlette's
    ``BaseHTTPMiddleware``, which would sit between streaming responses and the client.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = _error_response(
                    401, "invalid or missing API key (send Authorization: Bearer <key>)", code="invalid_api_key"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn, with a shutdown that ends in-flight requests cleanly.

    On a shutdown signal uvicorn stops accepting connections and waits for the open
    ones; meanwhile the engine stops admitting requests, lets the running ones go on for
    ``grace_s`` seconds and then aborts the rest, so every stream still ends with a
    final chunk (finish_reason "abort") and ``[DONE]`` rather than a cut connection.
    uvicorn's own deadline, a few seconds later, only catches clients that stall.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float) -> None:
        config.timeout_graceful_shutdown = grace_s + 5.0
        super().__init__(config)
        self._engine = engine
        self._grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(asyncio.to_thread(self._engine.shutdown, self._grace_s))
        try:
            await super().shutdown(sockets)
        finally:
            await drain


def create_app(engine: AsyncEngine, *, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine is shut down with the app (serve it
    with ``DrainingServer`` to let in-flight requests end cleanly first).

    ``api_key``: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``
    (``/health`` and ``/metrics`` stay open for probes and scrapers, as in vLLM).
    """
    server = OpenAIServer(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown)  # a no-op after DrainingServer's drain
        server.close()

    app = FastAPI(title="dsv4", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        if first.get("type") == "json_invalid":
            return _error_response(422, f"invalid JSON: {first.get('msg')}", None, "json_invalid")
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        return _error_response(422, f"{where}: {first.get('msg')}", param, first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(500, f"internal error: {exc!r}")

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return _error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(server.models().model_dump())

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await server.completions(req, request)

    return app

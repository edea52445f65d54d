"""The server as the official ``openai`` client sees it, over real HTTP."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import MODEL_NAME
from prometheus_client.parser import text_string_to_metric_families

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"}
    assert args["city"] in WEATHER["properties"]["city"]["enum"]
    assert args["days"] in WEATHER["properties"]["days"]["enum"]


def test_chat(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.message.role == "assistant"
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.completion_tokens <= 8 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_non_stream(client):
    """Same greedy request streamed: deltas add up to the same text; include_usage
    sends a final usage-only chunk."""
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) <= 2 and isinstance(entry.bytes, list)


def test_completions_with_token_ids(client):
    response = client.completions.create(model=MODEL_NAME, prompt=[[0, 5, 6, 7], [0, 9, 10]], max_tokens=3, n=2, logprobs=1)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == 7
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)
    single = client.completions.create(model=MODEL_NAME, prompt=[0, 5, 6, 7], max_tokens=3, temperature=0)
    assert single.choices[0].text and single.usage.prompt_tokens == 4


def test_completions_stream(client):
    """Two prompts streamed at once: chunks of both interleave under their own index."""
    stream = client.completions.create(
        model=MODEL_NAME, prompt=["Once upon a time", "Hello"], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    texts, finish = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert finish == {0: "length", 1: "length"} and all(texts.values())


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def structured(client):
    """The grammar-steered requests, run concurrently (they share engine steps, which
    keeps the suite fast on a CPU): name -> response, or the assembled stream."""

    def named_stream():
        calls: dict[int, dict] = {}
        finish = None
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64, stream=True
        )
        for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return calls, finish

    requests = {
        "named": lambda: client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64
        ),
        "named_stream": named_stream,
        "required": lambda: client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=96,
        ),
        "json_schema": lambda: client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
        ),
        "choice": lambda: client.completions.create(
            model=MODEL_NAME, prompt="Yes or no?", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
        ),
    }
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(fn) for name, fn in requests.items()}
        return {name: future.result() for name, future in futures.items()}


def test_forced_named_tool_call(client, structured):
    choice = structured["named"].choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _check_weather_args(call.function.arguments)

    # round trip: the call and its result go back as history
    follow = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            *MESSAGES,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
        tools=TOOLS,
        max_tokens=2,
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the system prompt with the tool schemas was computed before: a prefix-cache hit
    assert follow.usage.prompt_tokens_details.cached_tokens >= 256


def test_forced_named_tool_call_streamed(structured):
    calls, finish = structured["named_stream"]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    _check_weather_args(calls[0]["arguments"])


def test_required_tool_call(structured):
    choice = structured["required"].choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        _check_weather_args(call.function.arguments)
    else:
        assert json.loads(call.function.arguments) == {}


def test_json_schema_output(structured):
    choice = structured["json_schema"].choices[0]
    assert choice.finish_reason == "stop"
    _check_weather_args(choice.message.content)


def test_guided_choice(structured):
    assert structured["choice"].choices[0].text in ("yes", "no")


def test_grammar_waits_for_the_end_of_thinking(client):
    """With thinking on, the schema constrains only the answer: the reasoning before
    </think> is free text (a random model does not close it within a few tokens)."""
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "length"
    assert message.reasoning_content and not message.content
    assert not message.reasoning_content.startswith("{")


def test_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=0)
    assert error.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_metrics_scrape(client, server):
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True).close()
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    expected = {
        "dsv4:requests": "counter",
        "dsv4:prompt_tokens": "counter",
        "dsv4:generation_tokens": "counter",
        "dsv4:prompt_tokens_cached": "counter",
        "dsv4:time_to_first_token_seconds": "histogram",
        "dsv4:inter_token_latency_seconds": "histogram",
        "dsv4:e2e_request_latency_seconds": "histogram",
        "dsv4:num_requests_running": "gauge",
        "dsv4:num_requests_waiting": "gauge",
        "dsv4:kv_cache_usage_perc": "gauge",
        "dsv4:kv_cache_capacity_tokens": "gauge",
        "dsv4:prefix_cache_hit_rate": "gauge",
        "dsv4:num_preemptions": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prefix_cache_queries": "counter",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name

    def value(name: str, sample: str, **labels) -> float:
        return sum(s.value for s in families[name].samples if s.name == sample and labels.items() <= s.labels.items())

    assert value("dsv4:requests", "dsv4:requests_total", status="success") >= 1
    assert value("dsv4:generation_tokens", "dsv4:generation_tokens_total") >= 3
    assert value("dsv4:time_to_first_token_seconds", "dsv4:time_to_first_token_seconds_count") >= 1
    assert value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") > 0
    assert 0.0 <= value("dsv4:kv_cache_usage_perc", "dsv4:kv_cache_usage_perc") <= 1.0

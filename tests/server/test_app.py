"""HTTP behaviour of the server: error bodies, auth, health, disconnects, engine failures,
and the AsyncEngine's own lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import httpx
import pytest
from conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, LiveServer, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from dsv4.cli import build_parser, engine_options
from dsv4.config import EngineConfig
from dsv4.engine.async_engine import EngineClosedError
from dsv4.engine.sampling_params import SamplingParams
from dsv4.server.app import create_app
from dsv4.server.cli import serve

MESSAGES = [{"role": "user", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**body):
    return ("/v1/chat/completions", {"messages": MESSAGES, **body})


def completion(**body):
    return ("/v1/completions", {"prompt": "Hello", **body})


# (request, expected status, expected error.param)
BAD_REQUESTS = {
    "max_tokens < 1": (chat(max_tokens=0), 400, "max_tokens"),
    "max_completion_tokens < 1": (chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    "completions max_tokens < 1": (completion(max_tokens=0), 400, "max_tokens"),
    "n < 1": (chat(n=0), 400, "n"),
    "n too large": (completion(n=1000), 400, "n"),
    "top_logprobs too large": (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top_logprobs without logprobs": (chat(top_logprobs=2), 400, "top_logprobs"),
    "completions logprobs too large": (completion(logprobs=21), 400, "logprobs"),
    "temperature < 0": (chat(temperature=-1), 400, "temperature"),
    "top_p = 0": (completion(top_p=0), 400, "top_p"),
    "min_tokens > max_tokens": (chat(max_tokens=2, min_tokens=5), 400, "min_tokens"),
    "prompt too long": (("/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}), 400, "prompt"),
    "messages too long": (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}),
        400,
        "messages",
    ),
    "prompt + max_tokens too long": (("/v1/completions", {"prompt": [7] * 10, "max_tokens": MAX_MODEL_LEN}), 400, "max_tokens"),
    "token id outside vocabulary": (("/v1/completions", {"prompt": [1, 10**9]}), 400, "prompt"),
    "empty prompt list": (("/v1/completions", {"prompt": []}), 400, "prompt"),
    "logit_bias": (chat(logit_bias={"5": 10}), 400, "logit_bias"),
    "echo": (completion(echo=True), 400, "echo"),
    "suffix": (completion(suffix="x"), 400, "suffix"),
    "best_of": (completion(best_of=3), 400, "best_of"),
    "stream_options without stream": (chat(stream_options={"include_usage": True}), 400, "stream_options"),
    "bad role": (("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0].role"),
    "bad reasoning_effort": (chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    "tool_choice without tools": (chat(tool_choice="required"), 400, "tool_choice"),
    "unknown named tool": (
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice.function.name",
    ),
    "invalid json schema": (
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        400,
        "response_format.json_schema.schema",
    ),
    "json_schema without schema": (
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema.schema",
    ),
    "invalid regex": (completion(guided_regex="(("), 400, "guided_regex"),
    "invalid structured_outputs": (chat(structured_outputs={"regex": "(("}), 400, "structured_outputs.regex"),
    "two constraints": (chat(guided_regex="a", guided_choice=["a"]), 400, "guided_choice"),
    "invalid tool schema": (
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
        ),
        400,
        "tools[0].function.parameters",
    ),
    "unknown model": (chat(model="gpt-4"), 404, "model"),
    "wrong type": (chat(max_tokens="ten"), 422, "max_tokens"),
    "bool for a number": (chat(temperature=True), 422, "temperature"),
    "missing messages": (("/v1/chat/completions", {"max_tokens": 3}), 422, "messages"),
    "messages not a list": (("/v1/chat/completions", {"messages": "hi"}), 422, "messages"),
    "bad response_format type": (chat(response_format={"type": "yaml"}), 422, "response_format"),
    "prompt of floats": (("/v1/completions", {"prompt": [1.5]}), 422, "prompt"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_request(server, case, stream):
    (path, body), status, param = BAD_REQUESTS[case]
    if stream and case != "stream_options without stream":
        body = {**body, "stream": True}
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]


def test_malformed_json(server):
    response = httpx.post(
        server.url + "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert "JSON" in response.json()["error"]["message"]


def test_unknown_route_has_openai_error_body(server):
    response = httpx.get(server.url + "/v1/nothing")
    assert response.status_code == 404
    assert "message" in response.json()["error"]


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_api_key(keyed_server):
    url = keyed_server.url + "/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(url, json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    # a bad key is refused before the body is even parsed
    assert httpx.post(url, content=b"{", headers={"content-type": "application/json"}).status_code == 401
    assert httpx.get(keyed_server.url + "/v1/models").status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert httpx.get(keyed_server.url + "/metrics").status_code == 200


def _metric(url: str, family: str, **labels) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name == family:
            return sum(
                s.value for s in fam.samples if s.name in (family, family + "_total") and labels.items() <= s.labels.items()
            )
    return 0.0


def test_disconnecting_clients_free_the_engine(server, engine):
    """16 concurrent streams, half of which hang up early, and two non-streaming clients
    that time out. The engine must drop the deserted requests at once (they would
    otherwise run to max_model_len) and end with nothing in use."""
    aborts_before = _metric(server.url, "dsv4:requests", status="abort")
    long = MAX_MODEL_LEN - 64

    async def impatient(i: int, http: httpx.AsyncClient) -> str:
        body = {"messages": [{"role": "user", "content": f"impatient {i}"}], "max_tokens": long}
        with pytest.raises(httpx.ReadTimeout):
            await http.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
        return "timed out"

    async def client(i: int, http: httpx.AsyncClient) -> str:
        leaves = i % 2 == 0
        body = {"messages": [{"role": "user", "content": f"client {i}"}], "stream": True}
        body["max_tokens"] = long if leaves else 3
        async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            data = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data.append(line)
                if leaves and len(data) == 3:
                    return "left"
            assert data[-1] == "data: [DONE]"
            return "done"

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(client(i, http) for i in range(16)), *(impatient(i, http) for i in range(2)))

    results = asyncio.run(main())
    assert results.count("left") == 8 and results.count("timed out") == 2
    stats = wait_idle(engine, timeout=5.0)
    assert stats["running"] == 0 and stats["blocks_used"] == 0, stats
    assert _metric(server.url, "dsv4:requests", status="abort") - aborts_before == 10


def test_step_failure_fails_requests_not_the_server(server, engine, monkeypatch):
    real_step = engine.engine.step
    failures = []

    def failing_step():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", failing_step)
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert response.status_code == 500
    assert "injected step failure" in response.json()["error"]["message"]

    failures.clear()
    body = {"messages": MESSAGES, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert "injected step failure" in lines[-2] and lines[-1] == "data: [DONE]"

    ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200
    assert wait_idle(engine)["blocks_used"] == 0


def test_async_engine_requests(engine):
    """Bad input raises the engine's ValueError; leaving a stream early or cancelling an
    add frees the request."""
    params = SamplingParams(max_tokens=500, temperature=0)

    async def main():
        with pytest.raises(ValueError, match="prompt"):
            await engine.add_request("x", [5] * MAX_MODEL_LEN, params)

        gen = engine.generate("a", [5, 6, 7], params)
        first = await gen.__anext__()
        assert first.outputs[0].token_ids_delta
        await gen.aclose()
        assert wait_idle(engine)["running"] == 0

        # cancelled while the add waits for the engine thread: nothing leaks
        for i in range(5):
            task = asyncio.ensure_future(engine.add_request(f"z{i}", [5, 6], params))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        stats = wait_idle(engine)
        assert stats["running"] == stats["waiting"] == stats["blocks_used"] == 0 and engine.alive

    asyncio.run(main())


def test_graceful_shutdown(make_engine):
    """On shutdown a request that ends within the grace period completes normally; a
    longer one is aborted, yet its stream still ends with a final chunk and [DONE].
    Then the engine's thread is gone and it refuses new work."""
    engine = make_engine()
    live = LiveServer(create_app(engine, served_model_name=MODEL_NAME), engine, grace_s=2.0)

    def stream(max_tokens: int, started: threading.Event, out: list) -> None:
        body = {"messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    out.append(line)
                    started.set()

    outputs = {"short": [], "long": []}
    threads = []
    for name, max_tokens in (("long", MAX_MODEL_LEN - 64), ("short", 2)):
        started = threading.Event()
        threads.append(threading.Thread(target=stream, args=(max_tokens, started, outputs[name])))
        threads[-1].start()
        assert started.wait(30)
    live.stop()
    for thread in threads:
        thread.join(30)
    for name, reason in (("short", "length"), ("long", "abort")):
        lines = outputs[name]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == reason
    assert not engine.alive and engine.stats()["blocks_used"] == 0
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.add_request("late", [5], SamplingParams()))


def test_serve_flags():
    """`dsv4 serve` binds to loopback by default and takes every engine option under
    vLLM's flag name."""
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m"])
    assert (args.host, args.port, args.api_key, args.func) == ("127.0.0.1", 8000, None, serve)
    given = {
        "--device": ("cpu", "cpu"),
        "--dtype": ("bfloat16", "bfloat16"),
        "--block-size": ("64", 64),
        "--kv-cache-memory": ("1000000", 1000000),
        "--gpu-memory-utilization": ("0.5", 0.5),
        "--max-num-seqs": ("8", 8),
        "--max-num-batched-tokens": ("512", 512),
        "--max-model-len": ("4096", 4096),
        "--max-prefix-loads-per-step": ("2", 2),
        "--scheduling-policy": ("priority", "priority"),
        "--seed": ("3", 3),
    }
    argv = ["serve", "--model", "m", "--served-model-name", "x", "--api-key", "k", "--port", "9000"]
    argv += ["--no-enable-prefix-caching", "--no-swa-bounded-replay", "--enforce-eager", "--no-fast-path", "--async-scheduling", "--fp8-activations"]
    for flag, (text, _) in given.items():
        argv += [flag, text]
    args = parser.parse_args(argv)
    options = engine_options(args)
    expected = {flag[2:].replace("-", "_"): value for flag, (_, value) in given.items()}
    assert options == {**expected, "enable_prefix_caching": False, "swa_bounded_replay": False, "enforce_eager": True, "fast_path": False,
                       "async_scheduling": True, "fp8_activations": True, "fp4_experts": False}
    assert set(options) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert (args.served_model_name, args.api_key, args.port) == ("x", "k", 9000)

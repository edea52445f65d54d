"""Shared fixtures for the bench tests: the traces directory and a fake streaming server."""

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """/work/shared/traces, found via DSV4_SHARED or ../shared next to the repository."""
    shared = Path(os.environ.get("DSV4_SHARED") or REPO_ROOT.parent / "shared")
    path = shared / "traces"
    if not path.is_dir():
        pytest.skip(f"no traces directory at {path}")
    return path


class FakeState:
    """What the fake server saw, for assertions."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.blocks: set[int] = set()
        self.hits = 0
        self.queries = 0


def _fake_app(state: FakeState, block: int = 16):
    """A minimal OpenAI-compatible streaming server with an ideal prefix cache of `block`-token blocks."""
    app = FastAPI()

    def cached_tokens(tokens: list) -> int:
        chain, hit, matching = 0, 0, True
        for i in range(0, len(tokens) - len(tokens) % block, block):
            chain = hash((chain, tuple(tokens[i : i + block])))
            if matching and chain in state.blocks:
                hit += block
            else:
                matching = False
                state.blocks.add(chain)
        return hit

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake"}]}

    @app.get("/version")
    async def version():
        return {"version": "0.0-test"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return (
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="fake-model"}} {state.hits}\n'
            f'vllm:prefix_cache_queries_total{{model_name="fake-model"}} {state.queries}\n'
            f'vllm:kv_cache_usage_perc{{model_name="fake-model"}} 0.25\n'
            f'vllm:num_preemptions_total{{model_name="fake-model"}} 0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
        )

    async def stream(body: dict, tokens: list, chat: bool):
        prompt_tokens = len(tokens)
        cached = cached_tokens(tokens)
        state.hits += cached
        state.queries += prompt_tokens
        await asyncio.sleep(0.003 + 1e-6 * (prompt_tokens - cached))
        for i in range(body["max_tokens"]):
            if chat:
                choice = {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": f" w{i}", "finish_reason": None}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            await asyncio.sleep(0.001)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": body["max_tokens"],
            "total_tokens": prompt_tokens + body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.requests.append({**body, "host": request.headers.get("host"), "time": time.monotonic()})
        return StreamingResponse(stream(body, body["prompt"], False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state.requests.append({**body, "host": request.headers.get("host"), "time": time.monotonic()})
        words = [w for m in body["messages"] for w in m["content"].split()]
        return StreamingResponse(stream(body, words, True), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server():
    """(base_url, state) of a fake server running in a thread on a free 127.0.0.1 port."""
    state = FakeState()
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)

"""Closed-loop replay of a workload against one OpenAI-compatible server (BENCH.md 5.3).

One concurrency point = `concurrency` fixed lanes. Each lane plays one session tree at a
time: the first plays warm-start at turn t* (the t*-1 prompt is sent with max_tokens=1
and excluded, then all lanes drain before the clock starts), later plays start at turn
0 with the next session of the seeded queue. Calls wait their think time end-to-start,
capped by the workload's global idle guard; subagents run as extra concurrent calls of
the same lane and the parent waits for the joined ones. No call starts after the
measurement window (or once `max_requests` profiled calls started); calls in flight at
the end complete and count, up to a drain timeout after which they are cancelled (the
warm-up is bounded by the same timeout).

Safety: every request goes through one httpx client whose request hook refuses any
URL whose scheme/host/port differ from `--base-url`; redirects and proxy environment
variables are disabled so nothing else can be contacted.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from .metrics import RequestRecord
from .workloads import (
    MARKER_TOKENS,
    Conversation,
    PrefixCache,
    Request,
    Workload,
    ids_to_text,
    materialize,
    start_turn,
    with_marker,
)


@dataclass(frozen=True)
class ReplayConfig:
    """Client-side settings of a sweep (the CLI flags of the same names)."""

    base_url: str
    model: str
    chat: bool = False
    duration_s: float = 300.0
    max_requests: int = 10_000
    warmup_steps: int = 0
    drain_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    request_rate: float | None = None
    token_range: tuple[int, int] = (1000, 128_000)


@dataclass
class PointRun:
    """Raw outcome of one concurrency point: the request log plus server-side readings."""

    concurrency: int
    records: list[RequestRecord]
    sessions_completed: int
    server: dict = field(default_factory=dict)


class UnsafeRequest(RuntimeError):
    """Raised when something tries to contact a host other than the benchmarked server."""


# --------------------------------------------------------------------------- /metrics


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) for each sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return samples


def metric(samples: list[tuple[str, dict, float]], base: str) -> float | None:
    """Sum of a metric over label sets, matching `base` under a vllm/sglang/dsv4 namespace."""
    pattern = re.compile(rf"(?:(?:vllm|sglang|dsv4)[:_])?{base}(?:_total)?")
    values = [v for name, _, v in samples if pattern.fullmatch(name)]
    return sum(values) if values else None


def _kv_capacity_tokens(samples) -> float | None:
    direct = metric(samples, "kv_cache_capacity_tokens")
    if direct is not None:
        return direct
    for name, labels, _ in samples:
        if name.endswith("cache_config_info") and "num_gpu_blocks" in labels and "block_size" in labels:
            try:
                return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
            except ValueError:
                return None
    return None


def _delta(before, after, base: str) -> float | None:
    a, b = metric(before, base), metric(after, base)
    return None if a is None or b is None else b - a


def server_readings(before, after, kv_usage: list[float]) -> dict:
    """Cache, KV and spec-decode readings between two /metrics scrapes (empty if none)."""
    if not before or not after:
        return {}
    hits, queries = _delta(before, after, "prefix_cache_hits"), _delta(before, after, "prefix_cache_queries")
    drafts = _delta(before, after, "spec_decode_num_drafts")
    draft_tokens = _delta(before, after, "spec_decode_num_draft_tokens")
    accepted = _delta(before, after, "spec_decode_num_accepted_tokens")
    spec = {}
    if accepted is not None and draft_tokens:
        spec["acceptance_rate"] = accepted / draft_tokens
    if accepted is not None and drafts:
        spec["mean_acceptance_length"] = 1 + accepted / drafts
    preemptions = _delta(before, after, "num_preemptions")
    return {
        "prometheus_cache_hit_rate": hits / queries if hits is not None and queries else None,
        "kv_cache": {
            "usage_mean": sum(kv_usage) / len(kv_usage) if kv_usage else None,
            "usage_max": max(kv_usage) if kv_usage else None,
            "capacity_tokens": _kv_capacity_tokens(after),
            "preemptions": int(preemptions) if preemptions is not None else None,
        },
        "spec_decode": spec,
    }


def _kv_usage(samples) -> float | None:
    usage = metric(samples, "kv_cache_usage_perc")
    return usage if usage is not None else metric(samples, "gpu_cache_usage_perc")


# --------------------------------------------------------------------------- replayer


class Replayer:
    """Holds what outlives one concurrency point: the HTTP client and the ideal prefix cache.

    The prefix cache spans the sweep, so the theoretical hit counts what an infinite
    server cache could reuse across points too (only shared system prefixes: the
    per-play marker busts everything else).
    """

    def __init__(self, workload: Workload, cfg: ReplayConfig):
        self.workload, self.cfg = workload, cfg
        parts = urlsplit(cfg.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--base-url must be http(s)://host[:port][/v1], got {cfg.base_url!r}")
        root = cfg.base_url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self._origin = httpx.URL(self.root)
        self.cache = PrefixCache()
        # Markers must never repeat across invocations, or a rerun would hit the last run's cache.
        self.nonce = os.urandom(6).hex()
        self.client: httpx.AsyncClient | None = None

    async def _check_origin(self, request: httpx.Request) -> None:
        url, origin = request.url, self._origin
        if (url.scheme, url.host, url.port) != (origin.scheme, origin.host, origin.port):
            raise UnsafeRequest(f"refusing to contact {url} (only {self.root} is allowed)")

    async def __aenter__(self) -> Replayer:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.cfg.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            follow_redirects=False,
            trust_env=False,
            event_hooks={"request": [self._check_origin]},
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    async def server_info(self) -> dict:
        """Engine name (from /v1/models `owned_by`) and version (from /version); fails if unreachable."""
        resp = await self.client.get(self.root + "/v1/models", timeout=10.0)
        resp.raise_for_status()
        models = resp.json().get("data") or [{}]
        info = {"engine": models[0].get("owned_by"), "engine_version": None}
        try:
            version = await self.client.get(self.root + "/version", timeout=10.0)
            if version.status_code == 200:
                info["engine_version"] = version.json().get("version")
        except (httpx.HTTPError, ValueError):
            pass
        return info

    async def scrape(self) -> list[tuple[str, dict, float]]:
        """Samples from the server's /metrics, or [] when it has none."""
        try:
            resp = await self.client.get(self.root + "/metrics", timeout=10.0)
        except httpx.HTTPError:
            return []
        return parse_prometheus(resp.text) if resp.status_code == 200 else []

    def body(self, segments, user_start: int, max_tokens: int) -> bytes:
        """JSON body of one streamed call (built off the event loop: prompts can be 1M tokens).

        Chat mode sends the tools+system part as a system message and the rest as the
        user message, as an agent would; token counts then follow the server's tokenizer.
        """
        ids = materialize(segments, self.workload.seed, self.cfg.token_range)
        payload = {
            "model": self.cfg.model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if self.cfg.chat:
            split = max(0, min(user_start, len(ids) - MARKER_TOKENS))  # where with_marker put the marker
            user = {"role": "user", "content": ids_to_text(ids[split:], self.cfg.token_range)}
            system = {"role": "system", "content": ids_to_text(ids[:split], self.cfg.token_range)}
            payload["messages"] = [system, user] if split else [user]
        else:
            payload["prompt"] = ids.tolist()
        return json.dumps(payload).encode()

    async def run_point(self, concurrency: int) -> PointRun:
        return await _Point(self, concurrency).run()


class _Point:
    """State of one concurrency point (lanes, window, request log)."""

    def __init__(self, rp: Replayer, concurrency: int):
        self.rp, self.cfg, self.concurrency = rp, rp.cfg, concurrency
        self.origin = time.perf_counter()
        self.window_end = math.inf
        self.records: list[RequestRecord] = []
        self.started = 0
        self.sessions_completed = 0
        self._order = rp.workload.order
        self._plays = 0
        self._tasks: set[asyncio.Task] = set()
        self._arrivals = random.Random(f"{rp.workload.seed}/arrivals/{concurrency}")
        self._next_arrival = 0.0
        self._kv_usage: list[float] = []

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def may_start(self) -> bool:
        return self.now() < self.window_end and self.started < self.cfg.max_requests

    def next_play(self) -> tuple[str, Conversation]:
        """Next session of the seeded queue; it wraps around, each play getting a fresh marker."""
        session = self.rp.workload.sessions[self._order[self._plays % len(self._order)]]
        key = f"{self.rp.nonce}/c{self.concurrency}/p{self._plays}"
        self._plays += 1
        return key, session

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self) -> PointRun:
        plays = [self.next_play() for _ in range(self.concurrency)]
        first_turns = [start_turn(self.rp.workload.seed, conv) for _, conv in plays]
        try:  # a stuck warm-up must not hold the sweep: it gets the drain timeout too
            async with asyncio.timeout(self.cfg.drain_timeout_s):
                await asyncio.gather(
                    *(self.warmup(lane, key, conv, t) for lane, ((key, conv), t) in enumerate(zip(plays, first_turns)))
                )
        except TimeoutError:
            pass
        before = await self.rp.scrape()
        self.window_end = self.now() + self.cfg.duration_s
        self._next_arrival = self.now()
        lanes = [self.spawn(self.lane(i, plays[i], first_turns[i])) for i in range(self.concurrency)]
        sampler = self.spawn(self.sample_kv()) if before else None
        deadline = self.window_end + self.cfg.drain_timeout_s
        done, _ = await asyncio.wait(lanes, timeout=max(0.0, deadline - self.now()))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in done:
            task.result()  # surface bugs instead of silently losing a lane
        after = await self.rp.scrape() if sampler else []
        return PointRun(
            self.concurrency, self.records, self.sessions_completed, server_readings(before, after, self._kv_usage)
        )

    async def sample_kv(self) -> None:
        while True:
            usage = _kv_usage(await self.rp.scrape())
            if usage is not None:
                self._kv_usage.append(usage)
            await asyncio.sleep(1.0)

    async def warmup(self, lane: int, key: str, conv: Conversation, first_turn: int) -> None:
        """Prefill the t*-1 prompt (max_tokens=1), then `warmup_steps` more one-token calls on it."""
        if first_turn == 0:
            return
        for _ in range(1 + self.cfg.warmup_steps):
            await self.send(key, conv, first_turn - 1, lane, "warmup", 1)

    async def lane(self, lane: int, play: tuple[str, Conversation], first_turn: int) -> None:
        """Play sessions back to back; a session cut short by the window ends the lane."""
        while True:
            key, conv = play
            completed = await self.conversation(key, conv, first_turn, lane)
            self.sessions_completed += completed
            if not completed or not self.may_start():
                return
            play, first_turn = self.next_play(), 0

    async def conversation(self, key: str, conv: Conversation, first: int, lane: int) -> bool:
        """Play calls first.. of a (sub)conversation; True if every call of the tree was sent."""
        cap = self.rp.workload.idle_cap_s
        complete, prev_end = True, None
        joined: list[asyncio.Task] = []
        children: list[asyncio.Task] = []
        for turn in range(first, len(conv.requests)):
            req = conv.requests[turn]
            if prev_end is not None:
                ready = prev_end + min(req.think_s, cap)
                if joined:
                    complete &= all(await asyncio.gather(*joined))
                    joined = []
                if ready >= self.window_end:
                    complete = False
                    break
                await asyncio.sleep(max(0.0, ready - self.now()))
            if self.cfg.request_rate:
                await self.pace()
            if not self.may_start():
                complete = False
                break
            await self.send(key, conv, turn, lane, "profile", req.osl)
            prev_end = self.now()
            for child in req.children:
                task = self.spawn(self.subagent(key, child, lane))
                children.append(task)
                if child.join:
                    joined.append(task)
        results = await asyncio.gather(*children)
        return complete and all(results)

    async def subagent(self, key: str, child: Conversation, lane: int) -> bool:
        start = self.now() + min(child.start_delay_s, self.rp.workload.idle_cap_s)
        if start >= self.window_end:
            return False
        await asyncio.sleep(max(0.0, start - self.now()))
        return await self.conversation(key, child, 0, lane)

    async def pace(self) -> None:
        """Poisson arrivals for `--request-rate` (random workload), on top of the lane limit."""
        slot = self._next_arrival
        self._next_arrival += self._arrivals.expovariate(self.cfg.request_rate)
        await asyncio.sleep(max(0.0, slot - self.now()))

    async def send(self, key: str, conv: Conversation, turn: int, lane: int, phase: str, max_tokens: int) -> None:
        req: Request = conv.requests[turn]
        segments = with_marker(req.segments, conv.user_start, f"{key}/{conv.id}")
        if phase == "profile":
            self.started += 1
        theoretical = self.rp.cache.hit(segments)
        body = await asyncio.to_thread(self.rp.body, segments, conv.user_start, max_tokens)
        rec = RequestRecord(conv.id, turn, lane, phase, self.now(), 0.0, req.isl, max_tokens, theoretical)
        self.records.append(rec)
        path = "/v1/chat/completions" if self.cfg.chat else "/v1/completions"
        try:
            async with self.rp.client.stream(
                "POST", self.rp.root + path, content=body, headers={"content-type": "application/json"}
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    rec.error = f"http_{resp.status_code}"
                else:
                    await self.read_stream(resp, rec)
        except httpx.TimeoutException:
            rec.error = "timeout"
        except httpx.TransportError:
            rec.error = "connection"
        except asyncio.CancelledError:
            rec.error = "drain_timeout"
            raise
        finally:
            rec.end = self.now()

    async def read_stream(self, resp: httpx.Response, rec: RequestRecord) -> None:
        """Parse the SSE stream: TTFT at the first token chunk, token counts from the usage chunk."""
        usage, finished = None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                finished = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                rec.error = "bad_stream"
                return
            if "error" in chunk:
                rec.error = "bad_stream"
                return
            if rec.ttft is None and any(_has_token(c) for c in chunk.get("choices") or ()):
                rec.ttft = self.now() - rec.start
            usage = chunk.get("usage") or usage
        if not finished or usage is None or rec.ttft is None:
            rec.error = "bad_stream"
            return
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if rec.prompt_tokens is None or not rec.completion_tokens:
            rec.error = "bad_stream"


def _has_token(choice: dict) -> bool:
    """A completion chunk always carries a token; a chat chunk may be role-only (vLLM's first)."""
    delta = choice.get("delta") or {}
    return choice.get("text") is not None or bool(delta.get("content") or delta.get("reasoning_content"))

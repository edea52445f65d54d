"""Replay rules against the fake server: subagent joins, bounds, safety, seeded session order."""

import asyncio
import time

import pytest

from dsv4.bench.replay import ReplayConfig, Replayer, UnsafeRequest, _Point
from dsv4.bench.workloads import Conversation, Request, Segment, Workload, agentx_synth, random_workload

TOKENS = (1000, 32000)


def _run(workload, base_url, concurrency=1, **cfg):
    async def go():
        async with Replayer(workload, ReplayConfig(base_url, "fake-model", token_range=TOKENS, **cfg)) as rp:
            return await rp.run_point(concurrency)

    return asyncio.run(go())


def _subagent_workload() -> Workload:
    def child(name: str, join: bool, osl: int) -> Conversation:
        calls = (Request((Segment(name, 0, 80),), osl), Request((Segment(name, 0, 160),), osl))
        return Conversation(name, calls, 0, join=join)

    calls = tuple(
        Request(
            (Segment("p", 0, 100 * (k + 1)),),
            4,
            children=(child(f"p/t{k}/join", True, 20), child(f"p/t{k}/bg", False, 150)),
        )
        for k in range(4)
    )
    return Workload("test", "subagents", 42, (Conversation("p", calls),), idle_cap_s=0.0, duration_s=1.0)


def test_parent_waits_for_joined_subagents_but_not_background(fake_server):
    base, _ = fake_server
    run = _run(_subagent_workload(), base, duration_s=1.5)
    records = sorted((r for r in run.records if r.phase == "profile"), key=lambda r: r.start)
    assert all(r.error is None for r in records)
    last_end: dict[str, float] = {}
    prev_parent, overlapped, checked = None, False, 0
    for r in records:
        if r.session == "p":
            if prev_parent is not None and r.turn == prev_parent.turn + 1:
                assert last_end[f"p/t{prev_parent.turn}/join"] <= r.start  # join
                overlapped |= last_end.get(f"p/t{prev_parent.turn}/bg", 0.0) > r.start
                checked += 1
            if r.turn == 0 and prev_parent is not None:
                assert all(end <= r.start for end in last_end.values())  # lane = whole tree
            prev_parent = r
        last_end[r.session] = max(last_end.get(r.session, 0.0), r.end)
    assert checked >= 3 and overlapped  # background children kept running during the parent's next call
    assert run.sessions_completed >= 1


def test_max_requests_bounds_a_point(fake_server):
    base, _ = fake_server
    t = time.monotonic()
    run = _run(random_workload(64, 4, 100), base, concurrency=4, duration_s=30.0, max_requests=10)
    assert sum(r.phase == "profile" for r in run.records) == 10
    assert time.monotonic() - t < 10


def test_drain_timeout_bounds_wall_time(fake_server):
    base, _ = fake_server
    t = time.monotonic()
    run = _run(random_workload(64, 20_000, 10), base, concurrency=2, duration_s=0.2, drain_timeout_s=0.3)
    assert time.monotonic() - t < 5
    assert [r.error for r in run.records] == ["drain_timeout", "drain_timeout"]


def test_only_the_base_url_is_contacted(fake_server):
    base, state = fake_server

    async def go():
        async with Replayer(random_workload(64, 4, 1), ReplayConfig(base + "/v1", "fake-model")) as rp:
            assert rp.root == base
            with pytest.raises(UnsafeRequest):
                await rp.client.get("http://127.0.0.2:9/v1/completions")
            with pytest.raises(UnsafeRequest):
                await rp.client.get(base.replace("http://", "https://") + "/metrics")
            await rp.client.get(base + "/v1/models")

    asyncio.run(go())
    assert state.requests == []  # nothing refused reached anything; models is a GET


def test_session_order_does_not_depend_on_concurrency():
    rp = Replayer(agentx_synth("smoke"), ReplayConfig("http://127.0.0.1:1", "m"))
    one, four = _Point(rp, 1), _Point(rp, 4)
    plays_one = [one.next_play() for _ in range(12)]
    plays_four = [four.next_play() for _ in range(12)]
    assert [c.id for _, c in plays_one] == [c.id for _, c in plays_four]
    assert len({k for k, _ in plays_one + plays_four}) == 24  # every play has its own marker key

"""AgentX-synth generator: determinism, BENCH.md 5.2 calibration, markers and prefix hits."""

import numpy as np
import pytest

from dsv4.bench import workloads as w


@pytest.fixture(scope="module")
def full():
    return w.agentx_synth("full", seed=42)


def test_same_seed_same_sessions_in_any_order(full):
    assert w.agentx_synth("full", seed=42).sessions == full.sessions
    # Each session depends only on (seed, index): generating a few alone, backwards, matches the pool.
    p = w.PROFILES["full"]
    for i in (511, 200, 7, 0):
        assert w.synth_session(p, 42, i) == full.sessions[i]
        assert w.synth_session(p, 43, i) != full.sessions[i]
    assert w.agentx_synth("smoke", seed=42).sha256() == w.agentx_synth("smoke", seed=42).sha256()
    assert w.agentx_synth("smoke", seed=42).sha256() != w.agentx_synth("smoke", seed=43).sha256()


def test_lane_order_and_warm_start_are_per_session(full):
    order = full.order
    assert sorted(order) == list(range(len(full.sessions)))
    assert order != list(range(len(full.sessions)))
    starts = [w.start_turn(42, s) for s in full.sessions]
    for s, t in zip(full.sessions, starts):
        n = len(s.requests)
        assert 1 <= t <= n - 1
        assert 0.25 * n - 1 <= t <= 0.75 * n


def test_full_profile_medians_match_bench_table(full):
    """Medians over the 512-session pool within 15 % of BENCH.md's AgentX statistics."""
    sessions = full.sessions
    assert len(sessions) == 512
    turns = [len(s.requests) for s in sessions]
    first_isl = [s.requests[0].isl for s in sessions]
    osl = [r.osl for s in sessions for r in s.requests]
    think = [r.think_s for s in sessions for r in s.requests[1:]]
    new_tokens, cached, total = [], 0, 0
    for s in sessions:
        for i, (r, hit) in enumerate(w.theoretical_hits(s)):
            cached, total = cached + hit, total + r.isl
            if i:
                new_tokens.append(r.isl - hit)
    expected = {"turns": 45, "first_isl": 24_000, "new_tokens": 700, "osl": 216, "think_s": 10.0}
    measured = {
        "turns": np.median(turns),
        "first_isl": np.median(first_isl),
        "new_tokens": np.median(new_tokens),
        "osl": np.median(osl),
        "think_s": np.median(think),
    }
    for key, value in expected.items():
        assert abs(measured[key] / value - 1) <= 0.15, (key, measured[key], value)
    assert 0.93 <= cached / total <= 0.99  # BENCH.md: theoretical hit ~95-97.7 %
    assert max(think) <= 300.0  # per-session idle cap
    assert all(r.isl + r.osl <= 1_048_576 for s in sessions for r in s.requests)


def test_scaled_profiles():
    smoke = w.agentx_synth("smoke")
    assert len(smoke.sessions) == 8
    assert all(3 <= len(s.requests) <= 4 for s in smoke.sessions)
    assert all(r.osl >= 2 and r.isl + r.osl <= 4096 for s in smoke.sessions for r in s.requests)
    lite = w.agentx_synth("lite")
    assert 700 <= np.median([s.user_start for s in lite.sessions]) <= 1100  # sys ~0.9k
    assert max(r.think_s for s in lite.sessions for r in s.requests) <= 30.0
    k256 = w.agentx_synth("256k")
    assert all(r.isl + r.osl <= 262_144 for s in k256.sessions for r in s.requests)
    shared = w.agentx_synth("smoke", shared_sys_prefix=True)
    assert {s.requests[0].segments[0] for s in shared.sessions} == {shared.sessions[0].requests[0].segments[0]}


def test_subagent_profile_spawns_children():
    wl = w.agentx_synth("062126")
    kids = [c for s in wl.sessions for r in s.requests for c in r.children]
    spawning_turns = sum(bool(r.children) for s in wl.sessions for r in s.requests)
    all_turns = sum(len(s.requests) for s in wl.sessions)
    assert 0.02 <= spawning_turns / all_turns <= 0.04
    assert 1.3 <= len(kids) / spawning_turns <= 1.9
    assert 0.1 <= sum(not c.join for c in kids) / len(kids) <= 0.3
    # Siblings share the subagent system prompt, so the second sibling hits it.
    for s in wl.sessions:
        for r in s.requests:
            if len(r.children) > 1:
                a, b = r.children[:2]
                assert a.requests[0].segments[0] == b.requests[0].segments[0]
                return


def test_materialize_is_deterministic_and_prefix_stable():
    segs = (w.Segment("x", 0, 300),)
    a = w.materialize(segs, 42, (1000, 32000))
    assert a.shape == (300,) and a.min() >= 1000 and a.max() < 32000
    assert np.array_equal(a, w.materialize(segs, 42, (1000, 32000)))
    assert np.array_equal(a[:100], w.materialize((w.Segment("x", 0, 100),), 42, (1000, 32000)))
    assert np.array_equal(a[100:], w.materialize((w.Segment("x", 100, 200),), 42, (1000, 32000)))
    assert not np.array_equal(a, w.materialize(segs, 7, (1000, 32000)))


def test_marker_keeps_lengths_and_busts_only_other_plays():
    conv = w.agentx_synth("smoke").sessions[0]
    r0, r1 = conv.requests[:2]
    m0 = w.with_marker(r0.segments, conv.user_start, "play-a")
    m1 = w.with_marker(r1.segments, conv.user_start, "play-a")
    other = w.with_marker(r1.segments, conv.user_start, "play-b")
    assert sum(s.length for s in m0) == r0.isl and sum(s.length for s in m1) == r1.isl
    t0, t1, tb = (w.materialize(m, 42, (1000, 32000)) for m in (m0, m1, other))
    u = conv.user_start
    assert np.array_equal(t0, t1[: r0.isl])  # the play's prefix sharing survives
    assert np.array_equal(t1[:u], tb[:u])  # the system prefix is shared across plays
    assert not np.array_equal(t1[u : u + w.MARKER_TOKENS], tb[u : u + w.MARKER_TOKENS])
    cache = w.PrefixCache()
    cache.hit(m0)
    assert cache.hit(m1) == r0.isl // 64 * 64
    assert cache.hit(other) == u // 64 * 64


def test_prefix_cache_longest_common_prefix():
    s = w.Segment
    cache = w.PrefixCache()
    assert cache.hit((s("a", 0, 640),)) == 0
    assert cache.hit((s("a", 0, 320), s("b", 0, 640))) == 320
    assert cache.hit((s("a", 0, 320), s("b", 0, 100), s("c", 0, 64))) == 384  # 420 floored to blocks
    assert cache.hit((s("a", 0, 700),)) == 640
    assert cache.hit((s("z", 0, 64), s("a", 0, 640))) == 0  # same content at another offset is no prefix

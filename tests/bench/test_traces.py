"""Weka trace loading: token counts, think times, subagents and the hash-id prefix structure."""

import json

import numpy as np

from dsv4.bench import workloads as w

RANGE = (1000, 32000)


def _flatten(raw_requests, conv):
    """(raw call, loaded Request) pairs in replay order: a call, then its subagents' calls."""
    pairs, calls, children = [], iter(conv.requests), iter(())
    for raw in raw_requests:
        if raw.get("type") == "subagent":
            child = next(children)
            assert child.join == (raw["status"] != "async_launched")
            assert child.user_start == raw["tool_tokens"] + raw["system_tokens"]
            pairs.extend(_flatten(raw["requests"], child))
        else:
            call = next(calls)
            children = iter(call.children)
            pairs.append((raw, call))
    assert next(calls, None) is None
    return pairs


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_traces_reproduce_counts_and_prefix_structure(traces_dir):
    paths = sorted(traces_dir.glob("*.json"))
    assert len(paths) >= 6
    workload = w.weka_traces(traces_dir)
    assert [s.id for s in workload.sessions] == [json.loads(p.read_text())["id"] for p in paths]
    for path, conv in zip(paths, workload.sessions):
        doc = json.loads(path.read_text())
        assert conv.user_start == doc["tool_tokens"] + doc["system_tokens"]
        pairs = _flatten(doc["requests"], conv)
        totals = doc["totals"]["combined_tokens"]
        assert sum(r.isl for _, r in pairs) == totals["input"]
        assert sum(r.osl for _, r in pairs) == totals["output"]
        hits = [h for _, h in w.theoretical_hits(conv)]
        seen = []
        for (raw, req), hit in zip(pairs, hits):
            assert req.isl == raw["in"] and req.osl == max(1, raw["out"])
            if raw.get("think_time") is not None:
                assert req.think_s == raw["think_time"]
            # Ideal hit = longest run of leading hash ids shared with any earlier call.
            expected = max((_lcp(raw["hash_ids"], s) for s in seen), default=0) * 64
            assert hit == expected, (conv.id, raw["t"])
            seen.append(raw["hash_ids"])


def test_same_hash_id_same_tokens(traces_dir):
    conv = w.load_weka_trace(traces_dir / "trace_0291.json")
    doc = json.loads((traces_dir / "trace_0291.json").read_text())
    raw = [r for r in doc["requests"] if r.get("type") != "subagent"]
    for k in (2, 3):  # call 3 shares 297 leading blocks with call 2, then diverges
        a_ids, b_ids = raw[k - 1]["hash_ids"], raw[k]["hash_ids"]
        a = w.materialize(conv.requests[k - 1].segments, 42, RANGE)
        b = w.materialize(conv.requests[k].segments, 42, RANGE)
        for j in range(min(len(a_ids), len(b_ids))):
            same = np.array_equal(a[64 * j : 64 * j + 64], b[64 * j : 64 * j + 64])
            assert same == (a_ids[j] == b_ids[j])
    # Sibling subagents share their leading blocks (the subagent system prompt).
    kids = [c for r in conv.requests for c in r.children]
    assert len(kids) == 2
    a, b = (w.materialize(c.requests[0].segments, 42, RANGE) for c in kids)
    assert np.array_equal(a[: kids[0].user_start // 64 * 64], b[: kids[0].user_start // 64 * 64])


def test_subagent_timing_and_missing_think_time(traces_dir):
    conv = w.load_weka_trace(traces_dir / "trace_0291.json")
    parent = next(r for r in conv.requests if r.children)
    first, second = parent.children
    # Spawned after the call at t=1085 with api_time 15.64: gaps 47.37 s and 79.91 s.
    assert abs(first.start_delay_s - (1148.013 - 1085 - 15.64)) < 1e-6
    assert abs(second.start_delay_s - (1180.553 - 1085 - 15.64)) < 1e-6
    assert len(first.requests) == 5 and len(second.requests) == 7
    # trace_0211 call 1 has no think_time: t=16 after a call without api_time -> 16 s.
    assert w.load_weka_trace(traces_dir / "trace_0211.json").requests[1].think_s == 16.0

"""Workload specs for `dsv4 bench serve`: AgentX-synth sessions, replayed Weka traces, random.

A workload is a pool of *conversations* (sessions). A conversation is an ordered list of
model calls; each call's prompt is described by token-count *segments* rather than text,
so that prefix sharing is explicit and prompts can be materialised exactly, at any size,
from the seed alone (BENCH.md 5.1):

* a `Segment(stream, start, length)` is the token range [start, start+length) of an
  endless deterministic token stream named `stream`;
* two prompts share a prefix exactly when their segment lists agree up to that point,
  so the ideal (infinite-cache) prefix hit is computable without any tokens
  (`PrefixCache`), and the served prompt is `materialize(segments)`.

Every random draw of the generator comes from a counter-based PRNG keyed by
(seed, session id, field), whose t-th output is turn t's draw: a session is the same
whatever the concurrency, lane assignment or run order.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 64
"""Prefix-cache granularity used for the theoretical hit (the Weka trace block size)."""

MARKER_TOKENS = 12
"""Length of the per-play cache-bust marker (AgentX rule)."""


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class Segment:
    """Tokens [start, start + length) of the deterministic stream `stream`."""

    stream: str
    start: int
    length: int


@dataclass(frozen=True)
class Request:
    """One model call: its prompt, its output length and the wait before it.

    `think_s` is the end-to-start gap after the previous call of the same conversation
    (the replay caps it with the workload's idle guard). `children` are subagent
    conversations started when this call finishes.
    """

    segments: tuple[Segment, ...]
    osl: int
    think_s: float = 0.0
    children: tuple[Conversation, ...] = ()

    @property
    def isl(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True)
class Conversation:
    """A session (or a subagent): calls in order, plus where its first user turn starts.

    `user_start` is the token offset of the first user turn, i.e. the size of the
    tools+system prefix; the cache-bust marker goes there. For subagents, `join` says
    whether the parent's next call waits for it, and `start_delay_s` is the gap between
    the parent call's end and the subagent's first call.
    """

    id: str
    requests: tuple[Request, ...]
    user_start: int = 0
    join: bool = True
    start_delay_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "user_start": self.user_start,
            "join": self.join,
            "start_delay_s": self.start_delay_s,
            "requests": [
                {
                    "segments": [[s.stream, s.start, s.length] for s in r.segments],
                    "osl": r.osl,
                    "think_s": r.think_s,
                    "children": [c.to_dict() for c in r.children],
                }
                for r in self.requests
            ],
        }


@dataclass(frozen=True)
class Workload:
    """A session pool plus the replay parameters that belong to the workload.

    `order` is the seeded order in which lanes draw sessions; `idle_cap_s` is the global
    idle guard applied to every think time / subagent delay at replay.
    """

    name: str
    profile: str
    seed: int
    sessions: tuple[Conversation, ...]
    idle_cap_s: float
    duration_s: float
    params: dict = field(default_factory=dict)

    @property
    def order(self) -> list[int]:
        return sorted(range(len(self.sessions)), key=lambda i: uniform(self.seed, i, -1, "order"))

    def sha256(self) -> str:
        """Digest of the full spec, stored with results to prove two runs replayed the same sessions."""
        doc = {
            "name": self.name,
            "profile": self.profile,
            "seed": self.seed,
            "idle_cap_s": self.idle_cap_s,
            "params": self.params,
            "sessions": [s.to_dict() for s in self.sessions],
        }
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def canonical(segments) -> tuple[Segment, ...]:
    """Drop empty segments and merge contiguous ones, so equal prompts have equal lists.

    `PrefixCache` relies on this: a shared prefix must look the same in both prompts.
    """
    out: list[Segment] = []
    for s in segments:
        if s.length <= 0:
            continue
        if out and out[-1].stream == s.stream and out[-1].start + out[-1].length == s.start:
            out[-1] = Segment(s.stream, out[-1].start, out[-1].length + s.length)
        else:
            out.append(s)
    return tuple(out)


# --------------------------------------------------------------------------- randomness


def uniform(seed: int, *key) -> float:
    """Counter-based U(0,1): a hash of (seed, *key), so draws need no shared generator state."""
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return ((int.from_bytes(digest, "little") >> 11) + 0.5) * 2.0**-53


def _key(seed: int, *key) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest(), "little"))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(counters: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64 of key + counter * golden: a counter-based generator, one output per counter."""
    x = counters.astype(np.uint64) * _GOLDEN + key
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _uniforms(n: int, seed: int, *key) -> np.ndarray:
    """U(0,1) draws for counters 0..n-1 of the stream (seed, *key)."""
    return ((_mix(np.arange(n), _key(seed, *key)) >> np.uint64(11)).astype(float) + 0.5) * 2.0**-53


def _normals(n: int, seed: int, *key) -> np.ndarray:
    """Standard normals by Box-Muller; draw t uses counters 2t and 2t+1 only."""
    u = _uniforms(2 * n, seed, *key)
    return np.sqrt(-2.0 * np.log(u[0::2])) * np.cos(2.0 * np.pi * u[1::2])


def _lognormal(n: int, median: float, sigma: float, seed: int, *key) -> np.ndarray:
    return median * np.exp(sigma * _normals(n, seed, *key))


def _normal(mean: float, sd: float, seed: int, *key) -> float:
    return mean + sd * float(_normals(1, seed, *key)[0])


def _tokens(x, scale: float, floor: int = 0, lo: float = 0.0, hi: float = math.inf) -> list[int]:
    """Token counts: clip in unscaled units, then scale (profiles scale every token law)."""
    return np.maximum(floor, np.rint(np.clip(x, lo, hi) * scale)).astype(int).tolist()


def start_turn(seed: int, conv: Conversation) -> int:
    """Warm-start turn t* ~ U[0.25, 0.75] x turns (BENCH.md 5.3), at least 1 when possible."""
    n = len(conv.requests)
    if n < 2:
        return 0
    u = 0.25 + 0.5 * uniform(seed, conv.id, -1, "t_star")
    return min(n - 1, max(1, int(u * n)))


# --------------------------------------------------------------------------- AgentX-synth


@dataclass(frozen=True)
class Profile:
    """Parameters of one AgentX-synth profile (BENCH.md 5.2); token laws are multiplied by `scale`."""

    scale: float
    ctx_cap: int
    num_sessions: int
    max_turns: int
    think_median_s: float
    think_session_cap_s: float
    idle_cap_s: float
    duration_s: float
    osl_median: float = 216.0
    osl_sigma: float = 1.11
    subagents: bool = False


PROFILES: dict[str, Profile] = {
    "full": Profile(1.0, 1_048_576, 512, 1200, 10.0, 300.0, 10.0, 900.0),
    "256k": Profile(1.0, 262_144, 512, 1200, 10.0, 300.0, 10.0, 900.0),
    "lite": Profile(1 / 16, 65_536, 512, 1200, 1.0, 30.0, 2.0, 300.0),
    # CI on CPU: BENCH.md leaves smoke think times open; they are shrunk like lite's so a
    # few-second window still sees several turns per lane.
    "smoke": Profile(1 / 256, 4_096, 8, 4, 0.1, 1.0, 0.25, 60.0),
    # The newer corpus: longer outputs and subagents.
    "062126": Profile(
        1.0, 1_048_576, 512, 1200, 10.0, 300.0, 10.0, 900.0, osl_median=300.0, osl_sigma=1.25, subagents=True
    ),
}


class _TurnLaws:
    """Per-turn draws of one (sub)conversation with `n` turns: OSL, tool result, think time.

    OSL >= 2 so every request has an inter-token latency.
    """

    def __init__(self, p: Profile, seed: int, key, n: int):
        osl = _lognormal(n, p.osl_median, p.osl_sigma, seed, key, "osl")
        self.osl = _tokens(osl, p.scale, 2, 16, 16384)
        self.tool = _tokens(_lognormal(n, 272, 1.82, seed, key, "tool"), p.scale, 0, 0, 65536)
        think = _lognormal(n, p.think_median_s, 2.2, seed, key, "think")
        self.think = np.minimum(think, p.think_session_cap_s).tolist()


def _synth_subagents(p: Profile, seed: int, sid: str, turn: int, fan_u: float) -> tuple[Conversation, ...]:
    """Children spawned after a parent turn: fan-out Geometric(mean 1.6) <= 5.

    Siblings share one subagent system prompt (same stream), like real traces do.
    """
    fan_out = min(5, math.ceil(math.log(fan_u) / math.log(1 - 1 / 1.6)))
    sys_len = _tokens(_normal(9000, 1000, seed, sid, turn, "child_sys"), p.scale, 1)
    sys_seg = Segment(f"{sid}/t{turn}/agent-sys", 0, sys_len)
    children = []
    for c in range(fan_out):
        cid = f"{sid}/t{turn}/a{c}"
        turns = int(np.clip(np.rint(_lognormal(1, 12, 0.8, seed, cid, "turns")[0]), 1, p.max_turns))
        body = _tokens(_lognormal(1, 5000, 0.7, seed, cid, "task")[0], p.scale, 1)
        laws = _TurnLaws(p, seed, cid, turns)
        requests = []
        for t in range(turns):
            if t:
                body += laws.osl[t - 1] + laws.tool[t]
            think = laws.think[t] if t else 0.0
            requests.append(Request(canonical((sys_seg, Segment(f"{cid}/ctx", 0, body))), laws.osl[t], think))
        background = uniform(seed, cid, "background") < 0.2
        children.append(Conversation(cid, tuple(requests), sys_len, join=not background))
    return tuple(children)


def synth_session(p: Profile, seed: int, index: int, shared_sys_prefix: bool = False) -> Conversation:
    """One AgentX-synth session, following the laws of BENCH.md 5.2 row by row.

    The context is sys prefix + an "epoch" stream that grows by OSL_{t-1} + tool_t each
    turn; a compaction/reset starts a new epoch of fresh tokens behind the same sys
    prefix. Turns whose ISL + OSL exceed `ctx_cap` are dropped (the 256k corpus rule);
    the next turn is then a forced reset.
    """
    sid = f"s{index}"
    sys_key = ("shared",) if shared_sys_prefix else (index,)
    sys_len = _tokens(_normal(14500, 1500, seed, *sys_key, "sys"), p.scale, 1, 11000, 21000)
    sys_stream = "shared/sys" if shared_sys_prefix else f"{sid}/sys"
    turns = int(np.clip(np.rint(_lognormal(1, 45, 0.96, seed, index, "turns")[0]), 3, min(1200, p.max_turns)))
    # Start kind is stratified (a Weyl sequence over session indices with a seeded
    # offset) rather than i.i.d.: the first-turn ISL median sits in the thin tail between
    # the two modes, and an i.i.d. 60/40 split over 512 sessions moves it by ~20 %.
    if (uniform(seed, "start_kind") + index * 0.6180339887498949) % 1.0 < 0.6:  # fresh session
        body = _tokens(_lognormal(1, 4000, 1.0, seed, index, "first_user")[0], p.scale, 1)
    else:  # resumed session: one big first prompt, all fresh behind the sys prefix
        body = max(1, _tokens(_lognormal(1, 150_000, 0.8, seed, index, "resumed")[0], p.scale) - sys_len)
    laws = _TurnLaws(p, seed, index, turns)
    reset_u = _uniforms(turns, seed, index, "reset").tolist()
    compacted = _tokens(_lognormal(turns, 20000, 0.5, seed, index, "compacted"), p.scale, 1)
    spawn_u = _uniforms(turns, seed, index, "spawn").tolist()
    fan_u = _uniforms(turns, seed, index, "fan_out").tolist()
    epoch, requests = 0, []
    for t in range(turns):
        if t:
            body += laws.osl[t - 1] + laws.tool[t]
            if reset_u[t] < 0.01 or sys_len + body > 0.9 * p.ctx_cap:
                epoch += 1
                body = compacted[t]
        if sys_len + body + laws.osl[t] > p.ctx_cap:
            continue
        spawn = p.subagents and spawn_u[t] < 0.03
        children = _synth_subagents(p, seed, sid, t, fan_u[t]) if spawn else ()
        segs = canonical((Segment(sys_stream, 0, sys_len), Segment(f"{sid}/e{epoch}", 0, body)))
        requests.append(Request(segs, laws.osl[t], laws.think[t] if t else 0.0, children))
    return Conversation(sid, tuple(requests), sys_len)


def agentx_synth(profile: str, seed: int = 42, shared_sys_prefix: bool = False) -> Workload:
    p = PROFILES[profile]
    sessions = tuple(
        s for s in (synth_session(p, seed, i, shared_sys_prefix) for i in range(p.num_sessions)) if s.requests
    )
    params = {"shared_sys_prefix": shared_sys_prefix, **asdict(p)}
    return Workload("agentx-synth", profile, seed, sessions, p.idle_cap_s, p.duration_s, params)


# --------------------------------------------------------------------------- Weka traces


def _trace_calls(trace_id: str, path: str, raw_requests: list, user_start: int) -> tuple[Request, ...]:
    """Turn one (sub)conversation's Weka entries into Requests.

    Block `hash_id` h becomes tokens [64h, 64h+64) of the trace's stream, so equal ids
    mean equal content and contiguous ids merge into one segment; the trailing partial
    block is fresh content of its own. Subagent entries become children of the call
    before them, starting after the gap the trace recorded.
    """
    calls: list[tuple[dict, list[Conversation]]] = []
    prev_t, prev_api = 0.0, 0.0
    pending_children: list[Conversation] = []
    for i, r in enumerate(raw_requests):
        if r.get("type") == "subagent":
            child_path = f"{path}/{r.get('agent_id', i)}"
            delay = max(0.0, r["t"] - prev_t - prev_api) if calls else r["t"]
            child = Conversation(
                f"{trace_id}{child_path}",
                _trace_calls(trace_id, child_path, r["requests"], r["tool_tokens"] + r["system_tokens"]),
                r["tool_tokens"] + r["system_tokens"],
                join=r.get("status") != "async_launched",
                start_delay_s=delay,
            )
            (calls[-1][1] if calls else pending_children).append(child)
            continue
        calls.append((r, pending_children))
        pending_children = []
        prev_t, prev_api = r["t"], r.get("api_time") or 0.0
    out = []
    prev_t, prev_api = 0.0, 0.0
    for i, (r, children) in enumerate(calls):
        segs = [Segment(trace_id, h * BLOCK_TOKENS, BLOCK_TOKENS) for h in r["hash_ids"]]
        segs.append(Segment(f"{trace_id}{path}#tail{i}", 0, r["in"] - BLOCK_TOKENS * len(r["hash_ids"])))
        think = r.get("think_time")
        if think is None:  # missing on some calls: recover it from t = t_prev + api_prev + think
            think = max(0.0, r["t"] - prev_t - prev_api) if i else 0.0
        out.append(Request(canonical(segs), max(1, r["out"]), float(think), tuple(children)))
        prev_t, prev_api = r["t"], r.get("api_time") or 0.0
    return tuple(out)


def load_weka_trace(path: str | Path) -> Conversation:
    """One Weka trace file as a Conversation (subagents as children of the spawning call).

    A subagent listed before any parent call (not seen in the sample traces) is attached
    to the first call.
    """
    doc = json.loads(Path(path).read_text())
    if doc.get("block_size", BLOCK_TOKENS) != BLOCK_TOKENS:
        raise ValueError(f"{path}: block_size {doc['block_size']} != {BLOCK_TOKENS}")
    trace_id = doc.get("id") or Path(path).stem
    user_start = doc.get("tool_tokens", 0) + doc.get("system_tokens", 0)
    return Conversation(trace_id, _trace_calls(trace_id, "", doc["requests"], user_start), user_start)


def weka_traces(trace_dir: str | Path, seed: int = 42) -> Workload:
    sessions = tuple(load_weka_trace(p) for p in sorted(Path(trace_dir).glob("*.json")))
    if not sessions:
        raise ValueError(f"no Weka trace (*.json) in {trace_dir}")
    return Workload("weka-trace", Path(trace_dir).name, seed, sessions, 10.0, 300.0)


# --------------------------------------------------------------------------- random


def random_workload(input_len: int, output_len: int, num: int, seed: int = 42) -> Workload:
    """Single-call sessions of fixed lengths with unrelated prompts (the classic random test)."""
    sessions = tuple(
        Conversation(f"r{i}", (Request((Segment(f"r{i}", 0, input_len),), output_len),)) for i in range(num)
    )
    params = {"input_len": input_len, "output_len": output_len}
    return Workload("random", f"{input_len}x{output_len}", seed, sessions, 0.0, 300.0, params)


# --------------------------------------------------------------------------- prompts


def _slice(segments: tuple[Segment, ...], a: int, b: int) -> list[Segment]:
    """The segments covering tokens [a, b) of a prompt."""
    out, offset = [], 0
    for s in segments:
        lo, hi = max(a, offset), min(b, offset + s.length)
        if lo < hi:
            out.append(Segment(s.stream, s.start + lo - offset, hi - lo))
        offset += s.length
    return out


def with_marker(segments: tuple[Segment, ...], user_start: int, key: str) -> tuple[Segment, ...]:
    """Overwrite MARKER_TOKENS tokens at the first user turn with the play's own marker.

    Overwriting (not inserting) keeps every ISL equal to the spec. The marker sits at the
    same offset in every call of a play, so the play's own prefix sharing is intact while
    other plays of the same session (other concurrency points, recycled lanes) cannot
    reuse anything past the system prefix.
    """
    isl = sum(s.length for s in segments)
    pos = max(0, min(user_start, isl - MARKER_TOKENS))
    end = min(isl, pos + MARKER_TOKENS)
    marker = Segment(f"marker/{key}", 0, end - pos)
    return canonical([*_slice(segments, 0, pos), marker, *_slice(segments, end, isl)])


@lru_cache(maxsize=65536)
def _stream_key(seed: int, stream: str) -> np.uint64:
    return _key(seed, "tokens", stream)


def materialize(segments: tuple[Segment, ...], seed: int, token_range: tuple[int, int]) -> np.ndarray:
    """Token ids of a prompt: token i of stream s is output i of the generator keyed (seed, s).

    Vectorised so 1M-token prompts cost milliseconds; ids fall in [lo, hi) to stay clear
    of special tokens.
    """
    lo, hi = token_range
    parts = []
    for s in segments:
        x = _mix(np.arange(s.start, s.start + s.length), _stream_key(seed, s.stream))
        parts.append(x % np.uint64(hi - lo) + np.uint64(lo))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


_CONSONANTS, _VOWELS = "bcdfghjklmnprstvz", "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]


@lru_cache(maxsize=4)
def _words(hi: int) -> np.ndarray:
    n = len(_SYLLABLES)
    ids = range(hi)
    return np.array([_SYLLABLES[i % n] + _SYLLABLES[i // n % n] + _SYLLABLES[i // (n * n) % n] for i in ids])


def ids_to_text(ids: np.ndarray, token_range: tuple[int, int]) -> str:
    """Chat-mode text: one made-up pronounceable word per id, so equal ids give equal text."""
    return " ".join(_words(token_range[1])[ids].tolist())


# --------------------------------------------------------------------------- prefix hits


class PrefixCache:
    """Ideal infinite prefix cache over segment lists.

    For each prompt seen it records, per chained prefix of whole segments, how far the
    next segment reached. `hit(segments)` returns the longest common token prefix with
    any earlier prompt, floored to BLOCK_TOKENS (caches reuse whole blocks only), and
    then remembers the prompt. Cost is O(segments), independent of prompt length.
    """

    def __init__(self) -> None:
        self._reach: dict[tuple, int] = {}

    def hit(self, segments: tuple[Segment, ...]) -> int:
        chain, matched, matching = 0, 0, True
        for s in segments:
            key = (chain, s.stream, s.start)
            reach = self._reach.get(key, 0)
            if matching:
                matched += min(reach, s.length)
                matching = reach >= s.length
            if s.length > reach:
                self._reach[key] = s.length
            chain = hash((chain, s.stream, s.start, s.length))
        return matched // BLOCK_TOKENS * BLOCK_TOKENS


def theoretical_hits(conv: Conversation, cache: PrefixCache | None = None) -> list[tuple[Request, int]]:
    """(call, ideal cached tokens) for a whole session tree in replay order (children after their parent call)."""
    cache = cache or PrefixCache()
    out = []
    for r in conv.requests:
        out.append((r, cache.hit(r.segments)))
        for child in r.children:
            out.extend(theoretical_hits(child, cache))
    return out

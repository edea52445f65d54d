"""Forward-benchmark cases (vLLM's `bench forward` grammar), the batch each case stands for,
and the analytic floor of one step on an H200 (DESIGN.md "Performance model").

Cases
-----
`NAME=GROUP[,GROUP...]`, each group `[N*]Q[@K][c][:D]`: N requests (default 1) of Q new
tokens on a KV length K that includes them (default Q: an empty cache); `c` = the prefix was
built by earlier chunks of the same request (chunked prefill) rather than found in the
prefix cache (a hit); `:D` = D of the Q tokens are draft tokens to verify. Q, K accept the
suffixes k (x1024) and M (x1048576): `hit=1024@100k`, `decode=8*1@1M`.

What each group means for the batch (`plan_case`):

* Q = 1 or D > 0 (decode, verify) and `c` groups continue a running request: its window
  rings and compressor tails exist, its global KV covers positions < K - Q. The step runs
  the Q new tokens.
* Other groups with K > Q are prefix hits: global KV is cached, window state is not, so the
  step replays cached tokens first (DESIGN.md "Invariants"): bounded replay (default) the last
  `window` tokens, exact replay `num_layers * (window - 1)` tokens (every layer's window
  chain reaches W - 1 positions further back). The replay start is rounded down to a multiple
  of every compress ratio, so no compressor group straddles it; groups below K - Q are
  recomputed but never rewritten (`emit_from`). Window keys below the replay start are
  invisible.
* V4.1 decoder bounded replay: layers from the CED split on run each request's last
  min(rows, window) rows only (exact mode: every row).
* Logits: every new row of a verify group, the last row otherwise.

Floor
-----
For one step, bytes that must cross HBM and FLOPs, per component (the profiler's ranges:
attention, indexer, compressor, moe, mhc, engram, and head = embedding gather + final norm +
LM head). A component's floor is max(bytes / HBM_BW, its compute time), the step's floor is
max(total bytes / HBM_BW, total compute time). What is counted:

* weights actually touched, read once per step (the batch shares them): every layer's dense
  projections at their stored size (FP8: 1 byte per parameter plus one exponent byte per
  tile; BF16 tensors at the activation dtype's size, as loaded; F32 at 4); routed experts
  as the fast path keeps them (FP4: half a byte per parameter, or converted to FP8 under FP8
  activations: 1 byte; + 1 exponent byte per 32), only the expected
  number of distinct experts hit by T tokens choosing k of E uniformly:
  E * (1 - (1 - k/E)^T); `gate.bias_vl` (image tokens only) is never read;
* gathered rows: embedding rows of every computed token, engram table rows
  (24 rows of FP8 + exponent bytes per token), `tid2eid` rows;
* KV read, per layer and request, counted per query then capped by the distinct entries
  that exist (a query tile shares what its queries share): window ring entries
  (min(window, keys above the window floor) per query; 528 B each on V4.1), selected
  compressed entries (min(index_topk, visible) per query, 288 B; V4 HCA: every visible
  entry), indexer keys scored (every visible entry for a source, the candidate pool
  `candidate_topk_blocks * candidate_block_size` for a layer using candidates; 68 B);
* KV written: ring entries (the last min(rows, window) per request), new compressed entries
  and indexer keys (not those of a hit's cached groups);
* activations that cannot stay on chip: the hc x D residual streams, read and written at
  each mHC site and by engram (2 * hc * D * activation bytes per row each); the fp32 logits;
* FLOPs: 2 * parameters per row for every projection (FP8 weights at the FP8 peak, BF16
  weights at the BF16 peak: router, compressor, indexer `weights_proj` / `wk`, `hc_*_fn`,
  LM head), routed experts 2 * parameters * k per row (FP8); attention 4 * H * head_dim per
  key per query (QK^T and PV, BF16 peak); indexer scores 2 * index_heads * index_head_dim
  per scored entry per query (BF16 peak). Elementwise work (norms, RoPE, Sinkhorn, softmax,
  quantisation) is not counted; compressor tails are a few KB and are not counted.

The constants are one H200 measured by the project (DESIGN.md); they are an H200 floor
whatever device ran the step.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from dsv4.cache.storage import bytes_per_entry, ckv_is_fp4, idx_is_fp4, window_is_fp8
from dsv4.config import ModelConfig
from dsv4.model.spec import ENGRAM, FP4, FP8, PLAIN, SCALE, TensorSpec, checkpoint_spec

HBM_BYTES_PER_S = 4.2e12  # H200 HBM copy bandwidth, measured (DESIGN.md)
FP8_FLOPS_PER_S = 1365e12  # H200 dense FP8 GEMM, measured
BF16_FLOPS_PER_S = 758e12  # H200 dense BF16 GEMM, measured
EXPERT_SCALE_GROUP = 32  # compact experts: one exponent byte per 32 inputs
LOGITS_BYTES = 4  # the LM head's output is fp32 per vocabulary entry
COMPONENTS = ("attention", "indexer", "compressor", "moe", "mhc", "engram", "head")

_SUFFIX = {"": 1, "k": 1024, "K": 1024, "m": 1 << 20, "M": 1 << 20}
_NUM = r"(\d+)([kKmM]?)"
_GROUP_RE = re.compile(rf"^(?:{_NUM}\*)?{_NUM}(?:@{_NUM})?(c)?(?::(\d+))?$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
GRAMMAR = "NAME=[N*]Q[@K][c][:D] (groups joined by ','; N requests, Q new tokens, K KV length incl. them, c chunked prefill, D drafts)"


class CaseError(ValueError):
    """A malformed case; the message quotes the case and says what is wrong."""


@dataclass(frozen=True)
class Group:
    requests: int  # N
    new_tokens: int  # Q
    kv_len: int  # K, includes the Q new tokens
    chunked: bool  # `c`
    drafts: int  # D

    @property
    def continues(self) -> bool:
        """The request is running: its window and compressor state exist (no replay)."""
        return self.new_tokens == 1 or self.drafts > 0 or self.chunked


@dataclass(frozen=True)
class Case:
    name: str
    text: str  # the case as given
    groups: tuple[Group, ...]

    @property
    def num_requests(self) -> int:
        return sum(g.requests for g in self.groups)

    @property
    def new_tokens(self) -> int:
        return sum(g.requests * g.new_tokens for g in self.groups)


def _number(digits: str, suffix: str) -> int:
    return int(digits) * _SUFFIX[suffix]


def parse_case(text: str) -> Case:
    """Parse one `NAME=GROUP[,GROUP...]` case; raises CaseError naming the problem."""
    name, eq, body = text.partition("=")
    if not eq or not name:
        raise CaseError(f"case {text!r}: expected {GRAMMAR}")
    if not _NAME_RE.match(name):
        raise CaseError(f"case {text!r}: name {name!r} may only hold letters, digits, '_', '.', '-'")
    if not body:
        raise CaseError(f"case {text!r}: no group after '='; expected {GRAMMAR}")
    groups = []
    for part in body.split(","):
        m = _GROUP_RE.match(part.strip())
        if not m:
            raise CaseError(f"case {text!r}: group {part!r} does not match [N*]Q[@K][c][:D]; expected {GRAMMAR}")
        n = _number(m[1], m[2]) if m[1] else 1
        q = _number(m[3], m[4])
        k = _number(m[5], m[6]) if m[5] else q
        chunked, drafts = m[7] is not None, int(m[8]) if m[8] else 0
        where = f"case {text!r}, group {part!r}"
        if n < 1 or q < 1:
            raise CaseError(f"{where}: N (requests) and Q (new tokens) must be >= 1")
        if k < q:
            raise CaseError(f"{where}: the KV length K={k} includes the Q={q} new tokens, so K must be >= Q")
        if drafts >= q:
            raise CaseError(f"{where}: D={drafts} drafts must be < Q={q} (one of the Q tokens is the verified anchor)")
        if chunked and (k == q or q == 1 or drafts):
            raise CaseError(f"{where}: 'c' (chunk of a prefill) needs a prefix (K > Q), Q > 1 and no drafts")
        groups.append(Group(n, q, k, chunked, drafts))
    return Case(name, text, tuple(groups))


def parse_cases(texts: list[str]) -> list[Case]:
    cases = [parse_case(t) for t in texts]
    seen: set[str] = set()
    for c in cases:
        if c.name in seen:
            raise CaseError(f"case {c.text!r}: name {c.name!r} used twice")
        seen.add(c.name)
    return cases


# --------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class RequestPlan:
    """One request of a step. Its rows hold positions start .. kv_len - 1."""

    group: int
    start: int
    rows: int  # tokens computed (replay + new)
    new_tokens: int
    kv_len: int
    window_floor: int  # encoder side / every V4 layer
    decoder_rows: int  # rows that run the layers from the V4.1 CED split on
    decoder_window_floor: int
    emit_from: int  # compressed groups starting below are already cached
    logits_rows: int  # the last this-many rows get logits

    @property
    def cached(self) -> int:
        """Positions whose global KV is in the cache before the step."""
        return self.kv_len - self.new_tokens


def plan_case(cfg: ModelConfig, case: Case, *, bounded_replay: bool = True) -> list[RequestPlan]:
    """The requests of `case` in batch order (see the module docstring for the rules)."""
    w = cfg.window
    align = max(cfg.compress_ratio_set, default=1)
    plans = []
    for gi, g in enumerate(case.groups):
        if g.kv_len > cfg.max_position_embeddings:
            raise CaseError(f"case {case.text!r}: KV length {g.kv_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        first_new = g.kv_len - g.new_tokens
        if g.continues or first_new == 0:
            start = first_new
            floor = 0
        else:
            replay = min(first_new, w if bounded_replay else len(cfg.roles) * (w - 1))
            start = (first_new - replay) // align * align
            floor = start
        rows = g.kv_len - start
        split = bounded_replay and cfg.ced_split is not None
        decoder_rows = min(rows, w) if split else rows
        decoder_floor = max(floor, g.kv_len - w) if split else floor
        # a hit rewrites from the compressor group holding its first new token on
        emit_from = first_new // align * align if start < first_new else 0
        logits = g.new_tokens if g.drafts else 1
        plan = RequestPlan(gi, start, rows, g.new_tokens, g.kv_len, floor, decoder_rows, decoder_floor, emit_from, logits)
        plans += [plan] * g.requests
    return plans


# ------------------------------------------------------------------------------------ floor


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit when `tokens` tokens each pick `top_k` of `num_experts`
    uniformly: each expert is missed by one token with probability 1 - k/E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class _Sums:
    """Per-component bytes and FLOPs (FP8 and BF16 peaks)."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(COMPONENTS, 0.0)
        self.fp8 = dict.fromkeys(COMPONENTS, 0.0)
        self.bf16 = dict.fromkeys(COMPONENTS, 0.0)


def _tensor_bytes(s: TensorSpec, act: int, fp4_kept: bool = False) -> int:
    """Bytes of a tensor as the fast path holds it; FP4 (routed experts, `fp4_kept`: compact
    FP4, as stored, else converted to FP8: 1 byte per parameter; the scale is its own entry)."""
    n = math.prod(s.shape)
    if s.fmt in (FP8, SCALE, ENGRAM):
        return n
    if s.fmt == FP4:
        return n if fp4_kept else 2 * n
    return n * {"F32": 4, "I64": 8}.get(s.dtypes[0], act)


def _params(s: TensorSpec) -> int:
    return math.prod(s.shape) * (2 if s.fmt == FP4 else 1)


def _classify(local: str) -> tuple[str, str]:
    """(component, use) of a per-layer tensor (name without `layers.i.`). use: "row" = a
    projection applied to every row of the layer, "enc_row" = to every row the compressor sees,
    "entry" = to every new compressed entry, "read" = read once, "skip" = never read,
    "expert" / "gather" = counted separately."""
    if local.startswith("hc_"):
        return "mhc", "row" if local.endswith("_fn") else "read"
    if local.startswith("engram."):
        if local.startswith("engram.embed."):
            return "engram", "gather"
        return "engram", "row" if local.startswith("engram.wkv.") else "read"
    if local.startswith(("ffn.", "ffn_norm")):
        if local.startswith("ffn.experts."):
            return "moe", "expert"
        if local.endswith("bias_vl"):
            return "moe", "skip"
        if local.endswith("tid2eid"):
            return "moe", "gather"
        return "moe", "read" if local.endswith(("norm.weight", "gate.bias")) else "row"
    if local.startswith(("attn.compressor.", "attn.indexer.compressor.")):
        return "compressor", "enc_row" if local.endswith(("wkv.weight", "wgate.weight")) else "read"
    if local.startswith(("attn.indexer.wk.", "attn.indexer.k_norm.")):
        return "compressor", "entry" if "wk." in local else "read"
    if local.startswith("attn.indexer."):
        return "indexer", "row"
    if local.endswith(("norm.weight", "attn_sink")):
        return "attention", "read"
    return "attention", "row"


@lru_cache(maxsize=8)
def _tensors(cfg: ModelConfig) -> tuple[list[tuple[str, TensorSpec]], dict[int, list[tuple[str, TensorSpec]]]]:
    """The forward's tensors: (top-level (name, spec)), {layer: [(name inside the layer,
    spec)]}, routed experts represented by expert 0 (a real V4.1 spec has 92k entries; this
    runs once per config)."""
    top: list[tuple[str, TensorSpec]] = []
    per_layer: dict[int, list[tuple[str, TensorSpec]]] = {}
    for name, t in checkpoint_spec(cfg).items():
        if t.group != "model":
            continue
        if not name.startswith("layers."):
            top.append((name, t))
            continue
        _, idx, local = name.split(".", 2)
        if local.startswith("ffn.experts.") and not local.startswith("ffn.experts.0."):
            continue
        per_layer.setdefault(int(idx), []).append((local, t))
    return top, per_layer


def _window_keys(first: int, last: int, floor: int, w: int) -> tuple[int, int]:
    """(sum over queries first..last of visible window keys, distinct keys): query p sees
    positions max(floor, p - w + 1) .. p."""
    p = np.arange(first, last + 1, dtype=np.int64)
    per_query = np.minimum(w, p - floor + 1)
    return int(per_query.sum()), last - max(floor, first - w + 1) + 1


def _visible(first: int, last: int, ratio: int) -> np.ndarray:
    """Compressed entries visible to each query first..last (entry j covers j*r .. j*r+r-1)."""
    return (np.arange(first, last + 1, dtype=np.int64) + 1) // ratio


def case_floor(cfg: ModelConfig, case: Case | str, dtype: torch.dtype = torch.bfloat16, *, bounded_replay: bool = True) -> dict:
    """The floor of one step of `case` (see the module docstring).

    -> {"components": {name: {"bytes", "flops_fp8", "flops_bf16", "memory_ms", "compute_ms",
    "floor_ms"}}, the same six totals, "bound" ("memory" / "compute"), "rows", "new_tokens",
    "constants"}."""
    if isinstance(case, str):
        case = parse_case(case)
    plans = plan_case(cfg, case, bounded_replay=bounded_replay)
    counts = Counter(plans)  # identical requests of a group: compute once, weigh by count
    act = torch.empty((), dtype=dtype).element_size()
    d, hc, w = cfg.hidden_size, cfg.hc_mult, cfg.window
    split = cfg.ced_split
    s = _Sums()

    def layer_rows(i: int) -> list[tuple[int, int, int, int]]:
        """(count, first position, window floor, kv_len) of the rows layer i's attention and
        FFN run, per distinct request."""
        if split is not None and i >= split:
            return [(c, p.kv_len - p.decoder_rows, p.decoder_window_floor, p.kv_len) for p, c in counts.items()]
        return [(c, p.start, p.window_floor, p.kv_len) for p, c in counts.items()]

    ring_b = bytes_per_entry(cfg.head_dim, "fp8" if window_is_fp8(cfg) else None, dtype)
    ckv_b = bytes_per_entry(cfg.head_dim, "fp4_e4m3" if ckv_is_fp4(cfg) else None, dtype)
    idx_b = bytes_per_entry(cfg.index_head_dim, "fp4_ue8m0" if idx_is_fp4(cfg) else None, dtype)
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    enc_rows = sum(p.rows for p in plans)
    logits = sum(p.logits_rows for p in plans)

    top, per_layer = _tensors(cfg)
    for name, t in top:
        if name == "embed.weight":
            s.bytes["head"] += enc_rows * d * act
        elif name == "head.weight" or name == "hc_head_fn":
            s.bytes["head"] += _tensor_bytes(t, act)
            s.bf16["head"] += 2 * _params(t) * logits
        else:  # final norm, hc_head base / scale
            s.bytes["head"] += _tensor_bytes(t, act)
    s.bytes["head"] += logits * cfg.vocab_size * LOGITS_BYTES

    for role in cfg.roles:
        i = role.index
        rows = layer_rows(i)
        t_rows = sum(c * (kv - first) for c, first, _, kv in rows)
        new_entries = 0
        if role.owns_compressor:
            r = role.compress_ratio
            for p, c in counts.items():
                new_entries += c * max(0, p.kv_len // r - max(p.start // r, -(-p.emit_from // r)))
        expert_bytes = expert_params = 0
        for local, t in per_layer[i]:
            comp, use = _classify(local)
            if use == "skip":
                continue
            if use == "expert":  # expert 0 stands for every expert
                expert_bytes += _tensor_bytes(t, act, cfg.fp4_experts)
                expert_params += _params(t) if t.fmt != SCALE else 0
                continue
            if use == "gather":
                if local.endswith("tid2eid"):
                    s.bytes[comp] += t_rows * t.shape[1] * 8
                elif local == "engram.embed.weight":
                    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
                    row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
                    s.bytes[comp] += t_rows * cols * row_bytes
                continue
            s.bytes[comp] += _tensor_bytes(t, act)
            if t.fmt == SCALE or use == "read":
                continue
            n = {"row": t_rows, "enc_row": enc_rows, "entry": new_entries}[use]
            flops = 2 * _params(t) * n
            if t.fmt == PLAIN:
                s.bf16[comp] += flops
            else:
                s.fp8[comp] += flops
        # routed experts: distinct experts' weights once, k experts' FLOPs per row
        k = cfg.num_experts_per_tok
        s.bytes["moe"] += expected_experts(cfg.n_routed_experts, k, t_rows) * expert_bytes
        s.fp8["moe"] += 2 * expert_params * k * t_rows
        # activations: residual streams at the two mHC sites (and engram), read + write
        s.bytes["mhc"] += 2 * 2 * hc * d * act * t_rows
        if role.engram:
            s.bytes["engram"] += 2 * hc * d * act * t_rows
        # attention: window keys, selected compressed entries; ring writes
        keys_total = 0
        for c, first, floor, kv in rows:
            last = kv - 1
            summed, distinct = _window_keys(first, last, floor, w)
            s.bytes["attention"] += c * (min(summed, distinct) + min(kv - first, w)) * ring_b
            keys_total += c * summed
            if role.kv_source is None:
                continue
            r = role.compress_ratio
            vis = _visible(first, last, r)
            if role.index_source is not None:
                selected = int(np.minimum(vis, cfg.index_topk).sum())
            elif role.kind == "hca":
                selected = int(vis.sum())
            else:
                selected = 0
            s.bytes["attention"] += c * min(selected, kv // r) * ckv_b
            keys_total += c * selected
            if role.runs_indexer:
                scored = int((np.minimum(vis, pool) if role.uses_candidates else vis).sum())
                s.bytes["indexer"] += c * min(scored, kv // r) * idx_b
                s.bf16["indexer"] += c * 2 * cfg.index_n_heads * cfg.index_head_dim * scored
        s.bf16["attention"] += 4 * cfg.num_heads * cfg.head_dim * keys_total
        if role.owns_compressor:
            has_idx = cfg.arch == "v41" or role.kind == "csa"
            s.bytes["compressor"] += new_entries * (ckv_b + (idx_b if has_idx else 0))
    return _report(s, plans, case)


def _times(nbytes: float, fp8: float, bf16: float) -> dict:
    memory = nbytes / HBM_BYTES_PER_S * 1e3
    compute = (fp8 / FP8_FLOPS_PER_S + bf16 / BF16_FLOPS_PER_S) * 1e3
    return {
        "bytes": nbytes, "flops_fp8": fp8, "flops_bf16": bf16,
        "memory_ms": memory, "compute_ms": compute, "floor_ms": max(memory, compute),
    }


def _report(s: _Sums, plans: list[RequestPlan], case: Case) -> dict:
    comps = {c: _times(s.bytes[c], s.fp8[c], s.bf16[c]) for c in COMPONENTS}
    total = _times(sum(s.bytes.values()), sum(s.fp8.values()), sum(s.bf16.values()))
    return {
        "components": comps,
        **total,
        "bound": "memory" if total["memory_ms"] >= total["compute_ms"] else "compute",
        "rows": sum(p.rows for p in plans),
        "new_tokens": case.new_tokens,
        "constants": {
            "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "fp8_flops_per_s": FP8_FLOPS_PER_S,
            "bf16_flops_per_s": BF16_FLOPS_PER_S,
        },
    }

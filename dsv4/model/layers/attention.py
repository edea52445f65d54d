"""Attention of one layer: shared-KV MQA over the sliding window plus the selected compressed
entries, with sinks, inverse RoPE and the grouped output projection; and the compressed
branch (compressor, indexer keys, indexer) that feeds it.

Two implementations of the same layer share the weights:

* the reference path (`__call__`, `compress`, `select`): torch ops on gathers planned on the
  host once per `Segments` and shared by all layers; the compressor walks requests one by one.
  Bitwise batch invariant on CPU (docs/architecture.md), the oracle of the tests;
* the fast path (`forward_fast`, `compress_fast`, `select_fast`): the ops of dsv4.ops
  (Triton kernels on CUDA, their torch references elsewhere) on the device metadata of
  dsv4.model.step, with no host synchronisation and fixed shapes, so that CUDA graphs can
  capture it. The kernels read V4.1's quantised caches (FP8 ring, FP4 compressed KV and
  indexer keys) and V4's unquantised (bf16) ones; V4's HCA layers attend every visible entry,
  its compressors add the position bias and (CSA) overlap their windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4.cache.storage import KVCacheStorage, QTensor
from dsv4.config import LayerRole, ModelConfig
from dsv4.model.batch import ForwardBatch
from dsv4.model.sections import section
from dsv4.model.step import Rows, Step
from dsv4.ops import attention as attention_ops
from dsv4.ops import compressor as compressor_ops
from dsv4.ops import indexer as index_ops
from dsv4.ops import kv as kvops
from dsv4.ops.linear import Linear, grouped_linear, grouped_takes_codes, linear, linear_fp32, stack_rows
from dsv4.ops.norm import head_norm, rms_norm
from dsv4.ops.rope import RopeTables, apply_rope, apply_rope_


@dataclass
class Segments:
    """The rows a layer runs on, per request: rows offsets[b]:offsets[b+1] hold positions
    starts[b] .. starts[b]+counts[b]-1; window keys below floors[b] are invisible."""

    requests: list[int]  # batch request index of each segment
    starts: list[int]
    counts: list[int]
    floors: list[int]
    positions: torch.Tensor  # [R]

    def __post_init__(self) -> None:
        self.offsets = [0]
        for c in self.counts:
            self.offsets.append(self.offsets[-1] + c)
        self._plans: dict = {}

    def rows(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    def plan(self, key, build):
        """Index tensors derived from these rows, built once and reused by every layer that
        runs on them (one host build and upload per forward, not per layer)."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def live(self) -> dict[str, torch.Tensor]:
        """Host tensors over the segments that have rows (zero-count segments contribute
        nothing): seg (segment index), start, count, floor, offset (first row); and per row
        row_seg (its live segment) and row_pos (its position)."""
        return self.plan("live", self._live)

    def _live(self) -> dict[str, torch.Tensor]:
        idx = [i for i, c in enumerate(self.counts) if c > 0]
        pick = lambda v: torch.tensor([v[i] for i in idx], dtype=torch.long)
        live = dict(seg=torch.tensor(idx, dtype=torch.long), start=pick(self.starts), count=pick(self.counts),
                    floor=pick(self.floors), offset=pick(self.offsets))
        # per row: which live segment it belongs to, and its position (start + row - offset);
        # rows of live segments are exactly 0 .. offsets[-1]-1 in order
        live["row_seg"] = torch.repeat_interleave(torch.arange(len(idx)), live["count"])
        rows = torch.arange(self.offsets[-1])
        live["row_pos"] = live["start"][live["row_seg"]] + rows - live["offset"][live["row_seg"]]
        return live


@dataclass
class WindowPlan:
    """Window gather for all rows: `ring_index` names the ring rows to decode (positions
    before each segment's start that some query sees); `keys` [T, W] indexes
    cat(decoded ring rows, this step's keys) in canonical slot order (slot s of a query at p
    holds p-W+1+s); `write_rows` / `write_index` store each segment's last min(n, W) keys."""

    ring_index: tuple[torch.Tensor, torch.Tensor]
    keys: torch.Tensor
    valid: torch.Tensor
    write_rows: torch.Tensor
    write_index: tuple[torch.Tensor, torch.Tensor]


def _window_plan(segs: Segments, slots: list[int], w: int, device) -> WindowPlan:
    lv = segs.live()
    start, count, off = lv["start"], lv["count"], lv["offset"]
    slot = torch.tensor([slots[segs.requests[i]] for i in lv["seg"].tolist()], dtype=torch.long)
    first = torch.maximum(lv["floor"], start - w + 1).clamp_min(0)  # oldest visible position
    n_old = (start - first).clamp_min(0)  # ring rows a segment reads
    old_base = torch.cumsum(n_old, 0) - n_old
    n_ring = int(n_old.sum())
    old_seg = torch.repeat_interleave(torch.arange(len(n_old)), n_old)
    old_pos = first[old_seg] + torch.arange(n_ring) - old_base[old_seg]

    seg = lv["row_seg"].unsqueeze(1)
    q = lv["row_pos"].unsqueeze(1) - w + 1 + torch.arange(w)
    f, p0 = first[seg], start[seg]
    valid = q >= f
    q = torch.maximum(q, f)  # invisible slots read the oldest visible key, as a real key
    keys = torch.where(q < p0, old_base[seg] + q - f, n_ring + off[seg] + q - p0)

    keep = torch.minimum(count, torch.tensor(w))
    w_seg = torch.repeat_interleave(torch.arange(len(keep)), keep)
    j = torch.arange(int(keep.sum())) - (torch.cumsum(keep, 0) - keep)[w_seg]
    tail = count[w_seg] - keep[w_seg] + j
    dev = lambda t: t.to(device)
    return WindowPlan(
        ring_index=(dev(slot[old_seg]), dev(old_pos % w)),
        keys=dev(keys), valid=dev(valid),
        write_rows=dev(off[w_seg] + tail),
        write_index=(dev(slot[w_seg]), dev((start[w_seg] + tail) % w)),
    )


@dataclass
class Ragged:
    """Rows padded to a wider compressed-entry table: each row's own entry count, and the rows
    of each distinct count (the products over entries run per count, see `Attention._attend`)."""

    width: torch.Tensor  # [T]
    groups: list[tuple[torch.Tensor, int]]


def _ragged(own: torch.Tensor, width: int, device) -> Ragged | None:
    """Host per-row own entry counts -> None when every row has `width`, else `Ragged`."""
    if bool((own == width).all()):
        return None
    groups = [(torch.nonzero(own == w).squeeze(1).to(device), int(w)) for w in torch.unique(own).tolist() if w > 0]
    return Ragged(own.to(device), groups)


def _entry_locations(segs: Segments, entries: torch.Tensor, batch: ForwardBatch, ratio: int, block_size: int):
    """Cache locations (blocks, offsets) of per-row compressed entries [T, K] (all real
    entries of the row's request; masked ones too are read, then weighted 0)."""
    device = batch.block_tables.device
    lv = segs.live()
    req = torch.tensor(segs.requests, dtype=torch.long)[lv["seg"][lv["row_seg"]]].to(device)
    entries = entries.to(device)
    per_block = block_size // ratio
    return batch.block_tables[req.unsqueeze(1), entries // per_block], entries % per_block


@dataclass
class SelectPlan:
    """The indexer's gathers for all rows: `locations` of each live segment's entries padded
    to `width` (the most any request has; padding re-reads the last real entry), per row its
    live segment, the entries it sees ([R, width]), its newest visible candidate block and the
    top-k columns it owns ([R, min(index_topk, width)]); `owned` maps each segment with rows
    and entries to (request, rows, entry count)."""

    width: int
    owned: dict[int, tuple[int, slice, int]]
    locations: tuple[torch.Tensor, torch.Tensor]
    row_seg: torch.Tensor
    visible: torch.Tensor
    newest: torch.Tensor
    in_k: torch.Tensor


def topk_lowest_index_on_ties(scores: torch.Tensor, k: int):
    """Top-k along the last axis where equal scores prefer the lower index. ReLU index scores
    are exactly 0 for many entries; torch.topk breaks such ties differently for different
    tensor lengths, which would make a chunked prefill select differently from a whole one."""
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    return torch.return_types.topk((values[..., :k], indices[..., :k]))


# Rows of one indexer score table per call: bounds a long prefill's [rows, entries] scores.
SCORE_BYTES = 1 << 28
# Whether FP8 activations take wo_a's input from the PV epilogue (`sparse_attention(...,
# fp8_output=True)`) instead of quantising the bf16 output in `grouped_linear`. The epilogue
# builds the codes from their bits (`fp8_gemm.e4m3_bits`; sm_90's compiled cast had read a
# stale register for a quarter of them, thirty-second session): the same bits as fp8_act_quant
# on the device at T = 1, 8, 64, 256 and 4096, and insitu8 passes with it (H100, thirty-fourth
# session). Off because it does not pay: graph-replayed steps under --fp8-activations were
# -1.5% at d1_8k, +1.1% at d64_32k, level at p8k (docs/PERF.md, S34-3), so the separate
# quantiser (one launch a layer) runs.
FP8_OUTPUT_EPILOGUE = False


def _by_rows(score, n_rows: int, width: int) -> torch.Tensor:
    """`score(rows)` over slices of rows small enough that one slice's fp32 score table stays
    under SCORE_BYTES, concatenated (one call for decode)."""
    step = max(1, SCORE_BYTES // (4 * max(width, 1)))
    if n_rows <= step:
        return score(slice(0, n_rows))
    return torch.cat([score(slice(c, min(c + step, n_rows))) for c in range(0, n_rows, step)])


def _no_entries(cache: KVCacheStorage) -> QTensor:
    """A compressed-KV tensor for layers that attend no entries (top-k width 0): the kernel
    reads nothing from it, but wants valid shapes."""
    if cache.ckv:
        return next(iter(cache.ckv.values()))
    d = cache.cfg.head_dim
    return QTensor(codes=torch.zeros(1, 1, d // 2, dtype=torch.uint8, device=cache.device),
                   scales=torch.zeros(1, 1, d // 16, dtype=torch.float8_e4m3fn, device=cache.device))


def _stored(q: QTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache tensor as the fast-path ops take it: (codes, scales), or (values, None) for V4's
    unquantised caches."""
    return (q.codes, q.scales) if q.quantized else (q.values, None)


def _all_visible(visible: torch.Tensor, width: int) -> torch.Tensor:
    """V4 HCA's selection: entries 0 .. visible[t]-1 of each row, ascending, as a [R, width]
    int32 table (-1 = none)."""
    cols = torch.arange(width, device=visible.device)
    return torch.where(cols < visible.unsqueeze(1), cols, -1).to(torch.int32)


def _proj(w: dict, name: str, cfg: ModelConfig) -> Linear:
    """An FP8 projection of the checkpoint (its input quantised under `cfg.fp8_activations`)."""
    return Linear(w[f"{name}.weight"], w.get(f"{name}.scale"), cfg.weight_block_size, quant_input=cfg.fp8_activations)


class Compressor:
    """Pools `ratio` consecutive tokens into one entry (softmax gate, aligned to absolute
    positions); V4's ratio-4 variant overlaps each window with the previous window's first
    half. Incomplete groups wait in the request's state slot. Returns the pre-RoPE entries."""

    def __init__(self, w: dict, prefix: str, cfg: ModelConfig, ratio: int, width: int, overlap: bool, state: str):
        self.cfg, self.ratio, self.width, self.overlap, self.state = cfg, ratio, width, overlap, state
        self.v41 = cfg.arch == "v41"
        self.wkv = w[prefix + "wkv.weight"]
        self.wgate = w.get(prefix + "wgate.weight")
        self.wkv_gate = None
        if ratio > 1:  # one [2 * width, D] weight for a single GEMM; wkv and wgate are views of its halves
            # (V4.1's pooling projections run in fp32: converted once, not per call)
            self.wkv_gate = torch.cat([self.wkv.float(), self.wgate.float()] if self.v41 else [self.wkv, self.wgate])
            self.wkv, self.wgate = self.wkv_gate.split([self.wkv.shape[0], self.wgate.shape[0]])
        self.ape = w.get(prefix + "ape")
        self.norm = w[prefix + "norm.weight"]

    def _fp32_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1's pooling inputs (kv, gate), fp32 [R, width] each, from one fp32 GEMM."""
        return linear_fp32(x, self.wkv_gate).split([self.wkv.shape[0], self.wgate.shape[0]], dim=1)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, weight_in_fp32=not self.v41)

    def __call__(self, x: torch.Tensor, segs: Segments, batch: ForwardBatch, cache: KVCacheStorage, layer: int) -> list[tuple[int, torch.Tensor]]:
        """-> per segment (index of the first entry emitted, entries [m, width])."""
        r, dtype = self.ratio, x.dtype
        if r == 1:  # V4.1 decoder source: every token is its own entry, no gate
            latent = self._norm(linear(x, self.wkv.to(dtype)))
            return [(segs.starts[i], latent[segs.rows(i)]) for i in range(len(segs.starts))]
        if self.v41:  # pooling math in fp32 (the reference keeps these projections fp32)
            kv_all, gate_all = self._fp32_projections(x)
        else:
            kv_all = linear(x, self.wkv.to(dtype))
            gate_all = linear(x, self.wgate.to(dtype))
        key = (layer, self.state)
        tail_kv, tail_gate = cache.tail_kv[key], cache.tail_gate[key]
        out = []
        for i, b in enumerate(segs.requests):
            slot, p0 = batch.slots[b], segs.starts[i]
            rows = segs.rows(i)
            pend = p0 % r
            kv = torch.cat([tail_kv[slot, :pend].to(kv_all.dtype), kv_all[rows]])
            gate = torch.cat([tail_gate[slot, :pend].to(gate_all.dtype), gate_all[rows]])
            n_win = kv.shape[0] // r
            done = n_win * r
            rem = kv.shape[0] - done
            tail_kv[slot, :rem] = kv[done:].float()
            tail_gate[slot, :rem] = gate[done:].float()
            j0 = (p0 - pend) // r
            if n_win == 0:
                out.append((j0, kv.new_zeros(0, self.width, dtype=dtype)))
                continue
            kv = kv[:done].view(n_win, r, -1)
            gate = gate[:done].view(n_win, r, -1)
            if self.ape is not None:
                gate = gate + self.ape
            if self.overlap:
                kv, gate = self._overlap(kv, gate, slot, j0, cache, key)
            if self.v41:
                latent = (kv * gate.softmax(dim=1)).sum(dim=1).to(dtype)
            else:
                latent = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
            out.append((j0, self._norm(latent)))
        return out

    def _overlap(self, kv, gate, slot, j0, cache, key):
        """Entry j mixes window j-1's first half (Ca) with window j's second half (Cb) over
        2r slots. Window j-1 of an earlier step comes from the state slot; before window 0
        there is nothing (gate -inf, weight 0)."""
        n_win, r, w = kv.shape[0], self.ratio, self.width
        prev_kv, prev_gate = cache.prev_kv[key], cache.prev_gate[key]
        new_kv = kv.new_zeros(n_win, 2 * r, w)
        new_gate = gate.new_full((n_win, 2 * r, w), float("-inf"))
        new_kv[:, r:] = kv[..., w:]
        new_gate[:, r:] = gate[..., w:]
        new_kv[1:, :r] = kv[:-1, :, :w]
        new_gate[1:, :r] = gate[:-1, :, :w]
        if j0 > 0:
            new_kv[0, :r] = prev_kv[slot].to(kv.dtype)
            new_gate[0, :r] = prev_gate[slot].to(gate.dtype)
        prev_kv[slot] = kv[-1, :, :w].float()
        prev_gate[slot] = gate[-1, :, :w].float()
        return new_kv, new_gate

    def fast(self, x: torch.Tensor, rows: Rows, step: Step, cache: KVCacheStorage, layer: int, cos: torch.Tensor, sin: torch.Tensor,
             target: QTensor) -> tuple[torch.Tensor, tuple, torch.Tensor]:
        """Fast path: the entry every row would complete, computed for all rows with fixed
        shapes; the completed ones (not cached yet) go to `target` (the compressed KV cache;
        V4's indexer compressor: the indexer keys) in its format, rotated by cos / sin (the
        angles of each row's entry position), by `ops.compressor.compress_entries`. -> (pre-RoPE
        entries [R, width], their cache locations, emit [R]: the row's entry was stored). The
        rows of each request's trailing incomplete group then go to its state slot's tail."""
        r, dtype = self.ratio, x.dtype
        common = (rows.req, rows.positions, rows.start, rows.row0, rows.write, step.slots, step.emit_from, step.block_tables,
                  self.norm, self.cfg.rms_norm_eps, cos, sin, target, r, cache.block_size, dtype)
        if r == 1:  # every token is its own entry, no gate
            return compressor_ops.compress_entries(linear(x, self.wkv.to(dtype)), None, None, None, *common)
        key = (layer, self.state)
        if self.v41:
            kv_all, gate_all = self._fp32_projections(x)  # fp32 pooling math, as the reference
            v4 = None
        else:  # the activation dtype (one GEMM; kv and gate are column views of it), the position bias and (CSA) the overlapping windows
            kv_all, gate_all = linear(x, self.wkv_gate.to(dtype)).split([self.wkv.shape[0], self.wgate.shape[0]], dim=1)
            v4 = compressor_ops.V4Pooling(self.ape, self.overlap, cache.prev_kv.get(key), cache.prev_gate.get(key), rows.count)
        tail_kv, tail_gate = cache.tail_kv[key], cache.tail_gate[key]
        out = compressor_ops.compress_entries(kv_all, gate_all, tail_kv, tail_gate, *common, v4=v4)
        # after the pooling read the tails: the trailing incomplete group of each request
        pending, where = rows.by_ratio("tail", r), (rows.slot, rows.by_ratio("in_group", r))
        kvops.store_plain(tail_kv, where, kv_all, pending)
        kvops.store_plain(tail_gate, where, gate_all, pending)
        return out


class Attention:
    def __init__(self, w: dict, p: str, cfg: ModelConfig, role: LayerRole, rope: RopeTables):
        """`p`: the tensor-name prefix of this attention (`layers.{i}.attn.`, `mtp.{k}.attn.`)."""
        self.cfg, self.role, self.rope = cfg, role, rope
        self.v41 = cfg.arch == "v41"
        self.wq_b = _proj(w, p + "wq_b", cfg)
        # wq_a and wkv read the same input: the fast path runs them as one GEMM (`ops.attention.latent_inputs` takes its output)
        self.wq_a_kv, (self.wq_a, self.wkv) = stack_rows([_proj(w, p + "wq_a", cfg), _proj(w, p + "wkv", cfg)])
        self.wo_a, self.wo_b = _proj(w, p + "wo_a", cfg), _proj(w, p + "wo_b", cfg)
        self.wo_a_groups = self.wo_a.split_rows([self.wo_a.out_features // cfg.o_groups] * cfg.o_groups)  # one per output group
        self.q_norm, self.kv_norm = w[p + "q_norm.weight"], w[p + "kv_norm.weight"]
        self.sink = w[p + "attn_sink"]
        self.compressor = self.index_compressor = None
        if role.owns_compressor:
            r = role.compress_ratio
            self.compressor = Compressor(w, p + "compressor.", cfg, r, cfg.head_dim, role.kind == "csa", "kv")
            if self.v41:
                self.idx_wk = w[p + "indexer.wk.weight"]
                self.idx_k_norm = w[p + "indexer.k_norm.weight"]
            elif role.kind == "csa":
                self.index_compressor = Compressor(w, p + "indexer.compressor.", cfg, r, cfg.index_head_dim, True, "idx")
        self.wq_b_idx = None
        if role.runs_indexer:
            # wq_b and the indexer's wq_b read the same q_res: the fast path runs them as one GEMM
            self.wq_b_idx, (self.wq_b, self.idx_wq_b) = stack_rows([self.wq_b, _proj(w, p + "indexer.wq_b", cfg)])
            self.idx_weights = w[p + "indexer.weights_proj.weight"]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, weight_in_fp32=not self.v41)

    # ------------------------------------------------------------------ compressed branch
    def compress(self, x: torch.Tensor, segs: Segments, batch: ForwardBatch, cache: KVCacheStorage) -> None:
        """Run the compressor(s) over these rows and write the completed entries (compressed
        KV and indexer keys) into the request's blocks."""
        layer, r = self.role.index, self.role.compress_ratio
        ckv, idx = cache.ckv[layer], cache.idx.get(layer)
        main = self.compressor(x, segs, batch, cache, layer)
        index = self.index_compressor(x, segs, batch, cache, layer) if self.index_compressor else None
        for i, b in enumerate(segs.requests):
            j0, latent = main[i]
            m = latent.shape[0]
            if m == 0:
                continue
            entries = torch.arange(j0, j0 + m, device=latent.device)
            keep = entries * r >= batch.emit_from[b]  # groups of a prefix hit are already cached
            if not bool(keep.any()):
                continue
            entries, latent = entries[keep], latent[keep]
            cos, sin = self.rope.cos_sin(entries * r, "compress")
            blocks, offs = kvops.entry_locations(batch.block_tables[b], entries, r, cache.block_size)
            if idx is not None:
                if self.v41:  # indexer keys come from the PRE-RoPE latent
                    keys = self.norm(linear(latent, self.idx_wk.to(latent.dtype)), self.idx_k_norm)
                else:
                    keys = index[i][1][keep]
                kvops.store(idx, (blocks, offs), apply_rope(keys, cos, sin), "idx")
            kvops.store(ckv, (blocks, offs), apply_rope(latent, cos, sin), "ckv")

    def select(self, x: torch.Tensor, q_res: torch.Tensor, segs: Segments, batch: ForwardBatch, cache: KVCacheStorage, shared: dict) -> None:
        """Indexer of an index source: score every visible entry of the KV source for each
        query, keep the top-k (two-level with candidate blocks on V4.1), publish per segment.

        All requests at once, so a layer launches a fixed number of kernels whatever the
        batch: each request's entries are padded to the widest request's (padding scores -inf,
        so the stable sort puts it after every real entry and it is never picked) and each
        query row is scored against its own request's keys by one batched product per chunk
        of rows (chunks bound the gathered keys and scores of long prefills). Each score is
        one dk-long dot product and one sum over heads whatever the padding; checked bitwise
        against the per-request indexer on CPU (fp32/bf16, ragged decode and prefill)."""
        cfg, role = self.cfg, self.role
        r = role.compress_ratio
        idx_cache = cache.idx[role.kv_source]
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        q = self.idx_wq_b(q_res).view(-1, ih, ihd)
        cos, sin = self.rope.cos_sin(segs.positions, "compress")
        q = apply_rope(q, cos, sin)
        if self.v41:
            q = kvops.round_trip(idx_cache, q, "idx")  # QAT: the query is FP4 too
        weights = linear(x, self.idx_weights.to(x.dtype)).float() * ih**-0.5
        plan = segs.plan(("select", r), lambda: self._select_plan(segs, batch, cache.block_size))
        cands = {}
        if plan.width > 0:
            keys = kvops.load(idx_cache, plan.locations, "idx", torch.float32)  # [S, Tmax, dk]
            q, n = q.float(), q.shape[0]
            step = max(1, (1 << 26) // (plan.width * (ihd + ih)))  # bounds a chunk's keys and scores
            scores = torch.cat([
                (torch.einsum("rhd,rtd->rht", q[c : c + step], keys[plan.row_seg[c : c + step]]).relu() * ihd**-0.5
                 * weights[c : c + step].unsqueeze(-1)).sum(dim=1)
                for c in range(0, n, step)
            ]).masked_fill(~plan.visible, float("-inf"))  # [R, Tmax]
            if role.is_candidate_source:
                keep, blocks = self._candidates(scores, plan.newest)
                shared["cand_rows"] = (segs, keep)
                for b, rows, total in plan.owned.values():
                    cands[b] = keep[rows, :total]
                    if batch.trace is not None:
                        n_blocks = min(cfg.candidate_topk_blocks, -(-total // cfg.candidate_block_size))
                        batch.trace.setdefault(f"L{role.index}.candidate_blocks", []).append(blocks[rows, :n_blocks])
            elif role.uses_candidates and "cand" in shared:
                scores = scores.masked_fill(~self._candidate_rows(segs, plan, shared), float("-inf"))
            top = topk_lowest_index_on_ties(scores, min(cfg.index_topk, plan.width))
            # ascending entry order, empty picks last: the attention then sums the selected
            # entries in an order that does not depend on near-equal scores; columns beyond a
            # row's own k (min(index_topk, its request's entries)) are empty
            picked = (top.values > float("-inf")) & plan.in_k
            picks = torch.where(picked, top.indices, plan.width).sort(dim=-1).values
            picks = torch.where(picks < plan.width, picks, -1)
        topk = {}
        for i, b in enumerate(segs.requests):
            if i not in plan.owned:
                topk[b] = torch.full((segs.counts[i], 0), -1, dtype=torch.long, device=x.device)
                continue
            _, rows, total = plan.owned[i]
            topk[b] = picks[rows, : min(cfg.index_topk, total)]
            if batch.trace is not None:
                batch.trace.setdefault(f"L{role.index}.index_topk", []).append(topk[b])
        shared["topk"] = topk
        if role.is_candidate_source:
            shared["cand"] = cands

    def _select_plan(self, segs: Segments, batch: ForwardBatch, block_size: int) -> SelectPlan:
        """Host-built once per `Segments` and shared by every index source on them."""
        r, lv = self.role.compress_ratio, segs.live()
        total = (lv["start"] + lv["count"]) // r  # entries in the cache after this step, per live segment
        width = int(total.max()) if total.numel() else 0
        owned = {}
        for j, i in enumerate(lv["seg"].tolist()):
            if int(total[j]) > 0:
                owned[i] = (segs.requests[i], segs.rows(i), int(total[j]))
        device = batch.block_tables.device
        entries = torch.minimum(torch.arange(width), (total - 1).clamp_min(0).unsqueeze(1))  # padding reads the last real entry
        req = torch.tensor(segs.requests, dtype=torch.long)[lv["seg"]].to(device)
        per_block = block_size // r
        entries = entries.to(device)
        locations = (batch.block_tables[req.unsqueeze(1), entries // per_block], entries % per_block)
        visible = (lv["row_pos"] + 1) // r  # entries visible per query (all real: visible <= total)
        own_k = torch.minimum(total, torch.tensor(self.cfg.index_topk))[lv["row_seg"]]
        dev = lambda t: t.to(device)
        return SelectPlan(
            width=width, owned=owned, locations=locations, row_seg=dev(lv["row_seg"]),
            visible=dev(torch.arange(width) < visible.unsqueeze(1)), newest=dev((visible - 1) // self.cfg.candidate_block_size),
            in_k=dev(torch.arange(min(self.cfg.index_topk, width)) < own_k.unsqueeze(1)),
        )

    @staticmethod
    def _candidate_rows(segs: Segments, plan: SelectPlan, shared: dict) -> torch.Tensor:
        """The candidate entry mask [R, Tmax] for these rows: the source's padded mask when it
        ran on the same rows, else rebuilt from the per-request masks (all entries of a request
        without one)."""
        held = shared.get("cand_rows")
        if held is not None and held[0] is segs:
            return held[1]
        cand = shared["cand"]
        mask = torch.ones(plan.visible.shape, dtype=torch.bool, device=plan.visible.device)
        for b, rows, total in plan.owned.values():
            if b in cand:
                mask[rows, :total] = cand[b]
        return mask

    def _candidates(self, scores: torch.Tensor, newest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Level one of the two-level top-k: blocks of `candidate_block_size` entries scored by
        their max; the block holding the newest visible entry is always kept; keep the top
        `candidate_topk_blocks` blocks that hold any visible entry. Padding entries are -inf,
        so padding blocks sort after every real block and are never kept. -> (entry mask
        [n, T], kept blocks [n, min(candidate_topk_blocks, blocks)] in pick order, -1 = none)."""
        cbs, n_keep = self.cfg.candidate_block_size, self.cfg.candidate_topk_blocks
        width = scores.shape[-1]
        padded = F.pad(scores, (0, -width % cbs), value=float("-inf"))
        block_scores = padded.unflatten(-1, (-1, cbs)).amax(-1)
        n_blocks = block_scores.shape[-1]
        block_scores = block_scores.masked_fill(torch.arange(n_blocks, device=scores.device) == newest.unsqueeze(1), float("inf"))
        top = topk_lowest_index_on_ties(block_scores, min(n_keep, n_blocks))
        kept = top.values > float("-inf")
        keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top.indices, kept)
        return keep.repeat_interleave(cbs, dim=-1)[:, :width], torch.where(kept, top.indices, -1)

    # ------------------------------------------------------------------ attention proper
    def __call__(self, x: torch.Tensor, segs: Segments, batch: ForwardBatch, cache: KVCacheStorage, shared: dict) -> torch.Tensor:
        cfg, role = self.cfg, self.role
        h, hd, dtype = cfg.num_heads, cfg.head_dim, x.dtype
        cos, sin = self.rope.cos_sin(segs.positions, role.rope)
        q_res = self.norm(self.wq_a(x), self.q_norm)
        q = self.wq_b(q_res).view(-1, h, hd)
        if not self.v41:  # V4: unweighted per-head RMS norm of q
            q = head_norm(q, cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.norm(self.wkv(x), self.kv_norm), cos, sin)
        ring = cache.ring[role.index]
        kv = kvops.round_trip(ring, kv, "window")  # QAT: the window KV is FP8

        if role.runs_indexer:
            with section("indexer"):
                self.select(x, q_res, segs, batch, cache, shared)
        plan = segs.plan(("window", cfg.window), lambda: _window_plan(segs, batch.slots, cfg.window, x.device))
        old = kvops.load(ring, plan.ring_index, "window", dtype)  # each needed ring row decoded once
        keys = torch.cat([old, kv])[plan.keys]
        comp, comp_valid, ragged = self._compressed_keys(segs, batch, cache, shared, dtype)
        out = self._attend(q, keys, plan.valid, comp, comp_valid, ragged)
        kvops.store(ring, plan.write_index, kv[plan.write_rows], "window")
        return self.project_out(apply_rope(out, cos, sin, inverse=True))

    # ------------------------------------------------------------------ fast path
    # The same layer on device metadata (dsv4.model.step): every op takes the per-row /
    # per-request tensors and finds its own rows, nothing synchronises with the host and
    # every shape follows from the step's shapes (CUDA-graph capturable).

    def compress_fast(self, x: torch.Tensor, rows: Rows, step: Step, cache: KVCacheStorage) -> None:
        layer, r = self.role.index, self.role.compress_ratio
        # each row's entry position is its group's first (ratio 1: its own, the indexer's angles)
        cos, sin = rows.derived(("rope", "compress") if r == 1 else ("rope", "compress", r),
                                lambda: self.rope.cos_sin(rows.by_ratio("entry_pos", r), "compress"))
        latent, where, emit = self.compressor.fast(x, rows, step, cache, layer, cos, sin, cache.ckv[layer])
        if self.v41:
            keys = self.norm(linear(latent, self.idx_wk.to(latent.dtype)), self.idx_k_norm)  # from the PRE-RoPE latent
            kvops.store_rows(cache.idx[layer], "idx", apply_rope_(keys, cos, sin), where, emit)
        elif self.index_compressor is not None:  # V4 CSA: the indexer keys have their own compressor
            self.index_compressor.fast(x, rows, step, cache, layer, cos, sin, cache.idx[layer])

    def select_fast(self, x: torch.Tensor, idx_q: torch.Tensor, rows: Rows, step: Step, cache: KVCacheStorage, shared: dict) -> None:
        """The indexer on device metadata (idx_q: the indexer's queries [R, index_n_heads,
        index_head_dim], RoPE'd and rounded as the keys are stored, `rope_queries_`): FP4
        scores of every visible entry (reindex layers: of the candidate pool only), the top-k as ascending entry indices (-1 = none), and at
        the candidate source the kept candidate blocks, ascending. Publishes shared["topk"]
        [R, k] and shared["cand"] [R, n_blocks]; the first Reindex layer shared["pool"] (the
        candidate pool's entries and its width per row, for the others)."""
        cfg, role = self.cfg, self.role
        r = role.compress_ratio
        keys = cache.idx[role.kv_source]
        weights = linear(x, self.idx_weights.to(x.dtype)).float() * cfg.index_n_heads**-0.5
        # padding rows own no blocks: they see none
        visible = rows.by_ratio("visible", r)
        width = step.widths[r]
        k = min(cfg.index_topk, width)
        if k == 0:
            shared["topk"] = torch.full((rows.num_rows, 0), -1, dtype=torch.int32, device=x.device)
            return
        per_block = cache.block_size // r

        def scored(c: slice, lengths: torch.Tensor, n: int, entries: torch.Tensor | None = None) -> torch.Tensor:
            return index_ops.index_scores(idx_q[c], weights[c], *_stored(keys), step.block_tables, rows.req[c], lengths[c], per_block, n,
                                          entries=None if entries is None else entries[c])

        if role.uses_candidates and "cand" in shared:
            if "pool" not in shared:  # the candidate pool's entries, the same for every Reindex layer of the step
                entries = index_ops.pool_entries(shared["cand"], visible, cfg.candidate_block_size)
                shared["pool"] = entries, torch.full_like(visible, entries.shape[1])
            entries, full = shared["pool"]
            scores = _by_rows(lambda c: scored(c, full, entries.shape[1], entries), rows.num_rows, entries.shape[1])
            shared["topk"] = index_ops.topk_ascending(scores, full, k, labels=entries)  # the pool is ascending
            return
        scores = _by_rows(lambda c: scored(c, visible, width), rows.num_rows, width)
        shared["topk"] = index_ops.topk_ascending(scores, visible, k)
        if role.is_candidate_source:
            cbs = cfg.candidate_block_size
            blocks = index_ops.block_max(scores, visible, cbs)
            shared["cand"] = index_ops.topk_ascending(blocks, (visible + cbs - 1) // cbs, min(cfg.candidate_topk_blocks, blocks.shape[1]))

    def forward_fast(self, x: torch.Tensor, rows: Rows, step: Step, cache: KVCacheStorage, shared: dict, compressed_ready=lambda: None) -> torch.Tensor:
        """`compressed_ready()`: called before the first read of the compressed cache (the
        layer's compressor may still run on a side stream while the queries are projected)."""
        cfg, role = self.cfg, self.role
        h, hd = cfg.num_heads, cfg.head_dim
        cos, sin = rows.derived(("rope", role.rope), lambda: self.rope.cos_sin(rows.positions, role.rope))
        ring = cache.ring[role.index]
        # q_res and kv normed, kv RoPE'd and rounded as the ring stores it (QAT: FP8)
        q_res, kv = attention_ops.latent_inputs(self.wq_a_kv(x), self.wq_a.out_features, self.q_norm, self.kv_norm, cfg.rms_norm_eps,
                                                not self.v41, cos, sin, ring)
        if self.wq_b_idx is not None:  # the indexer's query projection in the same GEMM
            q, idx_q = self.wq_b_idx(q_res).split([self.wq_b.out_features, self.idx_wq_b.out_features], dim=-1)
            idx_q = idx_q.view(-1, cfg.index_n_heads, cfg.index_head_dim)
            idx_cos, idx_sin = rows.derived(("rope", "compress"), lambda: self.rope.cos_sin(rows.positions, "compress"))
        else:
            q, idx_q, idx_cos, idx_sin = self.wq_b(q_res), None, None, None
        q = q.view(-1, h, hd)
        if not self.v41:  # V4: unweighted per-head RMS norm of q
            q = head_norm(q, cfg.rms_norm_eps)
        # the indexer's queries RoPE'd too and rounded as its keys are stored (QAT: FP4)
        attention_ops.rope_queries_(q, cos, sin, idx_q, idx_cos, idx_sin, cache.idx.get(role.kv_source) if idx_q is not None else None)
        compressed_ready()
        if role.runs_indexer:
            with section("indexer"):
                self.select_fast(x, idx_q, rows, step, cache, shared)
        if role.kv_source is not None and role.index_source is not None and "topk" in shared:
            topk, ckv = shared["topk"], cache.ckv[role.kv_source]
        elif role.kv_source is not None and role.kind == "hca":  # V4 HCA: every visible entry
            r = role.compress_ratio
            topk = rows.derived(("hca", r), lambda: _all_visible(rows.by_ratio("visible", r), step.widths[r]))
            ckv = cache.ckv[role.kv_source]
        else:
            topk, ckv = torch.full((rows.num_rows, 0), -1, dtype=torch.int32, device=x.device), _no_entries(cache)
        # FP8 activations at decode: the output leaves the attention's epilogue as wo_a's FP8 input
        # (off: FP8_OUTPUT_EPILOGUE)
        g = cfg.o_groups
        fp8_output = FP8_OUTPUT_EPILOGUE and grouped_takes_codes(self.wo_a, g, q.shape[0], h * hd // g, q.dtype, q.device)
        out = attention_ops.sparse_attention(
            q, kv, *_stored(ring), *_stored(ckv), topk, rows.req, rows.positions, rows.start,
            rows.row0, step.slots, rows.floor, step.block_tables, self.sink, hd**-0.5, inverse_rope=(cos, sin), fp8_output=fp8_output,
        )
        kvops.store_rows(ring, "window", kv, (rows.slot, rows.ring_pos), rows.ring_keep)  # after attention: queries read the old ring
        return self.project_out(out)

    def project_out(self, out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The grouped low-rank output projection: heads [R, H, D] in o_groups groups, each
        through its slice of wo_a, then wo_b. `out` may be the heads' FP8 codes and exponent
        bytes (`sparse_attention(..., fp8_output=True)`, where `grouped_takes_codes` says wo_a
        multiplies them)."""
        g = self.cfg.o_groups
        if isinstance(out, tuple):
            codes, exps = out
            grouped = (codes.reshape(codes.shape[0], g, -1), exps)
        else:
            grouped = out.reshape(out.shape[0], g, out.shape[1] * out.shape[2] // g)
        return self.wo_b(grouped_linear(grouped, self.wo_a, self.wo_a_groups))

    def _compressed_keys(self, segs, batch, cache, shared, dtype):
        """The compressed entries each query attends: the top-k of the governing index source
        (V4.1 / V4 CSA), or every visible entry (V4 HCA), padded with masked entries to the
        widest row. -> ([T, K, hd], valid [T, K], per-row own width [T] or None when every row
        has K), or Nones when no row has any."""
        role = self.role
        if role.kv_source is None:
            return None, None, None
        r = role.compress_ratio
        if role.index_source is None and role.kind == "hca":
            located = segs.plan(("hca", r), lambda: self._hca_entries(segs, batch, cache.block_size))
        elif role.index_source is not None and "topk" in shared:
            topk = shared["topk"]
            cached = segs.plan(("topk", r), lambda: [None, None])  # [selection, its locations]
            if cached[0] is not topk:  # a new selection (held, so the identity test is sound)
                cached[:] = topk, self._topk_entries(segs, topk, batch, cache.block_size)
            located = cached[1]
        else:
            return None, None, None
        if located is None:
            return None, None, None
        index, valid, width = located
        return kvops.load(cache.ckv[role.kv_source], index, "ckv", dtype), valid, width

    def _hca_entries(self, segs, batch, block_size):
        """Every entry in the cache after this step, visible to a query at p when t < (p+1)//r;
        entries beyond the row's own request read its entry 0."""
        r, lv = self.role.compress_ratio, segs.live()
        total = (lv["start"] + lv["count"]) // r
        width = int(total.max()) if total.numel() else 0
        if width == 0:
            return None
        entries = torch.arange(width).expand(lv["row_seg"].numel(), width)
        valid = entries < ((lv["row_pos"] + 1) // r).unsqueeze(1)
        own = total[lv["row_seg"]]
        entries = torch.where(entries < own.unsqueeze(1), entries, 0)
        device = batch.block_tables.device
        return _entry_locations(segs, entries, batch, r, block_size), valid.to(device), _ragged(own, width, device)

    def _topk_entries(self, segs, topk, batch, block_size):
        """The published per-request top-k [n_b, k_b] (ascending, -1 = none) as one [T, K]
        table padded with -1; a request without a selection has none."""
        r = self.role.compress_ratio
        live = [i for i, c in enumerate(segs.counts) if c > 0]
        width = max((topk[segs.requests[i]].shape[1] for i in live if segs.requests[i] in topk), default=0)
        if width == 0:
            return None
        device = batch.block_tables.device
        parts = []
        for i in live:
            t = topk.get(segs.requests[i])
            if t is None:
                parts.append(torch.full((segs.counts[i], width), -1, dtype=torch.long, device=device))
            else:
                parts.append(F.pad(t, (0, width - t.shape[1]), value=-1) if t.shape[1] < width else t)
        entries = torch.cat(parts)
        own = torch.tensor([topk[segs.requests[i]].shape[1] if segs.requests[i] in topk else 0 for i in live], dtype=torch.long)
        own = own.repeat_interleave(torch.tensor([segs.counts[i] for i in live], dtype=torch.long))
        return _entry_locations(segs, entries.clamp_min(0), batch, r, block_size), entries >= 0, _ragged(own, width, device)

    def _attend(self, q, keys, valid, comp, comp_valid, ragged: Ragged | None = None):
        """One softmax over the window keys and the selected compressed entries, with the
        per-head sink in the denominator; K = V (shared latent). Logits are rounded to the
        activation dtype before the fp32 softmax, as the reference does.

        `ragged` (None: every row owns all K entries): rows padded to a wider table put the
        sink right after their own entries and the padding (probability 0) after it, so each
        row's softmax sees its values at the column positions it has when its request runs
        alone (trailing zeros leave the sum's rounding unchanged); the two products over the
        entries run per distinct own width, since a matmul's rounding depends on its width."""
        scale = self.cfg.head_dim**-0.5
        n, h = q.shape[:2]
        kw = keys.shape[1]
        logits = (torch.einsum("nhd,nwd->nhw", q, keys) * scale).float()
        parts = [logits.masked_fill(~valid.unsqueeze(1), float("-inf"))]
        if comp is not None:
            if ragged is None:
                cl = torch.einsum("nhd,nkd->nhk", q, comp)
            else:
                cl = q.new_zeros(n, h, comp.shape[1])
                for rows, w in ragged.groups:
                    cl[rows, :, :w] = torch.einsum("nhd,nkd->nhk", q[rows], comp[rows, :w])
            parts.append((cl * scale).float().masked_fill(~comp_valid.unsqueeze(1), float("-inf")))
        sink = self.sink.float().view(1, -1, 1)
        if ragged is None:
            allp = torch.cat(parts + [sink.expand(n, -1, 1)], dim=-1)
        else:
            allp = torch.cat(parts + [logits.new_full((n, h, 1), float("-inf"))], dim=-1)
            at_sink = torch.arange(allp.shape[-1], device=allp.device) == (kw + ragged.width).unsqueeze(1)
            allp = torch.where(at_sink.unsqueeze(1), sink, allp)
        allp = allp - allp.amax(-1, keepdim=True)
        # The CPU softmax reduces short rows on a scalar path and long ones on SIMD lanes, so
        # trailing -inf padding (a row's width in a wider batch) could change its sum's
        # rounding; padding every row to a multiple of 64 columns keeps it on the same lanes.
        cols = allp.shape[-1]
        padded = F.pad(allp, (0, -cols % 64), value=float("-inf"))
        probs = torch.softmax(padded, dim=-1)[..., : cols - 1].to(q.dtype)
        out = torch.einsum("nhw,nwd->nhd", probs[..., :kw], keys)
        if comp is None:
            return out
        if ragged is None:
            return out + torch.einsum("nhk,nkd->nhd", probs[..., kw:], comp)
        for rows, w in ragged.groups:
            out[rows] = out[rows] + torch.einsum("nhk,nkd->nhd", probs[rows, :, kw : kw + w], comp[rows, :w])
        return out

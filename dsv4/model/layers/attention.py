"""Attention of one layer: shared-KV MQA over the sliding window plus the selected compressed
entries, with sinks, inverse RoPE and the grouped output projection; and the compressed
branch (compressor, indexer keys, indexer) that feeds it.

The reference path processes requests one by one (each has its own positions, ring slot and
block table); a fused kernel replaces the per-request loops on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from dsv4.cache.storage import KVCacheStorage
from dsv4.config import LayerRole, ModelConfig
from dsv4.model.batch import ForwardBatch
from dsv4.ops import kv as kvops
from dsv4.ops.linear import Linear, linear
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import RopeTables, apply_rope


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

    def rows(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])


def topk_lowest_index_on_ties(scores: torch.Tensor, k: int):
    """Top-k along the last axis where equal scores prefer the lower index. ReLU index scores
    are exactly 0 for many entries; torch.topk breaks such ties differently for different
    tensor lengths, which would make a chunked prefill select differently from a whole one."""
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    return torch.return_types.topk((values[..., :k], indices[..., :k]))


def _proj(w: dict, name: str, block: int) -> Linear:
    return Linear(w[f"{name}.weight"], w.get(f"{name}.scale"), block)


class Compressor:
    """Pools `ratio` consecutive tokens into one entry (softmax gate, aligned to absolute
    positions); V4's ratio-4 variant overlaps each window with the previous window's first
    half. Incomplete groups wait in the request's state slot. Returns the pre-RoPE entries."""

    def __init__(self, w: dict, prefix: str, cfg: ModelConfig, ratio: int, width: int, overlap: bool, state: str):
        self.cfg, self.ratio, self.width, self.overlap, self.state = cfg, ratio, width, overlap, state
        self.v41 = cfg.arch == "v41"
        self.wkv = w[prefix + "wkv.weight"]
        self.wgate = w.get(prefix + "wgate.weight")
        self.ape = w.get(prefix + "ape")
        self.norm = w[prefix + "norm.weight"]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, weight_in_fp32=not self.v41)

    def __call__(self, x: torch.Tensor, segs: Segments, batch: ForwardBatch, cache: KVCacheStorage, layer: int) -> list[tuple[int, torch.Tensor]]:
        """-> per segment (index of the first entry emitted, entries [m, width])."""
        r, dtype = self.ratio, x.dtype
        if r == 1:  # V4.1 decoder source: every token is its own entry, no gate
            latent = self._norm(linear(x, self.wkv.to(dtype)))
            return [(segs.starts[i], latent[segs.rows(i)]) for i in range(len(segs.starts))]
        if self.v41:  # pooling math in fp32 (the reference keeps these projections fp32)
            kv_all = linear(x.float(), self.wkv.float())
            gate_all = linear(x.float(), self.wgate.float())
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


class Attention:
    def __init__(self, w: dict, p: str, cfg: ModelConfig, role: LayerRole, rope: RopeTables):
        """`p`: the tensor-name prefix of this attention (`layers.{i}.attn.`, `mtp.{k}.attn.`)."""
        self.cfg, self.role, self.rope = cfg, role, rope
        self.v41 = cfg.arch == "v41"
        b = cfg.weight_block_size
        self.wq_a, self.wq_b = _proj(w, p + "wq_a", b), _proj(w, p + "wq_b", b)
        self.wkv = _proj(w, p + "wkv", b)
        self.wo_a, self.wo_b = _proj(w, p + "wo_a", b), _proj(w, p + "wo_b", b)
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
        if role.runs_indexer:
            self.idx_wq_b = _proj(w, p + "indexer.wq_b", b)
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
        query, keep the top-k (two-level with candidate blocks on V4.1), publish per segment."""
        cfg, role = self.cfg, self.role
        src, r = role.kv_source, role.compress_ratio
        idx_cache = cache.idx[src]
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        q = self.idx_wq_b(q_res).view(-1, ih, ihd)
        cos, sin = self.rope.cos_sin(segs.positions, "compress")
        q = apply_rope(q, cos, sin)
        if self.v41:
            q = kvops.round_trip(idx_cache, q, "idx")  # QAT: the query is FP4 too
        weights = linear(x, self.idx_weights.to(x.dtype)).float() * ih**-0.5
        topk, cands = {}, {}
        for i, b in enumerate(segs.requests):
            rows = segs.rows(i)
            total = (segs.starts[i] + segs.counts[i]) // r  # entries in the cache after this step
            if total == 0 or segs.counts[i] == 0:
                topk[b] = torch.full((segs.counts[i], 0), -1, dtype=torch.long, device=x.device)
                continue
            entries = torch.arange(total, device=x.device)
            blocks, offs = kvops.entry_locations(batch.block_tables[b], entries, r, cache.block_size)
            keys = kvops.load(idx_cache, (blocks, offs), "idx", torch.float32)
            scores = torch.einsum("shd,td->sht", q[rows].float(), keys).relu() * ihd**-0.5
            scores = (scores * weights[rows].unsqueeze(-1)).sum(dim=1)  # [n, T]
            visible = (segs.positions[rows].unsqueeze(-1) + 1) // r  # entries visible per query
            scores = scores.masked_fill(entries >= visible, float("-inf"))
            if role.is_candidate_source:
                cands[b] = self._candidates(scores, visible, batch.trace)
            elif role.uses_candidates and b in shared.get("cand", {}):
                scores = scores.masked_fill(~shared["cand"][b], float("-inf"))
            k = min(cfg.index_topk, total)
            top = topk_lowest_index_on_ties(scores, k)
            # ascending entry order, empty picks last: the attention then sums the selected
            # entries in an order that does not depend on near-equal scores
            picks = torch.where(top.values > float("-inf"), top.indices, total)
            picks = picks.sort(dim=-1).values
            topk[b] = torch.where(picks < total, picks, -1)
            if batch.trace is not None:
                batch.trace.setdefault(f"L{role.index}.index_topk", []).append(topk[b])
        shared["topk"] = topk
        if role.is_candidate_source:
            shared["cand"] = cands

    def _candidates(self, scores: torch.Tensor, visible: torch.Tensor, trace: dict | None) -> torch.Tensor:
        """Level one of the two-level top-k: blocks of `candidate_block_size` entries scored by
        their max; the block holding the newest visible entry is always kept; keep the top
        `candidate_topk_blocks` blocks that hold any visible entry. -> entry mask [n, T]."""
        cbs, n_keep = self.cfg.candidate_block_size, self.cfg.candidate_topk_blocks
        width = scores.shape[-1]
        padded = F.pad(scores, (0, -width % cbs), value=float("-inf"))
        block_scores = padded.unflatten(-1, (-1, cbs)).amax(-1)
        n_blocks = block_scores.shape[-1]
        newest = (visible - 1) // cbs
        block_scores = block_scores.masked_fill(torch.arange(n_blocks, device=scores.device) == newest, float("inf"))
        top = topk_lowest_index_on_ties(block_scores, min(n_keep, n_blocks))
        keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
        if trace is not None:
            picks = torch.where(top.values > float("-inf"), top.indices, -1)
            trace.setdefault(f"L{self.role.index}.candidate_blocks", []).append(picks)
        return keep.repeat_interleave(cbs, dim=-1)[:, :width]

    # ------------------------------------------------------------------ attention proper
    def __call__(self, x: torch.Tensor, segs: Segments, batch: ForwardBatch, cache: KVCacheStorage, shared: dict) -> torch.Tensor:
        cfg, role = self.cfg, self.role
        h, hd, dtype = cfg.num_heads, cfg.head_dim, x.dtype
        cos, sin = self.rope.cos_sin(segs.positions, role.rope)
        q_res = self.norm(self.wq_a(x), self.q_norm)
        q = self.wq_b(q_res).view(-1, h, hd)
        if not self.v41:  # V4: unweighted per-head RMS norm of q
            q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + cfg.rms_norm_eps).to(dtype)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.norm(self.wkv(x), self.kv_norm), cos, sin)
        ring = cache.ring[role.index]
        kv = kvops.round_trip(ring, kv, "window")  # QAT: the window KV is FP8

        if role.runs_indexer:
            with record_function("dsv4.indexer"):
                self.select(x, q_res, segs, batch, cache, shared)
        out = torch.empty_like(q)
        for i, b in enumerate(segs.requests):
            if segs.counts[i] == 0:  # no decoder rows of this request in this step
                continue
            rows = segs.rows(i)
            keys, valid = self._window_keys(ring, kv[rows], segs.positions[rows], batch.slots[b], segs.starts[i], segs.floors[i], dtype)
            comp, comp_valid = self._compressed_keys(b, segs, i, batch, cache, shared, dtype)
            out[rows] = self._attend(q[rows], keys, valid, comp, comp_valid)
            self._write_ring(ring, kv[rows], batch.slots[b], segs.starts[i])
        out = apply_rope(out, cos, sin, inverse=True)
        g = cfg.o_groups
        grouped = out.reshape(-1, g, h * hd // g)
        wo_a = self.wo_a.dense(dtype).view(g, -1, h * hd // g)
        mid = torch.cat([linear(grouped[:, k], wo_a[k]) for k in range(g)], dim=-1)
        return self.wo_b(mid)

    def _window_keys(self, ring, kv_new, q_pos, slot, p0, floor, dtype):
        """Per query, its window in canonical slot order: slot i holds position p-W+1+i.
        Positions before p0 come from the ring, the rest from this step's keys. A fixed
        per-query layout makes each query's arithmetic independent of how many tokens the
        step has (batch invariance). -> keys [n, W, d], valid [n, W]."""
        w = self.cfg.window
        first = max(floor, p0 - w + 1, 0)
        old_pos = torch.arange(first, p0, device=kv_new.device)
        seq = torch.cat([kvops.load(ring, (slot, old_pos % w), "window", dtype), kv_new])
        pos = q_pos.unsqueeze(1) - w + 1 + torch.arange(w, device=kv_new.device)
        valid = pos >= first
        return seq[(pos - first).clamp_min(0)], valid
    def _write_ring(self, ring, kv_new, slot, p0):
        w, n = self.cfg.window, kv_new.shape[0]
        keep = min(n, w)
        pos = torch.arange(p0 + n - keep, p0 + n, device=kv_new.device)
        kvops.store(ring, (slot, pos % w), kv_new[n - keep :], "window")

    def _compressed_keys(self, b, segs, i, batch, cache, shared, dtype):
        """The compressed entries each query attends: the top-k of the governing index source
        (V4.1 / V4 CSA), or every visible entry (V4 HCA). -> ([n, k, hd], valid [n, k])."""
        role = self.role
        if role.kv_source is None:
            return None, None
        r = role.compress_ratio
        n = segs.counts[i]
        rows = segs.rows(i)
        if role.index_source is None and role.kind == "hca":
            total = (segs.starts[i] + n) // r
            entries = torch.arange(total, device=segs.positions.device).expand(n, total)
            valid = entries < ((segs.positions[rows].unsqueeze(-1) + 1) // r)
        elif role.index_source is not None and b in shared.get("topk", {}):
            entries = shared["topk"][b]
            valid = entries >= 0
        else:
            return None, None
        if entries.shape[1] == 0:
            return None, None
        safe = entries.clamp_min(0)
        blocks, offs = kvops.entry_locations(batch.block_tables[b], safe, r, cache.block_size)
        comp = kvops.load(cache.ckv[role.kv_source], (blocks, offs), "ckv", dtype)
        return comp, valid

    def _attend(self, q, keys, valid, comp, comp_valid):
        """One softmax over the window keys and the selected compressed entries, with the
        per-head sink in the denominator; K = V (shared latent). Logits are rounded to the
        activation dtype before the fp32 softmax, as the reference does."""
        scale = self.cfg.head_dim**-0.5
        logits = (torch.einsum("nhd,nwd->nhw", q, keys) * scale).float()
        parts = [logits.masked_fill(~valid.unsqueeze(1), float("-inf"))]
        if comp is not None:
            cl = (torch.einsum("nhd,nkd->nhk", q, comp) * scale).float()
            parts.append(cl.masked_fill(~comp_valid.unsqueeze(1), float("-inf")))
        sink = self.sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        allp = torch.cat(parts + [sink], dim=-1)
        allp = allp - allp.amax(-1, keepdim=True)
        probs = torch.softmax(allp, dim=-1)[..., :-1].to(q.dtype)
        kw = keys.shape[1]
        out = torch.einsum("nhw,nwd->nhd", probs[..., :kw], keys)
        if comp is not None:
            out = out + torch.einsum("nhk,nkd->nhd", probs[..., kw:], comp)
        return out

"""DeepSeek-V4.1-Flash and DeepSeek-V4-Flash, assembled from the layers, for a flat batch.

The two architectures share the block (mHC sites around attention and MoE); they differ in a
few explicit places, each marked `v41`: the single-pass `pre` shift, engram, the causal
encoder-decoder split (V4.1); per-site `pre`, the final `hc_head`, hash-routed MoE (V4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from dsv4.cache.storage import KVCacheStorage
from dsv4.config import LayerRole, ModelConfig
from dsv4.model.batch import ForwardBatch
from dsv4.model.layers.attention import Attention, Segments
from dsv4.model.layers.engram import Engram, EngramHasher
from dsv4.model.layers.moe import MoE
from dsv4.ops.linear import linear
from dsv4.ops.mhc import hc_collapse, hc_expand, hc_head, hc_mixes
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import RopeTables


class Block:
    """One layer: [engram] -> mHC site -> attention -> mHC site -> MoE."""

    def __init__(self, w: dict, prefix: str, cfg: ModelConfig, role: LayerRole, rope: RopeTables, n_experts: int, top_k: int):
        self.cfg, self.role, self.v41 = cfg, role, cfg.arch == "v41"
        self.attn = Attention(w, prefix + "attn.", cfg, role, rope)
        self.ffn = MoE(w, prefix + "ffn.", cfg, n_experts, top_k, role.hash_moe)
        self.attn_norm, self.ffn_norm = w[prefix + "attn_norm.weight"], w[prefix + "ffn_norm.weight"]
        self.hc = {site: (w[f"{prefix}hc_{site}_fn"], w[f"{prefix}hc_{site}_base"], w[f"{prefix}hc_{site}_scale"]) for site in ("attn", "ffn")}
        self.engram = Engram(w, prefix + "engram.", cfg) if role.engram else None

    def mixes(self, x: torch.Tensor, site: str):
        fn, base, scale = self.hc[site]
        c = self.cfg
        return hc_mixes(x, fn, base, scale, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, weight_in_fp32=not self.v41)


class _Rows:
    """The rows a forward is currently running on (all tokens, or the decoder's tail rows)."""

    def __init__(self, segs: Segments, row_ids: torch.Tensor):
        self.segs, self.row_ids = segs, row_ids


class Model:
    def __init__(self, cfg: ModelConfig, weights: dict, *, dtype: torch.dtype, device="cpu", token_map: torch.Tensor | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.v41 = cfg.arch == "v41"
        self.rope = RopeTables(cfg, dtype, self.device)
        self.embed = weights["embed.weight"]
        self.head = weights["head.weight"]
        self.final_norm = weights["norm.weight"]
        self.blocks = [
            Block(weights, f"layers.{r.index}.", cfg, r, self.rope, cfg.n_routed_experts, cfg.num_experts_per_tok)
            for r in cfg.roles
        ]
        if not self.v41:
            self.hc_head = (weights["hc_head_fn"], weights["hc_head_base"], weights["hc_head_scale"])
        self.hasher = None
        if self.v41 and cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("engram layers need the tokenizer's compressed-vocabulary map (token_map)")
            self.hasher = EngramHasher(cfg, token_map, self.device)

    # ---------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCacheStorage) -> torch.Tensor:
        """-> final hidden states [len(batch.logits_rows), D] (after the last collapse and norm)."""
        cfg = self.cfg
        ids = batch.input_ids
        x = F.embedding(ids, self.embed).to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(ids.shape[0], cfg.hc_mult, dtype=torch.float32, device=ids.device)
        pre[:, 0] = 1.0
        segs = Segments(list(range(batch.num_requests)), batch.start_pos, batch.num_tokens, batch.window_floor, batch.positions)
        rows = _Rows(segs, torch.arange(ids.shape[0], device=ids.device))
        hashes = None
        if self.hasher is not None:
            hashes = self.hasher(ids, batch.start_pos, batch.num_tokens, batch.prev_tokens)
        shared: dict = {}
        for block in self.blocks:
            role = block.role
            if block.engram is not None:
                k = cfg.engram_layer_ids.index(role.index)
                with record_function("dsv4.engram"):
                    streams = block.engram(streams, hashes[:, k])
            if batch.capture is not None and role.index in cfg.dspark_target_layer_ids:
                want = self._select(batch.logits_rows, rows.row_ids)
                batch.capture.setdefault("dspark", {})[role.index] = streams[want].mean(dim=1)
            residual = streams
            with record_function("dsv4.mhc"):
                a_pre, a_post, a_comb = block.mixes(streams, "attn")
                h = block.norm(hc_collapse(streams, pre if self.v41 else a_pre), block.attn_norm)
            if role.owns_compressor:
                with record_function("dsv4.compressor"):
                    block.attn.compress(h, rows.segs, batch, cache)
            if role.index == cfg.ced_split:
                keep = self._decoder_rows(batch, rows, shared)
                streams, residual, a_pre, a_post, a_comb, h, ids = (
                    t[keep] for t in (streams, residual, a_pre, a_post, a_comb, h, ids)
                )
                if hashes is not None:
                    hashes = hashes[keep]
            with record_function("dsv4.attention"):
                y = block.attn(h, rows.segs, batch, cache, shared)
            with record_function("dsv4.mhc"):
                streams = hc_expand(y, residual, a_post, a_comb, fp32=self.v41)
                residual = streams
                f_pre, f_post, f_comb = block.mixes(streams, "ffn")
                h = block.norm(hc_collapse(streams, a_pre if self.v41 else f_pre), block.ffn_norm)
            with record_function("dsv4.moe"):
                y = block.ffn(h, ids, batch.trace, f"L{role.index}")
            with record_function("dsv4.mhc"):
                streams = hc_expand(y, residual, f_post, f_comb, fp32=self.v41)
            pre = f_pre
        want = self._select(batch.logits_rows, rows.row_ids)
        streams = streams[want]
        if batch.capture is not None:
            batch.capture["final_streams"] = streams
        if self.v41:
            final = hc_collapse(streams, pre[want])
        else:
            fn, base, scale = self.hc_head
            final = hc_head(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)
        return rms_norm(final, self.final_norm, cfg.rms_norm_eps, weight_in_fp32=not self.v41)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits in fp32 (the head runs in the activation dtype)."""
        return linear(hidden, self.head.to(hidden.dtype)).float()

    # ------------------------------------------------------------------------ CED split
    def _decoder_rows(self, batch: ForwardBatch, rows: _Rows, shared: dict) -> torch.Tensor:
        """Switch `rows` to the rows the decoder runs on and return their indices in the
        current rows. Exact mode keeps every row; bounded replay keeps each request's last
        `decoder_tokens[b]` rows, whose window starts at their first position. Per-request
        selections published before the split cover every row: they keep the same tail."""
        segs = rows.segs
        counts = list(segs.counts) if batch.decoder_tokens is None else [min(k, n) for k, n in zip(batch.decoder_tokens, segs.counts)]
        keep = torch.cat([
            torch.arange(segs.offsets[i + 1] - counts[i], segs.offsets[i + 1], device=segs.positions.device)
            for i in range(len(counts))
        ])
        starts = [s + n - k for s, n, k in zip(segs.starts, segs.counts, counts)]
        floors = [batch.decoder_window_floor[b] for b in segs.requests]
        for key in ("topk", "cand"):
            for i, b in enumerate(segs.requests):
                if b in shared.get(key, {}):
                    shared[key][b] = shared[key][b][segs.counts[i] - counts[i] :]
        rows.segs = Segments(segs.requests, starts, counts, floors, segs.positions[keep])
        rows.row_ids = rows.row_ids[keep]
        return keep

    @staticmethod
    def _select(wanted: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Positions in the current rows of the wanted original rows (all must still exist)."""
        lookup = torch.full((int(row_ids.max()) + 1 if row_ids.numel() else 1,), -1, dtype=torch.long, device=row_ids.device)
        lookup[row_ids] = torch.arange(row_ids.numel(), device=row_ids.device)
        if wanted.numel() and (int(wanted.max()) >= lookup.numel() or bool((lookup[wanted] < 0).any())):
            raise ValueError("logits_rows: a requested row did not run the decoder layers (bounded replay keeps only each request's last tokens)")
        return lookup[wanted]

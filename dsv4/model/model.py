"""DeepSeek-V4.1-Flash and DeepSeek-V4-Flash, assembled from the layers, for a flat batch.

The two architectures share the block (mHC sites around attention and MoE); they differ in a
few explicit places, each marked `v41`: the single-pass `pre` shift, engram, the causal
encoder-decoder split (V4.1); per-site `pre`, the final `hc_head`, hash-routed MoE (V4).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from dsv4.cache.storage import KVCacheStorage, ckv_is_fp4, idx_is_fp4, window_is_fp8
from dsv4.config import LayerRole, ModelConfig
from dsv4.model.batch import ForwardBatch
from dsv4.model.sections import section
from dsv4.model.step import Step, build_step
from dsv4.model.layers.attention import Attention, Segments
from dsv4.model.layers.engram import Engram, EngramHasher
from dsv4.model.layers.moe import MoE
from dsv4.ops.linear import linear
from dsv4.ops.mhc import hc_collapse_norm, hc_expand, hc_expand_collapse_norm, hc_head, hc_mixes
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

    def collapse_norm(self, streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The site's input: the streams collapsed with `pre`, then RMS-normed."""
        return hc_collapse_norm(streams, pre, weight, self.cfg.rms_norm_eps, weight_in_fp32=not self.v41)


def fast_path_unsupported(cfg: ModelConfig) -> str | None:
    """Why the fast path (device metadata, Triton kernels, CUDA graphs) cannot run this
    config, or None. Its kernels read V4.1's quantised caches (FP8 ring, FP4 compressed KV and
    indexer keys) and V4's unquantised ones; a V4.1 config whose widths do not give the
    quantised formats runs the reference path."""
    if cfg.arch == "v41" and not (window_is_fp8(cfg) and ckv_is_fp4(cfg) and idx_is_fp4(cfg)):
        return f"head_dim {cfg.head_dim} / index_head_dim {cfg.index_head_dim} do not give the FP8 / FP4 caches (multiples of 32)"
    if cfg.head_dim & (cfg.head_dim - 1):
        return f"head_dim {cfg.head_dim} is not a power of two (the attention kernel's tile)"
    return None


@dataclass
class Carry:
    """What flows between layers: the residual streams, the `pre` mix of the last FFN site
    (V4.1's input collapse), the token ids (hash routing) and engram hashes, the selections
    that index sources publish for later layers (`shared`), and inside a layer the attention
    site's state (its residual, mixes and normed input)."""

    ids: torch.Tensor
    streams: torch.Tensor
    pre: torch.Tensor
    hashes: torch.Tensor | None
    shared: dict
    # engram layer -> its values (`Engram.values`), started a layer before it (`_encode`)
    engram_values: dict = field(default_factory=dict)
    residual: torch.Tensor | None = None
    a_pre: torch.Tensor | None = None
    a_post: torch.Tensor | None = None
    a_comb: torch.Tensor | None = None
    h: torch.Tensor | None = None

    # the per-row tensors that cross the CED split (`pre` does not: the split layer replaces it
    # before anything reads it; the selections in `shared` are kept by the rows' own `split`)
    PER_ROW = ("ids", "streams", "hashes", "residual", "a_pre", "a_post", "a_comb", "h")

    def per_row(self, fn) -> Carry:
        """A Carry of fn(t) for every per-row tensor t (None stays None), the same selections
        and no `pre`."""
        return Carry(pre=None, shared=self.shared, **{n: None if getattr(self, n) is None else fn(getattr(self, n)) for n in self.PER_ROW})

    def kept(self, keep: torch.Tensor | None) -> Carry:
        """The rows `keep` (the decoder's, at the CED split) of every per-row tensor."""
        return self if keep is None else self.per_row(lambda t: t[keep])


# Work that is read later than it can start, on side streams on the fast path (`Aside`;
# False: in place, for A/B runs): V4.1's mHC mixes and engram values, and both models'
# compressors
MIXES_ASIDE = True
ENGRAM_ASIDE = True
COMPRESSOR_ASIDE = True


class Aside:
    """Work whose inputs are ready well before its output is read runs on a second CUDA
    stream on the fast path, beside the main stream's kernels (at decode most of them are
    latency bound and leave HBM and SMs idle). Three uses (one Aside each, so none waits for
    another's queue): V4.1's mixes — a site collapses its input with the previous site's
    `pre`, so the site's own mixes (an fp32 GEMM of 80 small programs and a one-warp
    Sinkhorn epilogue, ~14 us a site, all latency) are first read after its sublayer; the
    engram values (table lookup + the 157 MB wkv projection), which need only the step's
    hashes but are read at their layer; and a layer's compressor (its projection GEMM, the
    pooling, the cache and tail stores), whose entries are first read by the layer's indexer or
    attention, after the query projections. Elsewhere (CPU, the reference path; V4's mixes,
    its collapse reads the site's own `pre`) the work runs in place. The breakdown's sections
    then time the main stream's part; a wait at a join falls in the section that joins.

    `start` forks: the side stream waits for the main stream's work so far, then the work is
    issued on it; `join` makes the main stream wait for all of it. Memory needs no
    record_stream: every fork starts behind the main stream (so a block the side stream reuses
    is one the main stream is done with), and the inputs stay referenced past the join. In a
    CUDA graph capture the fork and join become graph edges; a piece must join before its
    capture ends (`Model._encode` does)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.stream = torch.cuda.Stream(device) if enabled else None
        self.pending = False

    def start(self, mixes, *args):
        if self.stream is None:
            return mixes(*args)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = mixes(*args)
        self.pending = True
        return out

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.pending = False

    def forget(self) -> None:
        """At the start of a piece: side work a failed step left unjoined is never read (and
        the next fork waits behind the main stream anyway); joining it inside a capture would
        make the graph wait on an event recorded outside it."""
        self.pending = False


class Model:
    """`fast_path`: None picks the fast path on CUDA in bf16 when the config allows it
    (`fast_path_unsupported`), the reference path otherwise; True / False force one (True on
    CPU runs the fast path's torch references: the tests compare the two paths there)."""

    def __init__(self, cfg: ModelConfig, weights: dict, *, dtype: torch.dtype, device="cpu", token_map: torch.Tensor | None = None, fast_path: bool | None = None):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.v41 = cfg.arch == "v41"
        if cfg.fp4_experts and cfg.fp8_activations:
            raise ValueError("fp4_experts: not with fp8_activations (its expert kernels multiply FP8 weight codes)")
        if cfg.fp8_activations and not self.v41:
            raise ValueError("fp8_activations: supported for V4.1 only (its GEMM inputs are quantised per 32 columns; V4's "
                             "reference blocks are not specified here)")
        why = fast_path_unsupported(cfg)
        if fast_path is None:
            fast_path = why is None and self.device.type == "cuda" and dtype == torch.bfloat16
        elif fast_path and why is not None:
            raise ValueError(f"fast_path=True: {why}")
        self.fast = fast_path
        side = fast_path and self.v41 and self.device.type == "cuda"
        self.aside = Aside(self.device, MIXES_ASIDE and side)  # the mixes
        self.engram_aside = Aside(self.device, ENGRAM_ASIDE and side)
        self.compressor_aside = Aside(self.device, COMPRESSOR_ASIDE and fast_path and self.device.type == "cuda")
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
        # blocks[split_at] is the CED split layer (len(blocks): none, every layer sees every row)
        self.split_at = next((i for i, r in enumerate(cfg.roles) if r.index == cfg.ced_split), len(self.blocks))
        self.hasher = None
        if self.v41 and cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("engram layers need the tokenizer's compressed-vocabulary map (token_map)")
            self.hasher = EngramHasher(cfg, token_map, self.device)

    # ---------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCacheStorage) -> torch.Tensor:
        """-> final hidden states [len(batch.logits_rows), D] (after the last collapse and norm)."""
        if self.fast:
            if batch.trace is not None or batch.capture is not None:
                raise ValueError("trace / capture record the reference path's selections: build the model with fast_path=False")
            return self.forward_step(build_step(batch, self.cfg, cache.block_size, self.device), cache)
        req = torch.repeat_interleave(torch.arange(batch.num_requests), torch.tensor(batch.num_tokens), output_size=sum(batch.num_tokens)).to(batch.input_ids.device)
        local = torch.arange(batch.input_ids.shape[0], device=req.device) - torch.tensor(batch.offsets[:-1], device=req.device)[req]
        return self._run(batch.input_ids, req, local, batch.positions, batch.prev_tokens, _ReferenceRows(batch, cache), batch.trace, batch.capture)

    @torch.inference_mode()
    def forward_step(self, step: Step, cache: KVCacheStorage) -> torch.Tensor:
        """The fast path on a `Step` (dsv4.model.step) -> hidden states [len(step.logits_index), D].
        No host synchronisation: CUDA graphs capture this (dsv4.engine.cuda_graphs)."""
        return self.decode_step(self.encode_step(step, cache), step, cache)

    @torch.inference_mode()
    def encode_step(self, step: Step, cache: KVCacheStorage) -> Carry:
        """The fast path's first piece: every row through the layers before the CED split and
        the split layer up to its attention (dsv4.engine.cuda_graphs captures the two pieces
        on their own row counts)."""
        step.forget_derived()  # derived tensors are made inside this forward (and its graph)
        self.aside.forget()
        self.engram_aside.forget()
        self.compressor_aside.forget()
        rows = step.enc
        return self._encode(step.input_ids, rows.req, rows.local, rows.positions, step.prev_tokens, _FastRows(step, cache), None, None)

    @torch.inference_mode()
    def decode_step(self, carry: Carry, step: Step, cache: KVCacheStorage) -> torch.Tensor:
        """The second piece: the rows the decoder keeps (`step.dec`) from the split layer's
        attention on -> hidden states [len(step.logits_index), D]."""
        step.dec.memo.clear()
        self.aside.forget()  # (the encoder piece joined its own)
        self.engram_aside.forget()
        self.compressor_aside.forget()
        rows = _FastRows(step, cache)
        shared = dict(carry.shared)  # the split replaces the selections by the kept rows': not in the caller's carry
        keep = rows.split(shared) if self.split_at < len(self.blocks) else None
        return self._decode(replace(carry.kept(keep), shared=shared), rows, None, None)

    def _run(self, ids, req, local, positions, prev_tokens, rows, trace, capture) -> torch.Tensor:
        carry = self._encode(ids, req, local, positions, prev_tokens, rows, trace, capture)
        keep = rows.split(carry.shared) if self.split_at < len(self.blocks) else None
        return self._decode(carry.kept(keep), rows, trace, capture)

    def _encode(self, ids, req, local, positions, prev_tokens, rows, trace, capture) -> Carry:
        cfg = self.cfg
        x = F.embedding(ids, self.embed).to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(ids.shape[0], cfg.hc_mult, dtype=torch.float32, device=ids.device)
        pre[:, 0] = 1.0
        hashes = None
        if self.hasher is not None:
            with section("engram"):
                hashes = self.hasher(ids, req, local, positions, prev_tokens)
        carry = Carry(ids=ids, streams=streams, pre=pre, hashes=hashes, shared={})
        encoder = self.blocks[: self.split_at + 1]
        for i, block in enumerate(encoder):
            for later in encoder[i : i + 2]:  # engram values a layer before they are read (`Aside`; one held at a time)
                if later.engram is not None and later.role.index not in carry.engram_values:
                    with section("engram"):
                        carry.engram_values[later.role.index] = self.engram_aside.start(
                            later.engram.values, self._engram_hashes(hashes, later), self.dtype)
            self._block_in(block, carry, rows, capture, i > 0 and self._input_with_expand(block))
            if i < self.split_at:
                self._block_out(block, carry, rows, trace, encoder[i + 1] if i + 1 < len(encoder) else None)
        self.aside.join()  # the split layer's attention mixes (the decoder piece reads them)
        self.engram_aside.join()  # (each value was read at its layer: a no-op, so no capture ends with side work unjoined)
        self.compressor_aside.join()  # the split layer's (its attention runs in the decoder piece)
        return carry

    def _engram_hashes(self, hashes: torch.Tensor, block: Block) -> torch.Tensor:
        return hashes[:, self.cfg.engram_layer_ids.index(block.role.index)]

    def _decode(self, carry: Carry, rows, trace, capture) -> torch.Tensor:
        cfg = self.cfg
        decoder = self.blocks[self.split_at :]
        for i, block in enumerate(decoder):
            if i > 0:
                self._block_in(block, carry, rows, capture, self._input_with_expand(block))
            self._block_out(block, carry, rows, trace, decoder[i + 1] if i + 1 < len(decoder) else None)
        want = rows.final()
        streams = carry.streams[want]
        if capture is not None:
            capture["final_streams"] = streams
        if self.v41:
            return hc_collapse_norm(streams, carry.pre[want], self.final_norm, cfg.rms_norm_eps, weight_in_fp32=False)
        fn, base, scale = self.hc_head
        final = hc_head(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)
        return rms_norm(final, self.final_norm, cfg.rms_norm_eps, weight_in_fp32=True)

    def _input_with_expand(self, block: Block) -> bool:
        """Whether the previous layer's last expand also made this layer's attention input
        (`hc_expand_collapse_norm`): V4.1, whose site collapses with the previous site's `pre`,
        when no engram changes the streams in between."""
        return self.v41 and block.engram is None

    def _block_in(self, block: Block, carry: Carry, rows, capture, collapsed: bool) -> None:
        """A layer up to its attention: [engram], the attention site's mixes and input (already
        in carry.h when `collapsed`), and the compressor (which runs on every row, the split
        layer's included)."""
        cfg, role = self.cfg, block.role
        if block.engram is not None:
            with section("engram"):
                values = carry.engram_values.pop(role.index, None)
                if values is None:  # a layer after the CED split: its rows' own
                    values = block.engram.values(self._engram_hashes(carry.hashes, block), carry.streams.dtype)
                else:
                    self.engram_aside.join()
                carry.streams = block.engram.add(carry.streams, values)
        if capture is not None and role.index in cfg.dspark_target_layer_ids:
            capture.setdefault("dspark", {})[role.index] = carry.streams[rows.final()].mean(dim=1)
        carry.residual = carry.streams
        with section("mhc"):
            # V4.1: first read after the attention (`MixesAside`; V4 runs them in place)
            carry.a_pre, carry.a_post, carry.a_comb = self.aside.start(block.mixes, carry.streams, "attn")
            if not collapsed:
                carry.h = block.collapse_norm(carry.streams, carry.pre if self.v41 else carry.a_pre, block.attn_norm)
        if role.owns_compressor:  # joined before the layer's indexer or attention reads the entries (`Aside`)
            with section("compressor"):
                self.compressor_aside.start(rows.compress, block.attn, carry.h)

    def _block_out(self, block: Block, carry: Carry, rows, trace, next_block: Block | None) -> None:
        """The rest of a layer: attention, the FFN site, MoE (and, `_input_with_expand`, the
        next layer's attention input in carry.h)."""
        with section("attention"):
            y = rows.attend(block.attn, carry.h, carry.shared, self.compressor_aside.join)
        with section("mhc"):
            self.aside.join()
            if self.v41:  # the FFN site collapses with the attention site's pre: one launch with the expand
                streams, h = hc_expand_collapse_norm(y, carry.residual, carry.a_post, carry.a_comb, carry.a_pre, block.ffn_norm,
                                                     self.cfg.rms_norm_eps)
                f_pre, f_post, f_comb = self.aside.start(block.mixes, streams, "ffn")  # first read after the MoE
            else:
                streams = hc_expand(y, carry.residual, carry.a_post, carry.a_comb, fp32=False)
                f_pre, f_post, f_comb = self.aside.start(block.mixes, streams, "ffn")
                h = block.collapse_norm(streams, f_pre, block.ffn_norm)
        with section("moe"):
            y = block.ffn(h, carry.ids, trace, f"L{block.role.index}")
        with section("mhc"):
            self.aside.join()
            if next_block is not None and self._input_with_expand(next_block):
                carry.streams, carry.h = hc_expand_collapse_norm(y, streams, f_post, f_comb, f_pre, next_block.attn_norm, self.cfg.rms_norm_eps)
            else:
                carry.streams = hc_expand(y, streams, f_post, f_comb, fp32=self.v41)
        carry.pre = f_pre

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits in fp32 (the head runs in the activation dtype)."""
        with section("head"):
            return linear(hidden, self.head.to(hidden.dtype)).float()


class _ReferenceRows:
    """The reference path's view of the rows: host-planned `Segments` (all tokens, then the
    decoder's tail rows from the CED split on)."""

    def __init__(self, batch: ForwardBatch, cache: KVCacheStorage):
        self.batch, self.cache = batch, cache
        self.segs = Segments(list(range(batch.num_requests)), batch.start_pos, batch.num_tokens, batch.window_floor, batch.positions)
        self.row_ids = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)

    def compress(self, attn: Attention, h: torch.Tensor) -> None:
        attn.compress(h, self.segs, self.batch, self.cache)

    def attend(self, attn: Attention, h: torch.Tensor, shared: dict, compressed_ready) -> torch.Tensor:
        compressed_ready()
        return attn(h, self.segs, self.batch, self.cache, shared)

    def split(self, shared: dict) -> torch.Tensor:
        """Switch to the rows the decoder runs on and return their indices in the current
        rows. Exact mode keeps every row; bounded replay keeps each request's last
        `decoder_tokens[b]` rows, whose window starts at their first position. Per-request
        selections published before the split cover every row: they keep the same tail."""
        batch, segs = self.batch, self.segs
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
        self.segs = Segments(segs.requests, starts, counts, floors, segs.positions[keep])
        self.row_ids = self.row_ids[keep]
        return keep

    def final(self) -> torch.Tensor:
        """Positions in the current rows of the batch's logits rows (all must still exist)."""
        wanted, row_ids = self.batch.logits_rows, self.row_ids
        lookup = torch.full((int(row_ids.max()) + 1 if row_ids.numel() else 1,), -1, dtype=torch.long, device=row_ids.device)
        lookup[row_ids] = torch.arange(row_ids.numel(), device=row_ids.device)
        if wanted.numel() and (int(wanted.max()) >= lookup.numel() or bool((lookup[wanted] < 0).any())):
            raise ValueError("logits_rows: a requested row did not run the decoder layers (bounded replay keeps only each request's last tokens)")
        return lookup[wanted]


class _FastRows:
    """The fast path's view of the rows: the step's device metadata (`enc`, then `dec`)."""

    def __init__(self, step: Step, cache: KVCacheStorage):
        self.step, self.cache, self.rows = step, cache, step.enc

    def compress(self, attn: Attention, h: torch.Tensor) -> None:
        attn.compress_fast(h, self.rows, self.step, self.cache)

    def attend(self, attn: Attention, h: torch.Tensor, shared: dict, compressed_ready) -> torch.Tensor:
        return attn.forward_fast(h, self.rows, self.step, self.cache, shared, compressed_ready)

    def split(self, shared: dict) -> torch.Tensor | None:
        self.rows = self.step.dec
        keep = self.step.dec_keep
        if keep is not None:  # selections published before the split: keep the same rows
            for key in ("topk", "cand"):
                if key in shared:
                    shared[key] = shared[key][keep]
            if "pool" in shared:
                shared["pool"] = tuple(t[keep] for t in shared["pool"])
        return keep

    def final(self) -> torch.Tensor:
        return self.step.logits_index

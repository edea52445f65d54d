"""Draft modules for speculative decoding: DeepSeek-V4's MTP layer and V4.1's DSpark stages.

Both are ordinary blocks (mHC sites, window-only attention with the main rope, their own MoE)
stored under `mtp.K.` and sharing the target's embedding and head. Each keeps its own sliding
window ring per request slot (`DraftRings`), separate from the target's cache, so drafting
never touches the target's state. Verification and acceptance are not here (MODEL.md 7.4:
the engine defines them).

* V4 MTP (`MTPDraft`): position t reads token t+1 and the target's final streams at t and
  predicts token t+2; it runs over every position the target runs over (its ring needs them).
* V4.1 DSpark (`DSparkDraft`, MODEL.md 2.7): the target's captured layer means become `main_x`;
  prefill seeds each stage's ring from `main_x` (keys only); a draft step runs one block of
  `dspark_block_size` slots (anchor + noise) through the stage chain, then a sequential
  Markov head turns the block logits into tokens, and a confidence head scores each slot.

Choices where MODEL.md and the public sources are silent, made here and kept in one place:

* the block's own keys get the same FP8 window round trip as every window key (QAT), but are
  never written to the ring: only `main_x` positions live there;
* the confidence head reads x_j = collapse(streams, pre) before the final norm (MODEL.md
  names that value `x`; `norm(x)` feeds only the head);
* the mean over streams for DSpark inputs is taken in the activation dtype (torch accumulates
  in fp32 and rounds once);
* non-greedy drafting samples from softmax of the Markov-corrected logits at temperature 1;
* a V4.1 checkpoint with fewer DSpark stages than the config names has no Markov/confidence
  head (they live on the last stage), so it gets no draft (with a warning) instead of an error;
  a V4 checkpoint uses its first MTP stage.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsv4.cache.storage import QTensor, _alloc, window_is_fp8
from dsv4.config import LayerRole, ModelConfig
from dsv4.model.batch import ForwardBatch
from dsv4.model.layers.attention import Attention, Segments
from dsv4.model.model import Block
from dsv4.model.weights import LoadedWeights
from dsv4.ops import attention as attention_ops
from dsv4.ops import kv as kvops
from dsv4.ops.linear import Linear, linear
from dsv4.ops.mhc import hc_collapse, hc_expand, hc_head
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import RopeTables, apply_rope_


def _stage_role(cfg: ModelConfig, k: int) -> LayerRole:
    """Draft stage k as a layer: window-only, main rope, after the backbone (layer id
    num_layers + k, which also keys its ring)."""
    return LayerRole(cfg.num_layers + k, "window", 0, "main", None, None)


class DraftRings:
    """The draft stages' window rings `[slots, window, head_dim]`, in the same format as the
    target's rings (FP8 + ue8m0 on V4.1, the compute dtype on V4). Exposes `ring` keyed by
    layer id, which is all a window-only `Attention` reads from a cache."""

    def __init__(self, cfg: ModelConfig, layers: list[int], num_slots: int, dtype: torch.dtype, device):
        quant = "fp8" if window_is_fp8(cfg) else None
        self.ring: dict[int, QTensor] = {i: _alloc((num_slots, cfg.window), cfg.head_dim, quant, dtype, device) for i in layers}


def _run_stage(block: Block, streams: torch.Tensor, pre: torch.Tensor | None, ids: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """One stage through its two mHC sites, as the backbone does: V4.1 collapses each site with
    the previous site's `pre` (single-pass shift), V4 with the site's own. `attend(h)` is the
    stage's attention on the normalised collapsed input. -> (streams, the FFN site's pre)."""
    v41 = block.v41
    residual = streams
    a_pre, a_post, a_comb = block.mixes(streams, "attn")
    h = block.collapse_norm(streams, pre if v41 else a_pre, block.attn_norm)
    streams = hc_expand(attend(h), residual, a_post, a_comb, fp32=v41)
    residual = streams
    f_pre, f_post, f_comb = block.mixes(streams, "ffn")
    h = block.collapse_norm(streams, a_pre if v41 else f_pre, block.ffn_norm)
    streams = hc_expand(block.ffn(h, ids), residual, f_post, f_comb, fp32=v41)
    return streams, f_pre


class MTPDraft:
    """DeepSeek-V4's MTP layer (`mtp.0.`): `e_proj(enorm(embed(t+1)))` added to every stream of
    `h_proj(hnorm(target streams at t))`, one V4 block, its own `hc_head` and norm, the shared
    head. Predicts the token at t+2 for each position t."""

    def __init__(self, weights: dict, cfg: ModelConfig, rope: RopeTables, dtype: torch.dtype, device="cpu", *, num_slots: int = 1):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        p, b = "mtp.0.", cfg.weight_block_size
        self.role = _stage_role(cfg, 0)
        self.block = Block(weights, p, cfg, self.role, rope, cfg.n_routed_experts, cfg.num_experts_per_tok)
        self.e_proj = Linear(weights[p + "e_proj.weight"], weights.get(p + "e_proj.scale"), b, quant_input=cfg.fp8_activations)
        self.h_proj = Linear(weights[p + "h_proj.weight"], weights.get(p + "h_proj.scale"), b, quant_input=cfg.fp8_activations)
        self.enorm, self.hnorm, self.norm = (weights[f"{p}{n}.weight"] for n in ("enorm", "hnorm", "norm"))
        self.hc_head = (weights[p + "hc_head_fn"], weights[p + "hc_head_base"], weights[p + "hc_head_scale"])
        self.embed, self.head = weights["embed.weight"], weights["head.weight"]
        self.rings = DraftRings(cfg, [self.role.index], num_slots, dtype, self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, weight_in_fp32=True)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        main_streams: torch.Tensor,
        start_pos: list[int],
        num_tokens: list[int],
        slots: list[int],
        window_floor: list[int] | None = None,
    ) -> torch.Tensor:
        """Flat batch of requests like the target's: row i holds position `positions[i]`,
        `input_ids[i]` is the token at positions[i] + 1 and `main_streams[i]` the target's final
        streams at positions[i] (`capture["final_streams"]`). Every position is written to the
        request's ring, so call it for every position the target ran. -> logits [T, V] fp32."""
        cfg = self.cfg
        e = self._norm(F.embedding(input_ids, self.embed).to(self.dtype), self.enorm)
        h = self._norm(main_streams.to(self.dtype), self.hnorm)
        streams = self.e_proj(e).unsqueeze(1) + self.h_proj(h.flatten(0, 1)).view_as(h)
        n = len(start_pos)
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, start_pos=start_pos, num_tokens=num_tokens, slots=slots,
            block_tables=torch.empty(n, 0, dtype=torch.long, device=input_ids.device),
            prev_tokens=torch.empty(n, 0, dtype=torch.long, device=input_ids.device),
            window_floor=list(window_floor or []),
        )
        segs = Segments(list(range(n)), start_pos, num_tokens, batch.window_floor, positions)
        streams, _ = _run_stage(self.block, streams, None, input_ids, lambda x: self.block.attn(x, segs, batch, self.rings, {}))
        fn, base, scale = self.hc_head
        final = self._norm(hc_head(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps), self.norm)
        return linear(final, self.head.to(final.dtype)).float()


class DSparkOutput(NamedTuple):
    tokens: torch.Tensor  # [block_size] int64: drafts for positions p+2 .. p+block_size+1
    confidence: torch.Tensor  # [block_size] fp32: one acceptance logit per slot
    logits: torch.Tensor  # [block_size, V] fp32: Markov-corrected logits each token was drawn from


class DSparkDraft:
    """V4.1's DSpark stages `mtp.0 .. mtp.{n-1}` (MODEL.md 2.7): `main_proj`/`main_norm` on
    stage 0, the norm, Markov head and confidence head on the last stage, each stage its own
    128-expert (config: dspark_n_routed_experts) MoE and window ring."""

    def __init__(self, weights: dict, cfg: ModelConfig, rope: RopeTables, dtype: torch.dtype, device="cpu", *, num_slots: int = 1):
        self.cfg, self.rope, self.dtype, self.device = cfg, rope, dtype, torch.device(device)
        n, b = cfg.num_nextn_predict_layers, cfg.weight_block_size
        self.stages = [
            Block(weights, f"mtp.{k}.", cfg, _stage_role(cfg, k), rope, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
            for k in range(n)
        ]
        self.main_proj = Linear(weights["mtp.0.main_proj.weight"], weights.get("mtp.0.main_proj.scale"), b, quant_input=cfg.fp8_activations)
        self.main_norm = weights["mtp.0.main_norm.weight"]
        last = f"mtp.{n - 1}."
        self.norm = weights[last + "norm.weight"]
        self.markov_embed = weights[last + "markov_head.embed.weight"]
        # fp32 computes, kept fp32 once: upcasting a [V, rank] table every step costs more than
        # the step's matmuls
        self.markov_head = weights[last + "markov_head.head.weight"].float()
        self.confidence = weights[last + "confidence_head.proj.weight"].float()
        self.embed, self.head = weights["embed.weight"], weights["head.weight"]
        self.rings = DraftRings(cfg, [s.role.index for s in self.stages], num_slots, dtype, self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, weight_in_fp32=False)

    def main_x(self, target_means: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's layer means (`capture["dspark"]`) -> main_x [R, D]: concatenated in
        `dspark_target_layer_ids` order, `main_proj`, `main_norm`."""
        hidden = torch.cat([target_means[i] for i in self.cfg.dspark_target_layer_ids], dim=-1).to(self.dtype)
        return self._norm(self.main_proj(hidden), self.main_norm)

    def _keys(self, attn: Attention, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A stage's window keys from main_x: kv_norm(wkv(.)) with the main rope (no attn_norm:
        main_x is already normalised)."""
        cos, sin = self.rope.cos_sin(positions, "main")
        return apply_rope_(attn.norm(attn.wkv(main_x), attn.kv_norm), cos, sin)

    @torch.inference_mode()
    def prefill(self, main_x: torch.Tensor, positions: torch.Tensor, slot: int = 0) -> None:
        """Write keys of main_x at one request's ascending, contiguous positions into every
        stage's ring of `slot`; no queries run. Seeds the rings after the prompt, and is also how
        the target positions accepted after a verification must be appended (`draft` itself
        writes only position p). Only the last `window` rows can matter."""
        keep = min(main_x.shape[0], self.cfg.window)
        main_x, positions = main_x[-keep:].to(self.dtype), positions[-keep:]
        for stage in self.stages:
            ring = self.rings.ring[stage.role.index]
            kvops.store(ring, (slot, positions % self.cfg.window), self._keys(stage.attn, main_x, positions), "window")

    def block_ids(self, anchor: int) -> torch.Tensor:
        """The block input: the anchor (the token at p+1), then noise tokens."""
        ids = torch.full((self.cfg.dspark_block_size,), self.cfg.dspark_noise_token_id, dtype=torch.long, device=self.device)
        ids[0] = anchor
        return ids

    @torch.inference_mode()
    def block_hidden(self, ids: torch.Tensor, p: int, main_x_p: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """Run block `ids` at positions p+1 .. p+len(ids) through the stage chain, after writing
        main_x_p's keys at p into each stage's ring. -> x = collapse(streams, pre) [B, D]."""
        cfg = self.cfg
        positions = torch.arange(p + 1, p + 1 + ids.shape[0], device=self.device)
        main_x_p = main_x_p.to(self.dtype).view(1, -1)
        x = F.embedding(ids, self.embed).to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(ids.shape[0], cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0
        p_t = torch.tensor([p], device=self.device)
        for stage in self.stages:
            ring = self.rings.ring[stage.role.index]
            kvops.store(ring, (slot, p_t % cfg.window), self._keys(stage.attn, main_x_p, p_t), "window")
            streams, pre = _run_stage(stage, streams, pre, ids, partial(self._attend, stage.attn, ring, positions=positions, p=p, slot=slot))
        return hc_collapse(streams, pre)

    def _attend(self, attn: Attention, ring: QTensor, x: torch.Tensor, positions: torch.Tensor, p: int, slot: int) -> torch.Tensor:
        """Block attention: every block query sees the ring's positions p-window+1 .. p (those
        >= 0) and all block keys (bidirectional), in one softmax with the stage's sinks; then
        inverse rope and the grouped output projection, as the target's attention."""
        cfg = self.cfg
        h, hd, w, dtype = cfg.num_heads, cfg.head_dim, cfg.window, x.dtype
        n = x.shape[0]
        cos, sin = self.rope.cos_sin(positions, "main")
        q_res, kv = attention_ops.latent_inputs(attn.wq_a_kv(x), attn.wq_a.out_features, attn.q_norm, attn.kv_norm, cfg.rms_norm_eps,
                                                not attn.v41, cos, sin, ring)
        q = attn.wq_b(q_res).view(n, h, hd)
        attention_ops.rope_queries_(q, cos, sin)
        ring_pos = torch.arange(p - w + 1, p + 1, device=x.device)
        ring_keys = kvops.load(ring, (slot, ring_pos.clamp_min(0) % w), "window", dtype)
        ring_valid = (ring_pos >= 0).expand(n, w)
        block_valid = torch.ones(n, n, dtype=torch.bool, device=x.device)
        out = attn._attend(q, ring_keys.expand(n, w, hd), ring_valid, kv.expand(n, n, hd), block_valid)
        return attn.project_out(apply_rope_(out, cos, sin, inverse=True))

    @torch.inference_mode()
    def draft(self, anchor: int, p: int, main_x_p: torch.Tensor, *, slot: int = 0, greedy: bool = True, generator: torch.Generator | None = None) -> DSparkOutput:
        """One draft step after the target consumed position p and produced `anchor` (token
        p+1); `main_x_p` [D] is main_x at p. The Markov head is sequential: slot j's logits get
        `markov_head(markov_embed(tok_j))` with tok_0 = anchor and tok_{j+1} drawn from slot
        j's corrected logits (argmax, or sampled when not greedy)."""
        x = self.block_hidden(self.block_ids(anchor), p, main_x_p, slot)
        logits = linear(self._norm(x, self.norm), self.head.to(x.dtype)).float()
        tokens, confidence = [], []
        tok = torch.tensor([anchor], device=self.device)
        for j in range(x.shape[0]):
            m = F.embedding(tok, self.markov_embed).float()  # [1, rank]
            logits[j] += linear(m, self.markov_head)[0]
            confidence.append(linear(torch.cat([x[j : j + 1].float(), m], dim=-1), self.confidence)[0, 0])
            if greedy:
                tok = logits[j].argmax().view(1)
            else:
                tok = torch.multinomial(torch.softmax(logits[j], dim=-1), 1, generator=generator)
            tokens.append(tok[0])
        return DSparkOutput(torch.stack(tokens), torch.stack(confidence), logits)


def build_draft(cfg: ModelConfig, weights: LoadedWeights, rope: RopeTables, dtype: torch.dtype, device="cpu", *, num_slots: int = 1) -> MTPDraft | DSparkDraft | None:
    """The checkpoint's draft model, or None when it has none (no speculative decoding)."""
    if weights.draft_stages == 0:
        return None
    if cfg.arch == "v4":
        return MTPDraft(weights.tensors, cfg, rope, dtype, device, num_slots=num_slots)
    if weights.draft_stages < cfg.num_nextn_predict_layers:
        warnings.warn(
            f"checkpoint has {weights.draft_stages} of {cfg.num_nextn_predict_layers} DSpark stages; the heads live on "
            f"mtp.{cfg.num_nextn_predict_layers - 1}, so there is no draft model",
            stacklevel=2,
        )
        return None
    return DSparkDraft(weights.tensors, cfg, rope, dtype, device, num_slots=num_slots)

"""Engram: n-gram hash lookups written into the residual streams through a learned gate
(MODEL.md section 2.2)."""

from __future__ import annotations

import numpy as np
import torch

from dsv4.config import ModelConfig
from dsv4.model import quant
from dsv4.ops import elementwise, on_triton
from dsv4.ops.linear import Linear


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def engram_primes(cfg: ModelConfig) -> list[list[list[int]]]:
    """primes[layer][ngram-2][head]: for each layer, n-gram size and head, the next prime above
    `engram_vocab_size - 1` not used before (one used-set across all layers)."""
    used: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_layer = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            cur, heads = cfg.engram_vocab_size - 1, []
            for _ in range(cfg.engram_n_heads):
                cur += 1
                while not _is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                heads.append(cur)
            per_layer.append(heads)
        out.append(per_layer)
    return out


def hash_multipliers(cfg: ModelConfig) -> list[list[int]]:
    """Per layer, one odd multiplier per look-back, from numpy's PCG64 seeded by 10007 * layer,
    bounded so `compressed id * multiplier` cannot overflow int64."""
    bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
    rows = []
    for layer in cfg.engram_layer_ids:
        values = np.random.default_rng(10007 * layer).integers(0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64)
        rows.append([int(v) * 2 + 1 for v in values])
    return rows


class EngramHasher:
    """Hash ids [T, n_engram_layers, (N-1)*heads] of the n-grams ending at each token. The
    look-back of a step's first tokens comes from `ForwardBatch.prev_tokens` (ids the engine
    already knows), so no per-request hash state is kept."""

    def __init__(self, cfg: ModelConfig, token_map: torch.Tensor, device):
        self.cfg = cfg
        self.n = cfg.engram_max_ngram_size
        primes = engram_primes(cfg)
        for k, layer_primes in enumerate(primes):
            total = sum(sum(p) for p in layer_primes)
            if total != cfg.engram_num_embeddings[k]:
                raise ValueError(
                    f"engram_num_embeddings[{k}]: the prime layout of layer {cfg.engram_layer_ids[k]} needs {total} rows, config says {cfg.engram_num_embeddings[k]}"
                )
        self.primes = torch.tensor(primes, dtype=torch.long, device=device)  # [L, N-1, heads]
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, dim=1) - flat  # exclusive prefix sums per layer
        self.mult = torch.tensor(hash_multipliers(cfg), dtype=torch.long, device=device)  # [L, N]
        self.token_map = token_map.to(device=device, dtype=torch.long)
        self.pad = int(self.token_map[cfg.engram_pad_id])

    def __call__(self, input_ids: torch.Tensor, req: torch.Tensor, local: torch.Tensor, positions: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Rows of a flat batch: ids [T]; per row its request `req`, its index `local` among
        the request's rows of this step and its position; prev_tokens [B, >= N-1] the ids
        before each request's first row (nearest first, -1: none). Fixed shapes, no host
        synchronisation (the fast path captures it in CUDA graphs). CUDA: one Triton launch
        for all layers (`dsv4.ops.triton.engram.hash_ids`, the same integers)."""
        if on_triton(input_ids):
            from dsv4.ops.triton import engram as triton_engram

            return triton_engram.hash_ids(input_ids, req, local, positions, prev_tokens, self.token_map, self.mult, self.primes, self.offsets, self.pad)
        return self.reference(input_ids, req, local, positions, prev_tokens)

    def reference(self, input_ids: torch.Tensor, req: torch.Tensor, local: torch.Tensor, positions: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """The torch computation of `__call__` on any device (the kernel's oracle)."""
        req, rows = req.long(), torch.arange(input_ids.shape[0], device=input_ids.device)
        blocked = torch.zeros_like(positions, dtype=torch.bool)
        shifted = []
        for s in range(self.n):
            tok = input_ids[(rows - s).clamp_min(0)]
            if s:  # look-back before the step's first row comes from prev_tokens
                back = prev_tokens[req, (s - 1 - local).clamp(0, prev_tokens.shape[1] - 1)]
                tok = torch.where(local >= s, tok, back)
            comp = torch.where(tok >= 0, self.token_map[tok.clamp_min(0)], -1)
            blocked = blocked | (positions < s) | (comp < 0)  # once blocked, longer n-grams are too
            shifted.append(torch.where(blocked, self.pad, comp))
        tokens = torch.stack(shifted, dim=-1)  # [T, N]
        products = tokens.unsqueeze(1) * self.mult  # [T, L, N]
        rolling, hashes = products[..., 0], []
        for i in range(1, self.n):
            rolling = rolling ^ products[..., i]
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return torch.cat(hashes, dim=-1) + self.offsets


class Engram:
    def __init__(self, w: dict, prefix: str, cfg: ModelConfig):
        self.cfg = cfg
        self.table, self.table_scale = w[prefix + "embed.weight"], w[prefix + "embed.scale"]
        self.wkv = Linear(w[prefix + "wkv.weight"], w.get(prefix + "wkv.scale"), cfg.weight_block_size, quant_input=cfg.fp8_activations)
        self.gate_weight = w[prefix + "q_weight"].float() * w[prefix + "k_weight"].float()

    def __call__(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, D]; hash_ids [T, n_cols] -> streams with the gated value added."""
        return self.add(streams, self.values(hash_ids, streams.dtype))

    def values(self, hash_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The wkv projection [T, (hc+1)*D] of the table rows of hash_ids [T, n_cols]: what
        needs only the hashes (the fast path starts it beside the layers before this one).
        CUDA: the lookup is a Triton kernel (`dsv4.ops.triton.engram`)."""
        if on_triton(hash_ids):
            from dsv4.ops.triton import engram as triton_engram

            return self.wkv(triton_engram.lookup(self.table, self.table_scale, hash_ids, dtype))
        return self.wkv(self.lookup_reference(hash_ids, dtype))

    def add(self, streams: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, D] plus the gated value of `values`' kv (CUDA: one Triton kernel)."""
        if on_triton(streams):
            from dsv4.ops.triton import engram as triton_engram

            return triton_engram.gate(streams, kv, self.gate_weight, self.cfg.rms_norm_eps)
        return self.gate_reference(streams, kv)

    def lookup_reference(self, hash_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The table rows of hash_ids [T, n_cols], dequantised -> [T, n_cols * dim] in `dtype`
        (the torch computation, on any device)."""
        # validate=False: the loader checked every scale byte (no host sync per forward)
        rows = quant.dequant_fp8_rows(self.table[hash_ids.flatten()], self.table_scale[hash_ids.flatten()], validate=False)
        return rows.view(hash_ids.shape[0], -1).to(dtype)

    def gate_reference(self, streams: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, D] plus the gated value, from the wkv output kv [T, (hc+1)*D] (the
        torch computation, on any device)."""
        cfg, dtype = self.cfg, streams.dtype
        d, hc = cfg.hidden_size, cfg.hc_mult
        key = kv[:, : hc * d].float().view(-1, hc, d)
        value = kv[:, hc * d :].float()
        h = streams.float()
        eps = cfg.rms_norm_eps
        rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (h * self.gate_weight * key).sum(-1) * rstd * d**-0.5
        gate = elementwise.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.unsqueeze(1)).to(dtype)

"""KV cache tensors: paged global KV per KV-source layer, and per-request state slots.

Layout (MODEL.md section 5; stored in the model's own precision):

* window ring of every layer: `[slots, window, head_dim]` — V4.1 FP8 e4m3 codes with one
  ue8m0 exponent byte per 32 channels (when head_dim is a multiple of 32), else the compute
  dtype (V4, whose reference does not quantise, and odd test shapes);
* compressed KV of every layer that owns a compressor: `[blocks, block_size / ratio, dim]` —
  V4.1 FP4 e2m1 packed two per byte with one E4M3 scale per 16 channels; V4 compute dtype;
* indexer keys of the same layers (V4.1 KV sources, V4 CSA layers): V4.1 FP4 with a ue8m0
  byte per 32 channels; V4 compute dtype;
* compressor tails (the partial group still filling) and, for V4's overlapping CSA windows,
  the previous window's first half: `[slots, ratio, width]` fp32.

One logical block size for every kind: a ratio-r layer stores block_size / r entries per block.
The model never allocates: it reads and writes the slots and blocks the batch names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.config import ModelConfig

FP8_BLOCK = 32  # window KV: one ue8m0 scale per 32 channels
CKV_BLOCK = 16  # compressed KV: one E4M3 scale per 16 channels
IDX_BLOCK = 32  # indexer keys: one ue8m0 scale per 32 channels


@dataclass
class QTensor:
    """A cache tensor: either plain values in the compute dtype, or codes + scales."""

    values: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.codes is not None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.codes, self.scales) if t is not None)


def window_is_fp8(cfg: ModelConfig) -> bool:
    return cfg.arch == "v41" and cfg.head_dim % FP8_BLOCK == 0


def ckv_is_fp4(cfg: ModelConfig) -> bool:
    return cfg.arch == "v41" and cfg.head_dim % CKV_BLOCK == 0


def idx_is_fp4(cfg: ModelConfig) -> bool:
    return cfg.arch == "v41" and cfg.index_head_dim % IDX_BLOCK == 0


def _alloc(shape: tuple[int, ...], dim: int, quant: str | None, dtype: torch.dtype, device) -> QTensor:
    if quant is None:
        return QTensor(values=torch.zeros(*shape, dim, dtype=dtype, device=device))
    if quant == "fp8":
        return QTensor(
            codes=torch.zeros(*shape, dim, dtype=torch.float8_e4m3fn, device=device),
            scales=torch.full((*shape, dim // FP8_BLOCK), 127, dtype=torch.uint8, device=device),
        )
    if quant == "fp4_e4m3":
        return QTensor(
            codes=torch.zeros(*shape, dim // 2, dtype=torch.uint8, device=device),
            scales=torch.zeros(*shape, dim // CKV_BLOCK, dtype=torch.float8_e4m3fn, device=device),
        )
    return QTensor(
        codes=torch.zeros(*shape, dim // 2, dtype=torch.uint8, device=device),
        scales=torch.full((*shape, dim // IDX_BLOCK), 127, dtype=torch.uint8, device=device),
    )


def bytes_per_entry(dim: int, quant: str | None, dtype: torch.dtype) -> int:
    if quant is None:
        return dim * torch.tensor([], dtype=dtype).element_size()
    if quant == "fp8":
        return dim + dim // FP8_BLOCK
    if quant == "fp4_e4m3":
        return dim // 2 + dim // CKV_BLOCK
    return dim // 2 + dim // IDX_BLOCK


class KVCacheStorage:
    """All cache tensors of one model instance on one device."""

    def __init__(self, cfg: ModelConfig, *, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu"):
        for r in cfg.compress_ratio_set:
            if block_size % r:
                raise ValueError(f"block_size: must be a multiple of every compress ratio {list(cfg.compress_ratio_set)}, got {block_size}")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        wq = "fp8" if window_is_fp8(cfg) else None
        cq = "fp4_e4m3" if ckv_is_fp4(cfg) else None
        iq = "fp4_ue8m0" if idx_is_fp4(cfg) else None
        self.window_quant, self.ckv_quant, self.idx_quant = wq, cq, iq
        self.ring: dict[int, QTensor] = {}
        self.ckv: dict[int, QTensor] = {}
        self.idx: dict[int, QTensor] = {}
        self.tail_kv: dict[tuple[int, str], torch.Tensor] = {}
        self.tail_gate: dict[tuple[int, str], torch.Tensor] = {}
        self.prev_kv: dict[tuple[int, str], torch.Tensor] = {}
        self.prev_gate: dict[tuple[int, str], torch.Tensor] = {}
        for role in cfg.roles:
            self.ring[role.index] = _alloc((num_slots, cfg.window), cfg.head_dim, wq, dtype, device)
            if not role.owns_compressor:
                continue
            r = role.compress_ratio
            entries = block_size // r
            self.ckv[role.index] = _alloc((num_blocks, entries), cfg.head_dim, cq, dtype, device)
            if cfg.arch == "v41" or role.kind == "csa":
                self.idx[role.index] = _alloc((num_blocks, entries), cfg.index_head_dim, iq, dtype, device)
            streams = [("kv", cfg.head_dim)] + ([("idx", cfg.index_head_dim)] if role.kind == "csa" else [])
            for name, width in streams:
                overlap = role.kind == "csa"
                if r > 1:
                    w = width * (2 if overlap else 1)
                    self.tail_kv[role.index, name] = torch.zeros(num_slots, r, w, dtype=torch.float32, device=device)
                    self.tail_gate[role.index, name] = torch.zeros(num_slots, r, w, dtype=torch.float32, device=device)
                if overlap:
                    self.prev_kv[role.index, name] = torch.zeros(num_slots, r, width, dtype=torch.float32, device=device)
                    self.prev_gate[role.index, name] = torch.zeros(num_slots, r, width, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------------- accounting
    def global_bytes_per_token(self) -> dict[str, float]:
        """Bytes of paged (prefix-cacheable) state per token, by kind and in total."""
        out: dict[str, float] = {"compressed_kv": 0.0, "indexer_keys": 0.0}
        for layer in self.ckv:
            r = self.cfg.roles[layer].compress_ratio
            out["compressed_kv"] += bytes_per_entry(self.cfg.head_dim, self.ckv_quant, self.dtype) / r
            if layer in self.idx:
                out["indexer_keys"] += bytes_per_entry(self.cfg.index_head_dim, self.idx_quant, self.dtype) / r
        out["total"] = out["compressed_kv"] + out["indexer_keys"]
        return out

    def slot_bytes(self) -> dict[str, int]:
        """Bytes of fixed-size state per request slot, by kind."""
        ring = sum(q.nbytes() for q in self.ring.values()) // max(self.num_slots, 1)
        tails = sum(t.numel() * t.element_size() for d in (self.tail_kv, self.tail_gate, self.prev_kv, self.prev_gate) for t in d.values())
        return {"window_rings": ring, "compressor_tails": tails // max(self.num_slots, 1)}

    def block_bytes(self) -> int:
        return sum(q.nbytes() for d in (self.ckv, self.idx) for q in d.values()) // max(self.num_blocks, 1)

"""The compressor's entries of a fast-path step, from its projections to the compressed cache.

`compress_entries` takes, for every row of the step, the pooling inputs its group needs (this
step's rows, or the request's tail slot for positions before the step), pools them with the
softmax gate (ratio > 1), RMS-normalises the entry, and for the rows that complete a group
writes the RoPE-rotated entry to the compressed KV cache in its format (V4.1: FP4). It returns the normalised
pre-RoPE entries (the indexer keys are projected from them) with the cache location and the
emit flag of every row (the indexer keys go to the same place). The caller stores the step's
trailing incomplete groups to the tails afterwards (`kv.store_plain`): a tail slot can be read
for one group and written for a later one in the same step, so the reads must all come first.

On CUDA one Triton kernel (`dsv4.ops.triton.compressor`) replaces the ~40 small torch launches
of this reference (gathers, the emit masks and index arithmetic, softmax, norm, RoPE, store)
for V4.1 (FP4 cache, fp32 pooling). V4's compressors (position bias, overlapping CSA windows,
pooling in the activation dtype, caches in it too: `V4Pooling`) are torch code only so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.storage import QTensor
from dsv4.ops import kv as kvops
from dsv4.ops import on_triton
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope


def compress_entries(
    kv: torch.Tensor, gate: torch.Tensor | None, tail_kv: torch.Tensor | None, tail_gate: torch.Tensor | None,
    req: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, row0: torch.Tensor, write: torch.Tensor,
    slots: torch.Tensor, emit_from: torch.Tensor, block_tables: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, ckv: QTensor, ratio: int, block_size: int,
    dtype: torch.dtype, *, v4: V4Pooling | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Rows r of the step (R of them) belong to request req[r] at positions[r]; request b's rows
    are row0[b] .. at positions start[b] ..; `write` False marks padding rows (they store
    nothing). ratio > 1: kv / gate are the pooling projections [R, W] (any row stride; V4.1
    fp32, V4 in `dtype`) and tail_kv / tail_gate [slots, ratio, W] fp32 the requests' pending
    positions; ratio 1: kv is the entry [R, W] itself (in `dtype`, the activations') and gate /
    tails are None. A row at position p completes entry
    p // ratio when p % ratio == ratio - 1; it is cached (at its block table's location) unless
    its group starts before emit_from[req] (a prefix hit's cached groups). cos / sin [R, rd/2]:
    the angles of each row's entry position (p - p % ratio). `v4`: V4's position bias and
    overlapping windows (`V4Pooling`; torch code only). -> (`dtype` [R, E] normalised entries
    before RoPE (E = W, or W / 2 with overlap; a row that completes no group gets its partial
    group's pooling: unused), the cache location (block id from the table, offset) int64 [R]
    each, emit bool [R]: the row's entry was stored)."""
    _check(kv, gate, tail_kv, tail_gate, req, positions, cos, ckv, ratio, dtype, v4)
    if on_triton(kv) and dtype == torch.bfloat16:
        if v4 is not None or not ckv.quantized:
            raise NotImplementedError("compress_entries: no kernel for V4's compressors yet; V4 runs the reference path on CUDA")
        from dsv4.ops.triton import compressor as triton_compressor

        return triton_compressor.compress_entries(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from,
                                                  block_tables, norm_weight, eps, cos, sin, ckv, ratio, block_size, dtype)
    r, n_rows = ratio, kv.shape[0]
    req = req.long()
    if r > 1:
        first = start[req].unsqueeze(1)
        slot = slots[req].long().unsqueeze(1).expand(-1, r)

        def gathered(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """kv, gate [R, r, W] of positions `group` [R, r]: this step's rows, or the tail slot before them."""
            in_step = (group >= first).unsqueeze(-1)
            src = (row0[req].long().unsqueeze(1) + group - first).clamp(0, n_rows - 1)
            return (torch.where(in_step, kv[src], tail_kv[slot, group % r].to(kv.dtype)),
                    torch.where(in_step, gate[src], tail_gate[slot, group % r].to(gate.dtype)))

        group = (positions - positions % r).unsqueeze(1) + torch.arange(r, device=kv.device)  # the group's r positions
        pooled_kv, pooled_gate = gathered(group)
        if v4 is not None:
            pooled_gate = pooled_gate + v4.ape  # torch's type promotion, as the reference
            if v4.overlap:
                pooled_kv, pooled_gate = _overlap(v4, gathered, group, first, slot, req, positions, write, pooled_kv, pooled_gate, r)
        weights = pooled_gate.softmax(dim=1, dtype=torch.float32).to(pooled_kv.dtype)
        latent = (pooled_kv * weights).sum(dim=1).to(dtype)
    else:
        latent = kv
    latent = rms_norm(latent, norm_weight, eps, weight_in_fp32=v4 is not None)
    emit = write & (positions - positions % r >= emit_from[req]) & (positions % r == r - 1)
    entry = positions // r
    per_block = block_size // r
    block = (entry // per_block).clamp(max=block_tables.shape[1] - 1)  # a padding row's position may lie past the table
    where = (block_tables[req, block].long(), entry % per_block)
    kvops.store_rows(ckv, "ckv", apply_rope(latent, cos, sin), where, emit)
    return latent, where, emit


@dataclass
class V4Pooling:
    """What V4's compressors add to the pooling: `ape` [ratio, W] (as loaded), the learned
    position bias of the gate logits (tails hold the gate before it); `overlap` (CSA): entry j pools
    window j-1's first W/2 channels ("Ca") with window j's last W/2 ("Cb") over 2 * ratio
    slots, where `prev_kv` / `prev_gate` [slots, ratio, W/2] fp32 hold the Ca half (gate after
    `ape`) of each request's last window completed before the step, and `count` [B] its rows
    in the step (the step's last completed window becomes that state)."""

    ape: torch.Tensor
    overlap: bool = False
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    count: torch.Tensor | None = None


def _overlap(v4: V4Pooling, gathered, group, first, slot, req, positions, write, pooled_kv, pooled_gate, r):
    """The 2r pooling slots of V4's overlapping windows (`V4Pooling`): the previous window's Ca
    from this step's rows, the tail, or (completed before the step) the overlap state, none
    before window 0 (gate -inf); then the overlap state takes each request's last window
    completed in the step (after every read of it)."""
    half = pooled_kv.shape[-1] // 2
    prev = group - r
    p_kv, p_gate = gathered(prev)
    p_kv, p_gate = p_kv[..., :half], p_gate[..., :half] + v4.ape[:, :half]
    earlier = (prev < first - first % r).unsqueeze(-1)  # a window wholly before the step's first group
    state = (slot, prev % r)
    p_kv = torch.where(earlier, v4.prev_kv[state].to(p_kv.dtype), p_kv)
    p_gate = torch.where(earlier, v4.prev_gate[state].to(p_gate.dtype), p_gate)
    none = (prev < 0).unsqueeze(-1)
    p_kv, p_gate = p_kv.masked_fill(none, 0), p_gate.masked_fill(none, float("-inf"))
    end = first[:, 0] + v4.count[req]
    last = write & (positions % r == r - 1) & (positions + r >= end)  # completes its request's last window of the step
    v4.prev_kv[slot[last, 0]] = pooled_kv[last, :, :half].float()
    v4.prev_gate[slot[last, 0]] = pooled_gate[last, :, :half].float()
    return torch.cat([p_kv, pooled_kv[..., half:]], dim=1), torch.cat([p_gate, pooled_gate[..., half:]], dim=1)


def _check(kv, gate, tail_kv, tail_gate, req, positions, cos, ckv, ratio, dtype, v4) -> None:
    n_rows = kv.shape[0] if kv.dim() == 2 else -1
    width = kv.shape[-1]
    if kv.dim() != 2 or kv.stride(-1) != 1:
        raise ValueError(f"compress_entries: kv must be [R, W] with unit channel stride, got {list(kv.shape)} strides {list(kv.stride())}")
    if ratio < 1:
        raise ValueError(f"compress_entries: ratio must be >= 1, got {ratio}")
    if ratio == 1:
        if kv.dtype != dtype or gate is not None or tail_kv is not None or tail_gate is not None or v4 is not None:
            raise ValueError(f"compress_entries: ratio 1 takes the entries as kv (in the activation dtype {dtype}, got {kv.dtype}) and no gate, tails or V4 pooling")
    else:
        pool_dtype = dtype if v4 is not None else torch.float32  # V4 pools in the activation dtype, V4.1 in fp32
        if kv.dtype != pool_dtype or gate is None or gate.dtype != pool_dtype or gate.shape != kv.shape or gate.stride(-1) != 1:
            raise ValueError(f"compress_entries: ratio {ratio} takes {pool_dtype} kv and gate [R, W] (unit channel stride), got {kv.dtype} {list(kv.shape)}"
                             f" and {None if gate is None else (gate.dtype, list(gate.shape))}")
        for name, t in (("tail_kv", tail_kv), ("tail_gate", tail_gate)):
            if t is None or t.dtype != torch.float32 or t.dim() != 3 or t.shape[1:] != (ratio, width) or t.stride(-1) != 1:
                raise ValueError(f"compress_entries: {name} must be fp32 [slots, {ratio}, {width}] (unit channel stride), got "
                                 f"{None if t is None else (t.dtype, list(t.shape))}")
    if v4 is not None:
        if tuple(v4.ape.shape) != (ratio, width):
            raise ValueError(f"compress_entries: V4's ape must be [{ratio}, {width}] (one bias per place in the group and channel), got {list(v4.ape.shape)}")
        if v4.overlap:
            if width % 2:
                raise ValueError(f"compress_entries: overlapping windows take kv / gate of two halves, got width {width}")
            for name, t in (("prev_kv", v4.prev_kv), ("prev_gate", v4.prev_gate)):
                if t is None or t.dtype != torch.float32 or t.dim() != 3 or t.shape[1:] != (ratio, width // 2):
                    raise ValueError(f"compress_entries: V4's {name} must be fp32 [slots, {ratio}, {width // 2}], got "
                                     f"{None if t is None else (t.dtype, list(t.shape))}")
            if v4.count is None or v4.count.dim() != 1:
                raise ValueError("compress_entries: overlapping windows need each request's row count [B] (V4Pooling.count)")
    if tuple(req.shape) != (n_rows,) or tuple(positions.shape) != (n_rows,):
        raise ValueError(f"compress_entries: req and positions must be [{n_rows}] (one per row), got {list(req.shape)} and {list(positions.shape)}")
    if cos.dim() != 2 or cos.shape[0] != n_rows:
        raise ValueError(f"compress_entries: cos / sin must be [{n_rows}, rd/2], got {list(cos.shape)}")
    entry = width // 2 if v4 is not None and v4.overlap else width
    stored = ckv.codes.shape[-1] * 2 if ckv.quantized else ckv.values.shape[-1]
    if stored != entry:
        raise ValueError(f"compress_entries: ckv must be the compressed cache of {entry}-channel entries, holds {stored}")

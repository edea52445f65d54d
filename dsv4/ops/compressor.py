"""The compressor's entries of a fast-path step, from its projections to the FP4 cache (V4.1).

`compress_entries` takes, for every row of the step, the pooling inputs its group needs (this
step's rows, or the request's tail slot for positions before the step), pools them with the
softmax gate (ratio > 1), RMS-normalises the entry, and for the rows that complete a group
writes the RoPE-rotated entry to the compressed KV cache in FP4. It returns the normalised
pre-RoPE entries (the indexer keys are projected from them) with the cache location and the
emit flag of every row (the indexer keys go to the same place). The caller stores the step's
trailing incomplete groups to the tails afterwards (`kv.store_plain`): a tail slot can be read
for one group and written for a later one in the same step, so the reads must all come first.

On CUDA one Triton kernel (`dsv4.ops.triton.compressor`) replaces the ~40 small torch launches
of this reference (gathers, the emit masks and index arithmetic, softmax, norm, RoPE, store).
"""

from __future__ import annotations

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
    dtype: torch.dtype,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Rows r of the step (R of them) belong to request req[r] at positions[r]; request b's rows
    are row0[b] .. at positions start[b] ..; `write` False marks padding rows (they store
    nothing). ratio > 1: kv / gate are the fp32 pooling projections [R, W] (any row stride) and
    tail_kv / tail_gate [slots, ratio, W] fp32 the requests' pending positions; ratio 1: kv is
    the entry [R, W] itself (in `dtype`, the activations') and gate / tails are None. A row at position p completes entry
    p // ratio when p % ratio == ratio - 1; it is cached (at its block table's location) unless
    its group starts before emit_from[req] (a prefix hit's cached groups). cos / sin [R, rd/2]:
    the angles of each row's entry position (p - p % ratio). -> (`dtype` [R, W] normalised entries
    before RoPE (a row that completes no group gets its partial group's pooling: unused), the
    cache location (block id from the table, offset) int64 [R] each, emit bool [R]: the row's
    entry was stored)."""
    _check(kv, gate, tail_kv, tail_gate, req, positions, cos, ckv, ratio, dtype)
    if on_triton(kv) and dtype == torch.bfloat16:
        from dsv4.ops.triton import compressor as triton_compressor

        return triton_compressor.compress_entries(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from,
                                                  block_tables, norm_weight, eps, cos, sin, ckv, ratio, block_size, dtype)
    r, n_rows = ratio, kv.shape[0]
    req = req.long()
    if r > 1:
        group = (positions - positions % r).unsqueeze(1) + torch.arange(r, device=kv.device)  # the group's r positions
        first = start[req].unsqueeze(1)
        in_step = (group >= first).unsqueeze(-1)
        src = (row0[req].long().unsqueeze(1) + group - first).clamp(0, n_rows - 1)
        slot = slots[req].long().unsqueeze(1).expand(-1, r)
        pooled_kv = torch.where(in_step, kv[src], tail_kv[slot, group % r])
        pooled_gate = torch.where(in_step, gate[src], tail_gate[slot, group % r])
        latent = (pooled_kv * pooled_gate.softmax(dim=1)).sum(dim=1).to(dtype)
    else:
        latent = kv
    latent = rms_norm(latent, norm_weight, eps, weight_in_fp32=False)
    emit = write & (positions - positions % r >= emit_from[req]) & (positions % r == r - 1)
    entry = positions // r
    per_block = block_size // r
    block = (entry // per_block).clamp(max=block_tables.shape[1] - 1)  # a padding row's position may lie past the table
    where = (block_tables[req, block].long(), entry % per_block)
    kvops.store_rows(ckv, "ckv", apply_rope(latent, cos, sin), where, emit)
    return latent, where, emit


def _check(kv, gate, tail_kv, tail_gate, req, positions, cos, ckv, ratio, dtype) -> None:
    n_rows = kv.shape[0] if kv.dim() == 2 else -1
    width = kv.shape[-1]
    if kv.dim() != 2 or kv.stride(-1) != 1:
        raise ValueError(f"compress_entries: kv must be [R, W] with unit channel stride, got {list(kv.shape)} strides {list(kv.stride())}")
    if ratio < 1:
        raise ValueError(f"compress_entries: ratio must be >= 1, got {ratio}")
    if ratio == 1:
        if kv.dtype != dtype or gate is not None or tail_kv is not None or tail_gate is not None:
            raise ValueError(f"compress_entries: ratio 1 takes the entries as kv (in the activation dtype {dtype}, got {kv.dtype}) and no gate or tails")
    else:
        if kv.dtype != torch.float32 or gate is None or gate.dtype != torch.float32 or gate.shape != kv.shape or gate.stride(-1) != 1:
            raise ValueError(f"compress_entries: ratio {ratio} takes fp32 kv and gate [R, W] (unit channel stride), got {kv.dtype} {list(kv.shape)}"
                             f" and {None if gate is None else (gate.dtype, list(gate.shape))}")
        for name, t in (("tail_kv", tail_kv), ("tail_gate", tail_gate)):
            if t is None or t.dtype != torch.float32 or t.dim() != 3 or t.shape[1:] != (ratio, width) or t.stride(-1) != 1:
                raise ValueError(f"compress_entries: {name} must be fp32 [slots, {ratio}, {width}] (unit channel stride), got "
                                 f"{None if t is None else (t.dtype, list(t.shape))}")
    if tuple(req.shape) != (n_rows,) or tuple(positions.shape) != (n_rows,):
        raise ValueError(f"compress_entries: req and positions must be [{n_rows}] (one per row), got {list(req.shape)} and {list(positions.shape)}")
    if cos.dim() != 2 or cos.shape[0] != n_rows:
        raise ValueError(f"compress_entries: cos / sin must be [{n_rows}, rd/2], got {list(cos.shape)}")
    if not ckv.quantized or ckv.codes.shape[-1] * 2 != width:
        raise ValueError(f"compress_entries: ckv must be the FP4 compressed cache of {width}-channel entries")

"""The compressor's entries of a fast-path step, from its projections to the compressed cache.

`compress_entries` takes, for every row of the step, the pooling inputs its group needs (this
step's rows, or the request's tail slot for positions before the step), pools them with the
softmax gate (ratio > 1), RMS-normalises the entry, and for the rows that complete a group
writes the RoPE-rotated entry to the compressed KV cache in its format (V4.1: FP4; V4: bf16). It
returns the normalised pre-RoPE entries (V4.1's indexer keys are projected from them) with the
cache location and the emit flag of every row (the indexer keys go to the same place). The
caller stores the step's trailing incomplete groups to the tails afterwards (`kv.store_plain`):
a tail slot can be read for one group and written for a later one in the same step, so the
reads must all come first.

V4's compressors (`V4Pooling`) add the gate's position bias, pool in the activation dtype and,
on CSA layers, overlap each window with the previous one; the overlap state that carries a
window's first half to the next step is updated by `update_overlap_state` at the end of the op
(after every read of it, before the caller's tail stores), on CPU and CUDA alike.

On CUDA one Triton kernel (`dsv4.ops.triton.compressor`) replaces the ~40 small torch launches
of this reference (gathers, the emit masks and index arithmetic, softmax, norm, RoPE, store)
for both models (bf16 activations).
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
    overlapping windows (`V4Pooling`; with overlap the op also updates its state,
    `update_overlap_state`). -> (`dtype` [R, E] normalised entries before RoPE (E = W, or W / 2
    with overlap), the cache location (block id from the table, offset) int64 [R] each, emit
    bool [R]: the row's entry was stored). The entry of a row that completes no group is, for
    V4.1, its partial group's pooling (unused); for V4 zeros: such rows skip the pooling (only
    1 row in `ratio` completes a group, and V4's callers use the stored entries alone)."""
    _check(kv, gate, tail_kv, tail_gate, req, positions, cos, ckv, ratio, dtype, v4)
    if on_triton(kv) and dtype == torch.bfloat16:
        from dsv4.ops.triton import compressor as triton_compressor

        out = triton_compressor.compress_entries(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from,
                                                 block_tables, norm_weight, eps, cos, sin, ckv, ratio, block_size, dtype, v4=v4)
    else:
        out = _compress_entries_reference(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from,
                                          block_tables, norm_weight, eps, cos, sin, ckv, ratio, block_size, dtype, v4)
    if v4 is not None and v4.overlap:  # after every read of the state (the pooling), before the caller's tail stores
        update_overlap_state(v4, kv, gate, tail_kv, tail_gate, start, row0, write, slots, ratio)
    return out


def _compress_entries_reference(kv, gate, tail_kv, tail_gate, req, positions, start, row0, write, slots, emit_from, block_tables,
                                norm_weight, eps, cos, sin, ckv, ratio, block_size, dtype, v4):
    """The torch code of `compress_entries`, the overlap state's update aside."""
    r = ratio
    req = req.long()
    completes = positions % r == r - 1
    if r > 1:
        first, slot = start[req], slots[req].long()
        gathered = _gatherer(kv, gate, tail_kv, tail_gate, first, row0[req], slot)
        group = (positions - positions % r).unsqueeze(1) + torch.arange(r, device=kv.device)  # the group's r positions
        pooled_kv, pooled_gate = gathered(group)
        if v4 is not None:
            pooled_gate = pooled_gate + v4.ape  # torch's type promotion, as the reference
            if v4.overlap:
                pooled_kv, pooled_gate = _overlap(v4, gathered, group, first.unsqueeze(1), slot.unsqueeze(1), pooled_kv, pooled_gate)
        weights = pooled_gate.softmax(dim=1, dtype=torch.float32).to(pooled_kv.dtype)
        latent = (pooled_kv * weights).sum(dim=1).to(dtype)
        if v4 is not None:  # the kernel's skipped rows: nothing pooled (normalised: zeros)
            latent = latent.masked_fill(~completes.unsqueeze(1), 0)
    else:
        latent = kv
    latent = rms_norm(latent, norm_weight, eps, weight_in_fp32=v4 is not None)
    emit = write & (positions - positions % r >= emit_from[req]) & completes
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


def _gatherer(kv, gate, tail_kv, tail_gate, first: torch.Tensor, row0: torch.Tensor, slot: torch.Tensor):
    """-> positions [N, r] -> (kv, gate) [N, r, W] of requests whose rows in the step start at
    row row0 [N] with position first [N]: this step's rows, or the tail slot `slot` [N] before
    them (N: per row for the pooling, per request for the overlap state's update)."""
    n_rows, r = kv.shape[0], tail_kv.shape[1]
    first, row0, slot = first.unsqueeze(1), row0.long().unsqueeze(1), slot.long().unsqueeze(1)

    def gathered(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        in_step = (group >= first).unsqueeze(-1)
        src = (row0 + group - first).clamp(0, n_rows - 1)
        tail = (slot.expand_as(group), group % r)
        return (torch.where(in_step, kv[src], tail_kv[tail].to(kv.dtype)),
                torch.where(in_step, gate[src], tail_gate[tail].to(gate.dtype)))

    return gathered


def _overlap(v4: V4Pooling, gathered, group, first, slot, pooled_kv, pooled_gate):
    """The 2r pooling slots of V4's overlapping windows (`V4Pooling`): the previous window's Ca
    from this step's rows, the tail, or (completed before the step) the overlap state, none
    before window 0 (gate -inf)."""
    half, r = pooled_kv.shape[-1] // 2, group.shape[1]
    prev = group - r
    p_kv, p_gate = gathered(prev)
    p_kv, p_gate = p_kv[..., :half], p_gate[..., :half] + v4.ape[:, :half]
    earlier = (prev < first - first % r).unsqueeze(-1)  # a window wholly before the step's first group
    state = (slot.expand_as(prev), prev % r)
    p_kv = torch.where(earlier, v4.prev_kv[state].to(p_kv.dtype), p_kv)
    p_gate = torch.where(earlier, v4.prev_gate[state].to(p_gate.dtype), p_gate)
    none = (prev < 0).unsqueeze(-1)
    p_kv, p_gate = p_kv.masked_fill(none, 0), p_gate.masked_fill(none, float("-inf"))
    return torch.cat([p_kv, pooled_kv[..., half:]], dim=1), torch.cat([p_gate, pooled_gate[..., half:]], dim=1)


def update_overlap_state(v4: V4Pooling, kv, gate, tail_kv, tail_gate, start: torch.Tensor, row0: torch.Tensor, write: torch.Tensor,
                         slots: torch.Tensor, ratio: int) -> None:
    """V4's overlap state after a step (`compress_entries`' arguments): each request whose
    written rows complete a window takes the Ca half of the last one (its kv, and its gate plus
    `ape`) from this step's rows or its tail slot; the others (no window completed, padding
    rows) keep theirs. Runs after every read of the state (the pooling) and before the caller
    stores the step's tails (read here). On CUDA one Triton launch (`triton.compressor.
    overlap_state`, the same values); the torch code gathers fixed shapes ([B, ratio, W/2])
    and stores with masks: no host synchronisation either way."""
    if kv.shape[0] == 0:  # no row: no window completed
        return
    if on_triton(kv):
        from dsv4.ops.triton import compressor as triton_compressor

        triton_compressor.overlap_state(v4, kv, gate, tail_kv, tail_gate, start, row0, write, slots, ratio)
        return
    r, half = ratio, v4.prev_kv.shape[-1]
    end = start + v4.count
    last = end - end % r - 1  # the last position of the last window complete at the step's end
    window = (last - r + 1).unsqueeze(1) + torch.arange(r, device=kv.device)
    ca_kv, ca_gate = _gatherer(kv[:, :half], gate[:, :half], tail_kv[..., :half], tail_gate[..., :half], start, row0, slots)(window)
    completed = (last >= start) & write[(row0 + last - start).clamp(0, kv.shape[0] - 1)]  # by a row of this step
    n_req = slots.shape[0]
    per_place = lambda t: t.unsqueeze(1).expand(n_req, r).reshape(n_req * r)  # a request's value for each place in its window
    mask = per_place(completed)
    where = (per_place(slots.long()), torch.arange(r, device=kv.device).repeat(n_req))
    kvops.store_plain(v4.prev_kv, where, ca_kv.reshape(n_req * r, half), mask)
    kvops.store_plain(v4.prev_gate, where, (ca_gate + v4.ape[:, :half]).reshape(n_req * r, half), mask)


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

"""Weights asked of L2 ahead of the kernel that reads them (sm_90 bulk prefetch).

At small batches a decode layer alternates kernels that stream weights (the projections, the
MoE) with kernels bound by latency (attention at one row, the mHC sites, the router), during
which HBM idles. `prefetch_l2` issues `cp.async.bulk.prefetch.L2` over byte ranges: the copy
engine pulls the lines into L2 after the issuing program has exited, so the kernel costs a few
microseconds of a side stream and no SM time while the lines arrive. The model launches it at
the start of a latency-bound stretch for the weights the stretch's next streaming kernel reads
(`model.L2Ahead`).

A prefetch changes no value, only timing: its tests check the ranges it is given
(`prefetch_ranges`) and that a forward with it on is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.triton.pdl import begin, compiled, pdl_launch

# One bulk prefetch request covers at most this many bytes (the PTX size operand is 32-bit;
# 32 KiB pieces keep many requests in flight over a weight of tens of megabytes).
PIECE = 32 << 10
PIECES_PER_PROGRAM = 256  # 2 a lane at 4 warps: 8 MiB a program


@triton.jit
def _prefetch_kernel(a_ptr, a_bytes, b_ptr, b_bytes, PIECE: tl.constexpr, PIECES: tl.constexpr, PDL: tl.constexpr):
    """Program (p, t) prefetches pieces p*PIECES .. (p+1)*PIECES-1 of range t (a or b; byte
    counts multiples of 16, starts 16-byte aligned)."""
    begin(PDL)
    if tl.program_id(1) == 0:
        base = a_ptr.to(tl.pointer_type(tl.uint8))
        nbytes = a_bytes.to(tl.int64)
    else:
        base = b_ptr.to(tl.pointer_type(tl.uint8))
        nbytes = b_bytes.to(tl.int64)
    off = (tl.program_id(0) * PIECES + tl.arange(0, PIECES)).to(tl.int64) * PIECE
    size = tl.minimum(tl.maximum(nbytes - off, 0), PIECE).to(tl.int32)
    # a piece past the range has size 0, which bulk prefetch does not take: predicated off
    tl.inline_asm_elementwise(
        "{ .reg .pred live; setp.ne.s32 live, $2, 0; mov.u32 $0, 0; @live cp.async.bulk.prefetch.L2.global [$1], $2; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_ranges(tensors: list[torch.Tensor], budget: int) -> list[tuple[torch.Tensor, int]]:
    """(tensor, bytes from its start) covering the first `budget` bytes of `tensors` taken in
    order, each count cut to a multiple of 16 (at most two tensors: the kernel's two ranges)."""
    ranges = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"prefetch_l2: a tensor of shape {tuple(t.shape)} is not contiguous")
        if t.data_ptr() % 16:
            raise ValueError(f"prefetch_l2: a tensor at {t.data_ptr():#x} is not 16-byte aligned (bulk prefetch needs it)")
        nbytes = min(t.numel() * t.element_size(), budget) // 16 * 16
        if nbytes:
            ranges.append((t, nbytes))
        budget -= nbytes
        if budget < 16:
            break
    if len(ranges) > 2:
        raise ValueError(f"prefetch_l2: at most two ranges a call, got {len(ranges)}")
    return ranges


def prefetch_l2(tensors: list[torch.Tensor], budget: int) -> None:
    """Ask L2 for the first `budget` bytes of `tensors` (in order) without waiting for them.
    Compiled CUDA only (the interpreter has no PTX): a caller that cannot prefetch gets an
    error rather than a silent no-op."""
    if not compiled(tensors[0].device):
        raise ValueError(f"prefetch_l2: needs compiled kernels on a CUDA device, got {tensors[0].device}")
    ranges = prefetch_ranges(tensors, budget)
    if not ranges:
        return
    (a, a_bytes), (b, b_bytes) = ranges[0], ranges[-1] if len(ranges) == 2 else (ranges[0][0], 0)
    programs = triton.cdiv(max(a_bytes, b_bytes), PIECE * PIECES_PER_PROGRAM)
    _prefetch_kernel[(programs, len(ranges))](a, a_bytes, b, b_bytes, PIECE=PIECE, PIECES=PIECES_PER_PROGRAM, num_warps=4,
                                                **pdl_launch(a.device))

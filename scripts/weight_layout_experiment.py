#!/usr/bin/env python3
"""Device experiment: does the decode GEMMs' weight access pattern reach HBM bandwidth, or
would a tile-contiguous weight layout stream faster?

The weight-streaming kernels (`fp8_gemm._w8a16_kernel`, `moe._gate_up_kernel` / `_down_kernel`)
give each program BLOCK_N weight rows and walk K in steps of 128 bytes per row: every step
touches BLOCK_N separate 128-byte runs, rows K bytes apart. At one token the weight-only
projections ran at about 41% of the H100's bandwidth and the MoE at 64-72% (docs/PERF.md,
twenty-second session). This script times pure streaming (loads and an XOR, no dequantisation or MMA) of
weights of the model's shapes in two layouts:

* `rows`: the weight as stored, [N, K] row-major, read in the kernels' pattern (BLOCK_N rows x
  STEP bytes per step, K split into SPLIT chunks as split-K would);
* `tiled`: the same bytes read as if stored tile by tile (each program's steps one contiguous
  BLOCK_N x STEP block after another), the layout a load-time repack would give;

plus torch's copy of the same bytes. If `tiled` streams clearly faster than `rows` at the same
tiles, a load-time repack of the FP8 weights is the lead; if both sit near the copy, the
kernels' gap is their own (latency, dequantisation, tails). Answered on an H100 in the
twenty-sixth session (docs/PERF.md): `tiled` 0-10% faster at the same tile, sometimes slower,
and `rows` at the kernels' tile within 6-9% of the copy for wq_b and the MoE — no repack.
Run: `python scripts/weight_layout_experiment.py` (writes $OUT/weight_layout.json).

Each program XORs every 32-bit word it reads and stores the result, so the XOR of all
programs' results is the XOR of the whole weight in either layout: both forms read every
word exactly once (tests/ops/test_weight_layout_experiment.py checks it in the interpreter)."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _rows_kernel(w_ptr, out_ptr, K_WORDS, STEPS, BLOCK_N: tl.constexpr, STEP_WORDS: tl.constexpr, STAGES: tl.constexpr):
    """Program (row block, K chunk): BLOCK_N rows, STEPS steps of STEP_WORDS words each."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * STEPS * STEP_WORDS
    offs = rows[:, None].to(tl.int64) * K_WORDS + first + tl.arange(0, STEP_WORDS)[None, :]
    acc = tl.zeros((BLOCK_N, STEP_WORDS), dtype=tl.int32)
    for s in tl.range(0, STEPS, num_stages=STAGES):
        acc ^= tl.load(w_ptr + offs + s * STEP_WORDS)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


@triton.jit
def _tiled_kernel(w_ptr, out_ptr, STEPS, BLOCK_N: tl.constexpr, STEP_WORDS: tl.constexpr, STAGES: tl.constexpr):
    """The same grid and work, each step one contiguous BLOCK_N x STEP_WORDS block."""
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)[:, None] * STEP_WORDS + tl.arange(0, STEP_WORDS)[None, :]
    base = w_ptr + pid.to(tl.int64) * STEPS * BLOCK_N * STEP_WORDS
    acc = tl.zeros((BLOCK_N, STEP_WORDS), dtype=tl.int32)
    for s in tl.range(0, STEPS, num_stages=STAGES):
        acc ^= tl.load(base + s * BLOCK_N * STEP_WORDS + offs)
    tl.store(out_ptr + pid, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


def stream(w: torch.Tensor, layout: str, block_n: int, step_bytes: int, stages: int, split: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """One pass over the int32 weight w [N, K/4] in `layout` -> the programs' XORs (int32)."""
    n, k_words = w.shape
    step_words = step_bytes // 4
    steps, rem = divmod(k_words, step_words * split)
    if n % block_n or rem:
        raise ValueError(f"weight [{n}, {k_words * 4} bytes] is not whole {block_n}-row tiles of {split} chunks of {step_bytes}-byte steps")
    grid = (n // block_n, split)
    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=w.device) if out is None else out
    if layout == "rows":
        _rows_kernel[grid](w, out, k_words, steps, BLOCK_N=block_n, STEP_WORDS=step_words, STAGES=stages, num_warps=4)
    elif layout == "tiled":
        _tiled_kernel[grid](w, out, steps, BLOCK_N=block_n, STEP_WORDS=step_words, STAGES=stages, num_warps=4)
    else:
        raise ValueError(f"layout must be 'rows' or 'tiled', got {layout!r}")
    return out


def graph_us(fn, iters: int = 50) -> float:
    """Microseconds per call of fn(i), i = 0 .. iters-1 replayed from one CUDA graph."""
    stream_ = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream_):
        fn(0)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for i in range(iters):
                fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


# (name, N, K bytes): the model's decode weights at batch 1 (V4.1-Flash), the MoE's seven experts
# of a token as one matrix, and the 64-expert benchmark layer's whole stack
SHAPES = (("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("wq_a+wkv", 1792, 5120), ("gate_up x7", 7 * 4608, 5120),
          ("down x7", 7 * 5120, 2304), ("gate_up x65", 65 * 4608, 5120))
# (BLOCK_N, step bytes, stages, K chunks): the first is the kernels' decode tile
TILES = ((64, 128, 4, 1), (64, 128, 4, 2), (64, 128, 6, 1), (64, 256, 3, 1), (128, 128, 3, 1), (32, 256, 4, 1), (64, 512, 2, 1))
ROTATE_BYTES = 400 << 20  # copies rotated so that no call finds its weight in the 50 MB L2
HBM_BYTES_PER_S = 4.2e12


def main(path: str) -> None:
    results = []
    for name, n, k in SHAPES:
        copies = max(2, ROTATE_BYTES // (n * k) + 1)
        ws = [torch.randint(-2**31, 2**31 - 1, (n, k // 4), dtype=torch.int32, device="cuda") for _ in range(copies)]
        for block_n, step_bytes, stages, split in TILES:
            if k % (step_bytes * split):
                continue
            out = stream(ws[0], "rows", block_n, step_bytes, stages, split)
            for layout in ("rows", "tiled"):
                us = graph_us(lambda i: stream(ws[i % copies], layout, block_n, step_bytes, stages, split, out))
                results.append(dict(weight=name, layout=layout, block_n=block_n, step_bytes=step_bytes, stages=stages, split=split,
                                    programs=out.numel(), us=round(us, 2), tb_per_s=round(n * k / us / 1e6, 3),
                                    pct_of_floor=round(100 * n * k / HBM_BYTES_PER_S * 1e6 / us, 1)))
                print(results[-1], flush=True)
        dst = torch.empty_like(ws[0])
        us = graph_us(lambda i: dst.copy_(ws[i % copies]))
        results.append(dict(weight=name, layout="torch copy (read + write)", us=round(us, 2), tb_per_s=round(2 * n * k / us / 1e6, 3)))
        print(results[-1], flush=True)
        del ws, dst
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "."), "weight_layout.json"))

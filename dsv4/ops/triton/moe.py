"""Routed experts on Triton: two grouped GEMMs over FP8 expert weights with the clamped SwiGLU
fused into the first (H200 fast path).

Same semantics as `dsv4.ops.moe.experts_forward` with the weights stacked per layer:

    moe_experts(x bf16 [T, D], topk_ids int [T, k], topk_weights fp32 [T, k],
                w13 float8_e4m3fn [E, 2I, D], w13_scale uint8 [E, 2I, D/32],
                w2 float8_e4m3fn [E, D, I], w2_scale uint8 [E, D, I/32],
                limit: float, weight_before_down: bool) -> fp32 [T, D]

w13 holds w1 (gate) in rows 0..I-1 and w3 (up) in rows I..2I-1; the scales are E8M0 exponent
bytes, one per 32 inputs of a row — the exact FP4 -> FP8 conversion of the released experts
(`quant.fp4_expert_to_fp8`), or the released FP4 codes themselves (uint8 [E, 2I, D/2] and
[E, D, I/2], `quant.fp4_kernel_layout`, `ModelConfig.fp4_experts`: half the memory; the
kernels dequantise them to the same bf16 values, so the same results, in whole 128-input
steps, 5-18% faster than FP8's at 384 experts, docs/PERF.md thirteenth session), then with
V4.1's FP8 shared expert as `shared`. A routing weight of a token is applied before the down projection
(V4.1, `weight_before_down`) or to its output (V4); the result is the fp32 sum over the k
experts in ascending expert id, as the reference accumulates. (V4's reference accumulates in
bf16; here the sum is fp32 and the caller casts.)

How: the (token, slot) pairs are laid out by expert in segments padded to the row tile, so
that every row tile of the grouped GEMMs belongs to one expert. Up to `MOE["ALIGN_MAX_PAIRS"]`
pairs (decode) one Triton launch builds that layout (a counting sort, one program per expert:
one launch instead of about twenty small torch ops, whose launch gaps at T=1 are comparable
to the ~50 us that six experts' weights take to stream); above, torch ops do; and up to
`MOE["PAIR_TILES_MAX_PAIRS"]` (one decode token) each pair is its own tile, with no layout
launch. The padded layout's size
is bounded from the shapes alone (no host sync, CUDA-graph safe) and tiles past the end exit
at once. Kernel 1 gathers the token
rows and multiplies them by the gate and up rows of its expert — each program streams one
slab of BLOCK_N rows of one expert over all of D for the <= BLOCK_T pairs of its tile, the
FP8 weights read as int32 words and dequantised exactly in registers (`fp8_gemm.dequant_word_step`,
the permute of `fp8_gemm.dequant_rows`; `MOE["DEQUANT"]` says why words), one MMA chain over D
in fragment order (`MOE`: x and the activations hold their inputs in it, so that the
dequantised tiles need no shared-memory round trip) — rounds both to bf16 as the reference's linears do, clamps, applies silu(gate) * up (and the
routing weight) and stores bf16 activations. Kernel 2 multiplies them by the expert's down
weight and writes one bf16 row per (token, slot); kernel 3 sums the k rows of a token in fp32
in ascending expert id (it ranks the token's slots itself, so the routing needs no sort). No
atomics, and a token's rows never mix with other tokens' in any sum, so results change neither
from run to run nor with the batch (batch invariance; no tile knob changes a row's bits).

Activations stay bf16 (HF's numerics), unless `fp8_act` (`ModelConfig.fp8_activations`,
DeepSeek's reference numerics): then x and the SwiGLU output are quantised to FP8 per 32
inputs and both GEMMs run FP8 x FP8 (`_gate_up_fp8_kernel`, `_down_fp8_kernel`: no weight
dequantisation at all; each 32-input piece is one MMA scaled by its two exponents into fp32).
Expert ids must be in [0, E) (no expert-parallel "not local" marker yet).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv4.model import quant
from dsv4.ops.triton.fp8_gemm import (
    dequant_fp4, dequant_fp8, e8m0_to_fp32, fp8_act_fake_quant, fp8_act_quant, fp8_quantise, fragment_dot_order, fragment_order,
    fragment_order_tile, fragment_rows, launch_options, ptx_convert, step_dot, step_tile, wgmma_tile_error,
)
from dsv4.ops.triton.pdl import begin, pdl_launch

SCALE_BLOCK = 32  # one E8M0 scale per 32 inputs of an expert row
FRAGMENT_BLOCK = 64  # inputs per block of the bf16 kernels' fragment order (`fragment_dot_order`)
ALIGN_P_BLOCK = 512  # pairs per chunk of the layout kernel's passes
_PIECE = tl.constexpr(SCALE_BLOCK)  # the kernels' view of it (jit code reads constexpr globals only)
# inputs of a weight row that one lane's load of a 64-input block of FP8 words holds (4 words
# of 4 codes; `fragment_dot_order`)
_LANE_INPUTS = tl.constexpr(FRAGMENT_BLOCK // 4)

# Knobs (scripts/check_kernels.py's `gemm_sweep` section times alternatives on the device).
# Both GEMMs compute their tiles transposed, the expert's weight rows as the wgmma's M and the
# tile's pairs as its N, for the reason `fp8_gemm.W8A16` gives: every row class then issues
# the same instruction (wgmma m64nBLOCK_Tk16, dequantised weights as the register operand, K
# in natural order), where pair tiles of 16 or 32 as M would run on mma.sync, which need not
# round like the wgmma of the larger classes — and a token's bits would follow the load.
# "rows": by the mean pairs per expert (pairs / experts, up to `max_mean`; None: any), the
#   row tile BLOCK_T (pairs per tile, the wgmma's N: 16 .. 256, a multiple of 16; an expert
#   with more pairs takes several tiles and reads its weights once per tile) and per kernel
#   BLOCK_N weight rows per program (gate_up: BLOCK_N gate rows and BLOCK_N up rows; a
#   multiple of 16 x num_warps), BLOCK_K inputs per pipelined step (64 or 128: whole blocks of
#   the fragment order below), warps and pipeline depth; gate_up's optional STACK (default
#   False): its BLOCK_N rows are BLOCK_N / 2 gate rows over their up rows in one accumulator
#   (twice the programs, each with half the work: decode's few row tiles leave SMs idle);
#   the optional maxnreg, a register cap (`launch_options`): the prefill class's gate_up
#   compiles to 144 registers, one program an SM (ncu: 12.5% occupancy, 64% of cycles with no
#   eligible warp); at 128 it compiles without spills and two programs share an SM (24.5%).
#   Each K step is dequantised as one tile and multiplied by one dot (the interpreter: one dot
#   per 32 inputs, `fp8_gemm.step_dot`): on sm_90 one wgmma chain of k16 steps in the same order
#   whatever BLOCK_K, BLOCK_N, BLOCK_T or STACK, so a row's bits depend on none of these knobs.
# Fragment order (inputs a multiple of 64; not a knob: it is part of the numerics): inside
#   every block of 64 inputs the dot runs over them in the order `fragment_dot_order` gives, which is
#   the order in which Triton's load of a 64-input word tile already hands each thread the
#   pairs the wgmma register operand wants of it (with the tile's rows taken in
#   `fragment_rows` order), so the dequantised tile reaches the operand without the
#   shared-memory round trip (STS, LDSM and their barriers) that natural order needs — the
#   L1/TEX traffic the eighth session's ncu found bounding these kernels. x (`fp8_gemm.fragment_order`,
#   one copy) and the activations (stored so by gate_up) come in the same order. Measured
#   (docs/PERF.md twelfth session): a weight-streaming GEMM alone 10-32% faster at 1-64
#   tokens (scripts/weight_path_experiment.py), the MoE kernels 8-12% at T = 1 .. 256. FP4
#   stacks of whole 128s hold their words in slot order (`quant.fp4_kernel_layout`), so their
#   16-word steps land in the same lanes and, relabelled (`fp8_gemm.fp4_slot_words`), run in
#   the same order with the same bits (thirteenth session: 5-18% faster than FP8 at 384
#   experts, where natural word order had lost 8-13%).
# "ALIGN_MAX_PAIRS": up to this many (token, slot) pairs the expert layout is built by one
#   Triton launch (each program reads every pair twice), above by torch's sort.
# "PAIR_TILES_MAX_PAIRS": up to this many pairs there is no layout at all: pair p is row tile
#   p (the GEMMs read its expert from topk_ids), which saves the layout launch (a few us of a
#   ~0.1 ms decode MoE); an expert that several pairs route to is then streamed once per pair
#   (the later reads mostly from L2, as the pairs' tiles run side by side), so this suits
#   decode at one token (k + shared distinct experts). 0: always lay out.
# "DEQUANT": how the GEMMs read FP8 weights. "words": as int32 words (4 codes; 16-byte copies),
#   dequantised by a permute on each word in a plain blocked layout, the scale bytes as one
#   int32 word per row and 128 inputs (pipelined with the weights); the bf16 tile then reaches
#   the wgmma's register layout through shared memory (ldmatrix). "bytes": the FP8 tile is read
#   from shared memory straight in the wgmma's register layout, which for 8-bit codes is two
#   bytes per load plus byte permutes to repack them, and every scale byte is its own global
#   load that the pipeline does not cover. The sm_90 SASS of the T16 gate_up K step (16 KB of
#   weights): 943 instructions with "bytes", 626 with "words" (PRMT 304 -> 64) — at 4.2 TB/s
#   the former alone needs ~90% of the SMs' issue slots, which is why the kernel stalled at
#   1.7-1.9 TB/s with plenty of programs (T >= 8, device runs 2-3). The same permute and
#   multiplies either way, so the same bf16 values and bits. "words" needs inputs (D, I) in
#   whole 128s (the scale word) and the compiled PTX path; other calls use "bytes".
MOE = {
    "rows": (
        (1, {  # decode's few row tiles: gate over up rows in one tile doubles the programs (ncu,
            # S3-3: 252 programs at T=1 filled half a wave, 12% occupancy); moe_sweep S3-4: T=1
            # 138 -> 118 us, T=8 692 -> 643 us at 385 experts (65: 142 -> 120, 554 -> 516); at
            # T=64 of 385 experts (1.2 pairs per expert) it was 6% slower, hence the class bound;
            # 128 down rows in fragment order: moe_sweep S12-3, T=1 94.5 -> 91.9 us, T=8 391 ->
            # 384 us (65 experts; 385: 92.6 -> 91.6, 486 -> 477)
            "BLOCK_T": 16,
            "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "STACK": True},
            "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        }),
        (4, {  # 3 stages: 36% vs 4 stages' 32% of the floor (gemm_sweep, device run 2)
            "BLOCK_T": 16,
            "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
            "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        }),
        (16, {  # stacked gate/up at 3 stages: 966 -> 936 us at T=64 of 65 experts (gemm_sweep
            # S4-3; 2 stages had beaten 3 unstacked in S3-4: 975 vs 1013 us)
            "BLOCK_T": 32,
            "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "STACK": True},
            "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        }),
        (48, {  # T=256 of 65 experts (~27 pairs per expert): in fragment order 32-pair tiles,
            # gate and up apart, at 4 stages beat the 64-pair stacked tile at 3 (moe_sweep
            # S12-3: 0.980 -> 0.934 ms); before it, stacked 64-pair tiles at 3 stages were best
            # (S4-3, S9-3)
            "BLOCK_T": 32,
            "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
            "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
        }),
        (200, {  # prefill up to 200 pairs an expert (V4.1-Flash's 385 experts below ~11K tokens;
            # 65 experts from ~450 to ~1850): gate and up apart in 128-row accumulators over whole
            # 128-input steps, uncapped, and 256 down rows a program. Two runs of the same tiles
            # (twenty-first session, H100, ms, against the class below): 385 experts 4096 tokens
            # 13.24 / 13.46 -> 10.98 / 10.89, 8192 tokens 19.63 / 19.47 -> 15.81 / 15.62;
            # 65 experts 1152 tokens (hit=1024@100000's encoder rows) 2.76 / 2.37 -> 2.69 / 2.41
            "BLOCK_T": 128,
            "gate_up": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
            "down": {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        }),
        (None, {  # prefill: stacked gate/up (one [128, 128] accumulator at 8 warps), whole K
            # steps; moe_prefill S10-2, 8192 tokens: 385 experts 17.8 -> 16.7 ms, 65 experts
            # 13.8 -> 13.0 (4096 tokens 7.5 -> 6.7) against unstacked 64-row gate/up at 4 warps
            # in pieces; 256-row tiles were faster at 65 experts (11.9) but slower at 385 (19.8).
            # gate_up under a 128-register cap: ncu at 1152 rows of 65 experts 1.43 -> 1.18 ms;
            # bench S15-1 hit=1024@100000 23.4 -> 22.3 ms, mix 21.6 -> 20.5 ms. Above 200 pairs an
            # expert it stays the fastest measured (65 experts, 2048 tokens: 3.44 / 3.54 ms
            # against 4.00 / 4.02 for the class above, twenty-first session)
            "BLOCK_T": 128,
            "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "STACK": True, "maxnreg": 128},
            "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        }),
    ),
    # the FP8-activation kernels (`fp8_act`): the same classes; no dequantisation, so the
    # per-piece product (an fp32 tile next to the accumulator) is what bounds the tiles: from 17
    # pairs per expert the down tile is 64 rows and gate_up stacks (no spills on sm_90)
    "fp8_rows": (
        (1, {"BLOCK_T": 16,
             "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "STACK": True},
             "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}}),
        (4, {"BLOCK_T": 16,
             "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
             "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}}),
        (16, {"BLOCK_T": 32,
              "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "STACK": True},
              "down": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}}),
        # from 17 pairs per expert on: 64-row tiles (128-row ones crash the device's Triton 3.6
        # at 4 warps, an LLVM SLPVectorizer assertion, and spill at 8; --compile-only under 3.6)
        (None, {"BLOCK_T": 64,
                "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "STACK": True},
                "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}}),
    ),
    # row tiles of up to this many pairs put x in fragment order in registers (as the dense
    # projections' first class, `fp8_gemm.W8A16["XREG_MAX_T"]`), sparing decode the copy
    # launch (`fragment_order`) in front of every layer's MoE; wider tiles read the copy
    "XREG_MAX_T": 16,
    "ALIGN_MAX_PAIRS": 4096,
    "PAIR_TILES_MAX_PAIRS": 8,
    "DEQUANT": "words",
    # moe_experts_dense: the largest bf16 copy of a layer's experts it makes (gate + up; the
    # 64-expert benchmark layer's is 3 GB, V4.1-Flash's 384 + 1 experts' 18 GB); layers with
    # more experts take the grouped kernels at any load
    "DENSE_TEMP_BYTES": 8 << 30,
}


@triton.jit
def _sigma_inverse(c):
    """The dot position of input c inside its block of 64 (`fragment_dot_order`; the inverse of
    `fp8_gemm.fragment_input` at 16 inputs a lane): where the gate_up kernel stores activation
    channel c for the down kernel."""
    return (c // 64) * 64 + c % 2 + 8 * ((c // 2) % 8) + 2 * ((c // 16) % 4)


@triton.jit(do_not_specialize=["n_pairs", "n_experts", "n_tiles"])
def _align_kernel(
    ids_ptr, rows_ptr, tile_expert_ptr, n_pairs, n_experts, n_tiles,
    BLOCK_T: tl.constexpr, E_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr,
):
    """Program e < n_experts: expert e's segment of the layout of `align_by_expert`; program
    n_experts: the tiles past the used ones.

    Every program counts the pairs of all experts (a histogram per chunk of pairs; E_BLOCK >
    n_experts, so the bin n_experts takes the chunk's masked lanes) to find where its segment
    starts: the tile after the previous experts' tiles (an exclusive cumsum of tiles per
    expert). Then it places its own pairs in pair order (stable) and marks the rest of its
    segment as padding. The programs write disjoint parts of the layout, so they need no
    ordering (one program for everything was 22 us at 448 pairs and 85 us at 1792, device
    profile of the fourth session)."""
    begin(PDL)
    e = tl.program_id(0)
    bins = tl.arange(0, E_BLOCK)
    counts = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for p0 in range(0, n_pairs, P_BLOCK):
        p = p0 + tl.arange(0, P_BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=n_experts).to(tl.int32)
        counts += tl.histogram(ids, E_BLOCK)
    tiles = tl.where(bins < n_experts, (counts + BLOCK_T - 1) // BLOCK_T, 0)
    first_tile = tl.cumsum(tiles, axis=0) - tiles
    if e == n_experts:  # unused tiles: padding rows, expert n_experts
        used = tl.sum(tiles, axis=0)
        for r0 in range(used * BLOCK_T, n_tiles * BLOCK_T, FILL):
            r = r0 + tl.arange(0, FILL)
            tl.store(rows_ptr + r, tl.zeros((FILL,), dtype=tl.int32) + n_pairs, mask=r < n_tiles * BLOCK_T)
        for g0 in range(used, n_tiles, FILL):
            g = g0 + tl.arange(0, FILL)
            tl.store(tile_expert_ptr + g, tl.zeros((FILL,), dtype=tl.int32) + n_experts, mask=g < n_tiles)
        return
    mine = bins == e
    first = tl.sum(tl.where(mine, first_tile, 0), axis=0)
    n_tile = tl.sum(tl.where(mine, tiles, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    start = first * BLOCK_T
    seen = count * 0  # (a tensor: the loop carries it)
    for p0 in range(0, n_pairs, P_BLOCK):
        p = p0 + tl.arange(0, P_BLOCK)
        hit = (tl.load(ids_ptr + p, mask=p < n_pairs, other=n_experts).to(tl.int32) == e).to(tl.int32)
        tl.store(rows_ptr + start + seen + tl.cumsum(hit, axis=0) - 1, p, mask=hit != 0)
        seen += tl.sum(hit, axis=0)
    for r0 in range(start + count, start + n_tile * BLOCK_T, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(rows_ptr + r, tl.zeros((FILL,), dtype=tl.int32) + n_pairs, mask=r < start + n_tile * BLOCK_T)
    for g0 in range(first, first + n_tile, FILL):
        g = g0 + tl.arange(0, FILL)
        tl.store(tile_expert_ptr + g, tl.zeros((FILL,), dtype=tl.int32) + e, mask=g < first + n_tile)


@triton.jit
def _tile_pairs(rows_ptr, tile_expert_ptr, pid_t, n_pairs, BLOCK_T: tl.constexpr, PAIR_TILES: tl.constexpr, LAST_SLOT: tl.constexpr):
    """-> (expert of row tile pid_t as int64, its BLOCK_T pair indices, n_pairs for padding).
    PAIR_TILES: tile p holds pair p alone and tile_expert_ptr is the flat topk_ids.
    LAST_SLOT (k, the pairs per token; 0: off): the launch's one expert (index 0 of its
    weights) takes every token's last slot, tile p tokens p * BLOCK_T .. — the shared expert
    (no layout needed: its pairs are known) of FP4 layers, whose weights are FP8. Its routing
    weight is 1 (the routers append it so), which the kernels then do not read: a product by 1
    changes no bits."""
    if LAST_SLOT:
        e = pid_t.to(tl.int64) * 0
        token = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        pair = tl.where(token < n_pairs // LAST_SLOT, token * LAST_SLOT + LAST_SLOT - 1, n_pairs)
    elif PAIR_TILES:
        e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
        pair = tl.where(tl.arange(0, BLOCK_T) == 0, pid_t, n_pairs)
    else:
        e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
        pair = tl.load(rows_ptr + pid_t * BLOCK_T + tl.arange(0, BLOCK_T))
    return e, pair


@triton.jit
def _swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """The clamped SwiGLU of bf16 gate / up in fp32 (`ops.moe.swiglu`)."""
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _swiglu_rows_kernel(h_ptr, rw_ptr, act_ptr, P, I, stride_h, stride_act, limit,
                        HAS_LIMIT: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr, PDL: tl.constexpr):
    """act [P, I] bf16 = swiglu(h[:, :I], h[:, I:]) (* rw per row): the dense path's epilogue."""
    begin(PDL)
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows < P)[:, None] & (cols < I)[None, :]
    base = h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :]
    act = _swiglu(tl.load(base, mask=ok, other=0.0), tl.load(base + I, mask=ok, other=0.0), limit, HAS_LIMIT)
    if WEIGHTED:
        act = act * tl.load(rw_ptr + rows, mask=rows < P, other=0.0)[:, None]
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :], act.to(tl.bfloat16), mask=ok)


@triton.jit
def _rows_below(rows, limit, EVEN_N: tl.constexpr):
    """rows < limit; EVEN_N (the launcher's promise that every tile's rows are below limit, as
    at V4.1's shapes): a constant True instead, so that the compiler drops the weight loads' row
    masks and the predicate arithmetic the pipelined copies repeat every K step. sm_90 K step
    (Triton 3.6): gate_up 319 -> 297 instructions at the 16-pair class, 267 -> 248 at one token;
    down 472 -> 446, 454 -> 429. Steps on the H100 (thirty-third session): d64_32k -1.2%, d1_8k
    level. (The weight-only GEMM's 16-row class, given the same, ran d1_8k 3% slower.)"""
    if EVEN_N:
        return tl.full(rows.shape, 1, tl.int1)
    return rows < limit


@triton.jit
def _gate_up_rows(pid_n, I, r, BLOCK_N: tl.constexpr, STACK: tl.constexpr):
    """-> (output channel rn, weight row) of the gate_up program's rows r (of BLOCK_N). STACK:
    row r is gate row pid_n * BLOCK_N / 2 + r for r < BLOCK_N / 2 and its up row after; else
    gate rows (the up rows are I further)."""
    if STACK:  # (one return: Triton type-checks every return, taken or not)
        rn = pid_n * (BLOCK_N // 2) + r % (BLOCK_N // 2)
        w_row = rn + (r >= BLOCK_N // 2).to(tl.int32) * I
    else:
        rn = pid_n * BLOCK_N + r
        w_row = rn
    return rn, w_row


@triton.jit
def _gate_up_split(acc_gate, acc_up, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, STACK: tl.constexpr):
    """The bf16 gate and up tiles of a gate_up program's accumulators (STACK: rows 0 ..
    BLOCK_N / 2 - 1 of acc_gate hold gate, the rest up)."""
    if STACK:
        gate, up = tl.split(tl.permute(tl.reshape(acc_gate.to(tl.bfloat16), (2, BLOCK_N // 2, BLOCK_T)), (1, 2, 0)))
    else:
        gate, up = acc_gate.to(tl.bfloat16), acc_up.to(tl.bfloat16)
    return gate, up


@triton.jit(do_not_specialize=["n_pairs", "n_experts"])
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, rows_ptr, tile_expert_ptr, rw_ptr, act_ptr,
    n_pairs, n_experts, D, I,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_act,
    limit,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr,
    WORDS: tl.constexpr, PAIR_TILES: tl.constexpr, STACK: tl.constexpr, FP4: tl.constexpr, LAST_SLOT: tl.constexpr,
    FRAGMENT: tl.constexpr, ACT_FRAGMENT: tl.constexpr, WARPS: tl.constexpr, SLOTS: tl.constexpr, XREG: tl.constexpr,
    EVEN_N: tl.constexpr, PDL: tl.constexpr,
):
    """act[row tile, n tile] = swiglu(x_tok @ w1^T, x_tok @ w3^T) (* routing weight), computed
    transposed (the expert's rows as the wgmma's M, the tile's pairs as its N; see `MOE`), one
    dequantised K step (`fp8_gemm.step_tile`: WORDS, FP4) and one dot per iteration.
    STACK: the program's BLOCK_N weight rows are BLOCK_N / 2 gate rows over the same up rows,
    one accumulator split in two for the SwiGLU (half the work per program, twice the
    programs); else BLOCK_N gate rows and BLOCK_N up rows in two accumulators.
    FRAGMENT: x holds its inputs in fragment order (`fp8_gemm.fragment_order`; XREG: x is in
    input order and each tile is put in fragment order in registers, `fragment_order_tile`) and
    the weights enter the dot in it (`fragment_dot_order`); ACT_FRAGMENT: the activations are stored in fragment order, as
    the down kernel reads them. LAST_SLOT: see `_tile_pairs`."""
    begin(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64: an expert's offset e * stride_we passes 2**31 from expert 91 on at V4.1's shapes
    # (w13: 2 * 2304 * 5120 bytes per expert), and the launch passes the stride as i32 (its
    # value fits); in int32 the product wraps, and the program reads another expert's rows or
    # faults. The activation rows get int64 offsets for the same reason at large prefill chunks.
    e, pair = _tile_pairs(rows_ptr, tile_expert_ptr, pid_t, n_pairs, BLOCK_T, PAIR_TILES, LAST_SLOT)
    if e >= n_experts:
        return
    offs = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = pair < n_pairs
    token = pair // TOPK
    r = tl.arange(0, BLOCK_N)
    if FRAGMENT:
        r = fragment_rows(r, BLOCK_N, WARPS)
    rn, w_row = _gate_up_rows(pid_n, I, r, BLOCK_N, STACK)
    n_ok = _rows_below(rn, I, EVEN_N)
    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_x
    gate_rows = w_ptr + e * stride_we + w_row[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn  # (STACK: unused)
    gate_scales = s_ptr + e * stride_se + w_row * stride_sn
    up_scales = gate_scales + I * stride_sn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    if WORDS:
        gate_swords = gate_scales.to(tl.pointer_type(tl.int32), bitcast=True)
        up_swords = up_scales.to(tl.pointer_type(tl.int32), bitcast=True)
    for k0 in range(0, D, BLOCK_K):
        if WORDS:  # one scale word per row and 128 inputs
            sg_word = tl.load(gate_swords + k0 // (4 * _PIECE), mask=n_ok, other=0)
            if not STACK:
                su_word = tl.load(up_swords + k0 // (4 * _PIECE), mask=n_ok, other=0)
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=valid[:, None] if EVEN_K else valid[:, None] & (k < D)[None, :], other=0.0)
        if XREG:
            x = fragment_order_tile(x)
        wg = step_tile(gate_rows, gate_scales, sg_word if WORDS else 0, n_ok, k0, D, BLOCK_K, FP4, WORDS, PTX, FRAGMENT and BLOCK_K == 128, SLOTS)
        acc_gate = step_dot(fragment_dot_order(wg, BLOCK_N, BLOCK_K, FRAGMENT, WARPS, _LANE_INPUTS), x, acc_gate, not PTX)
        if not STACK:
            wu = step_tile(up_rows, up_scales, su_word if WORDS else 0, n_ok, k0, D, BLOCK_K, FP4, WORDS, PTX, FRAGMENT and BLOCK_K == 128, SLOTS)
            acc_up = step_dot(fragment_dot_order(wu, BLOCK_N, BLOCK_K, FRAGMENT, WARPS, _LANE_INPUTS), x, acc_up, not PTX)
    gate, up = _gate_up_split(acc_gate, acc_up, BLOCK_N, BLOCK_T, STACK)
    rn = pid_n * (BLOCK_N // 2 if STACK else BLOCK_N) + tl.arange(0, BLOCK_N // 2 if STACK else BLOCK_N)  # one channel per gate row
    n_ok = _rows_below(rn, I, EVEN_N)
    act = _swiglu(gate, up, limit, HAS_LIMIT)
    if WEIGHT_BEFORE_DOWN and not LAST_SLOT:  # (the shared expert's weight is 1: see `_tile_pairs`)
        act = act * tl.load(rw_ptr + pair, mask=valid, other=0.0)[None, :]
    col = _sigma_inverse(rn) if ACT_FRAGMENT else rn
    tl.store(act_ptr + offs.to(tl.int64)[None, :] * stride_act + col[:, None], act.to(tl.bfloat16), mask=n_ok[:, None] & valid[None, :])


@triton.jit(do_not_specialize=["n_pairs", "n_experts"])
def _down_kernel(
    act_ptr, w_ptr, s_ptr, rows_ptr, tile_expert_ptr, rw_ptr, y_ptr,
    n_pairs, n_experts, D, I,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr,
    WORDS: tl.constexpr, PAIR_TILES: tl.constexpr, FP4: tl.constexpr, LAST_SLOT: tl.constexpr,
    FRAGMENT: tl.constexpr, WARPS: tl.constexpr, SLOTS: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
):
    """y[(token, slot)] = bf16(act @ w2^T) (V4: times the routing weight, rounded to bf16),
    computed transposed like `_gate_up_kernel` (FP4, LAST_SLOT, FRAGMENT: as there; the
    activations arrive in fragment order with FRAGMENT)."""
    begin(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pair = _tile_pairs(rows_ptr, tile_expert_ptr, pid_t, n_pairs, BLOCK_T, PAIR_TILES, LAST_SLOT)  # int64: see _gate_up_kernel
    if e >= n_experts:
        return
    offs = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = pair < n_pairs
    r = tl.arange(0, BLOCK_N)
    if FRAGMENT:
        r = fragment_rows(r, BLOCK_N, WARPS)
    w_n = pid_n * BLOCK_N + r  # the weight row of each tile row
    n_ok = _rows_below(w_n, D, EVEN_N)
    a_rows = act_ptr + offs.to(tl.int64)[:, None] * stride_act
    w_rows = w_ptr + e * stride_we + w_n[:, None] * stride_wn
    scales = s_ptr + e * stride_se + w_n * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    if WORDS:
        s_words = scales.to(tl.pointer_type(tl.int32), bitcast=True)
    for k0 in range(0, I, BLOCK_K):
        if WORDS:
            s_word = tl.load(s_words + k0 // (4 * _PIECE), mask=n_ok, other=0)
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + k[None, :], mask=valid[:, None] if EVEN_K else valid[:, None] & (k < I)[None, :], other=0.0)
        w = step_tile(w_rows, scales, s_word if WORDS else 0, n_ok, k0, I, BLOCK_K, FP4, WORDS, PTX, FRAGMENT and BLOCK_K == 128, SLOTS)
        acc = step_dot(fragment_dot_order(w, BLOCK_N, BLOCK_K, FRAGMENT, WARPS, _LANE_INPUTS), a, acc, not PTX)
    y = acc.to(tl.bfloat16)
    if not WEIGHT_BEFORE_DOWN and not LAST_SLOT:  # (the shared expert's weight is 1)
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
        y = (y.to(tl.float32) * rw[None, :]).to(tl.bfloat16)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + pair.to(tl.int64)[None, :] * stride_y + rn[:, None], y, mask=(rn < D)[:, None] & valid[None, :])


@triton.jit(do_not_specialize=["n_pairs", "n_experts"])
def _gate_up_fp8_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, rows_ptr, tile_expert_ptr, rw_ptr, aq_ptr, as_ptr,
    n_pairs, n_experts, D, I,
    stride_xq, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_aq, stride_as,
    limit,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PAIR_TILES: tl.constexpr, STACK: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr,
):
    """`_gate_up_kernel` under FP8 activations: x arrives quantised (FP8 codes xq, exponent
    bytes xs per 32 inputs); each 32-input piece is one FP8 x FP8 MMA from zero, straight from
    the weight's FP8 codes (no dequantisation), scaled by (weight row scale x token scale) into
    the fp32 accumulator. The epilogue rounds the SwiGLU (times the routing weight) to bf16, as
    the reference's down projection receives it, and quantises it per 32 channels of a pair
    (the program's CH channels, BLOCK_N / 2 with STACK, are whole blocks): codes to aq,
    exponent bytes to as."""
    begin(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pair = _tile_pairs(rows_ptr, tile_expert_ptr, pid_t, n_pairs, BLOCK_T, PAIR_TILES, 0)  # int64: see _gate_up_kernel
    if e >= n_experts:
        return
    offs = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = pair < n_pairs
    token = pair // TOPK
    rn, w_row = _gate_up_rows(pid_n, I, tl.arange(0, BLOCK_N), BLOCK_N, STACK)
    n_ok = rn < I
    rp = tl.arange(0, _PIECE)
    x_rows = xq_ptr + token.to(tl.int64)[:, None] * stride_xq
    xs_rows = xs_ptr + token.to(tl.int64) * stride_xs
    gate_rows = w_ptr + e * stride_we + w_row[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn  # (STACK: unused)
    gate_scales = s_ptr + e * stride_se + w_row * stride_sn
    up_scales = gate_scales + I * stride_sn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        for j in tl.static_range(BLOCK_K // _PIECE):
            k = k0 + j * _PIECE + rp
            # a piece past D (not EVEN_K) reads zeros, and the row's last scales: it adds 0
            kb = tl.minimum((k0 + j * _PIECE) // _PIECE, D // _PIECE - 1)
            k_ok = (rp < _PIECE) if EVEN_K else (k < D)
            x = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            sx = e8m0_to_fp32(tl.load(xs_rows + kb, mask=valid, other=0))
            wg = tl.load(gate_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            sg = e8m0_to_fp32(tl.load(gate_scales + kb, mask=n_ok, other=0))
            acc_gate += tl.dot(wg, tl.trans(x)) * (sg[:, None] * sx[None, :])
            if not STACK:
                wu = tl.load(up_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                su = e8m0_to_fp32(tl.load(up_scales + kb, mask=n_ok, other=0))
                acc_up += tl.dot(wu, tl.trans(x)) * (su[:, None] * sx[None, :])
    gate, up = _gate_up_split(acc_gate, acc_up, BLOCK_N, BLOCK_T, STACK)
    rc = pid_n * CH + tl.arange(0, CH)
    act = _swiglu(gate, up, limit, HAS_LIMIT)
    if WEIGHT_BEFORE_DOWN:
        act = act * tl.load(rw_ptr + pair, mask=valid, other=0.0)[None, :]
    act = act.to(tl.bfloat16).to(tl.float32)  # [CH, BLOCK_T]
    blocks = tl.permute(tl.reshape(act, (CH // _PIECE, _PIECE, BLOCK_T)), (2, 0, 1))  # [pairs, blocks, 32]
    codes, exp = fp8_quantise(blocks)
    out_rows = offs.to(tl.int64)[:, None]
    tl.store(aq_ptr + out_rows * stride_aq + rc[None, :], tl.reshape(codes, (BLOCK_T, CH)).to(tl.float8e4nv),
             mask=valid[:, None] & (rc < I)[None, :])
    rb = pid_n * (CH // _PIECE) + tl.arange(0, CH // _PIECE)
    tl.store(as_ptr + out_rows * stride_as + rb[None, :], (exp + 127).to(tl.uint8), mask=valid[:, None] & (rb < I // _PIECE)[None, :])


@triton.jit(do_not_specialize=["n_pairs", "n_experts"])
def _down_fp8_kernel(
    aq_ptr, as_ptr, w_ptr, s_ptr, rows_ptr, tile_expert_ptr, rw_ptr, y_ptr,
    n_pairs, n_experts, D, I,
    stride_aq, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PAIR_TILES: tl.constexpr, PDL: tl.constexpr,
):
    """`_down_kernel` under FP8 activations: the quantised activations of `_gate_up_fp8_kernel`
    times the FP8 down weights, one FP8 x FP8 MMA per 32 inputs scaled into fp32."""
    begin(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pair = _tile_pairs(rows_ptr, tile_expert_ptr, pid_t, n_pairs, BLOCK_T, PAIR_TILES, 0)
    if e >= n_experts:
        return
    offs = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = pair < n_pairs
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < D
    rp = tl.arange(0, _PIECE)
    a_rows = aq_ptr + offs.to(tl.int64)[:, None] * stride_aq
    as_rows = as_ptr + offs.to(tl.int64) * stride_as
    w_rows = w_ptr + e * stride_we + rn[:, None] * stride_wn
    scales = s_ptr + e * stride_se + rn * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        for j in tl.static_range(BLOCK_K // _PIECE):
            k = k0 + j * _PIECE + rp
            kb = tl.minimum((k0 + j * _PIECE) // _PIECE, I // _PIECE - 1)  # as in _gate_up_fp8_kernel
            k_ok = (rp < _PIECE) if EVEN_K else (k < I)
            a = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            sa = e8m0_to_fp32(tl.load(as_rows + kb, mask=valid, other=0))
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            sw = e8m0_to_fp32(tl.load(scales + kb, mask=n_ok, other=0))
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    y = acc.to(tl.bfloat16)
    if not WEIGHT_BEFORE_DOWN:
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
        y = (y.to(tl.float32) * rw[None, :]).to(tl.bfloat16)
    tl.store(y_ptr + pair.to(tl.int64)[None, :] * stride_y + rn[:, None], y, mask=n_ok[:, None] & valid[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, ids_ptr, row_ptr, out_ptr, D, TOPK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                      LAST_AFTER_ROUNDING: tl.constexpr, PDL: tl.constexpr):
    """out[t] = ((0 + y[t, s_0]) + y[t, s_1]) + ... in fp32 (stored in out's dtype), s_0, s_1,
    ... the token's slots in ascending expert id (ties in slot order): the order the reference
    adds experts in. LAST_AFTER_ROUNDING (V4's shared expert, the highest id): the sum before
    the last slot is rounded to bf16 and the last added to it in bf16.
    GATHER: pair p = t * TOPK + s is row row_ptr[p] of y (else row p)."""
    begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    j = tl.arange(0, K_BLOCK)
    ids = tl.load(ids_ptr + t * TOPK + j, mask=j < TOPK, other=0).to(tl.int64)
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None]))
    rank = tl.sum((before & (j < TOPK)[None, :]).to(tl.int32), axis=1)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        slot = tl.sum(tl.where((rank == r) & (j < TOPK), j, 0), axis=0)
        row = t * TOPK + slot
        if GATHER:
            row = tl.load(row_ptr + row)
        if LAST_AFTER_ROUNDING and r == TOPK - 1:
            total = total.to(tl.bfloat16).to(tl.float32)
        total += tl.load(y_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, total.to(out_ptr.dtype.element_ty), mask=ok)  # fp32, or rounded once to bf16


def moe_config(pairs: int, experts: int, fp8_act: bool = False) -> dict:
    """The knobs of the first row class that holds the mean pairs per expert (of the FP8
    kernels' table with `fp8_act`)."""
    for max_mean, cfg in MOE["fp8_rows" if fp8_act else "rows"]:
        if max_mean is None or pairs <= max_mean * experts:
            return cfg
    raise ValueError("MOE['rows'] must end with a class for any load (max_mean None)")


def align_by_expert(flat_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) pairs grouped by expert in segments padded to `block_m` rows.

    -> rows int32 [n_tiles * block_m] (pair index, or n_pairs for padding), tile_expert int32
    [n_tiles] (expert of each row tile; n_experts for tiles past the end). n_tiles is an upper
    bound from the shapes (every used expert wastes < block_m rows), so nothing syncs with the
    host. Pairs of one expert keep their order."""
    n = flat_ids.numel()
    dev = flat_ids.device
    n_tiles = triton.cdiv(n, block_m) + min(n_experts, n)
    rows = torch.empty(n_tiles * block_m, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    if n <= MOE["ALIGN_MAX_PAIRS"]:
        _align_kernel[(n_experts + 1,)](
            flat_ids, rows, tile_expert, n, n_experts, n_tiles,
            BLOCK_T=block_m, E_BLOCK=triton.next_power_of_2(n_experts + 1), P_BLOCK=ALIGN_P_BLOCK, FILL=256, num_warps=4, **pdl_launch(flat_ids.device),
        )
        return rows, tile_expert
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat_ids.long(), torch.ones(n, dtype=torch.int64, device=dev))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    sorted_ids, order = flat_ids.long().sort(stable=True)
    dest = pad_start[sorted_ids] + torch.arange(n, device=dev) - start[sorted_ids]
    rows.fill_(n)
    rows[dest] = order.to(torch.int32)
    tile_start = torch.arange(n_tiles, device=dev) * block_m
    tile_expert.copy_(torch.searchsorted(pad_end, tile_start, right=True))
    return rows, tile_expert


def _check_out_dtype(name: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: out_dtype must be float32 or bfloat16, got {out_dtype}")


def _slot_sums(y: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype, pair_rows: torch.Tensor | None = None,
               shared_after_rounding: bool = False) -> torch.Tensor:
    """[T, D] in out_dtype (fp32, or bf16: the fp32 sum rounded once): the sum of each token's k
    rows of y (bf16 [T * k, D] contiguous; row = token * k + slot, or pair_rows[token * k +
    slot] when given) in ascending expert id (kernel 3). `shared_after_rounding` (bf16 only):
    the last (the shared expert's) added in bf16 to the others' sum rounded to bf16."""
    if shared_after_rounding and out_dtype != torch.bfloat16:
        raise ValueError(f"moe_experts: shared_after_rounding gives a bf16 sum, got out_dtype {out_dtype}")
    t, topk = ids.shape
    d = y.shape[1]
    out = torch.empty(t, d, dtype=out_dtype, device=y.device)
    _sum_slots_kernel[(t, triton.cdiv(d, 1024))](
        y, ids, ids if pair_rows is None else pair_rows, out, d,
        TOPK=topk, K_BLOCK=max(2, triton.next_power_of_2(topk)), BLOCK=1024, GATHER=pair_rows is not None,
        LAST_AFTER_ROUNDING=shared_after_rounding, num_warps=4, **pdl_launch(y.device),
    )
    return out


def expert_inputs(w: torch.Tensor) -> int:
    """Inputs per row of stacked expert weights: FP8 [E, rows, inputs], or compact FP4 (uint8,
    two codes a byte) [E, rows, inputs / 2]."""
    return w.shape[-1] * (2 if w.dtype == torch.uint8 else 1)


def dense_fits(w13: torch.Tensor) -> bool:
    """Whether `moe_experts_dense` may run a layer's stacked experts: their bf16 copy (gate and
    up; the down copy is half of it and made after the first is freed) within
    `MOE["DENSE_TEMP_BYTES"]`."""
    return math.prod(w13.shape[:-1]) * expert_inputs(w13) * 2 <= MOE["DENSE_TEMP_BYTES"]


def _check_experts(name: str, x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                   shared: tuple | None) -> tuple[int, int, bool]:
    """Validate a call's experts -> (hidden size, intermediate size, FP4). FP8 stacks are
    float8_e4m3fn; compact FP4 stacks uint8 (`quant.fp4_kernel_layout`), whose V4.1 shared
    expert (FP8, not FP4-representable) comes as `shared` (w13, w13_scale, w2, w2_scale of one
    expert) and takes every token's last slot."""
    fp4 = w13.dtype == torch.uint8
    want = torch.uint8 if fp4 else torch.float8_e4m3fn
    if w13.dtype not in (torch.uint8, torch.float8_e4m3fn) or w2.dtype != want:
        raise TypeError(f"{name}: expert weights must be float8_e4m3fn or compact FP4 (uint8), both alike; got {w13.dtype}, {w2.dtype}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: x must be bfloat16, got {x.dtype}")
    n_experts, two_i = w13.shape[:2]
    d, inter = expert_inputs(w13), two_i // 2
    if w2.shape[:2] != (n_experts, d) or expert_inputs(w2) != inter or x.shape[-1] != d or x.dim() != 2:
        raise ValueError(f"{name}: shapes x {list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)} do not match")
    if d % SCALE_BLOCK or inter % SCALE_BLOCK:
        raise ValueError(f"{name}: hidden and intermediate sizes must be multiples of {SCALE_BLOCK}")
    if tuple(w13_scale.shape) != (n_experts, two_i, d // SCALE_BLOCK) or tuple(w2_scale.shape) != (n_experts, d, inter // SCALE_BLOCK):
        raise ValueError(f"{name}: scale shapes must be [E, rows, inputs/32]")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError(f"{name}: expert weights must be row-major (last stride 1)")
    if fp4 and (w13.data_ptr() % 4 or w2.data_ptr() % 4):
        raise ValueError(f"{name}: compact FP4 experts are read as int32 words: their storage must be 4-byte aligned")
    if shared is not None:
        if not fp4:
            raise ValueError(f"{name}: a separate shared expert goes with compact FP4 experts only (FP8 stacks hold it as their last expert)")
        _check_experts(name, x, *shared, None)
        if shared[0].dtype != torch.float8_e4m3fn or shared[0].shape[0] != 1:
            raise ValueError(f"{name}: the shared expert must be one FP8 expert [1, rows, inputs], got {shared[0].dtype} {list(shared[0].shape)}")
    return d, inter, fp4


def moe_experts_dense(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                      w2: torch.Tensor, w2_scale: torch.Tensor, limit: float, weight_before_down: bool,
                      out_dtype: torch.dtype = torch.float32, fp8_act: bool = False, shared: tuple | None = None,
                      shared_after_rounding: bool = False) -> torch.Tensor:
    """`moe_experts` for compute-bound loads (prefill): the same arguments, semantics and
    result, by bf16 grouped GEMMs (`torch._grouped_mm`, CUTLASS on sm_90: 87% of the bf16
    peak at 8K tokens on 65 experts, device run 2) over the experts dequantised exactly to
    bf16 (`fp8_gemm.dequant_fp8` / `dequant_fp4`, one pass; the codes times power-of-two
    scales are exact in bf16; a separate shared expert becomes the last group), instead of
    the weight-only kernels, which re-read and re-dequantise an expert's weights for every
    tile of pairs and reach ~38% of the peak there.

    The pairs sorted by expert (stable: tokens ascending) form the groups; gate and up come
    out of one GEMM in bf16 (as the reference's linears round them), the clamped SwiGLU and
    the routing weight run in fp32 in one kernel and round to bf16, the down GEMM gives a bf16
    row per pair (in expert order), and kernel 3 sums a token's rows in ascending expert id in
    fp32, reading them through the inverse of the sort. Nothing
    syncs with the host (CUDA-graph capturable). The experts must fit `dense_fits`.
    `fp8_act`: x and the SwiGLU output take their FP8 round trip before their GEMMs (the
    numerics of `moe_experts`' FP8 kernels, on bf16 tensor cores)."""
    _check_out_dtype("moe_experts_dense", out_dtype)
    t, topk = topk_ids.shape
    d, inter, fp4 = _check_experts("moe_experts_dense", x, w13, w13_scale, w2, w2_scale, shared)
    n_experts = w13.shape[0] + (shared is not None)
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("moe_experts_dense: expert stacks must be contiguous (they are dequantised as one block)")
    if not dense_fits(w13):
        raise ValueError(f"moe_experts_dense: {n_experts} experts need {math.prod(w13.shape[:-1]) * d * 2 >> 20} MiB of bf16 copies, over MOE['DENSE_TEMP_BYTES']")
    n_pairs = t * topk
    if n_pairs == 0:
        return torch.zeros(t, d, dtype=out_dtype, device=x.device)
    if fp8_act:
        x = fp8_act_fake_quant(x, SCALE_BLOCK)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # (bincount would read its size back from the device)
    h = torch._grouped_mm(x[order // topk], _dense_stack(w13, w13_scale, shared and shared[:2]).transpose(1, 2), offs=offs)
    rw = topk_weights.reshape(-1).float()[order].contiguous()
    act = torch.empty(n_pairs, inter, dtype=torch.bfloat16, device=x.device)
    block_p, block_i = 32, 128
    _swiglu_rows_kernel[(triton.cdiv(n_pairs, block_p), triton.cdiv(inter, block_i))](
        h, rw, act, n_pairs, inter, h.stride(0), act.stride(0), float(limit),
        HAS_LIMIT=limit > 0, WEIGHTED=weight_before_down, BLOCK_P=block_p, BLOCK_I=block_i, num_warps=4, **pdl_launch(h.device),
    )
    del h
    if fp8_act:
        act = fp8_act_fake_quant(act, SCALE_BLOCK)
    down = torch._grouped_mm(act, _dense_stack(w2, w2_scale, shared and shared[2:]).transpose(1, 2), offs=offs)
    if not weight_before_down:
        down = (down.float() * rw[:, None]).bfloat16()
    # the slot sum reads each pair's row where the expert order put it (scattering the rows
    # back to pair order first was an extra [pairs, D] write and read: 1.3 ms of a layer's
    # MoE at 8K tokens, device profile of the fourth session)
    pair_rows = torch.empty_like(order).scatter_(0, order, torch.arange(n_pairs, device=x.device))
    return _slot_sums(down, topk_ids.contiguous(), out_dtype, pair_rows, shared_after_rounding)


def _dense_stack(w: torch.Tensor, scale: torch.Tensor, shared: tuple | None) -> torch.Tensor:
    """bf16 [E (+1), rows, inputs]: the stacked experts dequantised exactly, a separate shared
    expert (FP8, with a compact FP4 stack) as the last one (one bf16 write: an FP8 stack's copy
    into a larger buffer cost p8k 6 ms, device call S8-4)."""
    e, rows = w.shape[:2]
    inputs = expert_inputs(w)
    if w.dtype != torch.uint8:  # FP8 stacks hold their shared expert: dequantised in place of a copy
        return dequant_fp8(w.view(-1, inputs), scale.reshape(-1, inputs // SCALE_BLOCK), 0, True).view(e, rows, inputs)
    out = torch.empty(e + (shared is not None), rows, inputs, dtype=torch.bfloat16, device=w.device)
    dequant_fp4(w.view(-1, inputs // 2), scale.reshape(-1, inputs // SCALE_BLOCK), out[:e].view(-1, inputs))
    if shared is not None:
        out[e:] = dequant_fp8(shared[0].view(-1, inputs), shared[1].reshape(-1, inputs // SCALE_BLOCK), 0, True).view(1, rows, inputs)
    return out


def _words(ptx: bool, w: torch.Tensor, scale: torch.Tensor, block_k: int) -> bool:
    """Whether a GEMM reads its FP8 weights (compact FP4: its scales) as int32 words
    (`MOE["DEQUANT"]`): compiled PTX, inputs in whole 128s (one scale word per row and 128
    inputs), K steps inside one word, and 4-byte aligned rows and experts (the loads are
    int32)."""
    aligned = all(v % 4 == 0 for v in (w.data_ptr(), w.stride(0), w.stride(1), scale.data_ptr(), scale.stride(0), scale.stride(1)))
    return MOE["DEQUANT"] == "words" and ptx and expert_inputs(w) % 128 == 0 and 128 % block_k == 0 and aligned


def _call_tiles(name: str, n_pairs: int, n_experts: int, d: int, inter: int, fp4: bool, fp8_act: bool) -> tuple[int, dict, dict]:
    """A call's row tile and gate_up / down knobs (`moe_config`), checked: (BLOCK_T, gate_up,
    down). FP4 rows in slot order are read in whole slot blocks (`quant.fp4_kernel_layout`);
    a shared expert's FP8 launch takes the same steps (any step of 64 or 128 is exact)."""
    cfg = moe_config(n_pairs, n_experts, fp8_act)
    bt, gu, dn = cfg["BLOCK_T"], cfg["gate_up"], cfg["down"]
    gu = dict(gu, BLOCK_K=quant.FP4_SLOT_INPUTS) if fp4 and quant.fp4_slot_order(d) else gu
    dn = dict(dn, BLOCK_K=quant.FP4_SLOT_INPUTS) if fp4 and quant.fp4_slot_order(inter) else dn
    for part_name, part in (("gate_up", gu), ("down", dn)):  # the FP8 kernels run pieces of 32; the bf16 ones whole fragment blocks
        if (part["BLOCK_K"] % SCALE_BLOCK) if fp8_act else part["BLOCK_K"] not in (FRAGMENT_BLOCK, 2 * FRAGMENT_BLOCK):
            want = f"a multiple of {SCALE_BLOCK}" if fp8_act else f"{FRAGMENT_BLOCK} or {2 * FRAGMENT_BLOCK}"
            raise ValueError(f"{name}: {part_name} BLOCK_K must be {want}, got {part['BLOCK_K']}")
    bad = wgmma_tile_error(gu["BLOCK_N"], bt, gu["num_warps"]) or wgmma_tile_error(dn["BLOCK_N"], bt, dn["num_warps"])
    if bad:
        raise ValueError(f"{name}: {bad}")
    return bt, gu, dn


def _bf16_x(x: torch.Tensor, bt: int) -> tuple[torch.Tensor, bool]:
    """x as the bf16 gate_up kernel reads it -> (x, XREG): tiles of up to `MOE["XREG_MAX_T"]`
    pairs put it in fragment order in registers; wider ones read a copy in that order."""
    x_fragment = x.shape[1] % FRAGMENT_BLOCK == 0
    x_reg = x_fragment and bt <= MOE["XREG_MAX_T"]
    return (fragment_order(x) if x_fragment and not x_reg else x), x_reg


def _bf16_launch(x: torch.Tensor, x_reg: bool, rows: torch.Tensor, tile_expert: torch.Tensor, weights: torch.Tensor, act: torch.Tensor,
                 y: torch.Tensor, stack: tuple, fp4: bool, tiles: int, topk: int, n_pairs: int, bt: int, gu: dict,
                 dn: dict, pair_tiles: bool, limit: float, weight_before_down: bool, last_slot: int) -> None:
    """Kernels 1 and 2 over `tiles` row tiles of the layout (or, last_slot, of every token's
    last slot: the tiles are token blocks and the activations token rows) for the experts of
    `stack`; their rows of y."""
    w13, w13_scale, w2, w2_scale = stack
    experts = w13.shape[0]
    w13_scale, w2_scale = w13_scale.view(torch.uint8).contiguous(), w2_scale.view(torch.uint8).contiguous()
    d, inter = x.shape[1], act.shape[1]
    ptx = ptx_convert(x.device)
    x_fragment, act_fragment = d % FRAGMENT_BLOCK == 0, inter % FRAGMENT_BLOCK == 0
    stacked = gu.get("STACK", False)
    channels = gu["BLOCK_N"] // 2 if stacked else gu["BLOCK_N"]  # a gate_up program's output channels
    _gate_up_kernel[(tiles, triton.cdiv(inter, channels))](
        x, w13, w13_scale, rows, tile_expert, weights, act,
        n_pairs, experts, d, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        float(limit),
        TOPK=topk, HAS_LIMIT=limit > 0, WEIGHT_BEFORE_DOWN=weight_before_down,
        BLOCK_T=bt, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], EVEN_K=d % gu["BLOCK_K"] == 0, PTX=ptx,
        WORDS=_words(ptx, w13, w13_scale, gu["BLOCK_K"]), PAIR_TILES=pair_tiles, STACK=stacked, FP4=fp4, LAST_SLOT=last_slot,
        FRAGMENT=x_fragment, ACT_FRAGMENT=act_fragment, WARPS=gu["num_warps"], SLOTS=fp4 and quant.fp4_slot_order(d), XREG=x_reg,
        EVEN_N=inter % channels == 0,
        **launch_options(gu), **pdl_launch(x.device),
    )
    _down_kernel[(tiles, triton.cdiv(d, dn["BLOCK_N"]))](
        act, w2, w2_scale, rows, tile_expert, weights, y,
        n_pairs, experts, d, inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
        WEIGHT_BEFORE_DOWN=weight_before_down,
        BLOCK_T=bt, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], EVEN_K=inter % dn["BLOCK_K"] == 0, PTX=ptx,
        WORDS=_words(ptx, w2, w2_scale, dn["BLOCK_K"]), PAIR_TILES=pair_tiles, FP4=fp4, LAST_SLOT=last_slot,
        FRAGMENT=act_fragment, WARPS=dn["num_warps"], SLOTS=fp4 and quant.fp4_slot_order(inter), EVEN_N=d % dn["BLOCK_N"] == 0,
        **launch_options(dn), **pdl_launch(act.device),
    )


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
    weight_before_down: bool,
    out_dtype: torch.dtype = torch.float32,
    fp8_act: bool = False,
    shared: tuple | None = None,
    shared_after_rounding: bool = False,
) -> torch.Tensor:
    """Routed experts of a flat batch -> fp32 [T, D] (see the module docstring), or with
    out_dtype bf16 that sum rounded once in the slot-sum kernel (V4.1's layer output: one
    launch less than a cast after it). `fp8_act`: FP8 activations (`ModelConfig.fp8_activations`):
    x quantised per 32 inputs (`fp8_gemm.fp8_act_quant`), FP8 x FP8 GEMMs (`_gate_up_fp8_kernel`,
    `_down_fp8_kernel`; FP8 stacks only). Compact FP4 stacks (uint8, `quant.fp4_kernel_layout`)
    run the bf16 kernels' FP4 variant; their `shared` expert (FP8, expert id E, every token's
    last slot) a second pair of launches over the same buffers, so that the slot sum adds it
    last as before. `shared_after_rounding` (V4, out_dtype bf16): the last slot, the shared
    expert, is added in bf16 to the routed sum rounded to bf16 (`_slot_sums`)."""
    _check_out_dtype("moe_experts", out_dtype)
    t, topk = topk_ids.shape
    d, inter, fp4 = _check_experts("moe_experts", x, w13, w13_scale, w2, w2_scale, shared)
    if fp8_act and fp4:
        raise ValueError("moe_experts: FP8 activations run FP8 expert stacks (the loader keeps FP8 experts under fp8_activations), got compact FP4")
    n_experts = w13.shape[0] + (shared is not None)  # expert ids in [0, n_experts)
    n_pairs = t * topk
    if n_pairs == 0:  # no tokens, or k = 0
        return torch.zeros(t, d, dtype=out_dtype, device=x.device)
    x = x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.float().contiguous()  # pair p = token * k + slot, as the rows index it
    bt, gu, dn = _call_tiles("moe_experts", n_pairs, n_experts, d, inter, fp4, fp8_act)
    pair_tiles = n_pairs <= MOE["PAIR_TILES_MAX_PAIRS"]
    if pair_tiles:  # pair p is row tile p, of expert topk_ids.flat[p]
        rows = tile_expert = ids.view(-1)
    else:
        rows, tile_expert = align_by_expert(ids.view(-1), n_experts, bt)
    n_tiles = tile_expert.numel()
    if fp8_act:
        y = torch.empty(n_pairs, d, dtype=torch.bfloat16, device=x.device)
        stack = gu.get("STACK", False)
        xq, xs = fp8_act_quant(x, SCALE_BLOCK)
        act_q = torch.empty(n_tiles * bt, inter, dtype=torch.float8_e4m3fn, device=x.device)
        act_s = torch.empty(n_tiles * bt, inter // SCALE_BLOCK, dtype=torch.uint8, device=x.device)
        w13_scale, w2_scale = w13_scale.view(torch.uint8).contiguous(), w2_scale.view(torch.uint8).contiguous()
        _gate_up_fp8_kernel[(n_tiles, triton.cdiv(inter, gu["BLOCK_N"] // 2 if stack else gu["BLOCK_N"]))](
            xq, xs, w13, w13_scale, rows, tile_expert, weights, act_q, act_s,
            n_pairs, n_experts, d, inter,
            xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
            act_q.stride(0), act_s.stride(0),
            float(limit),
            TOPK=topk, HAS_LIMIT=limit > 0, WEIGHT_BEFORE_DOWN=weight_before_down,
            BLOCK_T=bt, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], EVEN_K=d % gu["BLOCK_K"] == 0,
            PAIR_TILES=pair_tiles, STACK=stack, CH=gu["BLOCK_N"] // 2 if stack else gu["BLOCK_N"],
            **launch_options(gu), **pdl_launch(xq.device),
        )
        _down_fp8_kernel[(n_tiles, triton.cdiv(d, dn["BLOCK_N"]))](
            act_q, act_s, w2, w2_scale, rows, tile_expert, weights, y,
            n_pairs, n_experts, d, inter,
            act_q.stride(0), act_s.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
            WEIGHT_BEFORE_DOWN=weight_before_down,
            BLOCK_T=bt, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], EVEN_K=inter % dn["BLOCK_K"] == 0, PAIR_TILES=pair_tiles,
            **launch_options(dn), **pdl_launch(act_q.device),
        )
        return _slot_sums(y, ids, out_dtype, shared_after_rounding=shared_after_rounding)
    y = torch.empty(n_pairs, d, dtype=torch.bfloat16, device=x.device)
    act = torch.empty(n_tiles * bt, inter, dtype=torch.bfloat16, device=x.device)
    x, x_reg = _bf16_x(x, bt)
    def launch(stack: tuple, fp4: bool, tiles: int, last_slot: int) -> None:
        _bf16_launch(x, x_reg, rows, tile_expert, weights, act, y, stack, fp4, tiles, topk, n_pairs, bt, gu, dn, pair_tiles,
                     limit, weight_before_down, last_slot)

    launch((w13, w13_scale, w2, w2_scale), fp4, n_tiles, 0)
    if shared is not None:  # the shared expert's pairs: act rows = token rows (LAST_SLOT tiles are token blocks)
        launch(shared, False, triton.cdiv(t, bt), topk)
    return _slot_sums(y, ids, out_dtype, shared_after_rounding=shared_after_rounding)

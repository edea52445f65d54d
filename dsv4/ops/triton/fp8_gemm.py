"""FP8 block-scaled projection `y = x @ (w * 2**(s - 127))^T` on Triton (H200 fast path).

Same signature as the torch reference `F.linear(x, quant.dequant_fp8_block(w, s, block))`
(`dsv4.ops.linear.Linear`): x bf16 [..., K], w float8_e4m3fn [N, K], s uint8 exponent bytes
[ceil(N/block), ceil(K/block)] (E8M0), bf16 [..., N] out. Two kernels, because the two regimes
have different limits:

* `fp8_linear_w8a16` (decode, few rows, memory bound): the weight tile is loaded as FP8 (one
  byte per weight crosses HBM, 16-byte copies pipelined through shared memory), dequantised
  exactly to bf16 in registers — the code's value times its power-of-two block scale; a byte
  permute instead of Triton's cast, which is bound by the SMs' conversion unit below the HBM
  rate — and multiplied on bf16 tensor cores, the weight rows as the wgmma's M and the
  activation rows as its N (one instruction family for every batch size: see `W8A16`). K is cut
  into chunks fixed by the weight's shape and the device (never by M); each chunk is one MMA
  chain from zero, and the chunk sums are added in a fixed order — in one program when there
  are many output tiles, or one program per chunk (split-K, to fill the SMs at decode) whose
  partials the tile's last program adds: the same bits either way, so a row's result does not
  depend on the batch it came in (batch invariance), and no sum uses atomics. The tile knobs
  (`W8A16`) do not change the bits either, only the chunking does. The weights are read as
  int32 words of 4 codes (`W8A16["DEQUANT"]`; the same bits as byte reads, 10-17% faster).
* `fp8_linear_w8a8` (prefill, many rows, compute bound): the activations are first quantised
  to FP8 per (row, `block` columns) with a power-of-two scale (`fp8_act_quant`, the DeepSeek
  reference's activation quantiser, bit-identical to `quant.quantize_fp8_ue8m0`), then both
  operands run on FP8 tensor cores; each block's partial product is multiplied by
  (row scale x column scale) into the fp32 accumulator. This follows the DeepSeek reference's
  numerics, not HF's (which does not quantise activations): the error against the w8a16
  reference is that of one e4m3 rounding of x (about 2**-5 relative per element).

Under FP8 activations (`ModelConfig.fp8_activations`) a decode projection's x arrives as FP8
codes from `fp8_act_quant` and `fp8_linear_w8a16(..., x_scale=)` multiplies them without
dequantising anything (FP8 x FP8 per 32 inputs, the same chunking); `fp8_act_fake_quant` is
the quantiser's round trip back to bf16 in one launch, for the inputs of the bf16 GEMMs.

`fp8_linear` picks one by the number of rows (`W8A8_MIN_ROWS`). The two paths differ
numerically (and the FP8 path's autotuned tiles depend on the row count), so through the
dispatcher a token's result depends on which path its batch took; callers that need
batch-invariant greedy decoding call `fp8_linear_w8a16` (whose row class follows M and whose
split follows the tile count; scripts/check_kernels.py checks on the device that neither
changes the bits).

Scale bytes are turned into 2**(byte - 127) by building the fp32 bits, which is exact for the
bytes a checkpoint holds (1..254); byte 0 (2**-127, a subnormal) reads as 0 and 0xFF (NaN) as
inf — the loader rejects 0xFF (`quant.FormatError`), the kernels do not check. The word
dequantisers fold the scale into one bf16 factor, finite for bytes up to 134: the loader keeps
compact FP8 weights' bytes in 1 .. 134 (`quant.check_fp8_scales`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv4.model import quant
from dsv4.ops.triton.pdl import begin, compiled, pdl_launch

# Rows from which `fp8_linear` switches from the weight-only kernel to the FP8 x FP8 kernel.
W8A8_MIN_ROWS = 1024
FP8_MAX = tl.constexpr(448.0)  # largest float8_e4m3fn (constexpr: kernels read it)


@triton.jit
def e8m0_to_fp32(byte):
    """2**(byte - 127) from the exponent byte, exactly (byte 0 flushes to 0)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 values with |v| <= 448 to the nearest e4m3 value (ties to even), in fp32.

    After this the cast to float8e4nv is exact, whatever rounding the backend's cast uses (the
    Triton interpreter's cast drops the carry when rounding crosses a power of two). Integer
    arithmetic on the 24-bit significand, so no compiler can fold it away: e4m3 keeps 3 bits
    after the leading one for exponents >= -6, one fewer per step below (subnormals, step
    2**-9); values below 2**-10 round to zero. The sign bit is put back (a value that rounds
    to zero keeps it, as a cast would)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    sig = (bits & 0x7FFFFF) | 0x800000
    drop = tl.minimum(20 + tl.maximum(-6 - e, 0), 25)
    q = sig >> drop
    rem = sig - (q << drop)
    half = 1 << (drop - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    unit = (tl.maximum(e + 104, 1) << 23).to(tl.float32, bitcast=True)  # 2**(e - 23)
    mag = (q << drop).to(tl.float32) * unit
    return (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """The e4m3 codes (int32, 0 .. 255) of fp32 values that e4m3 holds exactly (`round_to_e4m3`'s
    output), built from their bits in integer arithmetic: the codes the cast to float8e4nv
    gives, without a conversion instruction. (In the attention's FP8 output epilogue the
    compiled cast, packed two values a 16-bit register, lost the second value's code on sm_90:
    docs/PERF.md, thirty-second session.) Normal codes from 2**-6 take the fp32 exponent less
    120 and the top 3 mantissa bits; below, the subnormal codes are |v| / 2**-9 (0 .. 7)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    normal = ((exp - 120) << 3) | ((bits >> 20) & 7)
    sub = (tl.abs(v) * 512.0).to(tl.int32)
    return tl.where(exp >= 121, normal, sub) | ((bits >> 24) & 0x80)


@triton.jit
def pow2_ceil_exponent(t):
    """ceil(log2(t)) of positive normal fp32 t from its bits (`quant.pow2_ceil_exponent`)."""
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def pow2(e):
    """2**e as fp32 for integer e in [-126, 127], from the exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_exponent(amax):
    """The ue8m0 exponent of an FP8 block whose largest magnitude is amax: ceil(log2(amax *
    (1/448))), amax taken as at least 1e-4 (`quant.quantize_fp8_ue8m0`); the block's codes are
    then e4m3(x * 2**-exp), |x * 2**-exp| <= 448 by the rounding up (no clamp needed)."""
    return pow2_ceil_exponent(tl.maximum(amax, 1e-4) * (1.0 / FP8_MAX))


@triton.jit
def fp8_quantise(x):
    """FP8 blocks x [rows, blocks, block] -> (the e4m3 code values in fp32, the ue8m0 exponent
    per block; `fp8_exponent`) (GEMM inputs, the window KV, the experts' activations)."""
    exp = fp8_exponent(tl.max(tl.abs(x), axis=2))
    return round_to_e4m3(x * pow2(-exp)[:, :, None]), exp


# ------------------------------------------------------------------------------ w8a16 kernel

# e4m3 -> bf16 for 4 codes in a 32-bit register without the conversion unit: a byte permute
# puts each code, sign-extended, in a 16-bit half; shifted left by 4 and masked, sign, exponent
# and mantissa sit where bf16 keeps them, which reads as the value times 2**-120 (e4m3
# subnormals land on bf16 subnormals with the same factor); one bf16x2 multiply by 2**120
# makes it exact. (NaN codes 0x7F / 0xFF come out as +-480; checkpoints hold none.) Triton's
# own cast takes three conversion-unit instructions per two values (e4m3x2 -> f16x2, then
# f16 -> bf16 one by one), which at 16 conversions per SM and clock is slower than HBM.
_E4M3_PERMUTE_PTX = """.reg .b32 lo, hi;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
"""
_E4M3_TO_BF16_PTX = tl.constexpr("{\n" + _E4M3_PERMUTE_PTX + ".reg .b32 k;\nmov.b32 k, 0x7B807B80;\n"
                                 "mul.rn.bf16x2 $0, lo, k;\nmul.rn.bf16x2 $1, hi, k;\n}")
# "ptx": the permute above; "fp32": Triton's casts through fp32 (the interpreter's path, whose
# bf16 arithmetic is not IEEE; on the GPU a slower reference). Same bf16 values either way.
FP8_CONVERT = "ptx"


def ptx_convert(device: torch.device) -> bool:
    """Whether kernels on `device` dequantise with the PTX permute (compiled CUDA only)."""
    return FP8_CONVERT == "ptx" and compiled(device)


@triton.jit
def dequant_rows(w, scale_byte, PTX: tl.constexpr):
    """float8e4nv [R, C] times 2**(scale_byte - 127) per row (uint8 [R]) -> bf16 [R, C].

    Exact: e4m3 values have 4 significant bits, the scale is a power of two, and the product
    is a normal bf16 for any real block scale (bf16 has fp32's exponent range)."""
    if PTX:
        w16 = tl.inline_asm_elementwise(_E4M3_TO_BF16_PTX, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)
        scale = (scale_byte.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
        return w16 * scale[:, None]
    else:
        return (w.to(tl.float32) * e8m0_to_fp32(scale_byte)[:, None]).to(tl.bfloat16)


@triton.jit
def _bf16_from_pairs(pairs):
    """int32 [R, P] of bf16 pairs (the first value in the low half) -> bf16 [R, 2P] in order:
    the tail of every word dequantisation (two halves, interleaved back by join + reshape)."""
    even, odd = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    return tl.reshape(tl.join(even, odd), (pairs.shape[0], 2 * pairs.shape[1]))


# The permute's pairs times a factor pair ($3, the same bf16 in both halves) that is 2**120 x
# the block scale, 2**(byte - 7) (`_folded_scale_pair`): one multiply a pair instead of two.
# The pattern (the value times 2**-120) is exact, so its one rounded product by 2**(byte - 7)
# is the bf16 of value x scale, as the two multiplies gave. Two bf16x2 multiplies a word fewer
# in every FP8 weight kernel's K step (sm_90 compile of the batch-1 projection's loop: 330 ->
# 299 instructions). The weight kernels' dequantisation (`dequant_word_step`,
# `dequant_words`); bytes 1 .. `quant.FP8_MAX_SCALE_BYTE`, which the loader checks.
_E4M3_TO_BF16_SCALED_PTX = tl.constexpr("{\n" + _E4M3_PERMUTE_PTX + "mul.rn.bf16x2 $0, lo, $3;\nmul.rn.bf16x2 $1, hi, $3;\n}")


@triton.jit
def _folded_scale_pair(sb):
    """int32 bits of the bf16 pair 2**(sb - 7), both halves: 2**120 (the permute's factor)
    times the block scale 2**(sb - 127), for exponent bytes 1 .. quant.FP8_MAX_SCALE_BYTE."""
    f = sb + 120
    return (f << 7) | (f << 23)


@triton.jit
def dequant_words(words, scale_byte):
    """int32 [R, C] (4 e4m3 codes each, the first in the low byte) times 2**(scale_byte - 127)
    per row (int32 [R], bytes 1 .. `quant.FP8_MAX_SCALE_BYTE`) -> bf16 [R, 4C] in input order:
    `dequant_rows`' permute on whole words with the scale folded into its multiply
    (`_E4M3_TO_BF16_SCALED_PTX`; each word's two results split into bf16 halves and
    interleaved back into input order), so the same exact values."""
    lo, hi = tl.inline_asm_elementwise(_E4M3_TO_BF16_SCALED_PTX, "=r,=r,r,r", [words, _folded_scale_pair(scale_byte)[:, None]],
                                       dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    return _bf16_from_pairs(tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1])))


@triton.jit
def step_scale_bytes(scale_word, k0, BLOCK_K: tl.constexpr, CODES: tl.constexpr):
    """int32 [R, BLOCK_K / CODES]: the scale byte of each word (CODES codes) of the K step at k0
    (BLOCK_K 32, 64 or 128, inside the 128 inputs of the rows' scale words scale_word [R],
    byte i for inputs 32i .. 32i + 31; little-endian)."""
    c = tl.arange(0, BLOCK_K // CODES)
    if BLOCK_K == 128:
        shift = 8 * (c // (32 // CODES))
    else:
        shift = 8 * ((k0 // 32) % 4 + c // (32 // CODES))
    return (scale_word[:, None] >> shift[None, :]) & 0xFF


@triton.jit
def dequant_word_step(words, scale_word, k0, BLOCK_K: tl.constexpr):
    """int32 [R, BLOCK_K / 4] (the words of a whole K step at k0: BLOCK_K 64 or 128, inside
    one 128-input scale word) times each 32-input piece's scale from the rows' scale words
    (int32 [R], byte i for inputs 32i .. 32i + 31 of the 128) -> bf16 [R, BLOCK_K] in input
    order: `dequant_words` over several pieces at once (the same permute and folded multiply,
    so the same values), for one MMA chain per K step instead of one per
    piece (a quarter of the shared-memory barriers of the bf16 tile's round trip)."""
    sb = step_scale_bytes(scale_word, k0, BLOCK_K, 4)
    lo, hi = tl.inline_asm_elementwise(_E4M3_TO_BF16_SCALED_PTX, "=r,=r,r,r", [words, _folded_scale_pair(sb)], dtype=(tl.int32, tl.int32),
                                       is_pure=True, pack=1)
    return _bf16_from_pairs(tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1])))


# e2m1 -> bf16 by bit placement: with a code's sign at a bf16 sign bit and its exponent and
# mantissa bits at the exponent's two low bits and the mantissa's top bit, a bf16 pair holds
# the e2m1 values times 2**-126 (the subnormal code 0.5 lands on the bf16 subnormal 2**-127);
# one bf16x2 multiply by the scale times 2**126 (the second operand, its bits in both halves)
# makes them exact: no conversion unit, and the FP8 permute's instruction count per input.
def e2m1_pair_ptx(src: str, out: str, scale: str) -> str:
    """PTX: the bf16 pair of the e2m1 nibbles at bits 0..3 and 16..19 of register `src`
    (placed as above), times 2**126 (register k, below), then times the pair `scale`, into
    `out`. The cached keys' and compressed entries' nibbles (the indexer's and attention's FP4
    decoding, `attention._fp4_ptx`), whose scales may exceed what one multiply can fold in."""
    bits = (f"shl.b32 a, {src}, 12;\nshl.b32 b, {src}, 6;\nand.b32 a, a, 0x80008000;\n"
            f"and.b32 b, b, 0x01C001C0;\nor.b32 a, a, b;\n")
    return bits + f"mul.rn.bf16x2 a, a, k;\nmul.rn.bf16x2 {out}, a, {scale};\n"


# Compact FP4 expert words (`quant.fp4_kernel_layout`) hold pair i's two codes (inputs 2i and
# 2i + 1) in the two 16-bit halves with their signs and magnitudes placed so that shifting the
# word left by these amounts (negative: right) brings them to bits 15 / 31 and 6..8 / 22..24:
# one shift (or none) for both when the two amounts agree, one mask, one multiply.
_FP4_PAIR_SHIFTS = tuple((15 - s, 6 - m) for s, m in zip(quant.FP4_SIGN_BIT, quant.FP4_MAG_BIT))


def _fp4_pair_ptx(i: int) -> str:
    """PTX of output pair i of `_FP4_TO_BF16_PTX` (word $4, scale pair $5)."""
    def masked(reg: str, shift: int, mask: str) -> str:
        if shift == 0:
            return f"and.b32 {reg}, $4, {mask};\n"
        return f"{'shl.b32' if shift > 0 else 'shr.u32'} {reg}, $4, {abs(shift)};\nand.b32 {reg}, {reg}, {mask};\n"

    sign_shift, mag_shift = _FP4_PAIR_SHIFTS[i]
    if sign_shift == mag_shift:
        bits = masked("a", sign_shift, "0x81C081C0")
    else:
        bits = masked("a", sign_shift, "0x80008000") + masked("b", mag_shift, "0x01C001C0") + "or.b32 a, a, b;\n"
    return bits + f"mul.rn.bf16x2 ${i}, a, $5;\n"


_FP4_TO_BF16_PTX = tl.constexpr("{\n.reg .b32 a, b;\n" + "".join(_fp4_pair_ptx(i) for i in range(4)) + "}")


# The same pairs for scale bytes of any size (the indexer's keys: a byte above
# `quant.FP4_MAX_SCALE_BYTE` makes the one-multiply form's 2**(byte - 1) infinite): first one
# exact multiply by 2**126 (bf16 0x7E80) gives the e2m1 values, then one by 2**(byte - 127)
# ($5, both halves), exact for every byte 1 .. 254 (a product that underflows bf16's normals
# lands on its subnormals exactly: e2m1 values have two significant bits).
_E2M1_TO_BF16_TWO_STEP_PTX = tl.constexpr("{\n.reg .b32 r, a, b, k;\nmov.b32 k, 0x7E807E80;\n" + "".join(
    ("" if i == 0 else f"shr.u32 r, $4, {4 * i};\n") + e2m1_pair_ptx("$4" if i == 0 else "r", f"${i}", "$5") for i in range(4)) + "}")


@triton.jit
def _e2m1_pair_bits(words, i: tl.constexpr):
    """The bf16 bit pair (nibbles i and 4 + i; values x 2**-126) of each key word: the PTX
    above in Triton ops, for the interpreter."""
    r = words >> (4 * i)
    return ((r << 12) & -2147450880) | ((r << 6) & 0x01C001C0)  # -2147450880: the mask 0x80008000 as int32


@triton.jit
def _shifted(words, shift: tl.constexpr):
    """words shifted left by `shift` (right where negative; the bits it brings in are masked off)."""
    if shift >= 0:
        out = words << shift
    else:
        out = words >> -shift
    return out


@triton.jit
def _fp4_pair_bits(words, SIGN_SHIFT: tl.constexpr, MAG_SHIFT: tl.constexpr):
    """The bf16 bit pair (values x 2**-126) of an expert word's input pair whose shifts
    (`_FP4_PAIR_SHIFTS`) are given: `_FP4_TO_BF16_PTX` in Triton ops, for the interpreter."""
    return (_shifted(words, SIGN_SHIFT) & -2147450880) | (_shifted(words, MAG_SHIFT) & 0x01C001C0)  # -2147450880: 0x80008000 as int32


_FP4_S0, _FP4_S1, _FP4_S2, _FP4_S3 = (tl.constexpr(s) for s, _ in _FP4_PAIR_SHIFTS)
_FP4_M0, _FP4_M1, _FP4_M2, _FP4_M3 = (tl.constexpr(m) for _, m in _FP4_PAIR_SHIFTS)


@triton.jit
def dequant_fp4_words(words, scale_byte, PTX: tl.constexpr):
    """int32 [R, C] of 8 e2m1 codes each (`quant.fp4_kernel_layout`) times 2**(scale_byte -
    127) per row (int32 [R], at most `quant.FP4_MAX_SCALE_BYTE`: the multiplier 2**(scale_byte
    - 1) must be a finite bf16) -> bf16 [R, 8C] in input order, exact (`_FP4_TO_BF16_PTX`).
    Or a scale byte per word (int32 [R, C]: a whole K step, `step_scale_bytes`)."""
    if PTX:
        scale = (scale_byte + 126) << 7  # bf16 bits of 2**(scale_byte - 1), in both halves
        pair = (scale << 16) | scale
        if len(scale_byte.shape) == 1:
            pair = pair[:, None]
        o0, o1, o2, o3 = tl.inline_asm_elementwise(_FP4_TO_BF16_PTX, "=r,=r,=r,=r,r,r", [words, pair],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        out = _bf16_from_pairs(tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (words.shape[0], 4 * words.shape[1])))
    else:  # fp32 views of the bit pairs (numpy's fp32 keeps subnormals; its bf16 is not IEEE)
        o0, o1 = _fp4_pair_bits(words, _FP4_S0, _FP4_M0), _fp4_pair_bits(words, _FP4_S1, _FP4_M1)
        o2, o3 = _fp4_pair_bits(words, _FP4_S2, _FP4_M2), _fp4_pair_bits(words, _FP4_S3, _FP4_M3)
        pairs = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (words.shape[0], 4 * words.shape[1]))
        lo, hi = (pairs << 16).to(tl.float32, bitcast=True), ((pairs >> 16) << 16).to(tl.float32, bitcast=True)
        if len(scale_byte.shape) == 1:
            out = (tl.reshape(tl.join(lo, hi), (words.shape[0], 8 * words.shape[1])) * pow2(scale_byte - 1)[:, None]).to(tl.bfloat16)
        else:  # a scale per word, whose 8 inputs are consecutive
            out = tl.reshape(tl.join(lo, hi), (words.shape[0], words.shape[1], 8)) * pow2(scale_byte - 1)[:, :, None]
            out = tl.reshape(out, (words.shape[0], 8 * words.shape[1])).to(tl.bfloat16)
    return out


@triton.jit
def dequant_fp4_key_words(words, sb, PTX: tl.constexpr):
    """int32 [R, W] code words (nibble j of word w: channel 8w + j, the low nibble first as
    packed) with their scale bytes [R, W] -> bf16 [R, 8W] exact, position 8w + 2i + h holding
    channel 8w + i + 4h (the pairs `_E2M1_TO_BF16_TWO_STEP_PTX` builds, in their order)."""
    if PTX:
        pair = (sb << 7) | (sb << 23)  # the bf16 bits of 2**(byte - 127) in both halves
        o0, o1, o2, o3 = tl.inline_asm_elementwise(_E2M1_TO_BF16_TWO_STEP_PTX, "=r,=r,=r,=r,r,r", [words, pair],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        keys = _bf16_from_pairs(tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (words.shape[0], 4 * words.shape[1])))
    else:  # the same bit pairs as fp32 (numpy's fp32 keeps subnormals; its bf16 is not IEEE)
        o0, o1, o2, o3 = _e2m1_pair_bits(words, 0), _e2m1_pair_bits(words, 1), _e2m1_pair_bits(words, 2), _e2m1_pair_bits(words, 3)
        pairs = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (words.shape[0], words.shape[1], 4))
        lo, hi = (pairs << 16).to(tl.float32, bitcast=True), ((pairs >> 16) << 16).to(tl.float32, bitcast=True)
        keys = tl.reshape(tl.join(lo, hi), (words.shape[0], words.shape[1], 8)) * 2.0**126 * pow2(sb - 127)[:, :, None]
        keys = tl.reshape(keys, (words.shape[0], 8 * words.shape[1])).to(tl.bfloat16)
    return keys


@triton.jit
def fp4_slot_words(words):
    """int32 [R, 16 C] words of whole 128-input blocks in slot order (`quant.fp4_kernel_layout`:
    slot 4q + 2 u1 + u0 holds word 8 u1 + 2q + u0) -> the words in input order: a relabelling
    (lane q's four slots are its own words either way)."""
    return tl.reshape(tl.permute(tl.reshape(words, (words.shape[0], words.shape[1] // 16, 4, 2, 2)), (0, 1, 3, 2, 4)), (words.shape[0], words.shape[1]))


@triton.jit
def fp4_word_slot(w):
    """The slot (`quant.fp4_kernel_layout`) of FP4 word w of a row of whole 128-input blocks."""
    return (w // 16) * 16 + 4 * ((w % 8) // 2) + 2 * ((w % 16) // 8) + w % 2


@triton.jit
def halves(t):
    """[R, 2C] -> its two halves [R, C] along the last dim."""
    return tl.split(tl.permute(tl.reshape(t, (t.shape[0], 2, t.shape[1] // 2)), (0, 2, 1)))


# Fragment order (the MoE kernels' FP8 weights, the indexer's FP4 keys): Triton loads a tile
# of int32 words [rows, 16 words] with lanes on rows r % 8 (4 lanes per row, 4 words each)
# and warps on rows r // 8 % WARPS, where the wgmma register operand wants warp w on rows
# 16 w .. 16 w + 15 and lane q (of a row's 4) on dot positions 2q, 2q + 1 of every 8. Loading
# the rows in `fragment_rows` order and multiplying in `fragment_dot_order` makes the
# dequantised tile the operand by renaming registers (no shared-memory round trip).
@triton.jit
def fragment_rows(r, BLOCK_N: tl.constexpr, WARPS: tl.constexpr):
    """The row (of a program's BLOCK_N) that tile row r loads: tile row r = r3 + 8 w + 8 WARPS
    r1 + 16 WARPS hi holds row r3 + 8 r1 + 16 w + 16 WARPS hi (`fragment_dot_order` puts the
    rows back). Tiles of fewer than 16 rows a warp keep their order."""
    if BLOCK_N % (16 * WARPS) == 0:
        m = r % 8 + 8 * ((r // (8 * WARPS)) % 2) + 16 * ((r // 8) % WARPS) + 16 * WARPS * (r // (16 * WARPS))
    else:
        m = r
    return m


@triton.jit
def fragment_input(p, LANE_INPUTS: tl.constexpr):
    """The input (in load order) at dot position p of `fragment_dot_order`: the operand it is
    multiplied with must hold that input at p."""
    return (p // (4 * LANE_INPUTS)) * (4 * LANE_INPUTS) + LANE_INPUTS * ((p // 2) % 4) + 2 * ((p // 8) % (LANE_INPUTS // 2)) + p % 2


@triton.jit
def fragment_dot_order(w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr, WARPS: tl.constexpr,
                       LANE_INPUTS: tl.constexpr):
    """The dequantised tile w [tile rows, inputs as loaded] as the dot's operand [rows, dot
    positions]. FRAGMENT: inside every block of 4 LANE_INPUTS inputs (lane q of a row holds
    inputs q LANE_INPUTS + 2 j + h, j < LANE_INPUTS / 2, h < 2: 16 for 4 FP8 words, 32 for 4
    FP4 words) dot position h + 2 q + 8 j holds input q LANE_INPUTS + 2 j + h, and the tile
    rows come in `fragment_rows` order. Pure relabelling."""
    if FRAGMENT:
        if BLOCK_N % (16 * WARPS) == 0:  # rows hi, r1, w, r3 -> hi, w, r1, r3; inputs q, j, h -> j, q, h
            w = tl.permute(tl.reshape(w, (BLOCK_N // (16 * WARPS), 2, WARPS, 8, BLOCK_K // (4 * LANE_INPUTS), 4, LANE_INPUTS // 8, 2, 2, 2)),
                           (0, 2, 1, 3, 4, 6, 7, 8, 5, 9))
        else:
            w = tl.permute(tl.reshape(w, (BLOCK_N, BLOCK_K // (4 * LANE_INPUTS), 4, LANE_INPUTS // 8, 2, 2, 2)), (0, 1, 3, 4, 5, 2, 6))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    return w


_SCALE_PIECE = tl.constexpr(32)  # inputs per E8M0 scale of row-scaled weights (experts; V4.1's 32 x 32 tiles)


@triton.jit
def step_tile(w_rows, scales, scale_word, n_ok, k0, K, BLOCK_K: tl.constexpr, FP4: tl.constexpr, WORDS: tl.constexpr,
              PTX: tl.constexpr, HALVES: tl.constexpr, SLOTS: tl.constexpr):
    """bf16 [R, BLOCK_K]: the weights of the K step at k0 (inputs in input order) of the rows
    w_rows ([R, 1] pointers; `scales` [R] their first scale bytes, one per 32 inputs: the
    experts' row scales, or a dense weight's 32 x 32 tiles), dequantised exactly.
    FP4: int32 words of 8 codes (`quant.fp4_kernel_layout`; SLOTS: rows of whole 128s, read
    in whole 128-input steps and relabelled from slot order), the scale of each word from the
    rows' scale word (WORDS) or loaded. Else FP8: WORDS, int32 words of 4 codes with the
    scales from the rows' scale word (`moe.MOE["DEQUANT"]`, `W8A16["DEQUANT"]`; HALVES: a
    128-input step loaded as two 64-input halves, so that each half has the lane layout
    `fragment_dot_order` relies on); or bytes with a scale per 32 inputs. Steps past K read
    zero codes."""
    if FP4:  # (rows of whole 128s: whole slot blocks, put in input order by relabelling)
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_rows.to(tl.pointer_type(tl.int32), bitcast=True) + kw[None, :], mask=n_ok[:, None] & (kw < K // 8)[None, :], other=0)
        if SLOTS:
            words = fp4_slot_words(words)
        if WORDS:
            sb = step_scale_bytes(scale_word, k0, BLOCK_K, 8)
        else:
            sb = tl.load(scales[:, None] + tl.minimum(kw // 4, K // _SCALE_PIECE - 1)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        w = dequant_fp4_words(words, sb, PTX)
    elif WORDS:  # (K a multiple of 128: whole steps, no masks on the inputs)
        words_ptr = w_rows.to(tl.pointer_type(tl.int32), bitcast=True)
        if HALVES:
            kw = k0 // 4 + 16 * tl.arange(0, 2)[:, None, None] + tl.arange(0, 16)[None, None, :]
            lo, hi = tl.split(tl.permute(tl.load(words_ptr[None, :, :] + kw, mask=n_ok[None, :, None], other=0), (1, 2, 0)))
            w = tl.join(dequant_word_step(lo, scale_word, k0, 64), dequant_word_step(hi, scale_word, k0 + 64, 64))
            w = tl.reshape(tl.permute(w, (0, 2, 1)), (w.shape[0], BLOCK_K))
        else:
            w = dequant_word_step(tl.load(words_ptr + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :], mask=n_ok[:, None], other=0),
                                  scale_word, k0, BLOCK_K)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        kb = tl.minimum(k0 // _SCALE_PIECE + tl.arange(0, BLOCK_K // _SCALE_PIECE), K // _SCALE_PIECE - 1)  # (a piece past K: any scale)
        sb = tl.load(scales[:, None] + kb[None, :], mask=n_ok[:, None], other=0)
        pieces = dequant_rows(tl.reshape(codes, (codes.shape[0] * (BLOCK_K // _SCALE_PIECE), _SCALE_PIECE)), tl.reshape(sb, (codes.shape[0] * (BLOCK_K // _SCALE_PIECE),)), PTX)
        w = tl.reshape(pieces, (codes.shape[0], BLOCK_K))
    return w


@triton.jit
def step_dot(w, x, acc, PIECES: tl.constexpr):
    """acc + w @ x^T over one K step (64 or 128 dot positions): one dot (compiled: one wgmma
    chain of k16 steps), or with PIECES (the interpreter) one dot per 32 positions in order, so
    that numpy's sums, whose order follows the operands' shapes, do not depend on the tile."""
    if PIECES:
        w0, w1 = halves(w)
        x0, x1 = halves(x)
        if w.shape[1] == 128:
            w00, w01 = halves(w0)
            w10, w11 = halves(w1)
            x00, x01 = halves(x0)
            x10, x11 = halves(x1)
            acc = tl.dot(w11, tl.trans(x11), tl.dot(w10, tl.trans(x10), tl.dot(w01, tl.trans(x01), tl.dot(w00, tl.trans(x00), acc))))
        else:
            acc = tl.dot(w1, tl.trans(x1), tl.dot(w0, tl.trans(x0), acc))
    else:
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit
def fragment_order_tile(x):
    """x [T, C] (C a multiple of 64, inputs in input order) in fragment order, in registers:
    `fragment_order` of one tile (a relabelling of registers, then the shared-memory store
    that the dot's other operand takes anyway)."""
    return tl.reshape(tl.permute(tl.reshape(x, (x.shape[0], x.shape[1] // 64, 4, 2, 2, 2, 2)), (0, 1, 3, 4, 5, 2, 6)), (x.shape[0], x.shape[1]))


@triton.jit
def _fragment_order_kernel(x_ptr, out_ptr, t, blocks, stride_x, ROWS: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """Program (ROWS rows, BLOCKS blocks of 64 inputs): `fragment_order` on int32 words of two
    inputs (a pair n0 stays together), loaded and stored whole and contiguous, the words
    relabelled in registers."""
    begin(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    w = tl.arange(0, 32)
    ok = (r < t)[:, None, None] & (b < blocks)[None, :, None]
    src = x_ptr.to(tl.pointer_type(tl.int32)) + r.to(tl.int64)[:, None, None] * (stride_x // 2) + (b * 32)[None, :, None] + w[None, None, :]
    words = tl.load(src, mask=ok, other=0)
    # word n1 + 2 n2 + 4 n3 + 8 n45 of a block goes to n45 + 4 n1 + 8 n2 + 16 n3
    words = tl.reshape(tl.permute(tl.reshape(words, (ROWS, BLOCKS, 4, 2, 2, 2)), (0, 1, 3, 4, 5, 2)), (ROWS, BLOCKS, 32))
    dst = out_ptr.to(tl.pointer_type(tl.int32)) + r.to(tl.int64)[:, None, None] * (blocks * 32) + (b * 32)[None, :, None] + w[None, None, :]
    tl.store(dst, words, mask=ok)


FRAGMENT_ROWS, FRAGMENT_BLOCKS = 4, 16  # one program's tile: 4 rows x 16 blocks of 64 inputs (8 KB)


def fragment_order(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] (2-byte values, K a multiple of 64) with every block of 64 inputs in fragment
    order: position kappa = n0 + 2 n45 + 8 n1 + 16 n2 + 32 n3 holds input n0 + 2 n1 + 4 n2 +
    8 n3 + 16 n45 (`fragment_dot_order`). One copy: the MoE's gate_up kernel and the
    weight-only GEMM's wider row tiles then load x's K steps as they lie. A kernel of its own
    (`_fragment_order_kernel`): torch's copy of the 7-d permuted view took 23.6 us for a
    256 x 32768 bf16 x on the H100 (a third of the bandwidth)."""
    t, k = x.shape
    if x.element_size() != 2 or k % 64:
        raise ValueError(f"fragment_order: x must hold 2-byte values [T, K] with K a multiple of 64, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:  # int32 words of two inputs
        x = x.clone(memory_format=torch.contiguous_format)  # (a fresh, aligned allocation)
    out = torch.empty(t, k, dtype=x.dtype, device=x.device)
    if x.numel():
        _fragment_order_kernel[(triton.cdiv(t, FRAGMENT_ROWS), triton.cdiv(k // 64, FRAGMENT_BLOCKS))](
            x, out, t, k // 64, x.stride(0), ROWS=FRAGMENT_ROWS, BLOCKS=FRAGMENT_BLOCKS, num_warps=4, **pdl_launch(x.device))
    return out


# Knobs of the weight-only kernel (scripts/check_kernels.py's `gemm_sweep` section times
# alternatives on the device and prints the best per shape).
#
# Why the product is computed transposed (out^T = W x^T, weight rows as the MMA's M): Hopper
# has two tensor-core instruction families, and they need not round alike. Triton issues wgmma
# only for an M that is a multiple of 64 and mma.sync below it, the latter with bf16 operands
# in a layout (kWidth 4 in Triton 3.9) that puts the K values in other positions of the
# instruction — which changes the rounding wherever the instruction does not add its 16
# products in one exact step. The first device run saw the difference: 32-row tiles
# (mma.sync) and 64-row tiles (wgmma) gave different bits for the same chunking at every
# projection, and row 0 of wq_a alone differed from row 0 in a 4096-row batch (that of wo_b
# did not: rare per output, but not absent). With the weight rows as M (a multiple of 64 in
# every class) and the activation rows as N (16 .. 256), every row class issues the same wgmma
# m64nBLOCK_Tk16 chain, the dequantised weights as the register operand (K in natural order)
# and x^T from shared memory: per output element the same products in the same K order into
# the same fp32 accumulator, whatever M, BLOCK_T or BLOCK_N. (A 1-row call pays for 16 rows
# of tensor-core work, as the 16-row mma.sync tile did; the MMAs overlap the weight stream.)
# scripts/check_kernels.py checks that every default variant compiles to wgmma only
# (--compile-only) and, on the device, that rows keep their bits across row classes and tiles
# (sections `invariance` and `gemm_sweep`, "same bits").
#
# "rows": tiles by row class, the first whose `max_rows` (None: any) holds the call's rows:
#   BLOCK_T activation rows (the wgmma's N: 16 .. 256, a multiple of 16), BLOCK_N weight rows
#   (its M: a multiple of 16 x num_warps, so that each warp group owns whole 64-row slabs),
#   BLOCK_K inputs per pipelined step (32, 64 or 128, in pieces of min(block, 32) inputs that are
#   loaded, dequantised and multiplied one after the other), GROUP_T row tiles that
#   neighbouring programs share (L2 reuse when there are many row tiles), warps, pipeline
#   depth and an optional register cap `maxnreg` (`launch_options`; none set: the 128-row tile
#   compiles to 176-193 registers, one program an SM, and spills 264 bytes under a cap of 128,
#   which timed within 2% of it but for wq_b, 36% slower: gemm_sweep, twentieth session). None of these changes a row's bits (see above; the fixed pieces keep that true in
#   the interpreter too, whose dot is a numpy product per piece), so the row class may follow M.
# "CHUNKS" / "PROGRAMS_PER_SM" / "MIN_CHUNK_K": K is cut into chunks from the weight's shape and
#   the device only (never from M): CHUNKS[(N, K, block)] if set, else enough chunks that a
#   decode call (the first row class's BLOCK_N) has about PROGRAMS_PER_SM programs per SM,
#   each chunk at least MIN_CHUNK_K inputs. Chunk sums are added in order, so the chunk count
#   is part of the numerics of a shape (and so, for shapes without a CHUNKS entry, are these
#   three knobs and the first class's BLOCK_N: fixed per process, never per call).
# "SPLIT_TILES_PER_SM": calls with fewer output tiles than this x SMs run one program per
#   chunk (split-K) and the last program of a tile to finish adds the chunk partials in order;
#   larger calls run all chunks of a tile in one program. Same bits either way.
# "DEQUANT": how the weights are read; the same bits either way. "bytes": the FP8 tile goes
#   through shared memory as bytes and Triton reads it from there straight in the wgmma's
#   register-operand layout, two bytes per load plus byte permutes to repack them, before
#   `dequant_rows`' permute. "words": as int32 words of 4 codes in a plain blocked layout,
#   dequantised by `dequant_words` (the same permute and multiply on whole words), the bf16
#   tile reaching the register layout through shared memory (ldmatrix) — what took the MoE
#   gate_up K step from 943 to 626 SASS instructions (`moe.MOE["DEQUANT"]`). Here the sm_90
#   compile of the decode tile (T16 N64 K128, split; Triton 3.9) has 518 -> 406 instructions
#   per K step at block 32 and 482 -> 366 at block 128 with bf16 MMAs (static counts of the
#   loop body, not timings). "words" needs the compiled PTX path, K a multiple of BLOCK_K and
#   4-byte aligned weight rows (`w8a16_words`); other calls read bytes.
#   On the H200 (device call S3-1, CUDA graphs) "words" took wq_b at M=1 27.5 -> 22.8 us, wo_b
#   38.2 -> 33.6, shared.w13 25.8 -> 22.6; better or level at every projection and M <= 256 but
#   indexer.wq_b and wo_a at M = 64 (7% and 2% slower).
#   fp16 MMAs on the unscaled codes (`cvt.rn.f16x2.e4m3x2`, scale on the partial products)
#   had fewer instructions still but ran no faster at M <= 8 and 17-60% slower at M = 256, and
#   were dropped (the same held for the MoE kernels: docs/PERF.md, third session).
# Defaults: per class the tile with the best geometric mean fraction of the floor over the 10
# projections in the first device run (gemm_sweep, CUDA-graph timing, the kernel then still
# untransposed; the next sweep re-measures): 16 rows N128 K128 s3 (22%; s4 21%), 64 rows N128
# K64 s6 (14%, level with a 32-row mma.sync tile that read the weights twice), 128 rows N128
# K64 g8 w8 s3 (15%); 32 rows was not swept.
# Device run 2 (transposed kernel, geometric mean over the 10 projections): 16 rows N64 s4
# (20%), 32 rows N64 s4 (18%), 64 rows N128 K128 w8 s3 (14%), 128 rows unchanged (16%).
# Twentieth session (H100, gemm_sweep at M = 64, graph replays, us, 8 -> 4 warps, the same
# tile, same bits): the 64-row class at 4 warps (one warp group of 128 weight rows, 64
# accumulator registers a thread) was faster for 11 of the 12 projections: wq_a+wkv 17.7 ->
# 14.4, wq_b 30.9 -> 25.3, wo_b 35.6 -> 29.9, shared.w13 25.4 -> 20.3, shared.w2 18.1 -> 14.7,
# indexer.wq_b 14.5 -> 12.2, V4's wq_b 26.2 -> 22.4; V4's wo_b 24.4 -> 26.7. At M = 256 no
# single tile beat the 128-row default on all shapes (64 weight rows at 4 warps: wq_b 72.4 ->
# 68.9 but wo_b 71.0 -> 92.7); register caps moved it by under 2%.
W8A16 = {
    "rows": (
        (16, {"BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_T": 1, "num_warps": 4, "num_stages": 4}),
        (32, {"BLOCK_T": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_T": 1, "num_warps": 4, "num_stages": 4}),
        (64, {"BLOCK_T": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_T": 1, "num_warps": 4, "num_stages": 3}),
        (None, {"BLOCK_T": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_T": 8, "num_warps": 8, "num_stages": 3}),
    ),
    # FP8 inputs (A8): the same classes, whose per-piece product is a third fp32 tile next to
    # the chunk and total sums; from 33 rows 64 weight rows at 4 warps and at most 64 rows per
    # tile (the bf16 tiles spill there on sm_90, --compile-only); not swept yet
    "fp8_rows": (
        (16, {"BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_T": 1, "num_warps": 4, "num_stages": 4}),
        (32, {"BLOCK_T": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_T": 1, "num_warps": 4, "num_stages": 4}),
        (None, {"BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_T": 4, "num_warps": 4, "num_stages": 3}),
    ),
    # per-shape chunk counts (N, K, block): none now. wq_a alone had taken 10 (14% faster than 20
    # over M = 1, 8, 64, device run 1); the model now runs it stacked with wkv (1792 x 5120,
    # `Attention.wq_a_kv`), whose default 14 measured level with 10 (S15-4 A/B)
    "CHUNKS": {},
    # 4: twice the split-K chunks of 2 where the tile count allowed it (fp8_linear S3-4, M=1):
    # wo_b 37.7 -> 29.3 us, V4's wo_b 24.1 -> 22.3; shapes capped by MIN_CHUNK_K or CHUNKS keep
    # theirs (more chunks measured slower for wq_a, wkv, wo_a)
    "PROGRAMS_PER_SM": 4.0,
    "MIN_CHUNK_K": 256,
    "SPLIT_TILES_PER_SM": 1.0,
    "DEQUANT": "words",
    # with "words": each K step dequantised as one tile and one dot (`dequant_word_step`; why:
    # the STEP of `moe.MOE["rows"]`), not in pieces of 32; the same bits. check_kernels
    # fp8_linear S9-1 (graph replays, pieces -> steps): M=1 wq_a 10.4 -> 8.9 us, wq_b 23.0 ->
    # 20.4, wo_b 28.0 -> 23.5, shared.w2 12.8 -> 10.9; M=256 wq_b 93.4 -> 86.5, V4's wq_b 74.4
    # -> 65.8; of 40 cases at M <= 256 slower in 3 (wq_b at M=64 30.6 -> 33.3, 9%)
    "STEP": True,
    # fragment order (`_w8a16_kernel` FRAGMENT; docs/PERF.md fourteenth session): the model's
    # projections 0-14% faster at 1-8 rows (wo_b 24.4 -> 21.3 us at M=1), and steps d1_8k
    # -4%, v16 -2%; the 64-row class pays ~2.5 us a call for x's copy. Up to XREG_MAX_T rows a
    # tile (the first class) x is put in that order in registers (as fast as the copy at 1-16
    # rows, without its launch); wider tiles read the copy (`fragment_order`: relabelled in
    # registers, 64-row tiles lost 10-60% in scripts/weight_path_experiment.py, and 32 or 64
    # here made d64_32k 1-2% slower)
    "FRAGMENT": True,
    "XREG_MAX_T": 16,
    # split calls whose row tile is at most this many rows add their chunk partials in the
    # tile's last program (a ticket); wider tiles store them and `sum_chunks` adds them, spread
    # over many programs — the last program alone reading every chunk of a 128 x 128 tile was a
    # fixed ~25-34 us per call from 96 rows, whatever the weight (device call S6-2)
    "TICKET_MAX_T": 32,
}
# Chunks other than the last are a multiple of this (the widest BLOCK_K), so that no K step of
# any row class straddles two chunks.
CHUNK_ALIGN = 128
COUNTER_TILES = 4096  # split-K tile counters per device (calls with more tiles do not split)
# The tile's last program reads the chunk partials this many at a time (loads issued together,
# then added in chunk order): one L2 round trip per group instead of one per chunk — at 10 - 20
# chunks, about 0.2 us each, a large part of the 9 - 12 us the small decode GEMMs took (wq_a,
# wkv, wo_a: 6 - 14% of the floor, and fewer chunks measured faster); in slices of REDUCE_ROWS
# rows, so that the loads in flight stay at REDUCE_LOADS x 16 x BLOCK_N values whatever BLOCK_T.
REDUCE_LOADS = 4
REDUCE_ROWS = 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, CHUNK_K, GROUP_ROWS,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_om,
    QBLOCK: tl.constexpr, PIECE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr, WORDS: tl.constexpr,
    LOADS: tl.constexpr, ROWS: tl.constexpr, TICKET: tl.constexpr, A8: tl.constexpr, STEP: tl.constexpr,
    FRAGMENT: tl.constexpr, XREG: tl.constexpr, WARPS: tl.constexpr, PDL: tl.constexpr,
):
    """One output tile, transposed: acc [BLOCK_N, BLOCK_T] = dequant(w tile) @ x tile^T, K chunk
    by K chunk (the weight rows as the wgmma's M; see the knobs above).

    Each chunk is one chain of MMAs over exactly dequantised bf16 weights, from zero, in K
    order; chunk sums are added in order to a zero total. SPLIT: this program runs chunk
    program_id(1) only and stores its sum; the tile's last program to arrive (an integer
    ticket; no sum uses atomics) adds all partials in chunk order — the same additions, so the
    same bits, as one program running every chunk. GROUP_ROWS < N: a block-diagonal product
    (x holds N / GROUP_ROWS groups of K inputs, weight rows g*GROUP_ROWS .. read group g).

    WORDS (`W8A16["DEQUANT"]` "words"; needs EVEN_K, PTX and 4-byte aligned weight rows): the
    weights are read as int32 words of 4 codes and dequantised by `dequant_words` — the same
    values as the byte path.

    A8 (FP8 activations; PIECE 32, byte reads): x holds FP8 codes and xs their exponent bytes
    per 32 inputs (`fp8_act_quant`); each piece is one FP8 x FP8 MMA from zero straight from
    the weight codes, scaled by (weight scale x row scale) into the chunk's fp32 sum. The chunks
    and their order are the same, so the same batch invariance.

    STEP (WORDS; `W8A16["STEP"]`): each K step is dequantised as one tile and multiplied by one
    dot (`dequant_word_step`; QBLOCK 32 reads the scales as int32 words of four blocks) — the
    same wgmma chain as piece by piece, so the same bits.

    FRAGMENT (`W8A16["FRAGMENT"]`; 32 x 32 tiles, K in whole 128s): the MoE kernels' fragment
    order (`moe.MOE`): tile row r loads weight row `fragment_rows(r)`, each K step is
    dequantised whole (`step_tile`: words, or bytes) and enters the dot in `fragment_dot_order`,
    so that it reaches the wgmma's register operand without a shared-memory round trip; x
    comes in the same order, copied so by the caller (`fragment_order`) or, XREG, put so in
    registers (`fragment_order_tile`). A K order of its own (other bits than without it), the
    same for every row class, tile and weight read, so rows stay batch invariant."""
    begin(PDL)
    pid = tl.program_id(0)
    tiles_t = tl.cdiv(M, BLOCK_T)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_T * tiles_n
    first_t = (pid // width) * GROUP_T
    size_t = tl.minimum(tiles_t - first_t, GROUP_T)
    pid_t = first_t + (pid % width) % size_t
    pid_n = (pid % width) // size_t
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rp = tl.arange(0, PIECE)
    t_ok = rt < M
    n_ok = rn < N
    # int64 rows (and at the stores): M x N passes 2**31 from 64K rows of wq_b. Grouped
    # (GROUP_ROWS weight rows per group): the tile's group reads its own K inputs of x.
    x_rows = x_ptr + rt.to(tl.int64)[:, None] * stride_xm + (pid_n * BLOCK_N // GROUP_ROWS) * K
    xs_rows = xs_ptr + rt.to(tl.int64) * stride_xsm + (pid_n * BLOCK_N // GROUP_ROWS) * tl.cdiv(K, PIECE)  # (A8)
    if FRAGMENT:  # the weight row each tile row loads (the accumulator's rows come back in order)
        rw = pid_n * BLOCK_N + fragment_rows(tl.arange(0, BLOCK_N), BLOCK_N, WARPS)
    else:
        rw = rn
    w_ok = rw < N
    w_rows = w_ptr + rw[:, None] * stride_wn
    s_rows = s_ptr + (rw // QBLOCK) * stride_sn
    if SPLIT:
        k_lo = tl.program_id(1) * CHUNK_K
        k_hi = tl.minimum(k_lo + CHUNK_K, K)
    else:
        k_lo = 0
        k_hi = K
    if WORDS:  # int32 words of 4 codes (EVEN_K: no K edge, so only rows are masked)
        rq = tl.arange(0, PIECE // 4)
        w_words = w_rows.to(tl.pointer_type(tl.int32), bitcast=True)
        s_words = s_rows.to(tl.pointer_type(tl.int32), bitcast=True)  # (STEP with QBLOCK 32)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    chunk_end = k_lo + CHUNK_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if FRAGMENT:
            x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=t_ok[:, None], other=0.0)
            if XREG:
                x = fragment_order_tile(x)
            s_word = tl.load(s_words + k0 // 128, mask=w_ok, other=0) if WORDS else 0
            w = step_tile(w_rows, s_rows, s_word, w_ok, k0, K, BLOCK_K, False, WORDS, PTX, BLOCK_K == 128, False)
            acc = step_dot(fragment_dot_order(w, BLOCK_N, BLOCK_K, True, WARPS, 16), x, acc, not PTX)
        elif STEP:
            x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=t_ok[:, None], other=0.0)
            w = tl.load(w_words + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :], mask=n_ok[:, None], other=0)
            if QBLOCK == 32:
                w = dequant_word_step(w, tl.load(s_words + k0 // 128, mask=n_ok, other=0), k0, BLOCK_K)
            else:  # one scale for the step
                w = dequant_words(w, tl.load(s_rows + k0 // QBLOCK, mask=n_ok, other=0).to(tl.int32))
            acc = tl.dot(w, tl.trans(x), acc)
        for j in tl.static_range(0 if STEP or FRAGMENT else BLOCK_K // PIECE):
            k = k0 + j * PIECE + rp
            if EVEN_K:
                x = tl.load(x_rows + k[None, :], mask=t_ok[:, None], other=0.0)
            else:
                x = tl.load(x_rows + k[None, :], mask=t_ok[:, None] & (k < K)[None, :], other=0.0)
            if WORDS:
                w = tl.load(w_words + ((k0 + j * PIECE) // 4 + rq)[None, :], mask=n_ok[:, None], other=0)
            elif EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            if (j * PIECE) % QBLOCK == 0:  # a new scale column
                if EVEN_K:
                    s = tl.load(s_rows + (k0 + j * PIECE) // QBLOCK, mask=n_ok, other=0)
                else:  # a piece past K (zeros) takes the row's last scale: there is no column there
                    s = tl.load(s_rows + tl.minimum((k0 + j * PIECE) // QBLOCK, (K - 1) // QBLOCK), mask=n_ok, other=0)
            if A8:  # a piece past K (zeros) takes the row's last scale, as the weight's
                sx = tl.load(xs_rows + tl.minimum((k0 + j * PIECE) // PIECE, (K - 1) // PIECE), mask=t_ok, other=0)
                acc += tl.dot(w, tl.trans(x)) * (e8m0_to_fp32(s)[:, None] * e8m0_to_fp32(sx)[None, :])
            elif WORDS:
                acc = tl.dot(dequant_words(w, s.to(tl.int32)), tl.trans(x), acc)
            else:
                acc = tl.dot(dequant_rows(w, s, PTX), tl.trans(x), acc)
        if not SPLIT:
            if (k0 + BLOCK_K == chunk_end) | (k0 + BLOCK_K >= k_hi):
                total += acc
                acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
                chunk_end += CHUNK_K
    if SPLIT:
        chunks = tl.num_programs(1)
        plane = M * N  # partials [chunks, M, N]
        ok = n_ok[:, None] & t_ok[None, :]
        tl.store(part_ptr + tl.program_id(1) * plane + rt[None, :] * N + rn[:, None], acc, mask=ok)
    if SPLIT and TICKET:  # (without TICKET, `sum_chunks` adds the partials after the kernel)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == chunks - 1:
            # the sum reads the partials from memory (its own too) in [ROWS, BLOCK_N] slices
            # with N contiguous, whatever the MMA layout of acc
            for r0 in tl.static_range(0, BLOCK_T, ROWS):
                rr = pid_t * BLOCK_T + r0 + tl.arange(0, ROWS)
                ok_r = (rr < M)[:, None] & n_ok[None, :]
                offs = rr[:, None] * N + rn[None, :]
                sums = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                for c0 in range(0, chunks, LOADS):
                    parts = ()  # past the last chunk: the last one again, not added
                    for j in tl.static_range(LOADS):
                        c = tl.minimum(c0 + j, chunks - 1)
                        parts = parts + (tl.load(part_ptr + c * plane + offs, mask=ok_r, other=0.0, cache_modifier=".cg"),)
                    for j in tl.static_range(LOADS):
                        sums = tl.where(c0 + j < chunks, sums + parts[j], sums)
                tl.store(out_ptr + rr.to(tl.int64)[:, None] * stride_om + rn[None, :], sums.to(out_ptr.dtype.element_ty), mask=ok_r)
            tl.atomic_xchg(count_ptr + pid, 0)  # zero again for the next call on the stream
    if not SPLIT:
        out = out_ptr + rt.to(tl.int64)[None, :] * stride_om + rn[:, None]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


_SMS: dict[torch.device, int] = {}


def launch_options(tile: dict) -> dict:
    """The Triton launch options of a kernel's tile knobs (`W8A16["rows"]`, `moe.MOE["rows"]`
    gate_up / down): warps, pipeline depth and, where set, the register cap `maxnreg` (more
    programs an SM for kernels that registers hold at one; it never changes a result)."""
    return {"num_warps": tile["num_warps"], "num_stages": tile["num_stages"], **({"maxnreg": tile["maxnreg"]} if tile.get("maxnreg") else {})}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (4 stands in for the CPU interpreter); cached,
    as every launch asks."""
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def w8a16_config(m: int, fp8_inputs: bool = False) -> dict:
    """The tile knobs of the first row class that holds m rows (of the FP8-input table with
    `fp8_inputs`)."""
    for max_rows, cfg in W8A16["fp8_rows" if fp8_inputs else "rows"]:
        if max_rows is None or m <= max_rows:
            return cfg
    raise ValueError("W8A16['rows'] must end with a class for any row count (max_rows None)")


def grouped_fits(group_rows: int, m: int, fp8_inputs: bool = False) -> bool:
    """Whether an m-row grouped call with `group_rows` weight rows per group tiles evenly
    (each weight tile inside one group)."""
    return group_rows % w8a16_config(m, fp8_inputs)["BLOCK_N"] == 0


def wgmma_tile_error(rows: int, cols: int, warps: int) -> str | None:
    """Why a [rows (weights, the MMA's M), cols (tokens, its N)] accumulator tile at `warps`
    warps would not compile to whole-warp-group wgmma (see the W8A16 notes), or None."""
    if warps % 4 or rows % (16 * warps) or cols % 16 or not 16 <= cols <= 256:
        return f"a {rows} x {cols} tile at {warps} warps is no whole-warp-group wgmma: weight rows must be a multiple of 16 x warps (a multiple of 4), token rows a multiple of 16 in [16, 256]"
    return None


def w8a16_chunk_k(n: int, k: int, block: int, device: torch.device) -> int:
    """Inputs per K chunk of a weight, from N, K, block and the SM count only (never from M, so
    that a row's bits do not depend on the call's rows); K itself for a single chunk."""
    chunks = W8A16["CHUNKS"].get((n, k, block))
    if chunks is None:
        tiles = triton.cdiv(n, W8A16["rows"][0][1]["BLOCK_N"])
        chunks = min(int(W8A16["PROGRAMS_PER_SM"] * num_sms(device)) // tiles, k // W8A16["MIN_CHUNK_K"])
    chunk_k = triton.cdiv(triton.cdiv(k, max(chunks, 1)), CHUNK_ALIGN) * CHUNK_ALIGN
    return k if chunk_k >= k else chunk_k


def w8a16_words(ptx: bool, w: torch.Tensor, even_k: bool) -> bool:
    """Whether `fp8_linear_w8a16` reads its weight as int32 words (`W8A16["DEQUANT"]` "words"):
    the compiled PTX path (`dequant_words` is inline PTX), no K edge (even_k:
    K a multiple of BLOCK_K, so that whole words need only row masks) and 4-byte aligned rows
    (the loads are int32). Otherwise the bytes path, whose bits are the same."""
    return W8A16["DEQUANT"] == "words" and ptx and even_k and w.data_ptr() % 4 == 0 and w.stride(0) % 4 == 0


def _scale_words(w_scale: torch.Tensor) -> bool:
    """Whether 32 x 32 tile scales read as int32 words of four (aligned, rows in whole 128 inputs)."""
    return w_scale.data_ptr() % 4 == 0 and w_scale.stride(0) % 4 == 0 and w_scale.shape[1] % 4 == 0


def w8a16_step(w_scale: torch.Tensor, block: int, block_k: int) -> bool:
    """Whether a "words" call dequantises whole K steps (`W8A16["STEP"]`): 128-blocks, or
    32-blocks whose scale rows read as int32 words of four, and K steps inside one 128-input
    word."""
    return W8A16["STEP"] and 128 % block_k == 0 and (block == 128 or (block == 32 and _scale_words(w_scale)))


def w8a16_fragment(fp8_inputs: bool, block: int, k: int, block_k: int) -> bool:
    """Whether a call multiplies in fragment order (`W8A16["FRAGMENT"]`): bf16 inputs, 32 x 32
    tiles (the row scales `step_tile` reads), K in whole 128s — a weight's K order must not
    follow the call's rows or tile, so a K step other than 64 or 128 there is an error."""
    fragment = W8A16["FRAGMENT"] and not fp8_inputs and block == 32 and k % 128 == 0
    if fragment and block_k not in (64, 128):
        raise ValueError(f"fp8_linear_w8a16: fragment order (W8A16['FRAGMENT']) multiplies K steps of 64 or 128 inputs, got BLOCK_K {block_k}")
    return fragment


def _tile_counters(device: torch.device, split: bool) -> torch.Tensor:
    """The split-K tickets of a device: zeroed once, and zeroed again by the program that uses
    one, so calls on one stream (and CUDA-graph replays) find them at zero. A zero fill
    recorded during graph capture would only run at replay, hence the first call must come
    before capture; an unsplit call only needs a pointer of the right type."""
    counters = _COUNTERS.get(device)
    if counters is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and split:
            raise RuntimeError("fp8_linear_w8a16: call it once before CUDA-graph capture (its split-K counters are zeroed at first use)")
        if capturing:
            return torch.empty(0, dtype=torch.int32, device=device)
        counters = _COUNTERS[device] = torch.zeros(COUNTER_TILES, dtype=torch.int32, device=device)
    return counters


def fp8_linear_w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int, groups: int = 1,
                     x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only dequantisation in the kernel; bf16 x bf16 tensor-core products (any M).
    With `x_scale`, x is FP8 (float8_e4m3fn codes, `x_scale` their exponent bytes per 32 inputs,
    from `fp8_act_quant` of the bf16 input; FP8 activations): FP8 x FP8 products, no weight
    dequantisation (the kernel's A8), the same chunking and so the same batch invariance.

    Calls with few output tiles (decode) run one program per K chunk; larger ones one program
    per tile over all chunks. Both give the same bits (see `_w8a16_kernel`).

    `groups` > 1: a grouped (block-diagonal) projection in one launch — x [..., groups * K],
    w [groups * N_g, K]: output columns g*N_g .. of group g are x's inputs g*K .. times rows
    g*N_g .. of w (the attention's grouped wo_a), the same bits as each group on its own."""
    n, k = w.shape
    if groups < 1 or n % groups or x.shape[-1] != groups * k:
        raise ValueError(f"fp8_linear_w8a16: groups={groups} needs x [..., {groups} * {k}] and a weight of rows divisible by {groups}, got x {list(x.shape)}, weight {[n, k]}")
    a8 = x_scale is not None
    x2, lead, w_scale = _check(x.reshape(-1, groups, k)[:, 0] if groups > 1 else x, w, w_scale, block, a8)
    if groups > 1:
        x2, lead = x.reshape(-1, groups * k).contiguous(), tuple(x.shape[:-1])
    m = x2.shape[0]
    if a8:
        want = [*lead, groups * triton.cdiv(k, 32)]
        if groups > 1 and k % 32:
            raise ValueError(f"fp8_linear_w8a16: grouped FP8 inputs need each group's {k} inputs in whole 32-input scale blocks")
        if x_scale.dtype != torch.uint8 or list(x_scale.shape) != want:
            raise ValueError(f"fp8_linear_w8a16: x_scale must be uint8 exponent bytes {want} (one per 32 inputs), got {x_scale.dtype} {list(x_scale.shape)}")
        x_scale = x_scale.reshape(m, -1).contiguous()
    if m == 0:
        return x.new_empty(*lead, n)
    cfg = w8a16_config(m, a8)
    bn, bt, bk = cfg["BLOCK_N"], cfg["BLOCK_T"], cfg["BLOCK_K"]
    if groups > 1 and (n // groups) % bn:
        raise ValueError(f"fp8_linear_w8a16: a group's {n // groups} rows must be whole {bn}-row tiles")
    if bk < min(block, 32) or CHUNK_ALIGN % bk:
        raise ValueError(f"fp8_linear_w8a16: BLOCK_K {bk} must be a power of two in [{min(block, 32)}, {CHUNK_ALIGN}]")
    bad = wgmma_tile_error(bn, bt, cfg["num_warps"])
    if bad:
        raise ValueError(f"fp8_linear_w8a16: {bad}")
    if W8A16["DEQUANT"] not in ("bytes", "words"):
        raise ValueError(f"fp8_linear_w8a16: W8A16['DEQUANT'] is {W8A16['DEQUANT']!r}, expected 'bytes' or 'words'")
    chunk_k = w8a16_chunk_k(n, k, block, x.device)
    chunks = triton.cdiv(k, chunk_k)
    tiles = triton.cdiv(m, bt) * triton.cdiv(n, bn)
    split = chunks > 1 and tiles < W8A16["SPLIT_TILES_PER_SM"] * num_sms(x.device) and tiles <= COUNTER_TILES
    ticket = split and bt <= W8A16["TICKET_MAX_T"]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = torch.empty(chunks if split else 0, m, n, dtype=torch.float32, device=x.device)
    ptx = ptx_convert(x.device)
    words = not a8 and w8a16_words(ptx, w, k % bk == 0)
    fragment = w8a16_fragment(a8, block, k, bk)
    xreg = fragment and bt <= W8A16["XREG_MAX_T"]
    if fragment:
        words = words and _scale_words(w_scale)
        if not xreg:
            x2 = fragment_order(x2)
    _w8a16_kernel[(tiles, chunks if split else 1)](
        x2, x_scale if a8 else x2, w, w_scale, out, part, _tile_counters(x.device, ticket), m, n, k, chunk_k, n // groups,
        x2.stride(0), x_scale.stride(0) if a8 else 0, w.stride(0), w_scale.stride(0), out.stride(0),
        QBLOCK=block, PIECE=min(block, 32), BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, GROUP_T=cfg["GROUP_T"],
        SPLIT=split, EVEN_K=k % bk == 0, PTX=ptx, WORDS=words,
        LOADS=REDUCE_LOADS, ROWS=REDUCE_ROWS, TICKET=ticket, A8=a8, STEP=words and w8a16_step(w_scale, block, bk),
        FRAGMENT=fragment, XREG=xreg, WARPS=cfg["num_warps"], **pdl_launch(x.device), **launch_options(cfg),
    )
    if split and not ticket:
        sum_chunks(part, out)
    return out.view(*lead, n)


SUM_BLOCK_T = 4  # rows per program of `sum_chunks`


@triton.jit
def _sum_chunks_kernel(part_ptr, out_ptr, T, N, stride_part, stride_row, stride_out,
                       CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """out[rows, :N] = the chunk partials added in chunk order from zero (stored in out's dtype)."""
    begin(PDL)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rt < T)[:, None] & (rn < N)[None, :]
    src = part_ptr + rt.to(tl.int64)[:, None] * stride_row + rn[None, :]
    total = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):  # unrolled: every chunk's loads issue at once
        total += tl.load(src + c * stride_part, mask=ok, other=0.0)
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_out + rn[None, :], total.to(out_ptr.dtype.element_ty), mask=ok)


def sum_chunks(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, N] (fp32 or bf16) = part [C, T, N] fp32 (rows contiguous) summed over C in order,
    in fp32 from zero — the additions of the split GEMMs' in-kernel sums, so the same bits."""
    t, n = out.shape
    if t:
        block_n = min(triton.next_power_of_2(n), 256)
        _sum_chunks_kernel[(triton.cdiv(t, SUM_BLOCK_T), triton.cdiv(n, block_n))](
            part, out, t, n, part.stride(0), part.stride(1), out.stride(0),
            CHUNKS=part.shape[0], BLOCK_T=SUM_BLOCK_T, BLOCK_N=block_n, num_warps=4, **pdl_launch(part.device),
        )
    return out


# ------------------------------------------------------------------------------ dequantisation


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                    QROWS: tl.constexpr, QCOLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """out [BLOCK_R, BLOCK_C] tile = w * 2**(s - 127), one scale per QROWS x QCOLS weights: the
    tile is loaded whole (coalesced rows) and viewed as BLOCK_R * BLOCK_C / QCOLS rows of QCOLS
    for `dequant_rows`."""
    begin(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    pieces = tl.program_id(1) * (BLOCK_C // QCOLS) + tl.arange(0, BLOCK_C // QCOLS)
    r_ok = rows < N
    ok = r_ok[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :], mask=ok, other=0.0)
    # a piece past K stores nothing: any scale will do
    s = tl.load(s_ptr + (rows // QROWS)[:, None] * stride_sn + tl.minimum(pieces, (K - 1) // QCOLS)[None, :], mask=r_ok[:, None], other=127)
    out = dequant_rows(tl.reshape(w, (BLOCK_R * (BLOCK_C // QCOLS), QCOLS)), tl.reshape(s, (BLOCK_R * (BLOCK_C // QCOLS),)), PTX)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :], tl.reshape(out, (BLOCK_R, BLOCK_C)), mask=ok)


# `dequant_fp8`'s tile: BLOCK_R weight rows x BLOCK_C inputs a program (BLOCK_C at least one
# scale's width). Any tile gives the same bits (an elementwise product); check_kernels
# `dequant_sweep` times others at the prefill MoE's expert stacks: 512 inputs (was 256) took
# the 65-expert gate_up stack 1.882 -> 1.695 ms (2.47 -> 2.74 TB/s), down 0.872 -> 0.846
# (H100, twentieth session); more rows, 4 or 16 warps no better.
DEQUANT_TILE = {"BLOCK_R": 32, "BLOCK_C": 512, "num_warps": 8}


def dequant_tile(qcols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of `dequant_fp8`'s launch for scales `qcols` inputs wide."""
    return DEQUANT_TILE["BLOCK_R"], max(qcols, DEQUANT_TILE["BLOCK_C"]), DEQUANT_TILE["num_warps"]


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor, block: int, row_scales: bool) -> torch.Tensor:
    """FP8 weight -> bf16 in one pass (1 byte read, 2 written per weight): one E8M0 scale per
    `block` x `block` tile, or per 32 inputs of a row (`row_scales`); exactly
    `quant.dequant_fp8_block` / `quant.dequant_fp8_rows`, without their fp32 temporaries.
    The dense prefill paths (cuBLAS on bf16) dequantise their weights with it."""
    n, k = w.shape
    qrows, qcols = (1, 32) if row_scales else (block, block)
    scale = quant.e8m0_bytes(scale)
    if tuple(scale.shape) != (triton.cdiv(n, qrows), triton.cdiv(k, qcols)) or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequant_fp8: weight float8_e4m3fn {[n, k]} needs scales {[triton.cdiv(n, qrows), triton.cdiv(k, qcols)]}, got {w.dtype} {list(scale.shape)}")
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    block_r, block_c, warps = dequant_tile(qcols)
    _dequant_kernel[(triton.cdiv(n, block_r), triton.cdiv(k, block_c))](
        w, scale, out, n, k, w.stride(0), scale.stride(0), out.stride(0),
        QROWS=qrows, QCOLS=qcols, BLOCK_R=block_r, BLOCK_C=block_c, PTX=ptx_convert(w.device), num_warps=warps, **pdl_launch(w.device),
    )
    return out


@triton.jit
def _dequant_fp4_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        PTX: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr):
    """out [BLOCK_R, BLOCK_C] tile of a compact FP4 weight (kernel layout, K a multiple of 32):
    each 32 inputs are 4 int32 words and one scale byte, viewed as BLOCK_R * BLOCK_C / 32 rows
    for `dequant_fp4_words`. SLOTS: rows of whole 128s, their words in slot order."""
    begin(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pieces = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    words = tl.program_id(1) * (BLOCK_C // 8) + tl.arange(0, BLOCK_C // 8)
    r_ok = rows < N
    w_rows = (w_ptr + rows.to(tl.int64)[:, None] * stride_wn).to(tl.pointer_type(tl.int32), bitcast=True)
    w = tl.load(w_rows + (fp4_word_slot(words) if SLOTS else words)[None, :], mask=r_ok[:, None] & (words < K // 8)[None, :], other=0)
    s = tl.load(s_ptr + rows[:, None] * stride_sn + pieces[None, :], mask=r_ok[:, None] & (pieces < K // 32)[None, :], other=127)
    out = dequant_fp4_words(tl.reshape(w, (BLOCK_R * (BLOCK_C // 32), 4)), tl.reshape(s, (BLOCK_R * (BLOCK_C // 32),)).to(tl.int32), PTX)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :], tl.reshape(out, (BLOCK_R, BLOCK_C)),
             mask=r_ok[:, None] & (cols < K)[None, :])


def dequant_fp4(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Compact FP4 expert weight uint8 [N, K/2] (`quant.fp4_kernel_layout`) with an E8M0 byte
    per 32 inputs [N, K/32] -> bf16 [N, K] (into `out` when given), exactly
    `quant.dequant_fp4_kernel_layout`: the dense prefill MoE dequantises FP4 experts with it."""
    n, half = w.shape
    k = 2 * half
    scale = quant.e8m0_bytes(scale)
    if w.dtype != torch.uint8 or k % 32 or tuple(scale.shape) != (n, k // 32) or w.stride(1) != 1 or w.stride(0) % 4:
        raise ValueError(f"dequant_fp4: weight uint8 [N, K/2] (K a multiple of 32, rows 4-byte aligned) with scales [N, K/32], got {w.dtype} {list(w.shape)}, {list(scale.shape)}")
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    if out.shape != (n, k) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"dequant_fp4: out must be bf16 {[n, k]} with unit last stride, got {out.dtype} {list(out.shape)}")
    block_c = 256
    _dequant_fp4_kernel[(triton.cdiv(n, 32), triton.cdiv(k, block_c))](
        w, scale, out, n, k, w.stride(0), scale.stride(0), out.stride(0), BLOCK_R=32, BLOCK_C=block_c, PTX=ptx_convert(w.device),
        SLOTS=quant.fp4_slot_order(k), num_warps=8, **pdl_launch(w.device),
    )
    return out


# ------------------------------------------------------------------------------ w8a8 kernels


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
    QBLOCK: tl.constexpr, BLOCK_R: tl.constexpr, FAKE: tl.constexpr, PDL: tl.constexpr,
):
    """Rows x one QBLOCK column block: amax (>= 1e-4), exponent ceil(log2(amax / 448)) from the
    fp32 bits of amax * (1/448), codes = e4m3(x * 2**-exponent). A partial last block is
    quantised over the columns it has. FAKE: store code * 2**exponent in x's dtype (exact in
    bf16) and no scales."""
    begin(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * QBLOCK + tl.arange(0, QBLOCK)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    codes, exp = fp8_quantise(tl.reshape(x, (BLOCK_R, 1, QBLOCK)))
    codes, exp = tl.reshape(codes, (BLOCK_R, QBLOCK)), tl.reshape(exp, (BLOCK_R,))
    if FAKE:
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], (codes * pow2(exp)[:, None]).to(q_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], codes.to(tl.float8e4nv), mask=ok)
        tl.store(s_ptr + rows * stride_sm + tl.program_id(1), (exp + 127).to(tl.uint8), mask=rows < M)


def fp8_act_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] -> (float8_e4m3fn [M, K], exponent bytes uint8 [M, ceil(K/block)]); equal
    to `quant.quantize_fp8_ue8m0(x, block)` when K is a multiple of `block`."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, block), dtype=torch.uint8, device=x.device)
    rows = max(1, min(64, 4096 // block))
    _act_quant_kernel[(triton.cdiv(m, rows), triton.cdiv(k, block))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), QBLOCK=block, BLOCK_R=rows, FAKE=False, num_warps=4, **pdl_launch(x.device)
    )
    return q, s


def fp8_act_fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """x bf16 [..., K] -> its FP8 round trip in bf16 (`quant.fake_quant_act`), one launch: the
    input of an FP8 projection under `fp8_activations` whose GEMM then runs in bf16."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:  # (the kernel takes any row stride)
        x2 = x2.contiguous()
    m, k = x2.shape
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m:
        rows = max(1, min(64, 4096 // block))
        _act_quant_kernel[(triton.cdiv(m, rows), triton.cdiv(k, block))](
            x2, out, out, m, k, x2.stride(0), out.stride(0), 0, QBLOCK=block, BLOCK_R=rows, FAKE=True, num_warps=4, **pdl_launch(x2.device)
        )
    return out.view(x.shape)


def on_gpu() -> bool:
    """Whether kernels compile for a GPU (autotuning makes sense) or run in the interpreter."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


def w8a8_configs(gpu: bool) -> list:
    """Tile shapes for the FP8 GEMM, autotuned once per (N, K, row class) on the device (one
    small tile in the interpreter). All 8 warps with 32-wide K steps; none spills on sm_90
    when compiled with the launch's 16-byte alignment (scripts/check_kernels.py --compile-only)."""
    if not gpu:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 4}, num_warps=4, num_stages=2)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
    ]


@triton.autotune(configs=w8a8_configs(on_gpu()), key=["N", "K", "ROW_CLASS"])
@triton.jit
def _w8a8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, ROW_CLASS,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    QBLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """FP8 x FP8 tile GEMM with per-(row, K block) and per-(N block, K block) power-of-two
    scales applied to each K step's partial product. Tiles are visited in groups of GROUP_M
    row tiles so that neighbouring programs share weight tiles in L2."""
    begin(PDL)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am  # int64 rows: M x N passes 2**31 at 64K-token batches
    w_rows = w_ptr + rn[:, None] * stride_wn
    as_rows = as_ptr + rm * stride_asm
    ws_rows = ws_ptr + (rn // QBLOCK) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(tl.cdiv(K, BLOCK_K)):
        k = step * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        kb = (step * BLOCK_K) // QBLOCK
        sa = e8m0_to_fp32(tl.load(as_rows + kb, mask=m_ok, other=0))
        sw = e8m0_to_fp32(tl.load(ws_rows + kb, mask=n_ok, other=0))
        acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Activations quantised to FP8 (per row and `block` columns, power-of-two scales), FP8
    tensor-core products. `block` >= 32 (the FP8 MMA reduces over 32)."""
    x2, lead, w_scale = _check(x, w, w_scale, block)
    if block < 32:
        raise ValueError(f"fp8_linear_w8a8: block must be >= 32 for FP8 MMA, got {block}")
    m, k = x2.shape
    n = w.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    xq, xs = fp8_act_quant(x2, block)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _w8a8_kernel[grid](
        xq, xs, w, w_scale, out, m, n, k, min(m.bit_length(), 14),
        xq.stride(0), xs.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        QBLOCK=block, BLOCK_K=32, **pdl_launch(xq.device),
    )
    return out.view(*lead, n)


# ------------------------------------------------------------------------------ dispatch


def _check(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int, fp8_x: bool = False) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """Validate shapes/dtypes (x bf16, or FP8 codes with `fp8_x`); -> (x as a contiguous [M, K]
    view, leading shape of x, scale bytes as uint8)."""
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_linear: weight must be float8_e4m3fn, got {w.dtype}")
    if w_scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"fp8_linear: scale must be E8M0 exponent bytes (uint8), got {w_scale.dtype}")
    w_scale = quant.e8m0_bytes(w_scale)
    if block < 16 or block & (block - 1):
        raise ValueError(f"fp8_linear: block must be a power of two >= 16, got {block}")
    grid = (triton.cdiv(n, block), triton.cdiv(k, block))
    if tuple(w_scale.shape) != grid:
        raise ValueError(f"fp8_linear: scale shape {list(w_scale.shape)} != {list(grid)} for weight {[n, k]} and block {block}")
    want = torch.float8_e4m3fn if fp8_x else torch.bfloat16
    if x.shape[-1] != k or x.dtype != want:
        raise ValueError(f"fp8_linear: x must be {want} [..., {k}], got {x.dtype} {list(x.shape)}")
    if w.stride(1) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_linear: weight and scale must be row-major (last stride 1)")
    return x.reshape(-1, k).contiguous(), tuple(x.shape[:-1]), w_scale


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int) -> torch.Tensor:
    """x bf16 [..., K] @ dequant(w, w_scale)^T -> bf16 [..., N]; weight-only kernel below
    `W8A8_MIN_ROWS` rows, FP8 x FP8 kernel from there on (see the module docstring)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows >= W8A8_MIN_ROWS and block >= 32:
        return fp8_linear_w8a8(x, w, w_scale, block)
    return fp8_linear_w8a16(x, w, w_scale, block)

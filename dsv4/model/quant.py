"""Number formats of DeepSeek-V4 / V4.1: checkpoint weight decoding and the KV quantisers.

Two families live here, both exact:

* checkpoint formats (MODEL.md section 4): FP8 e4m3 weights with E8M0 block scales, routed
  experts as packed FP4 e2m1 with an E8M0 scale per 32 inputs, engram tables as FP8 rows with
  an E8M0 scale per 32 channels;
* the activation quantisers that are part of the V4.1 model (QAT): window KV FP8 e4m3 with a
  power-of-two (ue8m0) scale per 32 channels, compressed KV FP4 e2m1 with an E4M3 scale per
  16 channels, indexer keys/queries FP4 e2m1 with a ue8m0 scale per 32 channels.

The quantisers return real codes (what the cache stores) and a matching dequantiser; the
"fake quantisation" of the reference is `dequantize(quantize(x))`, bit for bit, because every
decoded value is exactly representable in fp32 and bf16.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACT_BLOCK = 32  # columns per scale of quantised GEMM inputs (V4.1's weight block: the reference quantises x the same way)
FP4_MAX = 6.0  # largest e2m1 magnitude

# e2m1 code -> value; bit 3 is the sign (code 8 is -0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_LUT: dict[torch.device, torch.Tensor] = {}

# Round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6}: a magnitude gets the code equal to the
# number of thresholds it reaches. At a tie the even code wins, so the threshold of a boundary
# whose upper neighbour has an odd code sits just above the boundary.
_E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_GOES_UP = (False, True, False, True, False, True, False)
_E2M1_THRESHOLDS: dict[torch.device, torch.Tensor] = {}


class FormatError(ValueError):
    """A stored tensor holds a value its format does not allow (e.g. an E8M0 NaN scale)."""


def fp4_lut(device: torch.device) -> torch.Tensor:
    lut = _FP4_LUT.get(device)
    if lut is None:
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)
        _FP4_LUT[device] = lut
    return lut


# --------------------------------------------------------------------------------------------
# E8M0 scales


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw exponent bytes of an E8M0 tensor (stored as float8_e8m0fnu or uint8)."""
    if scale.dtype == torch.uint8:
        return scale
    return scale.view(torch.uint8)


def e8m0_to_float(scale: torch.Tensor, name: str = "scale", validate: bool = True) -> torch.Tensor:
    """2**(byte - 127) as fp32. The byte 0xFF encodes NaN, which no valid checkpoint holds;
    `validate=False` skips that check (a host sync) for scales the loader already checked."""
    raw = e8m0_bytes(scale)
    if validate and bool((raw == 0xFF).any()):
        raise FormatError(f"{name}: E8M0 scale byte 0xFF (NaN) is not a valid scale")
    return torch.exp2(raw.to(torch.float32) - 127.0)


# --------------------------------------------------------------------------------------------
# checkpoint weights


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int, name: str = "weight", validate: bool = True) -> torch.Tensor:
    """FP8 e4m3 [rows, cols] times one E8M0 scale per `block` x `block` tile (edge tiles may be
    partial). `block` comes from the config's `weight_block_size`, never from the scale shape."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != grid:
        raise FormatError(f"{name}.scale: expected shape {list(grid)} for {list(weight.shape)} with block {block}, got {list(scale.shape)}")
    s = e8m0_to_float(scale, f"{name}.scale", validate)
    s = s.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.to(torch.float32) * s


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [rows, cols/2] (int8/uint8, low nibble = even column) -> codes [rows, cols]."""
    raw = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    low = raw & 0x0F
    high = raw >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_fp4`: codes [..., 2n] (uint8 < 16) -> bytes [..., n]."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequant_fp4_expert(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Routed-expert weight: packed e2m1 [out, in/2] times an E8M0 scale per 32 inputs [out, in/32]."""
    codes = unpack_fp4(packed)
    rows, cols = codes.shape
    if tuple(scale.shape) != (rows, cols // 32) or cols % 32:
        raise FormatError(f"{name}.scale: expected shape {[rows, cols // 32]} for an FP4 weight of {[rows, cols]} inputs, got {list(scale.shape)}")
    values = fp4_lut(codes.device)[codes.long()]
    return values * e8m0_to_float(scale, f"{name}.scale").repeat_interleave(32, dim=1)


def dequant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: int = 32, name: str = "weight", validate: bool = True) -> torch.Tensor:
    """FP8 e4m3 [rows, dim] times an E8M0 scale per `block` channels of a row: engram table rows,
    and routed experts converted exactly from FP4 (their scales are per 32 inputs)."""
    rows, dim = weight.shape
    if tuple(scale.shape) != (rows, dim // block) or dim % block:
        raise FormatError(f"{name}.scale: expected shape {[rows, dim // block]}, got {list(scale.shape)}")
    s = e8m0_to_float(scale, f"{name}.scale", validate).repeat_interleave(block, dim=-1)
    return weight.to(torch.float32) * s


# Compact FP4 experts on the GPU (`fp4_kernel_layout`): the checkpoint's e2m1 codes, eight to
# a 4-byte word (8 consecutive inputs), their bits placed for the kernels' conversion
# (`fp8_gemm.dequant_fp4_words`). Input 2i + h (pair i < 4, half h < 2) lives in the word's
# 16-bit half h: its sign at bit FP4_SIGN_BIT[i] and its three exponent-and-mantissa bits at
# FP4_MAG_BIT[i] .. + 2. A bf16 pair wants each code's sign at bit 15 and those three bits at
# 6 .. 8 of its half; with these places the four pairs need one shift each or none for both
# fields (pairs 0 and 3: `word & 0x81C081C0`, `(word << 6) & 0x81C081C0`) or two shifts (pair 1:
# << 1 and >> 5, pair 2: << 5 and << 3): 11 integer instructions a word against 19 when each
# code was a nibble (shifted by 4i, then its sign and its magnitude moved apart). The exhaustive
# search over the 16 places of a half found none needing fewer.
FP4_SIGN_BIT = (15, 14, 10, 9)
FP4_MAG_BIT = (6, 11, 3, 0)
# Rows of whole 128s of inputs also reorder the 16 words of every 128 inputs ("slots"): slot
# 4q + u (u < 4) holds word 8 (u // 2) + 2q + u % 2. A 16-byte load by lane q of a [rows, 16
# words] tile then brings it inputs 16q .. 16q + 15 of both 64-input halves — the lane layout
# of the FP8 words' fragment order (`fp8_gemm.fragment_dot_order`), so FP4 stacks multiply in
# the FP8 stacks' order without a shared-memory round trip, and keep their bits
# (`fp8_gemm.step_tile`, `fp8_gemm.fp4_slot_words`).
FP4_SLOT_INPUTS = 128
_FP4_SLOT_WORD = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)  # slot m holds word _FP4_SLOT_WORD[m]
_FP4_WORD_SLOT = tuple(_FP4_SLOT_WORD.index(w) for w in range(16))


def fp4_slot_order(cols: int) -> bool:
    """Whether FP4 rows of `cols` inputs hold their words in slot order (whole 128s)."""
    return cols % FP4_SLOT_INPUTS == 0


# The kernels multiply the bf16 pattern of a code (its value x 2**-126) by 2**(byte - 1), a
# bf16 below 2**128 for exponent bytes up to 128 (2**1; released experts sit near 2**-8).
FP4_MAX_SCALE_BYTE = 128


def _fp4_places() -> list[tuple[int, int, int]]:
    """(input within the word, bit of its sign, lowest bit of its magnitude) for the 8 codes of
    a kernel-layout word (above)."""
    return [(2 * i + h, 16 * h + FP4_SIGN_BIT[i], 16 * h + FP4_MAG_BIT[i]) for i in range(4) for h in range(2)]


def fp4_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint FP4 [rows, cols/2] (int8/uint8, low nibble = even input) -> uint8 [rows,
    cols/2] in the kernels' order (above: bit places within each word, and slots when cols is a
    multiple of FP4_SLOT_INPUTS); cols a multiple of 8."""
    codes = unpack_fp4(packed)
    rows, cols = codes.shape
    if cols % 8:
        raise FormatError(f"FP4 expert rows must hold a multiple of 8 inputs for the kernels' layout, got {cols}")
    codes = codes.view(rows, cols // 8, 8).to(torch.int32)
    words = torch.zeros(rows, cols // 8, dtype=torch.int32, device=codes.device)
    for k, sign_bit, mag_bit in _fp4_places():
        words |= ((codes[..., k] >> 3) << sign_bit) | ((codes[..., k] & 7) << mag_bit)  # (int32 wraps at bit 31)
    words = words.view(torch.uint8).view(rows, cols // 8, 4)  # the word's bytes, least significant first
    if fp4_slot_order(cols):
        words = words.view(rows, cols // FP4_SLOT_INPUTS, 16, 4)[:, :, list(_FP4_SLOT_WORD)]
    return words.reshape(rows, cols // 2)


def fp4_codes_from_kernel_layout(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of `fp4_kernel_layout`: uint8 [rows, cols/2] -> e2m1 codes [rows, cols]."""
    rows, half = stored.shape
    if fp4_slot_order(2 * half):
        stored = stored.view(rows, 2 * half // FP4_SLOT_INPUTS, 16, 4)[:, :, list(_FP4_WORD_SLOT)]
    words = stored.reshape(rows, half).contiguous().view(torch.int32)
    codes = torch.empty(rows, half // 4, 8, dtype=torch.uint8, device=stored.device)
    for k, sign_bit, mag_bit in _fp4_places():
        codes[..., k] = ((((words >> sign_bit) & 1) << 3) | ((words >> mag_bit) & 7)).to(torch.uint8)
    return codes.view(rows, 2 * half)


def dequant_fp4_kernel_layout(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A compact FP4 expert weight (kernel layout) times its E8M0 scale per 32 inputs -> fp32."""
    codes = fp4_codes_from_kernel_layout(stored)
    return fp4_lut(codes.device)[codes.long()] * e8m0_to_float(scale, validate=False).repeat_interleave(32, dim=1)


# The FP8 weight kernels (`fp8_gemm.dequant_word_step` / `dequant_words`) turn a code into its
# bf16 value with one multiply by 2**(byte - 7): the code's bit pattern reads as its value
# times 2**-120, and 2**120 x the scale is folded into one factor, which is a finite bf16 up to
# byte 134 (2**127; scale 2**7). Byte 0 (2**-127) is excluded too, so that every path of every
# kernel reads the same values (the byte paths read it as 0). Real scales sit near 2**-8
# (bytes ~105 .. 127: the reference quantiser's amax floor of 1e-4 gives at least 2**-22).
FP8_MIN_SCALE_BYTE = 1
FP8_MAX_SCALE_BYTE = 134


def check_fp8_scales(scale: torch.Tensor, name: str) -> None:
    """FP8 weights kept compact for the kernels: exponent bytes in [FP8_MIN_SCALE_BYTE,
    FP8_MAX_SCALE_BYTE] (above)."""
    raw = e8m0_bytes(scale)
    if bool(((raw < FP8_MIN_SCALE_BYTE) | (raw > FP8_MAX_SCALE_BYTE)).any()):
        raise FormatError(f"{name}: an FP8 weight scale outside 2**{FP8_MIN_SCALE_BYTE - 127} .. 2**{FP8_MAX_SCALE_BYTE - 127} "
                          "is outside what the FP8 kernels take")


def check_fp4_scales(scale: torch.Tensor, name: str) -> None:
    """Compact FP4 experts: exponent bytes up to FP4_MAX_SCALE_BYTE (above)."""
    if bool((e8m0_bytes(scale) > FP4_MAX_SCALE_BYTE).any()):
        raise FormatError(f"{name}: an FP4 expert scale above 2**{FP4_MAX_SCALE_BYTE - 127} is outside what the compact FP4 kernels take")


def fp4_expert_to_fp8(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 expert -> FP8 e4m3 codes with the same E8M0 scales (per 32 inputs).

    Every e2m1 value is exactly an e4m3 value, so this is lossless: on Hopper the experts run
    on FP8 tensor cores."""
    codes = unpack_fp4(packed)
    values = fp4_lut(codes.device)[codes.long()]
    return values.to(torch.float8_e4m3fn), e8m0_bytes(scale)


# --------------------------------------------------------------------------------------------
# activation quantisers (the cache formats)


def pow2_ceil_exponent(t: torch.Tensor) -> torch.Tensor:
    """ceil(log2(t)) for positive normal fp32 `t`, from the IEEE bits (exponent field, plus one
    when any mantissa bit is set) — the ue8m0 rounding of the reference kernels."""
    bits = t.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return exponent - 127 + (mantissa != 0).to(torch.int32)


def _e2m1_thresholds(device: torch.device) -> torch.Tensor:
    """The magnitudes from which each next e2m1 code is reached (kept per device: a CUDA
    graph may not upload constants while it captures)."""
    t = _E2M1_THRESHOLDS.get(device)
    if t is None:
        boundaries = torch.tensor(_E2M1_BOUNDARIES, dtype=torch.float32)
        t = torch.where(torch.tensor(_E2M1_TIE_GOES_UP), boundaries, torch.nextafter(boundaries, torch.full_like(boundaries, float("inf"))))
        t = _E2M1_THRESHOLDS[device] = t.to(device)
    return t


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even of fp32 values already clamped to [-6, 6] onto e2m1 codes."""
    codes = (q.abs().unsqueeze(-1) >= _e2m1_thresholds(q.device)).sum(-1).to(torch.uint8)
    return codes | (torch.signbit(q).to(torch.uint8) << 3)


def quantize_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Window-KV quantiser: x [..., n] -> (float8_e4m3fn codes [..., n], exponent bytes [..., n/block]).

    Per block: amax clamped to >= 1e-4, scale = 2**ceil(log2(amax * (1/448))) (the reference
    multiplies by the reciprocal; the rounding of that product decides the exponent)."""
    n = x.shape[-1]
    blocks = x.float().unflatten(-1, (n // block, block))
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    exp = pow2_ceil_exponent(amax * (1.0 / FP8_MAX))
    scale = torch.exp2(exp.to(torch.float32)).unsqueeze(-1)
    codes = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2), (exp + 127).to(torch.uint8)


def dequantize_fp8_ue8m0(codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    scale = torch.exp2(exps.to(torch.float32) - 127.0).unsqueeze(-1)
    values = codes.float().unflatten(-1, (-1, block)) * scale
    return values.flatten(-2).to(dtype)


def quantize_fp4(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 quantiser: x [..., n] -> (packed e2m1 bytes [..., n/2], scales [..., n/block]).

    `e4m3_scale=True` (compressed KV, block 16): scale = e4m3(max(amax, 6*2**-9) / 6), returned
    as float8_e4m3fn. Otherwise (indexer, block 32): scale = 2**ceil(log2(max(amax, 6*2**-126) *
    (1/6))), returned as exponent bytes (ue8m0)."""
    n = x.shape[-1]
    blocks = x.float().unflatten(-1, (n // block, block))
    amax = blocks.abs().amax(-1)
    if e4m3_scale:
        # saturate explicitly: torch's cast to e4m3 saturates from 2.12 on, gives NaN before
        stored = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
        scale = stored.float()
    else:
        exp = pow2_ceil_exponent(amax.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
        stored = (exp + 127).to(torch.uint8)
        scale = torch.exp2(exp.to(torch.float32))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return pack_fp4(e2m1_codes(q).flatten(-2)), stored


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    codes = unpack_fp4(packed)
    if scales.dtype == torch.float8_e4m3fn:
        scale = scales.float()
    else:
        scale = torch.exp2(scales.to(torch.float32) - 127.0)
    values = fp4_lut(codes.device)[codes.long()].unflatten(-1, (-1, block)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """dequantize(quantize(x)) for the window KV; identity when the width is not a multiple of
    the block (the reference leaves such tensors unquantised)."""
    if x.shape[-1] % block:
        return x
    return dequantize_fp8_ue8m0(*quantize_fp8_ue8m0(x, block), x.dtype, block)


def fake_quant_act(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """dequantize(quantize(x)) of a GEMM input under FP8 activations (`ModelConfig.fp8_activations`,
    DeepSeek's reference numerics): the window-KV quantiser's rule per `block` columns of a row;
    a partial last block is quantised over the columns it has (zero padding leaves its amax)."""
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    y = dequantize_fp8_ue8m0(*quantize_fp8_ue8m0(x, block), x.dtype, block)
    return y[..., :n] if pad else y


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    if x.shape[-1] % block:
        return x
    return dequantize_fp4(*quantize_fp4(x, block, e4m3_scale), x.dtype, block)

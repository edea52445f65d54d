"""Exact number-format tests on hand-computed values."""

import pytest
import torch

from dsv4.model import quant


def test_e8m0_values_and_nan_rejected():
    raw = torch.tensor([127, 128, 126, 0, 254], dtype=torch.uint8)
    assert quant.e8m0_to_float(raw).tolist() == [1.0, 2.0, 0.5, 2.0**-127, 2.0**127]
    with pytest.raises(quant.FormatError, match="0xFF"):
        quant.e8m0_to_float(torch.tensor([127, 255], dtype=torch.uint8), "w.scale")


def test_fp8_scale_bytes_outside_the_kernels_range_are_named():
    """The FP8 weight kernels fold 2**120 into the scale (`fp8_gemm._folded_scale_pair`): bytes
    1 .. FP8_MAX_SCALE_BYTE pass, byte 0 and anything above are refused with the tensor named."""
    edges = [quant.FP8_MIN_SCALE_BYTE, 120, quant.FP8_MAX_SCALE_BYTE]
    quant.check_fp8_scales(torch.tensor([edges], dtype=torch.uint8), "w.scale")
    quant.check_fp8_scales(torch.tensor([edges], dtype=torch.uint8).view(torch.float8_e8m0fnu), "w.scale")
    for bad in (0, quant.FP8_MAX_SCALE_BYTE + 1, 254):
        with pytest.raises(quant.FormatError, match=r"^layers\.0\.attn\.wkv\.scale: an FP8 weight scale outside"):
            quant.check_fp8_scales(torch.tensor([[120, bad]], dtype=torch.uint8), "layers.0.attn.wkv.scale")


def test_fp4_unpack_low_nibble_is_even_column():
    # byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) column 1
    # byte 0xF8: low nibble 8 (-0), high nibble 15 (-6)
    packed = torch.tensor([[0x21, 0xF8 - 256]], dtype=torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # x2
    w = quant.dequant_fp4_expert(torch.cat([packed] * 8, 1), scale)
    assert w[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert torch.signbit(w[0, 2])  # negative zero decodes to -0 (value 0)


def test_fp8_block_dequant_partial_edge_blocks():
    w = torch.ones(48, 40).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 128], [129, 126]], dtype=torch.uint8)  # grid 2x2 for block 32
    d = quant.dequant_fp8_block(w, scale, 32)
    assert d[0, 0] == 1 and d[0, 39] == 2 and d[47, 0] == 4 and d[47, 39] == 0.5
    with pytest.raises(quant.FormatError, match="expected shape"):
        quant.dequant_fp8_block(w, scale[:1], 32, "layers.0.attn.wkv")


def test_e2m1_round_to_nearest_even_ties():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 5.01, 0.2500001, 6.0])
    values = quant.fp4_lut(x.device)[quant.e2m1_codes(x).long()]
    assert values.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0, 0.5, 6.0]


def test_fp8_window_quantiser_scale_and_roundtrip():
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0 * 3  # amax/448 = 3 -> scale 4
    x[0, 1] = 1.0
    codes, exps = quant.quantize_fp8_ue8m0(x)
    assert exps.tolist() == [[129]]
    back = quant.dequantize_fp8_ue8m0(codes, exps, torch.float32)
    # 1344 / 4 = 336 lies halfway between the e4m3 values 320 and 352: ties go to even (320)
    assert back[0, 0] == 1280.0 and back[0, 1] == 1.0
    # tiny blocks use the 1e-4 floor
    _, exps = quant.quantize_fp8_ue8m0(torch.zeros(1, 32))
    assert exps.item() == 127 - 22  # ceil(log2(1e-4 / 448)) = ceil(-22.09)


def test_fp4_quantisers_match_reference_formulas():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * 3
    for block, e4m3 in ((16, True), (32, False)):
        packed, scales = quant.quantize_fp4(x, block, e4m3)
        back = quant.dequantize_fp4(packed, scales, torch.float32, block)
        blocks = x.unflatten(-1, (-1, block))
        amax = blocks.abs().amax(-1)
        if e4m3:
            s = (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
        else:
            s = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(6 * 2**-126) * (1 / 6))))
        # every decoded value is s times a grid value, and the error is at most half a grid step
        ratio = back.unflatten(-1, (-1, block)) / s.unsqueeze(-1)
        grid = torch.tensor(quant.FP4_VALUES[:8])
        assert torch.isin(ratio.abs(), grid).all()
        assert ((back - x).abs().unflatten(-1, (-1, block)) <= s.unsqueeze(-1) * 1.0 + 1e-6).all()

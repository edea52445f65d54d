"""Triton kernels against their torch references on random non-zero inputs, at small shapes.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before the
kernels are imported); with CUDA they are compiled for the GPU. The real shapes and timings are
checked on the H200 by scripts/check_kernels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from dsv4.cache.storage import QTensor
from dsv4.model import quant
from dsv4.model.layers.attention import _stored
from dsv4.ops import attention as attention_ops
from dsv4.ops import kv as kvops
from dsv4.ops import moe as moe_ref
from dsv4.ops import rope as rope_ops
from dsv4.ops.linear import Linear, grouped_linear, grouped_takes_codes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/ops/conftest.py set TRITON_INTERPRET=1

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton) — kernel tests skipped")
tl = pytest.importorskip("triton.language")

from dsv4.ops.triton import attention as tattn
from dsv4.ops.triton import fp8_gemm, moe

BF16_REL = 2.0**-8  # half a bf16 ulp, relative
REPO = Path(__file__).resolve().parents[2]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error relative to the reference's magnitude (elementwise, floored at 1e-3 of its max)."""
    y, ref = y.double().cpu(), ref.double().cpu()
    return ((y - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())).max().item()


def _fp8_weight(n: int, k: int, block: int, g: torch.Generator):
    w = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.randint(118, 131, (-(-n // block), -(-k // block)), generator=g, dtype=torch.uint8)
    return w, s


# ----------------------------------------------------------------------------------- guards

GUARD = 4096  # elements of poison on each side of a guarded tensor


def _poison(dtype: torch.dtype):
    """A value no kernel writes and that shows when read: NaN for floats (255 for scale bytes,
    an infinite scale), the largest value for index types (past every pair and expert)."""
    if dtype.is_floating_point:
        return float("nan")
    return 255 if dtype == torch.uint8 else torch.iinfo(dtype).max


def _guarded(t: torch.Tensor, fill) -> torch.Tensor:
    """A contiguous copy of t on DEVICE in the middle of a buffer GUARD elements larger on each
    side, filled with `fill`: whatever a kernel reads past t is `fill`."""
    buf = torch.full((t.numel() + 2 * GUARD,), fill, dtype=t.dtype, device=DEVICE)
    inner = buf[GUARD : GUARD + t.numel()].view(t.shape)
    inner.copy_(t)
    return inner


class _PoisonedTorch:
    """torch for a kernel module (monkeypatched in as its `torch`), except that `empty` hands out
    tensors filled with `_poison` in the middle of poison guards, kept for `check_guards`."""

    def __init__(self):
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (inner view, whole buffer)

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size, dtype=None, device=None):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        dtype = dtype or torch.get_default_dtype()
        numel = 1
        for d in shape:
            numel *= d
        buf = torch.full((numel + 2 * GUARD,), _poison(dtype), dtype=dtype, device=device)
        inner = buf[GUARD : GUARD + numel].view(shape)
        self.buffers.append((inner, buf))
        return inner

    def check_guards(self) -> None:
        """Every guard still holds its poison (no kernel wrote past a buffer)."""
        for inner, buf in self.buffers:
            fill = torch.full((GUARD,), _poison(buf.dtype), dtype=buf.dtype, device=buf.device)
            for guard in (buf[:GUARD], buf[GUARD + inner.numel() :]):
                assert guard.view(torch.uint8).equal(fill.view(torch.uint8)), f"write past a {buf.dtype} buffer of shape {list(inner.shape)}"


# ----------------------------------------------------------------------------------- fp8 GEMM


@pytest.mark.parametrize("row_scales,n,k,block", [(False, 70, 100, 32), (False, 40, 300, 128), (True, 50, 96, 32)])
def test_dequant_fp8_is_exact(row_scales, n, k, block):
    g = _gen(n + k)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(110, 140, (n, k // 32) if row_scales else (-(-n // block), -(-k // block)), generator=g, dtype=torch.uint8)
    ref = quant.dequant_fp8_rows(w, s) if row_scales else quant.dequant_fp8_block(w, s, block)
    out = fp8_gemm.dequant_fp8(w.to(DEVICE), s.to(DEVICE), block, row_scales)
    assert out.dtype == torch.bfloat16 and torch.equal(out.cpu().float(), ref)


@pytest.mark.parametrize("m", [1, 40])
def test_fp8_linear_w8a16_grouped_is_each_group_on_its_inputs(m):
    """groups=3: one launch of a block-diagonal projection (the attention's grouped wo_a)."""
    g = _gen(m + 77)
    groups, n_g, k, block = 3, 128, 96, 32
    x = torch.randn(m, groups * k, generator=g).bfloat16()
    w, s = _fp8_weight(groups * n_g, k, block, g)
    dense = quant.dequant_fp8_block(w, s, block).double()
    ref = torch.cat([x[:, i * k : (i + 1) * k].double() @ dense[i * n_g : (i + 1) * n_g].T for i in range(groups)], dim=1)
    y = fp8_gemm.fp8_linear_w8a16(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), block, groups=groups)
    assert y.shape == (m, groups * n_g)
    assert _rel_err(y, ref) <= BF16_REL * 1.01
    with pytest.raises(ValueError, match="groups=2"):
        fp8_gemm.fp8_linear_w8a16(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), block, groups=2)


@pytest.mark.parametrize(
    "m,n,k,block",
    [
        (1, 70, 100, 32),  # decode row, partial N and K tiles
        (20, 64, 96, 32),  # row tile 32, partial M, K step past K
        (5, 50, 300, 128),  # V4 block: one scale per 128-wide step
        (3, 64, 256, 32),  # fragment order, x put in it in registers (row tile 16)
        (40, 64, 640, 32),  # row tile 64, split-K over two chunks (fragment order, x copied into it)
        (70, 130, 64, 16),  # row tile 128, block 16 (pieces of 16 inputs)
        (130, 40, 384, 128),  # two row tiles of 128, block wider than the K step
        (6, 64, 640, 256),  # split-K, a chunk end inside a scale block
    ],
)
def test_fp8_linear_w8a16_matches_dequant_reference(m, n, k, block):
    g = _gen(m * 1000 + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, s = _fp8_weight(n, k, block, g)
    ref = x.double() @ quant.dequant_fp8_block(w, s, block).double().T
    y = fp8_gemm.fp8_linear_w8a16(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), block)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert _rel_err(y, ref) <= BF16_REL * 1.01
    # the model's reference (bf16 weights, bf16 matmul) agrees within bf16 rounding
    lin = Linear(w, s, block)(x)
    assert _rel_err(y, lin) <= 2 * BF16_REL


@pytest.mark.parametrize(
    "m,n,k,block",
    [(1, 70, 100, 32), (20, 64, 96, 32), (5, 50, 300, 128), (40, 64, 640, 32), (130, 40, 384, 128), (6, 64, 640, 256)],
)
def test_fp8_linear_w8a16_fp8_inputs_match_quantised_reference(m, n, k, block):
    """x_scale (FP8 activations): FP8 codes of x times the FP8 weight, per 32 inputs scaled
    into fp32, against x's FP8 round trip times the dequantised weight (the same products; a
    partial last block of K = 100 / 300 quantised over its columns)."""
    g = _gen(m * 1000 + n + 3)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, s = _fp8_weight(n, k, block, g)
    xq = quant.fake_quant_act(x, 32)
    ref = xq.double() @ quant.dequant_fp8_block(w, s, block).double().T
    codes, exps = fp8_gemm.fp8_act_quant(x.to(DEVICE), 32)
    y = fp8_gemm.fp8_linear_w8a16(codes, w.to(DEVICE), s.to(DEVICE), block, x_scale=exps)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert _rel_err(y, ref) <= BF16_REL * 1.01
    plain = x.double() @ quant.dequant_fp8_block(w, s, block).double().T
    assert _rel_err(ref, plain) > 4 * BF16_REL  # the quantisation shows at this tolerance
    with pytest.raises(ValueError, match="x_scale"):
        fp8_gemm.fp8_linear_w8a16(codes, w.to(DEVICE), s.to(DEVICE), block, x_scale=exps[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm.fp8_linear_w8a16(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), block, x_scale=exps)


def test_fp8_inputs_rows_do_not_depend_on_batch_and_groups_split(monkeypatch):
    """FP8 inputs keep the weight-only kernel's batch invariance (a row alone, split-K, and in
    unsplit batches of every row class: the same bits), and a grouped call (wo_a) is each group
    on its own inputs."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: 4)
    g = _gen(19)
    x = torch.randn(200, 640, generator=g).bfloat16().to(DEVICE)
    w, s = (a.to(DEVICE) for a in _fp8_weight(64, 640, 32, g))
    codes, exps = fp8_gemm.fp8_act_quant(x, 32)
    alone = {i: fp8_gemm.fp8_linear_w8a16(codes[i : i + 1], w, s, 32, x_scale=exps[i : i + 1])[0] for i in (0, 17, 199)}
    monkeypatch.setitem(fp8_gemm.W8A16, "SPLIT_TILES_PER_SM", 0.0)
    for m in (20, 50, 200):
        batch = fp8_gemm.fp8_linear_w8a16(codes[-m:], w, s, 32, x_scale=exps[-m:])
        for i, row in alone.items():
            if i >= 200 - m:
                assert torch.equal(row, batch[i - (200 - m)])
    groups, n_g, k = 3, 128, 96
    xg = torch.randn(5, groups * k, generator=g).bfloat16()
    wg, sg = _fp8_weight(groups * n_g, k, 32, g)
    cg, eg = fp8_gemm.fp8_act_quant(xg.to(DEVICE), 32)
    y = fp8_gemm.fp8_linear_w8a16(cg, wg.to(DEVICE), sg.to(DEVICE), 32, groups=groups, x_scale=eg)
    dense = quant.dequant_fp8_block(wg, sg, 32).double()
    xq = quant.fake_quant_act(xg, 32).double()
    ref = torch.cat([xq[:, i * k : (i + 1) * k] @ dense[i * n_g : (i + 1) * n_g].T for i in range(groups)], dim=1)
    assert _rel_err(y, ref) <= BF16_REL * 1.01


@triton.jit
def _dequant_codes_kernel(w_ptr, s_ptr, out_ptr, PTX: tl.constexpr):
    """Every e4m3 code (columns) under 8 scale bytes (rows) through `fp8_gemm.dequant_rows`."""
    rows = tl.arange(0, 8)[:, None]
    cols = tl.arange(0, 256)[None, :]
    w = tl.load(w_ptr + cols + 0 * rows)
    tl.store(out_ptr + rows * 256 + cols, fp8_gemm.dequant_rows(w, tl.load(s_ptr + tl.arange(0, 8)), PTX))


def test_w8a16_words_only_where_they_fit(monkeypatch):
    """W8A16["DEQUANT"] "words" needs the compiled PTX path, no K edge and 4-byte aligned weight
    rows; any other call reads bytes, with the same bits (on CPU every call: the interpreter
    runs no PTX). An unknown knob value is refused."""
    w = _fp8_weight(64, 256, 32, _gen(4))[0]
    odd = torch.empty(64 * 256 + 1, dtype=torch.float8_e4m3fn)[1:].view(64, 256)  # data_ptr % 4 == 1
    wide = torch.empty(64, 258, dtype=torch.float8_e4m3fn)[:, :256]  # rows 258 bytes apart
    assert fp8_gemm.W8A16["DEQUANT"] == "words"
    assert fp8_gemm.w8a16_words(True, w, True)
    assert not fp8_gemm.w8a16_words(False, w, True)
    assert not fp8_gemm.w8a16_words(True, w, False)
    assert not fp8_gemm.w8a16_words(True, odd, True)
    assert not fp8_gemm.w8a16_words(True, wide, True)
    assert not fp8_gemm.w8a16_words(fp8_gemm.ptx_convert(torch.device("cpu")), w, True)
    g = _gen(5)
    for n, k in ((64, 256), (70, 100)):  # whole words; a K edge (bytes on any device)
        x = torch.randn(3, k, generator=g).bfloat16().to(DEVICE)
        w, s = (a.to(DEVICE) for a in _fp8_weight(n, k, 32, g))
        ref = x.double().cpu() @ quant.dequant_fp8_block(w.cpu(), s.cpu(), 32).double().T
        monkeypatch.setitem(fp8_gemm.W8A16, "DEQUANT", "bytes")
        base = fp8_gemm.fp8_linear_w8a16(x, w, s, 32)
        monkeypatch.setitem(fp8_gemm.W8A16, "DEQUANT", "words")
        y = fp8_gemm.fp8_linear_w8a16(x, w, s, 32)
        assert torch.equal(y, base), (n, k)
        assert _rel_err(y, ref) <= BF16_REL * 1.01
    monkeypatch.setitem(fp8_gemm.W8A16, "DEQUANT", "nibbles")
    with pytest.raises(ValueError, match="W8A16"):
        fp8_gemm.fp8_linear_w8a16(x, w, s, 32)


def test_dequant_rows_exact_for_every_code():
    """The in-register dequantisation gives fp8 x 2**(s - 127) exactly for all 256 codes
    (subnormals, zeros, both signs; NaN codes excepted) and small to large scale bytes (all
    products normal bf16s, as real block scales give)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.tensor([20, 60, 112, 120, 127, 131, 200, 240], dtype=torch.uint8)
    out = torch.empty(8, 256, dtype=torch.bfloat16, device=DEVICE)
    _dequant_codes_kernel[(1,)](codes.to(DEVICE), scales.to(DEVICE), out, PTX=fp8_gemm.ptx_convert(out.device))
    ref = (codes.float()[None, :] * torch.exp2(scales.float() - 127)[:, None]).bfloat16()
    finite = ~codes.float().isnan()
    assert torch.equal(out.cpu()[:, finite].view(torch.int16), ref[:, finite].view(torch.int16))


@triton.jit
def _dequant_words_kernel(w_ptr, s_ptr, out_ptr):
    """16 rows of 32 int32 words (128 e4m3 codes) and their scale words through
    `fp8_gemm.dequant_word_step` (the weight kernels' compiled K step)."""
    rows = tl.arange(0, 16)
    words = tl.load(w_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :])
    out = fp8_gemm.dequant_word_step(words, tl.load(s_ptr + rows), 0, 128)
    tl.store(out_ptr + rows[:, None] * 128 + tl.arange(0, 128)[None, :], out)


def test_word_dequantisation_exact_for_every_code(ptx_in_interpreter):
    """The compiled path's K step (the PTX permute with the scale folded into its multiply,
    run by `ptx_emulator`) gives fp8 x 2**(s - 127) exactly for all 256 codes under scale
    bytes across the loader's range 1 .. 134 (the device checks the PTX itself the same way,
    check_kernels `fp8_linear`)."""
    codes = torch.arange(256, dtype=torch.uint8).view(2, 128).repeat(8, 1)  # row r: half r % 2 of the codes
    byte = torch.tensor([1, 20, 60, 112, 120, 127, 131, quant.FP8_MAX_SCALE_BYTE], dtype=torch.uint8).repeat_interleave(2)
    scale_words = byte[:, None].expand(16, 4).contiguous().view(torch.int32).view(16)  # one byte a 32-input piece
    out = torch.empty(16, 128, dtype=torch.bfloat16, device=DEVICE)
    _dequant_words_kernel[(1,)](codes.view(torch.int32).to(DEVICE), scale_words.to(DEVICE), out)
    values = codes.view(torch.float8_e4m3fn).float()
    ref = (values * torch.exp2(byte.float() - 127)[:, None]).bfloat16()
    finite = ~values.isnan()
    assert torch.equal(out.cpu().view(torch.int16)[finite], ref.view(torch.int16)[finite])


def test_w8a16_chunks_from_weight_shape(monkeypatch):
    """Chunks come from (N, K, block) and the SM count only, align to every K step, and a
    per-shape override wins."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    for n, k in ((512, 5120), (5120, 8192), (32768, 1280), (1280, 5120)):
        chunk = fp8_gemm.w8a16_chunk_k(n, k, 32, cpu)
        assert chunk == k or (chunk % fp8_gemm.CHUNK_ALIGN == 0 and chunk >= fp8_gemm.W8A16["MIN_CHUNK_K"])
    assert fp8_gemm.w8a16_chunk_k(32768, 1280, 32, cpu) == 1280  # 256 tiles fill the SMs unsplit
    assert -(-8192 // fp8_gemm.w8a16_chunk_k(5120, 8192, 32, cpu)) > 1
    monkeypatch.setitem(fp8_gemm.W8A16, "CHUNKS", {(5120, 8192, 32): 4})
    assert fp8_gemm.w8a16_chunk_k(5120, 8192, 32, cpu) == 2048


@pytest.mark.parametrize("m,n,k,block", [(3, 70, 100, 32), (33, 64, 256, 128), (17, 96, 640, 32)])
def test_fp8_linear_w8a8_matches_quantised_reference(m, n, k, block):
    g = _gen(m * 1000 + n + 7)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, s = _fp8_weight(n, k, block, g)
    kp = -(-k // block) * block
    xp = torch.nn.functional.pad(x.float(), (0, kp - k))
    xq = quant.dequantize_fp8_ue8m0(*quant.quantize_fp8_ue8m0(xp, block), torch.float32, block)[:, :k]
    ref = xq.double() @ quant.dequant_fp8_block(w, s, block).double().T
    y = fp8_gemm.fp8_linear_w8a8(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), block)
    assert _rel_err(y, ref) <= BF16_REL * 1.01
    # against unquantised activations: the e4m3 rounding of x, not a bug-sized error
    exact = x.double() @ quant.dequant_fp8_block(w, s, block).double().T
    assert (y.double().cpu() - exact).abs().max() < 0.1 * exact.abs().max()


@triton.jit
def _e4m3_bits_kernel(v_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, fp8_gemm.e4m3_bits(tl.load(v_ptr + i)))


def test_e4m3_bits_are_the_cast_for_every_code():
    """`fp8_gemm.e4m3_bits` (the codes from the fp32 bits, no conversion instruction) gives
    torch's e4m3 code for every finite e4m3 value: normals, subnormals, both zeros."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    out = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _e4m3_bits_kernel[(1,)](values.nan_to_num(0.0).to(DEVICE), out, N=256)  # (NaN codes: not e4m3 values the epilogue makes)
    assert torch.equal(out.cpu()[finite], codes.int()[finite])


def test_fp8_act_quant_bit_exact():
    g = _gen(3)
    x = torch.randn(9, 256, generator=g) * torch.logspace(-8, 3, 256).view(1, -1)
    x[0, :32] = 0.0  # amax clamp
    x[1, :32] = torch.tensor([448.0, 2.0**-10, 3 * 2.0**-11, 1.0625, 1.1875] + [0.5] * 27)  # ties, subnormals
    x = x.bfloat16()
    for block in (32, 128):
        q, s = fp8_gemm.fp8_act_quant(x.to(DEVICE), block)
        rq, rs = quant.quantize_fp8_ue8m0(x, block)
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s.cpu(), rs)


def test_fp8_act_fake_quant_is_the_quantised_round_trip():
    """The one-launch FP8 round trip of a projection input (`fp8_activations`) equals
    `quant.fake_quant_act` bit for bit, with a partial last block (K = 48) quantised over the
    columns it has; a [R, G, K] input (grouped wo_a) is quantised per row of K."""
    g = _gen(4)
    for shape in ((5, 96), (3, 48), (2, 3, 64)):
        x = (torch.randn(*shape, generator=g) * torch.logspace(-6, 2, shape[-1])).bfloat16()
        y = fp8_gemm.fp8_act_fake_quant(x.to(DEVICE), 32)
        ref = quant.fake_quant_act(x, 32)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        assert torch.equal(y.cpu(), ref)
        assert not torch.equal(ref, x)  # the round trip rounds
    padded = quant.fake_quant_act(torch.nn.functional.pad(x, (0, 0)), 32)
    assert torch.equal(padded, quant.fake_quant_fp8(x, 32))  # whole blocks: the window-KV quantiser


def test_fp8_linear_dispatch_and_leading_dims(monkeypatch):
    g = _gen(5)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    w, s = _fp8_weight(48, 64, 32, g)
    ref = x.double() @ quant.dequant_fp8_block(w, s, 32).double().T
    y = fp8_gemm.fp8_linear(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), 32)
    assert y.shape == (2, 3, 48) and _rel_err(y, ref) <= BF16_REL * 1.01
    monkeypatch.setattr(fp8_gemm, "W8A8_MIN_ROWS", 4)
    y8 = fp8_gemm.fp8_linear(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), 32)
    assert (y8.double().cpu() - ref).abs().max() < 0.1 * ref.abs().max()
    with pytest.raises(ValueError, match="scale shape"):
        fp8_gemm.fp8_linear(x.to(DEVICE), w.to(DEVICE), s[:1].to(DEVICE), 32)


@pytest.mark.parametrize(
    "m,n,k,sms",
    [
        (1, 128, 512, 8),  # row tile 16, x put in fragment order in registers, split-K with the ticket sum
        (20, 64, 640, 8),  # row tile 32, split-K
        (40, 128, 512, 8),  # row tile 64 (x copied in fragment order), split-K
        (130, 128, 512, 8),  # row tiles of 128, 64-input steps (two a scale word), split-K partials summed apart
        (130, 256, 384, 0),  # the same unsplit: the chunk sums inside one program
    ],
)
def test_fp8_linear_w8a16_compiled_path_matches_reference(ptx_in_interpreter, monkeypatch, m, n, k, sms):
    """The GPU's form of the weight-only GEMM (FP8 weights read as int32 words, each K step
    dequantised by the PTX permute with its 128-input scale word) in the interpreter: within
    bf16 rounding of the exact product. Scale bytes vary over K, so a step dequantised with
    another step's word is far off."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: max(sms, 1))
    monkeypatch.setitem(fp8_gemm.W8A16, "SPLIT_TILES_PER_SM", 1.0 if sms else 0.0)
    g = _gen(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, s = _fp8_weight(n, k, 32, g)
    assert fp8_gemm.w8a16_words(True, w, True) and fp8_gemm.w8a16_fragment(False, 32, k, fp8_gemm.w8a16_config(m)["BLOCK_K"])
    ref = x.double() @ quant.dequant_fp8_block(w, s, 32).double().T
    y = fp8_gemm.fp8_linear_w8a16(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), 32)
    assert _rel_err(y, ref) <= BF16_REL * 1.01


def test_fp8_linear_w8a16_rows_do_not_depend_on_batch(monkeypatch):
    """A row alone (split-K: one program per chunk, the last one adds the partials) and in
    batches of every row class (one program over all chunks) has the same bits; the tickets
    are back at zero after each split call (what CUDA-graph replays rely on)."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: 4)
    g = _gen(9)
    x = torch.randn(200, 640, generator=g).bfloat16().to(DEVICE)
    w, s = (a.to(DEVICE) for a in _fp8_weight(64, 640, 32, g))
    assert -(-640 // fp8_gemm.w8a16_chunk_k(64, 640, 32, x.device)) > 1
    alone = {i: fp8_gemm.fp8_linear_w8a16(x[i : i + 1], w, s, 32)[0] for i in (0, 17, 199)}
    assert not fp8_gemm._COUNTERS[x.device].any()
    monkeypatch.setitem(fp8_gemm.W8A16, "SPLIT_TILES_PER_SM", 0.0)  # batches never split
    for m in (20, 50, 200):  # row tiles 32, 64, 128
        batch = fp8_gemm.fp8_linear_w8a16(x[-m:], w, s, 32)
        for i, row in alone.items():
            if i >= 200 - m:
                assert torch.equal(row, batch[i - (200 - m)])


@pytest.mark.parametrize(
    "block,chunks",
    [(32, 2), (128, 2), (256, 4)],  # the last: chunk ends inside scale blocks
)
def test_fp8_linear_w8a16_bits_do_not_depend_on_tiles(monkeypatch, block, chunks):
    """Row tile, weight tile, K step, grouping, pipeline depth and register cap leave the bits
    alone (the K chunks, fixed by the weight's shape, are the only part of the numerics)."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: 4)
    g = _gen(10 + block)
    x = torch.randn(40, 512, generator=g).bfloat16().to(DEVICE)
    w, s = (a.to(DEVICE) for a in _fp8_weight(96, 512, block, g))
    monkeypatch.setitem(fp8_gemm.W8A16, "CHUNKS", {(96, 512, block): chunks})  # else sized by the first class's BLOCK_N
    base = fp8_gemm.fp8_linear_w8a16(x, w, s, block)
    tilings = [
        {"BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_K": 32 if block > 32 else 64, "GROUP_T": 1, "num_warps": 4, "num_stages": 2},
        {"BLOCK_T": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_T": 2, "num_warps": 4, "num_stages": 3},
        {"BLOCK_T": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_T": 1, "num_warps": 8, "num_stages": 4, "maxnreg": 128},
        {"BLOCK_T": 256, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_T": 1, "num_warps": 4, "num_stages": 2},
    ]
    launches = []  # each launch's options: a tile's register cap must reach Triton
    monkeypatch.setattr(fp8_gemm, "_w8a16_kernel", _Launches(fp8_gemm._w8a16_kernel, "_w8a16_kernel", launches))
    for split in (1.0, 0.0):
        for cfg in tilings:
            monkeypatch.setitem(fp8_gemm.W8A16, "rows", ((None, cfg),))
            monkeypatch.setitem(fp8_gemm.W8A16, "SPLIT_TILES_PER_SM", split)
            assert torch.equal(fp8_gemm.fp8_linear_w8a16(x, w, s, block), base), (cfg, split)
            assert launches[-1].kwargs.get("maxnreg") == cfg.get("maxnreg"), cfg


def test_w8a16_tiles_must_be_whole_wgmma(monkeypatch):
    """Tiles that would not compile to whole-warp-group wgmma (weight rows below 64 per warp
    group, token rows not a multiple of 16) are refused: Triton would run them on mma.sync,
    whose bits differ, and a row's result would then depend on its row class."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    w, s = (a.to(DEVICE) for a in _fp8_weight(64, 64, 32, _gen(1)))
    for bn, bt, warps in ((32, 16, 4), (64, 16, 8), (64, 24, 4), (128, 512, 4)):
        cfg = {"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_T": 1, "num_warps": warps, "num_stages": 2}
        monkeypatch.setitem(fp8_gemm.W8A16, "rows", ((None, cfg),))
        with pytest.raises(ValueError, match="wgmma|multiple of 16"):
            fp8_gemm.fp8_linear_w8a16(x, w, s, 32)


@pytest.mark.parametrize("m,n,k,split", [(1, 200, 640, 1.0), (17, 200, 640, 1.0), (64, 130, 608, 1.0), (33, 130, 608, 0.0)])
def test_fp8_linear_w8a16_stays_in_bounds(monkeypatch, m, n, k, split):
    """Exactly sized inputs inside NaN guards and the wrapper's own buffers (output, split-K
    partials) poisoned: a read past any tensor or of an unwritten partial turns the result
    NaN, a write past one changes its guard (accesses just past a tensor fault neither in the
    interpreter nor, mostly, on the GPU)."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: 8)
    monkeypatch.setitem(fp8_gemm.W8A16, "SPLIT_TILES_PER_SM", split)
    poisoned = _PoisonedTorch()
    monkeypatch.setattr(fp8_gemm, "torch", poisoned)
    g = _gen(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, s = _fp8_weight(n, k, 32, g)
    ref = x.double() @ quant.dequant_fp8_block(w, s, 32).double().T
    y = fp8_gemm.fp8_linear_w8a16(_guarded(x, float("nan")), _guarded(w, float("nan")), _guarded(s, 255), 32)
    chunks = -(-k // fp8_gemm.w8a16_chunk_k(n, k, 32, y.device))
    # (from 17 rows a third buffer: x's copy in fragment order, poisoned and guarded alike)
    out, part = (inner for inner, _ in poisoned.buffers[:2])
    cfg = fp8_gemm.w8a16_config(m)
    copied = fp8_gemm.w8a16_fragment(False, 32, k, cfg["BLOCK_K"]) and cfg["BLOCK_T"] > fp8_gemm.W8A16["XREG_MAX_T"]
    assert len(poisoned.buffers) == 2 + copied
    assert chunks > 1 and out.data_ptr() == y.data_ptr() and (part.numel() > 0) == bool(split)
    poisoned.check_guards()
    assert not y.isnan().any() and _rel_err(y, ref) <= BF16_REL * 1.01


# ----------------------------------------------------------------------------------- MoE


def _experts(e: int, d: int, inter: int, g: torch.Generator):
    w13 = torch.randn(e, 2 * inter, d, generator=g).to(torch.float8_e4m3fn)
    s13 = torch.randint(121, 126, (e, 2 * inter, d // 32), generator=g, dtype=torch.uint8)
    w2 = torch.randn(e, d, inter, generator=g).to(torch.float8_e4m3fn)
    s2 = torch.randint(118, 123, (e, d, inter // 32), generator=g, dtype=torch.uint8)
    return w13, s13, w2, s2


def _dequant_rows(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, -1)).bfloat16()


@pytest.mark.parametrize("weight_before_down", [True, False])
# mean pairs per expert 0.75: the stacked gate/up class, with pair tiles (6 pairs) and with the expert layout (12),
# then row tiles 16, 64, 128
@pytest.mark.parametrize("t,top_k,n_exp", [(3, 2, 8), (6, 2, 16), (5, 3, 8), (40, 2, 4), (60, 2, 2)])
def test_moe_experts_matches_reference(weight_before_down, t, top_k, n_exp):
    d, inter, limit = 64, 96, 10.0
    g = _gen(t * 10 + top_k)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    scores = moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g))
    weights, ids = moe_ref.route(scores, torch.zeros(n_exp), top_k, None, 1.5, True)
    w1 = [Linear(_dequant_rows(w13[e, :inter], s13[e, :inter])) for e in range(n_exp)]
    w3 = [Linear(_dequant_rows(w13[e, inter:], s13[e, inter:])) for e in range(n_exp)]
    w2l = [Linear(_dequant_rows(w2[e], s2[e])) for e in range(n_exp)]
    ref = moe_ref.experts_forward(x, weights, ids, w1, w2l, w3, limit, weight_before_down).float()
    gate = torch.stack([w1[e](x) for e in range(n_exp)])
    assert (gate > limit).any(), "inputs should exercise the clamp"
    dev = [a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)]
    y = moe.moe_experts(*dev, limit, weight_before_down)
    assert y.dtype == torch.float32 and y.shape == (t, d)
    if weight_before_down:  # V4.1: every rounding point of the reference is mirrored
        assert _rel_err(y, ref) <= 2 * BF16_REL
    else:  # V4: the reference sums the k expert outputs in bf16, the kernel in fp32
        assert (y.cpu() - ref).abs().max() <= 3 * BF16_REL * ref.abs().max()


def test_moe_register_cap_is_a_launch_option(monkeypatch):
    """A tile's optional `maxnreg` reaches the launches as Triton's register cap (and only
    where set); the results keep their bits (on the GPU the cap only changes how many
    programs an SM holds)."""
    part = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "STACK": True}
    assert fp8_gemm.launch_options(part) == {"num_warps": 8, "num_stages": 3}
    assert fp8_gemm.launch_options(dict(part, maxnreg=128)) == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}
    t, top_k, n_exp, d, inter = 40, 2, 4, 64, 96
    g = _gen(77)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    weights, ids = moe_ref.route(moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g)), torch.zeros(n_exp), top_k, None, 1.5, True)
    dev = [a.to(DEVICE) for a in (x, ids, weights, *_experts(n_exp, d, inter, g))]
    base = moe.moe_experts(*dev, 10.0, True)
    cfg = dict(moe.moe_config(t * top_k, n_exp))
    monkeypatch.setitem(moe.MOE, "rows", ((None, dict(cfg, gate_up=dict(cfg["gate_up"], maxnreg=128), down=dict(cfg["down"], maxnreg=128))),))
    assert torch.equal(moe.moe_experts(*dev, 10.0, True), base)


def _fp4_experts(e: int, d: int, inter: int, g: torch.Generator):
    """Random FP4 experts, compact (kernel layout) and their exact FP8 conversion, + scales."""
    p13 = torch.randint(0, 256, (e, 2 * inter, d // 2), generator=g, dtype=torch.uint8)
    p2 = torch.randint(0, 256, (e, d, inter // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(121, 126, (e, 2 * inter, d // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 123, (e, d, inter // 32), generator=g, dtype=torch.uint8)
    kept = [torch.stack([quant.fp4_kernel_layout(w) for w in p]) for p in (p13, p2)]
    fp8 = [torch.stack([quant.fp4_expert_to_fp8(w, s)[0] for w, s in zip(p, sc)]) for p, sc in ((p13, s13), (p2, s2))]
    return (kept[0], s13, kept[1], s2), (fp8[0], s13, fp8[1], s2)


@triton.jit
def _fragment_maps_kernel(out_ptr):
    p = tl.arange(0, 256)
    tl.store(out_ptr + p, fp8_gemm.fragment_input(p, 16))
    tl.store(out_ptr + 256 + p, moe._sigma_inverse(fp8_gemm.fragment_input(p, 16)))
    tl.store(out_ptr + 512 + p, fp8_gemm.fragment_input(p, 32))
    tl.store(out_ptr + 768 + p[None, :], fp8_gemm.fragment_order_tile(p[None, :]))


def test_fragment_order_has_one_permutation():
    """The fragment order's homes agree: the input at each dot position (`fragment_input`), x's
    copy into that order (`fp8_gemm.fragment_order`), the activations' store (`_sigma_inverse`, its
    inverse), a tile's relabelling in registers (`fragment_order_tile`, the dense GEMM's small
    tiles); at 32 inputs a lane (the indexer's FP4 keys) a permutation of every 128."""
    out = torch.empty(1024, dtype=torch.int32, device=DEVICE)
    _fragment_maps_kernel[(1,)](out)
    held, back, held32, tile = out.view(4, 256).long().cpu()
    x = torch.arange(256, dtype=torch.bfloat16, device=DEVICE).view(1, 256)  # (exact in bf16)
    assert torch.equal(fp8_gemm.fragment_order(x)[0].long().cpu(), held)
    assert torch.equal(tile, held)
    assert torch.equal(back, torch.arange(256))
    assert torch.equal(held32.view(2, 128).sort(1).values, torch.arange(256).view(2, 128))


@pytest.mark.parametrize("t, k, offset", [(1, 64, None), (7, 64 * 37, None), (5, 1280, 64), (3, 128, 1)])
def test_fragment_order_kernel_is_the_permuted_copy(t, k, offset):
    """The copy kernel against the permuted view it stands for, on random bf16 rows: row and
    block counts that leave partial tiles, and column slices of a wider x: at an even offset
    read through its row stride, at an odd one (rows not in whole int32 words) copied first."""
    wide = torch.randn(t, k + (offset or 0), generator=_gen(t + k)).bfloat16().to(DEVICE)
    x = wide[:, offset:] if offset else wide
    want = x.cpu().view(t, k // 64, 4, 2, 2, 2, 2).permute(0, 1, 3, 4, 5, 2, 6).reshape(t, k)
    assert torch.equal(fp8_gemm.fragment_order(x).cpu(), want)
    with pytest.raises(ValueError, match="2-byte values"):
        fp8_gemm.fragment_order(x.float())


# pair tiles, the layout's 16-pair tiles (stacked gate/up), 32-pair tiles, the 128-pair prefill class
@pytest.mark.parametrize("t,top_k,n_exp", [(1, 2, 8), (6, 2, 4), (40, 2, 4), (300, 2, 2)])
def test_moe_experts_compiled_path_matches_reference(ptx_in_interpreter, t, top_k, n_exp):
    """The GPU's form of the grouped expert GEMMs (FP8 and FP4 weights read as int32 words,
    each K step dequantised by the PTX permutes with its 128-input scale word) in the
    interpreter, against the torch experts, with scale bytes
    varying over K; FP4 stacks within bf16 rounding of FP8's result. (Their bits are equal in
    `..._fp4_give_the_bits_...`; here each step is one numpy dot whose sum order follows the
    step's width, and FP4 steps are whole 128s where the prefill class's FP8 steps are 64.)"""
    d, inter, limit = 256, 256, 10.0
    g, x, ids, weights, fp4, fp8 = _fp4_routed_case(t * 31 + top_k, t, top_k, n_exp, d, inter)
    w13, s13, w2, s2 = fp8
    w1 = [Linear(_dequant_rows(w13[e, :inter], s13[e, :inter])) for e in range(n_exp)]
    w3 = [Linear(_dequant_rows(w13[e, inter:], s13[e, inter:])) for e in range(n_exp)]
    w2l = [Linear(_dequant_rows(w2[e], s2[e])) for e in range(n_exp)]
    ref = moe_ref.experts_forward(x.cpu(), weights.cpu(), ids.cpu(), w1, w2l, w3, limit, True).float()
    assert moe._words(True, w13, s13, 128) and moe._words(True, w2, s2, 128)
    y = moe.moe_experts(x, ids, weights, *(a.to(DEVICE) for a in fp8), limit, True)
    assert _rel_err(y, ref) <= 2 * BF16_REL
    y4 = moe.moe_experts(x, ids, weights, *(a.to(DEVICE) for a in fp4), limit, True)
    assert (y4 - y).abs().max() <= BF16_REL * y.abs().max()


def _fp4_routed_case(seed: int, t: int, top_k: int, n_exp: int, d: int, inter: int):
    """(generator, x, ids, weights on the device, FP4 stacks, their FP8 conversion) of a routed batch."""
    g = _gen(seed)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    fp4, fp8 = _fp4_experts(n_exp, d, inter, g)
    scores = moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g))
    weights, ids = moe_ref.route(scores, torch.zeros(n_exp), top_k, None, 1.5, True)
    return g, x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), fp4, fp8


@pytest.mark.parametrize("weight_before_down", [True, False])
# the row classes of test_moe_experts_matches_reference (pair tiles, the layout, row tiles 16, 64, 128)
@pytest.mark.parametrize("t,top_k,n_exp", [(3, 2, 8), (6, 2, 16), (5, 3, 8), (40, 2, 4), (60, 2, 2)])
def test_moe_experts_fp4_give_the_bits_of_their_fp8_conversion(weight_before_down, t, top_k, n_exp):
    """Compact FP4 stacks dequantise in the kernels to the same bf16 values as their FP8
    conversion, so every row class gives the FP8 kernels' bits; with V4.1's shared expert as
    a separate FP8 stack of one (every token's last slot) the bits of the FP8 stack that holds
    it as its last expert — grouped and dense (prefill) paths alike."""
    d, inter, limit = 64, 96, 10.0
    g, x, ids, weights, fp4, fp8 = _fp4_routed_case(t * 13 + top_k, t, top_k, n_exp, d, inter)
    shared = _experts(1, d, inter, g)
    dev = lambda ts: [a.to(DEVICE) for a in ts]
    want = moe.moe_experts(x, ids, weights, *dev(fp8), limit, weight_before_down)
    assert torch.equal(moe.moe_experts(x, ids, weights, *dev(fp4), limit, weight_before_down), want)
    ids_s = torch.cat([ids, torch.full_like(ids[:, :1], n_exp)], 1)
    weights_s = torch.cat([weights, torch.ones_like(weights[:, :1])], 1)
    with_shared = dev(torch.cat([a, b]) for a, b in zip(fp8, shared))
    for kernel in (moe.moe_experts, moe.moe_experts_dense):
        want = kernel(x, ids_s, weights_s, *with_shared, limit, weight_before_down, torch.bfloat16)
        got = kernel(x, ids_s, weights_s, *dev(fp4), limit, weight_before_down, torch.bfloat16, shared=tuple(dev(shared)))
        assert torch.equal(got, want), kernel.__name__


@pytest.mark.parametrize("t,top_k,n_exp", [(3, 2, 8), (40, 2, 4), (60, 2, 2)])
def test_moe_experts_fp4_slot_layout_gives_the_bits_of_fp8(t, top_k, n_exp):
    """Inputs in whole 128s: the FP4 words lie in slot order (`quant.fp4_kernel_layout`), read
    in whole 128-input steps (the prefill class's 64-input steps too) and relabelled into input
    order — the FP8 stacks' bits at pair tiles, 16-pair tiles and the prefill tile."""
    _, x, ids, weights, fp4, fp8 = _fp4_routed_case(t * 17 + top_k, t, top_k, n_exp, 128, 256)
    want = moe.moe_experts(x, ids, weights, *[a.to(DEVICE) for a in fp8], 10.0, True)
    assert torch.equal(moe.moe_experts(x, ids, weights, *[a.to(DEVICE) for a in fp4], 10.0, True), want)


def test_moe_experts_fp4_reject_bad_stacks():
    g = _gen(4)
    fp4, fp8 = _fp4_experts(2, 64, 96, g)
    shared = _experts(1, 64, 96, g)
    x = torch.randn(3, 64, generator=g).bfloat16()
    ids, weights = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(TypeError, match="both alike"):
        moe.moe_experts(x, ids, weights, fp4[0], fp4[1], fp8[2], fp8[3], 10.0, True)
    with pytest.raises(ValueError, match="compact FP4 experts only"):
        moe.moe_experts(x, ids, weights, *fp8, 10.0, True, shared=shared)
    with pytest.raises(ValueError, match="one FP8 expert"):
        moe.moe_experts(x, ids, weights, *fp4, 10.0, True, shared=tuple(fp4))
    with pytest.raises(ValueError, match="FP8 activations run FP8 expert stacks"):
        moe.moe_experts(x, ids, weights, *fp4, 10.0, True, fp8_act=True)
    with pytest.raises(ValueError, match="shapes"):
        moe.moe_experts(x, ids, weights, fp4[0][:, :, :16], fp4[1], fp4[2], fp4[3], 10.0, True)
    with pytest.raises(quant.FormatError, match="outside what the compact FP4 kernels take"):
        quant.check_fp4_scales(torch.tensor([[119, quant.FP4_MAX_SCALE_BYTE + 1]], dtype=torch.uint8), "w.scale")


@pytest.mark.parametrize("ptx", [False, True])
def test_dequant_fp4_matches_the_checkpoint_decoding(ptx, request):
    """The kernel layout's bit places and their decoding, in Triton ops and in the PTX (run by
    `ptx_emulator`), exactly the checkpoint's values; every one of the 16 codes sits at each of
    a word's 8 places in the first rows."""
    if ptx:
        request.getfixturevalue("ptx_in_interpreter")
    g = _gen(8)
    every = torch.arange(16, dtype=torch.uint8)[:, None].expand(16, 8)  # row c: code c at all 8 places
    for n, k in ((16, 64), (33, 288), (2, 32), (3, 256), (4, 384)):  # (256, 384: words in slot order)
        packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        if n == 16:
            packed[:, :4] = quant.pack_fp4(every)
        scale = torch.randint(100, quant.FP4_MAX_SCALE_BYTE + 1, (n, k // 32), generator=g, dtype=torch.uint8)
        kept = quant.fp4_kernel_layout(packed)
        assert torch.equal(quant.fp4_codes_from_kernel_layout(kept), quant.unpack_fp4(packed))
        want = quant.dequant_fp4_expert(packed, scale).bfloat16()
        assert torch.equal(fp8_gemm.dequant_fp4(kept.to(DEVICE), scale.to(DEVICE)).cpu(), want)


def _exact_experts(e: int, d: int, inter: int, g: torch.Generator):
    """Experts whose FP8 x FP8 products sum exactly in fp32 in any order (few significant bits,
    two scales per matrix): a kernel and the reference then see the same bf16 gate / up."""
    w13 = (torch.randint(-8, 9, (e, 2 * inter, d), generator=g) * 0.25).to(torch.float8_e4m3fn)
    s13 = torch.randint(125, 127, (e, 2 * inter, d // 32), generator=g, dtype=torch.uint8)
    w2 = (torch.randint(-8, 9, (e, d, inter), generator=g) * 0.25).to(torch.float8_e4m3fn)
    s2 = torch.randint(121, 123, (e, d, inter // 32), generator=g, dtype=torch.uint8)
    return w13, s13, w2, s2


@pytest.mark.parametrize("weight_before_down", [True, False])
# the row classes of test_moe_experts_matches_reference: pair tiles, the layout, row tiles 16, 64, 128
@pytest.mark.parametrize("t,top_k,n_exp", [(3, 2, 8), (6, 2, 16), (5, 3, 8), (40, 2, 4), (60, 2, 2)])
def test_moe_experts_fp8_activations_match_quantised_reference(weight_before_down, t, top_k, n_exp):
    """FP8 activations: the FP8 x FP8 kernels (x quantised per 32 inputs, the SwiGLU output
    quantised in the gate/up epilogue) and the prefill path (FP8 round trips, bf16 GEMMs)
    against the per-expert reference whose Linears quantise their inputs. x has values off the
    FP8 grid (its quantisation rounds), the experts sum exactly in fp32 (`_exact_experts`)."""
    d, inter, limit = 64, 96, 10.0
    g = _gen(t * 10 + top_k + 500)
    x = (torch.randint(-4, 5, (t, d), generator=g) * 0.25 + torch.randn(t, d, generator=g) * 0.01).bfloat16()
    w13, s13, w2, s2 = _exact_experts(n_exp, d, inter, g)
    scores = moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g))
    weights, ids = moe_ref.route(scores, torch.zeros(n_exp), top_k, None, 1.5, True)
    ref = _moe_reference(x, ids, weights, w13, s13, w2, s2, limit, weight_before_down, quant_input=True)
    plain = _moe_reference(x, ids, weights, w13, s13, w2, s2, limit, weight_before_down)
    assert _rel_err(ref, plain) > 8 * BF16_REL  # the quantisation is visible at this tolerance
    dev = [a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)]
    for kernel in (moe.moe_experts, moe.moe_experts_dense):
        y = kernel(*dev, limit, weight_before_down, fp8_act=True)
        assert y.dtype == torch.float32 and y.shape == (t, d)
        if weight_before_down:
            assert _rel_err(y, ref) <= 2 * BF16_REL, kernel.__name__
        else:  # V4: the reference sums in bf16
            assert (y.cpu() - ref).abs().max() <= 3 * BF16_REL * ref.abs().max(), kernel.__name__


MOE_TILINGS = [  # (BLOCK_T, gate_up (BLOCK_N, BLOCK_K, STACK), down (BLOCK_N, BLOCK_K)), whole-wgmma tiles at 4 warps
    (16, (64, 64, False), (64, 128)),
    (16, (64, 64, True), (64, 64)),  # gate over up rows in one accumulator
    (32, (64, 128, False), (128, 64)),
    (128, (128, 128, False), (64, 128)),
    (128, (128, 64, True), (64, 64)),
]


def test_moe_experts_rows_do_not_depend_on_batch(monkeypatch):
    """A token alone (its 2 pairs as their own row tiles) and in a 40-token batch, under every
    tiling, both layout builders (the one-program counting sort and torch's sort) and with the
    whole batch in pair tiles, has the same bits."""
    d, inter, n_exp = 64, 64, 4
    g = _gen(21)
    x = torch.randn(40, d, generator=g).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    weights, ids = moe_ref.route(moe_ref.sqrtsoftplus(torch.randn(40, n_exp, generator=g)), torch.zeros(n_exp), 2, None, 1.5, True)
    dev = [a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)]
    assert moe.moe_config(80, n_exp) is not moe.moe_config(2, n_exp)
    batch = moe.moe_experts(*dev, 10.0, True)
    alone = {i: moe.moe_experts(dev[0][i : i + 1], dev[1][i : i + 1], dev[2][i : i + 1], *dev[3:], 10.0, True)[0] for i in (0, 39)}
    for i, row in alone.items():
        assert torch.equal(row, batch[i])
    for bt, (gn, gk, stack), (dn, dk) in MOE_TILINGS:
        cfg = {"BLOCK_T": bt, "gate_up": {"BLOCK_N": gn, "BLOCK_K": gk, "num_warps": 4, "num_stages": 2, "STACK": stack},
               "down": {"BLOCK_N": dn, "BLOCK_K": dk, "num_warps": 4, "num_stages": 3}}
        monkeypatch.setitem(moe.MOE, "rows", ((None, cfg),))
        for max_pairs, pair_tiles in ((4096, 0), (0, 0), (4096, 80)):
            monkeypatch.setitem(moe.MOE, "ALIGN_MAX_PAIRS", max_pairs)
            monkeypatch.setitem(moe.MOE, "PAIR_TILES_MAX_PAIRS", pair_tiles)
            assert torch.equal(moe.moe_experts(*dev, 10.0, True), batch), (bt, max_pairs, pair_tiles)


def test_moe_slot_sum_orders_slots_by_expert():
    """The slots of a token are added in ascending expert id whatever their order in topk_ids
    (ties, as hash routing may give, in slot order): permuting a token's slots keeps the bits."""
    d, inter, n_exp, k = 64, 64, 8, 4
    g = _gen(23)
    x = torch.randn(6, d, generator=g).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(6)])
    ids[5] = torch.tensor([2, 6, 2, 1])  # a repeated expert
    weights = torch.rand(6, k, generator=g)
    weights[5, 2] = weights[5, 0]  # the repeated expert with the same weight: any tie order gives the same bits
    y = moe.moe_experts(*(a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)), 10.0, True)
    perm = torch.stack([torch.randperm(k, generator=g) for _ in range(6)])
    yp = moe.moe_experts(*(a.to(DEVICE) for a in (x, ids.gather(1, perm), weights.gather(1, perm), w13, s13, w2, s2)), 10.0, True)
    assert torch.equal(y, yp)


class _Experts:
    """`experts_forward`'s per-expert Linears of stacked FP8 experts, dequantised (exactly, to
    bf16) only for the experts a routing uses."""

    def __init__(self, w: torch.Tensor, s: torch.Tensor, rows: slice, quant_input: bool = False):
        self.w, self.s, self.rows, self.quant_input = w, s, rows, quant_input

    def __len__(self) -> int:
        return self.w.shape[0]

    def __getitem__(self, e: int) -> Linear:
        return Linear(_dequant_rows(self.w[e, self.rows].cpu(), self.s[e, self.rows].cpu()), quant_input=self.quant_input)


def _moe_reference(x, ids, weights, w13, s13, w2, s2, limit: float, weight_before_down: bool = True, quant_input: bool = False) -> torch.Tensor:
    """The per-expert torch loop (its Linears quantise their inputs with `quant_input`)."""
    inter = w2.shape[2]
    w1, w3 = _Experts(w13, s13, slice(0, inter), quant_input), _Experts(w13, s13, slice(inter, 2 * inter), quant_input)
    return moe_ref.experts_forward(x, weights, ids, w1, _Experts(w2, s2, slice(None), quant_input), w3, limit, weight_before_down).float()


@pytest.mark.parametrize("t,max_pairs,pair_tiles", [(1, 4096, 0), (1, 4096, 8), (8, 0, 0), (64, 4096, 0)])  # max_pairs 0: torch's layout builder
def test_moe_experts_384_experts_stay_in_bounds(monkeypatch, t, max_pairs, pair_tiles):
    """V4.1's 384 experts (the layout kernel's 512-wide expert block; the device's first run
    failed there) at small D / I: exactly sized inputs inside NaN guards (ids: expert 0) and
    the wrapper's own buffers (layout, activations, expert rows, output; pair tiles: no
    layout) poisoned, so that a read past any tensor or of an unwritten row turns the result
    NaN or moves it off the reference, and a write past a buffer changes its guard."""
    n_exp, d, inter, k = 384, 64, 96, 6
    monkeypatch.setitem(moe.MOE, "ALIGN_MAX_PAIRS", max_pairs)
    monkeypatch.setitem(moe.MOE, "PAIR_TILES_MAX_PAIRS", pair_tiles)
    poisoned = _PoisonedTorch()
    monkeypatch.setattr(moe, "torch", poisoned)
    g = _gen(t + max_pairs)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    weights, ids = moe_ref.route(moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g)), torch.zeros(n_exp), k, None, 1.5, True)
    ref = _moe_reference(x, ids, weights, w13, s13, w2, s2, 10.0)
    args = [_guarded(a, 0 if a is ids else _poison(a.dtype)) for a in (x, ids, weights, w13, s13, w2, s2)]
    y = moe.moe_experts(*args, 10.0, True)
    poisoned.check_guards()
    assert len(poisoned.buffers) == (3 if t * k <= pair_tiles else 5)  # [rows, tile_expert,] act, y, out
    assert not y.isnan().any() and _rel_err(y, ref) <= 2 * BF16_REL


class _Launch(NamedTuple):
    name: str
    grid: tuple
    args: tuple
    kwargs: dict


class _Launches:
    """Stands in for a Triton kernel: each launch is recorded in `log` (a `_Launch`), then runs."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(_Launch(self.name, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return run


@pytest.mark.parametrize("d,inter", [(64, 96), (128, 128)])
def test_moe_experts_drop_row_masks_only_for_whole_tiles(monkeypatch, d, inter):
    """The bf16 kernels load weight rows without masks (EVEN_N) only where the launch's row
    tiles divide the rows: D = 64 under down's 128-row tile, or I = 96 under 64 gate rows,
    keep them (a tile's rows past the weight would be read), D = I = 128 drops them."""
    t, top_k, n_exp = 40, 2, 4  # 20 pairs an expert: the 48-pair class, gate and up apart in 64 rows each
    g = _gen(d + inter)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    weights, ids = moe_ref.route(moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g)), torch.zeros(n_exp), top_k, None, 1.5, True)
    launches = []
    for name in ("_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(moe, name, _Launches(getattr(moe, name), name, launches))
    y = moe.moe_experts(*[a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)], 10.0, True)
    _, gu, dn = moe._call_tiles("moe_experts", t * top_k, n_exp, d, inter, False, False)
    assert not gu.get("STACK", False) and gu["BLOCK_N"] == 64 and dn["BLOCK_N"] == 128
    assert [(n.name, n.kwargs["EVEN_N"]) for n in launches] == [("_gate_up_kernel", inter % 64 == 0), ("_down_kernel", d % 128 == 0)]
    assert _rel_err(y, _moe_reference(x, ids, weights, w13, s13, w2, s2, 10.0)) <= 2 * BF16_REL


def test_moe_experts_far_experts_use_64_bit_offsets():
    """Expert e's weights start e * stride(0) elements in: at V4.1's shapes that passes 2**31
    from expert 91 of w13 (182 of w2) on, where int32 offsets wrapped on the device (wrong
    rows, then an illegal address; the interpreter faults or reads garbage). Here the experts
    sit 6 MiB apart in one buffer that is never touched beyond the routed experts' rows (so it
    costs no memory), and the routing picks experts on both sides of 2**31."""
    n_exp, d, inter, stride = 384, 64, 64, 6 << 20
    buf = torch.empty(n_exp * stride, dtype=torch.uint8, device=DEVICE)
    w13 = buf.as_strided((n_exp, 2 * inter, d), (stride, d, 1)).view(torch.float8_e4m3fn)
    w2 = buf.as_strided((n_exp, d, inter), (stride, inter, 1), 2 * inter * d).view(torch.float8_e4m3fn)
    assert 91 * stride < 2**31 < 383 * stride
    ids = torch.tensor([[383, 1, 200, 300], [91, 92, 383, 5]])
    g = _gen(31)
    for e in ids.unique().tolist():
        w13[e] = torch.randn(2 * inter, d, generator=g).to(torch.float8_e4m3fn)
        w2[e] = torch.randn(d, inter, generator=g).to(torch.float8_e4m3fn)
    s13 = torch.randint(121, 126, (n_exp, 2 * inter, d // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 123, (n_exp, d, inter // 32), generator=g, dtype=torch.uint8)
    x = torch.randn(2, d, generator=g).bfloat16()
    weights = torch.rand(2, 4, generator=g)
    ref = _moe_reference(x, ids, weights, w13, s13.to(DEVICE), w2, s2.to(DEVICE), 10.0)
    y = moe.moe_experts(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), w13, s13.to(DEVICE), w2, s2.to(DEVICE), 10.0, True)
    assert _rel_err(y, ref) <= 2 * BF16_REL


def test_moe_tiles_must_be_whole_wgmma(monkeypatch):
    """As for fp8_linear_w8a16: tiles that would fall back to mma.sync are refused."""
    w13, s13, w2, s2 = (a.to(DEVICE) for a in _experts(2, 64, 64, _gen(2)))
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)
    for gate_n, t in ((32, 16), (64, 8)):
        cfg = {"BLOCK_T": t, "gate_up": {"BLOCK_N": gate_n, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}, "down": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}}
        monkeypatch.setitem(moe.MOE, "rows", ((None, cfg),))
        with pytest.raises(ValueError, match="multiple of 16"):
            moe.moe_experts(x, ids, torch.ones(2, 1, device=DEVICE), w13, s13, w2, s2, 10.0, True)


@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_moe_steps_must_be_whole_fragment_blocks(monkeypatch, part):
    """The bf16 kernels' dot order is defined per block of 64 inputs: a 32-input K step (or a
    96-input one) is refused naming the kernel, not run in another order."""
    w13, s13, w2, s2 = (a.to(DEVICE) for a in _experts(2, 128, 128, _gen(2)))
    x = torch.zeros(2, 128, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)
    for block_k in (32, 96):
        cfg = {"BLOCK_T": 16, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
               "down": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}}
        cfg[part]["BLOCK_K"] = block_k
        monkeypatch.setitem(moe.MOE, "rows", ((None, cfg),))
        with pytest.raises(ValueError, match=f"{part} BLOCK_K must be 64 or 128, got {block_k}"):
            moe.moe_experts(x, ids, torch.ones(2, 1, device=DEVICE), w13, s13, w2, s2, 10.0, True)


@pytest.mark.parametrize("n_exp,block_m", [(5, 4), (384, 16)])
def test_align_by_expert_layout(monkeypatch, n_exp, block_m):
    """Both layout builders give the same layout: every used tile holds pairs of its expert
    only, in pair order, every pair exactly once, padding marked n_pairs, unused tiles n_exp."""
    ids = torch.tensor([3, 0, 3, 3, 1, 0]) if n_exp == 5 else torch.randint(0, n_exp, (300,), generator=_gen(4))
    layouts = []
    for max_pairs in (4096, 0):
        monkeypatch.setitem(moe.MOE, "ALIGN_MAX_PAIRS", max_pairs)
        rows, tile_expert = (a.cpu() for a in moe.align_by_expert(ids.to(DEVICE), n_exp, block_m))
        assert rows.dtype == tile_expert.dtype == torch.int32
        layouts.append((rows, tile_expert))
    assert torch.equal(layouts[0][0], layouts[1][0]) and torch.equal(layouts[0][1], layouts[1][1])
    rows, tile_expert = layouts[0]
    used = tile_expert < n_exp
    assert tile_expert[used].tolist() == sorted(set(ids.tolist()))
    assert (tile_expert[~used] == n_exp).all() and not used[used.sum():].any()
    for tile, e in zip(rows.view(-1, block_m)[used], tile_expert[used]):
        real = tile[tile < ids.numel()]
        assert (ids[real.long()] == e).all() and (real.diff() > 0).all()
    assert sorted(rows[rows < ids.numel()].tolist()) == list(range(ids.numel()))
    assert (rows[rows >= ids.numel()] == ids.numel()).all()


# ----------------------------------------------------------------------------------- attention


# the caches' stored forms: (bf16 ring, bf16 compressed KV); quantised otherwise (FP8 ring,
# FP4 compressed KV). V4.1's, V4's, and a bf16 ring beside FP4 entries (each cache's form is its
# own kernel constexpr; with FP4 entries the dense copy's path reads the bf16 ring too)
ATTN_FORMATS = {"v41": (False, False), "v4": (True, True), "bf16_ring": (True, False)}


def _attention_case(g, *, heads, dim, window, per_block, n_top, requests, formats="v41"):
    """A batch over random rings and paged compressed KV stored as `formats` (ATTN_FORMATS).
    `requests`: (start, count, floor) per request. Returns the kernel arguments and the
    QTensors for the model path."""
    bf16_ring, bf16_ckv = ATTN_FORMATS[formats]
    n_slots, n_blocks = len(requests) + 1, 12
    ring_vals = torch.randn(n_slots, window, dim, generator=g)
    ckv_vals = torch.randn(n_blocks, per_block, dim, generator=g) * 2
    ring = QTensor(values=ring_vals.bfloat16()) if bf16_ring else QTensor(None, *quant.quantize_fp8_ue8m0(ring_vals, 32))
    ckv = QTensor(values=ckv_vals.bfloat16()) if bf16_ckv else QTensor(None, *quant.quantize_fp4(ckv_vals, 16, e4m3_scale=True))
    (ring_codes, ring_scales), (ckv_codes, ckv_scales) = _stored(ring), _stored(ckv)  # as the model passes them
    t = sum(c for _, c, _ in requests)
    q = (torch.randn(t, heads, dim, generator=g) * 2).bfloat16()
    kv_new = kvops.round_trip(ring, torch.randn(t, dim, generator=g).bfloat16(), "window")  # as the ring holds keys
    max_blocks = 6
    block_tables = torch.stack([torch.randperm(n_blocks, generator=g)[:max_blocks] for _ in requests])
    token_req, positions, topk, row_start = [], [], [], []
    row = 0
    for b, (start, count, _floor) in enumerate(requests):
        row_start.append(row)
        row += count
        for p in range(start, start + count):
            token_req.append(b)
            positions.append(p)
            visible = min((p + 1) // 2, max_blocks * per_block)  # ratio-2 entries visible at p
            pick = torch.randperm(max(visible, 1), generator=g)[:n_top]
            pick = torch.where(torch.rand(pick.shape, generator=g) < 0.2, -1, pick) if visible else torch.full_like(pick, -1)
            topk.append(torch.cat([pick, torch.full((n_top - pick.numel(),), -1, dtype=torch.long)]))
    args = {
        "q": q,
        "kv_new": kv_new,
        "ring_codes": ring_codes,
        "ring_scales": ring_scales,
        "ckv_codes": ckv_codes,
        "ckv_scales": ckv_scales,
        "topk": torch.stack(topk),
        "token_req": torch.tensor(token_req, dtype=torch.int32),
        "positions": torch.tensor(positions),
        "start_pos": torch.tensor([s for s, _, _ in requests]),
        "row_start": torch.tensor(row_start, dtype=torch.int32),
        "slots": torch.arange(1, len(requests) + 1),
        "floors": torch.tensor([f for _, _, f in requests]),
        "block_tables": block_tables,
        "sink": torch.randn(heads, generator=g),
        "softmax_scale": dim**-0.5,
    }
    return args, ring, ckv


def _naive_attention(args, ring, ckv, per_block):
    """Token by token, from the definition (MODEL.md 2.4 step 5): the visible window keys
    (ring below the step's first position, this step's keys from there on) and the valid
    top-k entries, bf16 logits times the bf16-rounded scale, fp32 softmax with the sink column,
    bf16 probabilities times V = K."""
    q, kv_new = args["q"], args["kv_new"]
    window = args["ring_codes"].shape[1]
    outs = []
    for t in range(q.shape[0]):
        b = int(args["token_req"][t])
        p, p0, floor = int(args["positions"][t]), int(args["start_pos"][b]), int(args["floors"][b])
        row0, slot = int(args["row_start"][b]), int(args["slots"][b])
        keys = []
        for kp in range(max(p - window + 1, floor, 0), p + 1):
            if kp < p0:
                keys.append(kvops.load(ring, (slot, kp % window), "window", torch.bfloat16))
            else:
                keys.append(kv_new[row0 + kp - p0])
        entries = args["topk"][t]
        entries = entries[entries >= 0]
        if entries.numel():
            blocks, offs = kvops.entry_locations(args["block_tables"][b], entries, 2, 2 * per_block)
            keys.extend(kvops.load(ckv, (blocks, offs), "ckv", torch.bfloat16))
        keys = torch.stack(keys)
        logits = (q[t] @ keys.T * args["softmax_scale"]).float()
        full = torch.cat([logits, args["sink"].float()[:, None]], dim=1)
        probs = torch.softmax(full, dim=1)[:, :-1].to(torch.bfloat16)
        outs.append(probs @ keys)
    return torch.stack(outs)


ATTN_CASES = {
    # prefill from 0, chunked prefill continuing over the ring, decode with a replay floor;
    # partial head block
    "mixed": {"heads": 20, "dim": 64, "window": 16, "per_block": 8, "n_top": 20, "requests": [(0, 6, 0), (21, 5, 0), (40, 1, 30)]},
    # one decode token with a long top-k, 128 channels (4 PV channel slices possible)
    "decode": {"heads": 16, "dim": 128, "window": 32, "per_block": 16, "n_top": 100, "requests": [(150, 1, 0)]},
    # a window-only layer (no compressed entries): prefill, then a decode token with a floor
    "window_only": {"heads": 8, "dim": 64, "window": 16, "per_block": 8, "n_top": 0, "requests": [(0, 5, 0), (30, 1, 20)]},
}
# the kernel checks: every case in both models' formats, the mixed forms on the richest case
ATTN_KERNEL_CASES = [(case, formats) for case in ATTN_CASES for formats in ("v41", "v4")] + [("mixed", "bf16_ring")]
# the default tiling (one logits tile covers a window) and 16-key tiles (several statistics
# tiles per key list, the window over several tiles, 16-pair operand pieces)
ATTN_TILINGS = {"default": {}, "small": {"LOGIT_BLOCK_N": 16, "PV_BLOCK_N": 16, "PIECE": 16}}
# how the work is spread over programs, which must not change a bit: logits tiles per program,
# logits head blocks (partial ones at 20 and 8 heads) and PV channel slices per token
ATTN_SPREADS = [
    {"TILES_PER_PROGRAM": 1, "LOGIT_BLOCK_H": 16, "DSPLIT": 1},
    {"TILES_PER_PROGRAM": 2, "LOGIT_BLOCK_H": 32, "DSPLIT": 2},
    # (8 slices asked: a slice holds whole ring scale groups of 16 pairs, so 128 channels take
    # 4, as one token's 16 slices of 512 channels, and 64-channel cases 2)
    {"TILES_PER_PROGRAM": 64, "LOGIT_BLOCK_H": 64, "DSPLIT": 8},
    # the compressed keys from the dense bf16 copy (prefill-sized steps) instead of the cache
    # (FP4 entries only: bf16 ones are read in place whatever the config says)
    {"DENSE_CKV": True, "DSPLIT": 1},
    {"DENSE_CKV": True, "TILES_PER_PROGRAM": 1, "LOGIT_BLOCK_H": 16, "DSPLIT": 4},
]


@pytest.mark.parametrize("formats", ATTN_FORMATS)
@pytest.mark.parametrize("case", ATTN_CASES)
def test_sparse_attention_reference_matches_definition(case, formats):
    spec = ATTN_CASES[case]
    args, ring, ckv = _attention_case(_gen(11), **spec, formats=formats)
    ref = attention_ops.sparse_attention_reference(**args)
    naive = _naive_attention(args, ring, ckv, spec["per_block"])
    assert _rel_err(ref, naive) <= 2 * BF16_REL


def _token_alone(args: dict, t: int) -> dict:
    """The arguments for token t of the batch on its own; t must be its request's only token
    (a decode step), whose key row then moves from row t to row 0."""
    one = slice(t, t + 1)
    picked = {k: args[k][one] for k in ("q", "kv_new", "topk", "token_req", "positions")}
    return dict(args, **picked, row_start=args["row_start"] - t)


def _on_device(args: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("tiling", ATTN_TILINGS)
@pytest.mark.parametrize("case,formats", ATTN_KERNEL_CASES)
def test_sparse_attention_matches_reference(case, formats, tiling):
    spec = ATTN_CASES[case]
    args, _, _ = _attention_case(_gen(11), **spec, formats=formats)
    ref = attention_ops.sparse_attention_reference(**args)
    dev = _on_device(args)
    cfg = ATTN_TILINGS[tiling]
    y = tattn.sparse_attention(**dev, config=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert torch.isfinite(y.float()).all()
    # probabilities are rounded to bf16 unnormalised (times 1 / denominator in fp32 at the end)
    # vs normalised (reference)
    assert (y.float().cpu() - ref.float()).abs().max() <= 4 * BF16_REL * ref.float().abs().max()
    for spread in ATTN_SPREADS:
        assert torch.equal(tattn.sparse_attention(**dev, config={**cfg, **spread}), y), spread
    # batch invariance under the default "auto" spread: the last token alone (spread over more
    # programs) has the bits it has in the batch
    last = y.shape[0] - 1
    assert torch.equal(tattn.sparse_attention(**_token_alone(dev, last), config=cfg)[0], y[last])


def _rope_angles(g, t: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(t, half, generator=g) * 6.3
    return angle.cos().bfloat16(), angle.sin().bfloat16()


@pytest.mark.parametrize("case,formats", [("mixed", "v41"), ("decode", "v41"), ("decode", "v4")])
def test_sparse_attention_inverse_rope_in_the_epilogue(case, formats):
    """The PV epilogue's inverse RoPE gives the bits of `apply_rope_(out, cos, sin,
    inverse=True)` on the output (torch's rotation, which the separate kernel it replaces
    matches), under every spread of the channel slices: a slice holds both channels of its
    pairs, the rotated ones at the end."""
    spec = ATTN_CASES[case]
    g = _gen(12)
    args, _, _ = _attention_case(g, **spec, formats=formats)
    dev = _on_device(args)
    cos, sin = (x.to(DEVICE) for x in _rope_angles(g, args["q"].shape[0], spec["dim"] // 8))
    plain = tattn.sparse_attention(**dev)
    want = rope_ops.apply_rope_(plain.cpu().clone(), cos.cpu(), sin.cpu(), inverse=True).to(DEVICE)  # (torch ops on the CPU)
    assert not torch.equal(want, plain)
    for spread in ({}, *ATTN_SPREADS):
        y = tattn.sparse_attention(**dev, inverse_rope=(cos, sin), config=spread)
        assert torch.equal(y, want), spread
    ref = attention_ops.sparse_attention_reference(**args, inverse_rope=(cos.cpu(), sin.cpu()))
    assert torch.equal(ref, rope_ops.apply_rope_(attention_ops.sparse_attention_reference(**args), cos.cpu(), sin.cpu(), inverse=True))


@pytest.mark.parametrize("case,formats", [("mixed", "v41"), ("decode", "v41"), ("window_only", "v41")])
def test_sparse_attention_fp8_output_in_the_epilogue(case, formats):
    """`fp8_output`: the PV epilogue quantises the output for an FP8 projection (per 32
    channels, power-of-two exponent) with the bits torch's quantiser gives on the bf16 output,
    with and without the inverse RoPE, under every spread of the channel slices (each holds
    whole 32-channel blocks)."""
    spec = ATTN_CASES[case]
    g = _gen(14)
    args, _, _ = _attention_case(g, **spec, formats=formats)
    dev = _on_device(args)
    t, h, dim = args["q"].shape
    cos, sin = (x.to(DEVICE) for x in _rope_angles(g, t, dim // 8))
    for rope in (None, (cos, sin)):
        plain = tattn.sparse_attention(**dev, inverse_rope=rope).cpu()
        want_codes, want_exps = quant.quantize_fp8_ue8m0(plain.reshape(t, h * dim), 32)
        assert len(set(want_exps.flatten().tolist())) > 1  # blocks of other scales
        for spread in ({}, *ATTN_SPREADS):
            codes, exps = tattn.sparse_attention(**dev, inverse_rope=rope, fp8_output=True, config=spread)
            assert codes.dtype == torch.float8_e4m3fn and codes.shape == (t, h, dim) and exps.shape == (t, h * dim // 32)
            assert torch.equal(codes.cpu().view(torch.uint8).reshape(t, -1), want_codes.view(torch.uint8)), (rope is not None, spread)
            assert torch.equal(exps.cpu(), want_exps), (rope is not None, spread)


def test_attention_fp8_output_feeds_the_grouped_projection():
    """What the model hands wo_a under FP8 activations at decode: the attention's FP8 output
    (`fp8_output`) through `grouped_linear` as codes and exponent bytes, against the per-group
    projections of the bf16 output quantised per block (`quantise_input`, bf16 products)."""
    spec = ATTN_CASES["decode"]
    g = _gen(15)
    args, _, _ = _attention_case(g, **spec, formats="v41")
    dev = _on_device(args)
    t, h, dim = args["q"].shape
    groups, group_rows = 2, 64
    k = h * dim // groups
    weight = (torch.randn(groups * group_rows, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.randint(118, 130, (groups * group_rows // 32, k // 32), generator=g, dtype=torch.uint8)
    whole = Linear(weight.to(DEVICE), scale.to(DEVICE), 32, quant_input=True)
    parts = whole.split_rows([group_rows] * groups)
    # the shapes the model asks about take the codes (on the GPU; the CPU's dtype and device aside)
    assert grouped_takes_codes(whole, groups, t, k, torch.bfloat16, torch.device("cuda"))
    assert not grouped_takes_codes(whole, groups, t, k, torch.bfloat16, torch.device("cpu"))
    codes, exps = tattn.sparse_attention(**dev, fp8_output=True)
    y = grouped_linear((codes.reshape(t, groups, k), exps), whole, parts)
    want = grouped_linear(tattn.sparse_attention(**dev).reshape(t, groups, k), whole, parts)
    assert y.shape == want.shape == (t, groups * group_rows)
    assert _rel_err(y, want) <= 2 * BF16_REL


def test_sparse_attention_rejects_bad_rope_tables():
    spec = ATTN_CASES["decode"]
    args, _, _ = _attention_case(_gen(13), **spec, formats="v41")
    dev = _on_device(args)
    t = args["q"].shape[0]
    for cos in (torch.ones(t, 3), torch.ones(t + 1, 8), torch.ones(t, 128), torch.ones(t)):
        with pytest.raises(ValueError, match="inverse_rope"):
            tattn.sparse_attention(**dev, inverse_rope=(cos.bfloat16().to(DEVICE), cos.bfloat16().to(DEVICE)))


def test_sparse_attention_reads_q_and_kv_new_from_aligned_words(monkeypatch):
    """Both kernels read q and kv_new as int32 words of two channels: views that start 2 bytes
    past a 4-byte boundary (even strides) are copied first, with the contiguous inputs' bits."""
    dev = _on_device(_attention_case(_gen(12), **ATTN_CASES["mixed"])[0])
    whole = tattn.sparse_attention(**dev)
    shifted = dict(dev)
    for name in ("q", "kv_new"):
        x = dev[name]
        view = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
        view.copy_(x)
        assert view.data_ptr() % 4 == 2
        shifted[name] = view
    launches = []
    monkeypatch.setattr(tattn, "_logits_kernel", _Launches(tattn._logits_kernel, "_logits_kernel", launches))
    assert torch.equal(tattn.sparse_attention(**shifted), whole)
    q, kv_new = launches[0].args[:2]
    assert q.data_ptr() % 4 == 0 and kv_new.data_ptr() % 4 == 0


@pytest.mark.parametrize("per_launch", [5, 1])
def test_sparse_attention_slices_tokens_to_bound_the_workspace(monkeypatch, per_launch):
    """With the workspace bound at per_launch tokens' worth, a call runs its tokens in slices
    of that many (a request's tokens split across slices: its window keys from kv_new rows in
    another slice) and gives the bits of one launch over them all."""
    spec = ATTN_CASES["mixed"]
    dev = _on_device(_attention_case(_gen(11), **spec, formats="v4")[0])
    whole = tattn.sparse_attention(**dev)
    t, h = whole.shape[:2]
    n_keys = spec["window"] + spec["n_top"]
    n_tiles = tattn.launch_plan(t, h, spec["dim"], spec["window"], spec["n_top"], whole.device, tattn.CONFIG, 1, 1)["n_tiles"]
    monkeypatch.setattr(tattn, "WORKSPACE_MAX_BYTES", tattn.workspace_bytes(per_launch + 1, h, n_keys, n_tiles) - 1)
    launches = []
    for name in ("_logits_kernel", "_pv_kernel"):
        monkeypatch.setattr(tattn, name, _Launches(getattr(tattn, name), name, launches))
    assert torch.equal(tattn.sparse_attention(**dev), whole)
    sizes = [min(per_launch, t - t0) for t0 in range(0, t, per_launch)]
    assert [(n.name, n.grid[0]) for n in launches] == [(name, n) for n in sizes for name in ("_logits_kernel", "_pv_kernel")]


@pytest.mark.parametrize("formats", ["v4", "v41"])
def test_sparse_attention_skips_empty_tiles_of_wide_tables(monkeypatch, formats):
    """A table wider than SKIP_EMPTY_MIN_ENTRIES (V4 HCA's every visible entry, as wide as the
    capacity) skips its tiles without an entry: the bits of the loops over every tile, at any
    tiling; the skipped tiles' logits are never stored (poisoned workspace: a read would show)."""
    spec = dict(ATTN_CASES["mixed"], n_top=20)
    args, _, _ = _attention_case(_gen(13), **spec, formats=formats)
    visible = (args["positions"] + 1) // 2
    width = 96  # entries 0 .. visible - 1 of every row, then -1 (two requests see fewer than 16)
    cols = torch.arange(width)
    dev = _on_device(dict(args, topk=torch.where(cols < visible.clamp(max=width).unsqueeze(1), cols, -1)))
    small = {"LOGIT_BLOCK_N": 16, "PV_BLOCK_N": 16, "PIECE": 16}
    monkeypatch.setattr(tattn, "SKIP_EMPTY_MIN_ENTRIES", 1 << 30)
    whole = {name: tattn.sparse_attention(**dev, config=cfg) for name, cfg in (("default", {}), ("small", small))}
    monkeypatch.setattr(tattn, "SKIP_EMPTY_MIN_ENTRIES", 0)
    poisoned = _PoisonedTorch()
    monkeypatch.setattr(tattn, "torch", poisoned)
    for name, cfg in (("default", {}), ("small", small)):
        assert torch.equal(tattn.sparse_attention(**dev, config=cfg), whole[name]), name
        assert torch.equal(tattn.sparse_attention(**dev, config={**cfg, "TILES_PER_PROGRAM": 1, "DSPLIT": 4}), whole[name]), name


def test_sparse_attention_workspace_bound_at_hca_widths():
    """An 8192-token chunk of an HCA layer at 1M tokens (8192 compressed entries each) runs in
    launches of as many tokens as fit WORKSPACE_MAX_BYTES; a V4.1 chunk (top-k 512) in one."""
    cfg, cpu = tattn.CONFIG, torch.device("cpu")
    hca = tattn.launch_plan(8192, 64, 512, 128, 8192, cpu, cfg, 1, 8192, fp4_ckv=False)

    def size(tokens: int) -> int:
        return tattn.workspace_bytes(tokens, 64, 128 + 8192, hca["n_tiles"])

    assert size(hca["tokens"]) <= tattn.WORKSPACE_MAX_BYTES < size(hca["tokens"] + 1)
    assert tattn.launch_plan(8192, 64, 512, 128, 512, cpu, cfg, 1, 2048)["tokens"] == 8192


def test_sparse_attention_serves_bf16_caches_on_the_kernel_path(monkeypatch):
    """dsv4.ops.attention.sparse_attention hands V4's unquantised caches to the kernel."""
    monkeypatch.setattr("dsv4.ops.TRITON_ON_CPU", True)
    dev = _on_device(_attention_case(_gen(3), **ATTN_CASES["window_only"], formats="v4")[0])
    assert torch.equal(attention_ops.sparse_attention(**dev), tattn.sparse_attention(**dev))


def test_sparse_attention_rejects_bad_caches():
    """Each cache in neither form (FP8 ring / bf16 ring; FP4 / bf16 compressed KV) is refused
    naming the argument and both forms."""
    args, _, _ = _attention_case(_gen(3), **ATTN_CASES["window_only"], formats="v4")
    fp8, _, _ = _attention_case(_gen(3), **ATTN_CASES["window_only"], formats="v41")
    ring, ckv = args["ring_codes"], args["ckv_codes"]
    bad = [
        ({"ring_codes": ring.half()}, r"ring_codes must be float8_e4m3fn \[S, W, 64\] .* or V4's bf16 values \[S, W, 64\] with ring_scales None"),
        ({"ring_codes": ring[..., :32].contiguous()}, "ring_codes must be"),
        ({"ring_codes": fp8["ring_codes"]}, "ring_codes must be"),  # FP8 codes without their scales
        ({"ring_scales": fp8["ring_scales"]}, "ring_codes must be"),  # bf16 values with scales
        ({"ring_codes": ring.transpose(0, 1).contiguous().transpose(0, 1)}, "ring_codes must be contiguous"),
        ({"ckv_codes": ckv.flatten(0, 1)}, r"ckv_codes must be packed FP4 uint8 \[NB, P, 32\] .* or V4's bf16 values \[NB, P, 64\] with ckv_scales None"),
        ({"ckv_codes": fp8["ckv_codes"]}, "ckv_codes must be"),  # packed FP4 without its scales
        ({"ckv_codes": ckv.float()}, "ckv_codes must be"),
        ({"ckv_codes": ckv.transpose(0, 1).contiguous().transpose(0, 1)}, "ckv_codes must be contiguous"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            tattn.sparse_attention(**_on_device(dict(args, **change)))


def test_dense_ckv_copy_is_the_cache_decoding_in_pieces():
    """Row b * max_blocks * P + j of the dense copy is entry j of request b decoded as the
    torch path decodes it, channels in operand pieces (even then odd channels of each run of
    `piece` pairs); -1 table slots give zero rows."""
    g = _gen(5)
    per_block, dim, piece = 4, 64, 8
    codes, scales = quant.quantize_fp4(torch.randn(6, per_block, dim, generator=g), 16, e4m3_scale=True)
    tables = torch.tensor([[3, 0, -1], [5, 2, 1]])
    dense = tattn.dense_ckv(codes.to(DEVICE), scales.to(DEVICE), tables.to(DEVICE), piece).cpu()
    assert dense.shape == (2 * 3 * per_block, dim) and dense.dtype == torch.bfloat16
    want = quant.dequantize_fp4(codes, scales, torch.bfloat16, 16)[tables.clamp_min(0)]  # [B, max_blocks, P, D]
    want = want.masked_fill((tables < 0)[:, :, None, None], 0).reshape(-1, dim // 2 // piece, piece, 2)
    assert torch.equal(dense, want.transpose(-1, -2).reshape(-1, dim))


def test_sparse_attention_dense_keys_when_used_enough(monkeypatch):
    """"auto" copies the compressed entries when the selections use them DENSE_MIN_USES times
    on average and the copy fits DENSE_MAX_BYTES; never without selections."""
    cfg, cpu = tattn.CONFIG, torch.device("cpu")
    prefill = tattn.launch_plan(8192, 64, 512, 128, 512, cpu, cfg, 1, 2048)
    decode = tattn.launch_plan(64, 64, 512, 128, 512, cpu, cfg, 64, 8192)
    assert prefill["DENSE_CKV"] and not decode["DENSE_CKV"]
    assert not tattn.launch_plan(8192, 64, 512, 128, 0, cpu, cfg, 1, 2048)["DENSE_CKV"]
    assert not tattn.launch_plan(8192, 64, 512, 128, 0, cpu, dict(cfg, DENSE_CKV=True), 1, 2048)["DENSE_CKV"]
    # V4's bf16 entries are read in place, whatever the config says
    assert not tattn.launch_plan(8192, 64, 512, 128, 512, cpu, cfg, 1, 2048, fp4_ckv=False)["DENSE_CKV"]
    assert not tattn.launch_plan(8192, 64, 512, 128, 512, cpu, dict(cfg, DENSE_CKV=True), 1, 2048, fp4_ckv=False)["DENSE_CKV"]
    monkeypatch.setattr(tattn, "DENSE_MAX_BYTES", 2048 * 512 * 2 - 1)
    assert not tattn.launch_plan(8192, 64, 512, 128, 512, cpu, cfg, 1, 2048)["DENSE_CKV"]
    with pytest.raises(ValueError, match="DENSE_CKV"):
        tattn.launch_plan(1, 64, 512, 128, 512, cpu, dict(cfg, DENSE_CKV="yes"), 1, 16)


def test_sparse_attention_launch_plan(monkeypatch):
    """ "auto" spreads few tokens over more programs (never past the tile count or the channel
    slices a head dimension allows; logits tiles before head blocks) and leaves large batches
    at one program per token."""
    cfg = tattn.CONFIG
    cpu = torch.device("cpu")  # 4 SMs stand in for the interpreter
    one = tattn.launch_plan(1, 64, 512, 128, 512, cpu, cfg, 1, 16)  # 5 logits tiles, one a program (dense keys: 2 programs an SM)
    assert one["n_tiles"] == 5 and one["LOGIT_BLOCK_H"] == 64 and one["tiles_per_program"] == 1 and one["logit_programs"] == 5 and one["DSPLIT"] == 2
    assert one["DENSE_CKV"] and tattn.launch_plan(1, 64, 512, 128, 512, cpu, dict(cfg, DENSE_CKV=False), 1, 16)["tiles_per_program"] == 2
    many = tattn.launch_plan(4096, 64, 512, 128, 512, cpu, cfg, 1, 16)
    assert many["LOGIT_BLOCK_H"] == 64 and many["logit_programs"] == 1 and many["DSPLIT"] == 1
    assert tattn.launch_plan(1, 64, 64, 16, 0, cpu, dict(cfg, DSPLIT=8), 1, 16)["DSPLIT"] == 2  # whole 16-pair ring scale groups
    with pytest.raises(ValueError, match="DSPLIT"):
        tattn.launch_plan(1, 64, 512, 128, 512, cpu, dict(cfg, DSPLIT=3), 1, 16)
    with pytest.raises(ValueError, match="LOGIT_BLOCK_H"):
        tattn.launch_plan(1, 64, 512, 128, 512, cpu, dict(cfg, LOGIT_BLOCK_H=8), 1, 16)
    # the H200's 132 SMs: one token gets one tile per program and 16-head blocks (20 logits
    # programs), 8 tokens 32-head blocks (80), 64 tokens all 64 heads in runs of 3 tiles (128
    # programs, one wave: runs of 2 made 192, two waves of 2 tile rounds), 256 one program (16
    # tokens: 64-head blocks); PV: 16 slices of 64-key tiles while they fit one wave (up to 8
    # tokens), then within half the SMs (16 tokens x 4 slices, 64 x 1) with 32-key tiles
    monkeypatch.setattr(tattn, "num_sms", lambda device: 132)
    plans = {t: tattn.launch_plan(t, 64, 512, 128, 512, cpu, cfg, t, 16384) for t in (1, 8, 16, 64, 256)}
    assert [(p["LOGIT_BLOCK_H"], p["tiles_per_program"]) for p in plans.values()] == [(16, 1), (32, 1), (64, 1), (64, 3), (64, 5)]
    assert [(p["DSPLIT"], p["PV_BLOCK_N"]) for p in plans.values()] == [(16, 64), (16, 64), (4, 32), (1, 32), (1, 32)]
    assert tattn.launch_plan(1, 64, 512, 128, 512, cpu, dict(cfg, PV_BLOCK_N=16), 1, 16)["PV_BLOCK_N"] == 16


def test_logit_tiles_per_program_counts_whole_waves():
    """The most tiles a program whose rounds of tiles per SM (waves x tiles) are within 10% of
    the fewest: whole waves, ties to the larger tiles."""
    assert tattn.logit_tiles_per_program(4, 5, 132) == 1  # one token, 16-head blocks: 20 programs
    assert tattn.logit_tiles_per_program(64, 5, 132) == 3  # 128 programs in one wave, not 192 in two
    assert tattn.logit_tiles_per_program(128, 5, 132) == 5  # 5 rounds either way: the larger tiles
    assert tattn.logit_tiles_per_program(4096, 5, 132) == 5  # 156 rounds of 1 tile vs 160 of 5: within 10%
    assert tattn.logit_tiles_per_program(4096, 5, 264) == 5  # two resident programs an SM (the dense form)
    assert tattn.logit_tiles_per_program(1, 65, 132) == 1  # V4's HCA at 1M tokens: 65 tiles, 65 programs


# ----------------------------------------------------------------------------------- sm_90 build


def test_kernels_compile_for_sm90():
    """Every kernel variant the wrappers launch compiles for the H200 (sm_90) with the wheel's
    ptxas, no GPU needed: catches what the interpreter accepts and the compiler does not."""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.exists():
        pytest.skip(f"triton wheel without ptxas ({ptxas})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPO / "scripts/check_kernels.py"), "--compile-only"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("weight_before_down", [True, False])
def test_moe_experts_dense_matches_reference(weight_before_down):
    """The prefill path (grouped bf16 GEMMs over dequantised experts, the fused SwiGLU) against
    the per-expert reference, with an unused expert (an empty group)."""
    t, top_k, n_exp, d, inter, limit = 24, 2, 5, 64, 96, 10.0
    g = _gen(91)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    scores = moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g))
    scores[:, 3] = 0.0  # expert 3 gets no token
    weights, ids = moe_ref.route(scores, torch.zeros(n_exp), top_k, None, 1.5, True)
    assert not (ids == 3).any() and len(ids.unique()) == n_exp - 1
    w1 = [Linear(_dequant_rows(w13[e, :inter], s13[e, :inter])) for e in range(n_exp)]
    w3 = [Linear(_dequant_rows(w13[e, inter:], s13[e, inter:])) for e in range(n_exp)]
    w2l = [Linear(_dequant_rows(w2[e], s2[e])) for e in range(n_exp)]
    ref = moe_ref.experts_forward(x, weights, ids, w1, w2l, w3, limit, weight_before_down).float()
    dev = [a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)]
    y = moe.moe_experts_dense(*dev, limit, weight_before_down)
    assert y.dtype == torch.float32 and y.shape == (t, d)
    if weight_before_down:  # the same rounding points as the reference
        assert _rel_err(y, ref) <= 2 * BF16_REL
    else:  # the reference sums in bf16
        assert (y.cpu() - ref).abs().max() <= 3 * BF16_REL * ref.abs().max()
    # the grouped (decode) kernels on the same inputs: the same roundings
    assert _rel_err(y, moe.moe_experts(*dev, limit, weight_before_down).cpu()) <= 2 * BF16_REL
    # out_dtype bf16 (V4.1's layer output): the fp32 sum rounded once, in the slot-sum kernel
    for kernel in (moe.moe_experts_dense, moe.moe_experts):
        want = kernel(*dev, limit, weight_before_down)
        got = kernel(*dev, limit, weight_before_down, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), want.cpu().bfloat16())


@pytest.mark.parametrize("dense", [False, True], ids=["grouped", "dense"])
def test_moe_shared_expert_after_rounding(dense):
    """V4's shared expert in the stack (the highest id, every token's last slot at weight 1):
    with `shared_after_rounding` the routed sum is rounded to bf16 and the shared output added
    to it in bf16 — bit for bit the routed-only and shared-only calls combined that way."""
    t, top_k, n_exp, d, inter, limit = 9, 2, 5, 64, 96, 10.0
    g = _gen(97)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16()
    stack = _experts(n_exp + 1, d, inter, g)  # expert n_exp: the shared one
    weights, ids = moe_ref.route(moe_ref.sqrtsoftplus(torch.randn(t, n_exp, generator=g)), torch.zeros(n_exp), top_k, None, 1.5, True)
    shared_ids, ones = torch.full((t, 1), n_exp), torch.ones(t, 1)
    kernel = moe.moe_experts_dense if dense else moe.moe_experts
    call = lambda i, w, *a, **kw: kernel(*(v.to(DEVICE) for v in (x, i, w, *stack)), limit, False, *a, **kw).cpu()
    routed, shared = call(ids, weights), call(shared_ids, ones)
    got = call(torch.cat([ids, shared_ids], 1), torch.cat([weights, ones], 1), torch.bfloat16, shared_after_rounding=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (routed.bfloat16().float() + shared).bfloat16())
    assert not torch.equal(got, (routed + shared).bfloat16())  # one rounding more than V4.1's sum
    with pytest.raises(ValueError, match="shared_after_rounding gives a bf16 sum"):
        call(ids, weights, torch.float32, shared_after_rounding=True)


def test_moe_experts_dense_rejects_bad_inputs(monkeypatch):
    g = _gen(5)
    w13, s13, w2, s2 = _experts(2, 64, 96, g)
    x = torch.randn(3, 64, generator=g).bfloat16()
    ids, weights = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(TypeError, match="bfloat16"):
        moe.moe_experts_dense(x.float(), ids, weights, w13, s13, w2, s2, 10.0, True)
    with pytest.raises(ValueError, match="shapes"):
        moe.moe_experts_dense(x[:, :32], ids, weights, w13, s13, w2, s2, 10.0, True)
    empty = moe.moe_experts_dense(x[:0], ids[:0], weights[:0], w13, s13, w2, s2, 10.0, True)
    assert empty.shape == (0, 64) and empty.dtype == torch.float32
    for kernel in (moe.moe_experts_dense, moe.moe_experts):
        with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
            kernel(x, ids, weights, w13, s13, w2, s2, 10.0, True, torch.float16)
        assert kernel(x[:0], ids[:0], weights[:0], w13, s13, w2, s2, 10.0, True, torch.bfloat16).dtype == torch.bfloat16
    monkeypatch.setitem(moe.MOE, "DENSE_TEMP_BYTES", w13.numel())  # half the bf16 copy
    assert not moe.dense_fits(w13)
    with pytest.raises(ValueError, match="DENSE_TEMP_BYTES"):
        moe.moe_experts_dense(x, ids, weights, w13, s13, w2, s2, 10.0, True)


# ----------------------------------------------------------------------------------- router


def _router_case(t: int, e: int, d: int, seed: int):
    """bf16 hidden states and an fp32 gate whose row 0 of logits is exactly 25, -30, 21, 19.5
    on its first experts (x[0] is one-hot: softplus's linear branch and its small tail)."""
    g = _gen(seed)
    x = (torch.randn(t, d, generator=g) * 0.5).bfloat16()
    x[0] = 0
    x[0, 0] = 1
    gate = torch.randn(e, d, generator=g) * 0.3
    gate[:4, 0] = torch.tensor([25.0, -30.0, 21.0, 19.5])
    return x, gate, torch.randn(e, generator=g) * 0.1


@pytest.mark.parametrize("t,e,k,normalize,extra", [(5, 64, 6, True, 64), (3, 384, 6, True, None), (4, 8, 1, False, None), (2, 20, 3, False, 20)])
def test_route_scores_matches_reference(t, e, k, normalize, extra, monkeypatch):
    """The fp32 gate GEMM (3 K chunks) and the routing against the torch path: the same experts
    in the same (descending) order, weights to fp32 rounding of the logits."""
    from dsv4.ops import moe as moe_ops
    from dsv4.ops.triton import mhc as tmhc
    from dsv4.ops.triton import router

    monkeypatch.setitem(tmhc.CONFIG, "CHUNK", 128)
    x, gate, bias = _router_case(t, e, 320, seed=t * e + k)
    want_w, want_ids = moe_ops.route_scores(x, gate, bias, k, 1.7, 2.5, normalize, extra)  # CPU: torch
    got_w, got_ids = router.route_scores(x.to(DEVICE), gate.to(DEVICE), bias.to(DEVICE), k, 1.7, 2.5, normalize, extra)
    width = k + (extra is not None)
    assert got_w.shape == got_ids.shape == (t, width) and got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids)
    assert torch.allclose(got_w.cpu(), want_w, rtol=1e-5, atol=0)


def test_route_scores_rows_do_not_depend_on_batch(monkeypatch):
    """A token alone (one row tile, one program per K chunk) gets the bits it gets in a batch of
    150 (three row tiles: split as well while its partials fit `mhc.SPLIT_MAX_BYTES`; with the
    cap at 0, every chunk in one program on the interpreter's 4 'SMs')."""
    from dsv4.ops.triton import mhc as tmhc
    from dsv4.ops.triton import router

    monkeypatch.setitem(tmhc.CONFIG, "CHUNK", 128)
    x, gate, bias = _router_case(150, 64, 320, seed=5)
    # halves times eighths: every chunk's sum is exact whatever the order of its products, as
    # the interpreter's numpy matmul orders them by the column block's width (the split calls
    # take 32 columns, the others 64) differently on different CPUs; what is left to see is
    # the order of the chunk sums
    x, gate = ((x.float() * 2).round().clamp(-4, 4) / 2).bfloat16(), (gate * 8).round() / 8
    # token 0's chunk sums are 1e8, -1e8 and gate[:, 256]: added in order they give the last,
    # in any other order it is lost (so the test sees the order of the chunk sums)
    x[0] = 0
    x[:, [0, 128]] = 0  # (the other tokens leave the two large columns alone)
    x[0, [0, 128, 256]] = 1
    gate[:, 0], gate[:, 128] = 1e8, -1e8
    x, gate, bias = x.to(DEVICE), gate.to(DEVICE), bias.to(DEVICE)
    # the batch's partials (3 x 150 x 64 fp32) fit SPLIT_MAX_BYTES: it splits too, unless the cap is 0
    assert tmhc.fp32_gemm_parts(x, gate, False).shape[0] == 3
    split_batch = router.route_scores(x, gate, bias, 6, 1.7, 2.5, True, 64)
    monkeypatch.setattr(tmhc, "SPLIT_MAX_BYTES", 0)
    assert tmhc.fp32_gemm_parts(x[:1], gate, False).shape[0] == 3 and tmhc.fp32_gemm_parts(x, gate, False).shape[0] == 1
    batch = router.route_scores(x, gate, bias, 6, 1.7, 2.5, True, 64)
    assert all(torch.equal(a, b) for a, b in zip(split_batch, batch))
    for i in (0, 77, 149):
        alone = router.route_scores(x[i : i + 1], gate, bias, 6, 1.7, 2.5, True, 64)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, batch))


def test_route_scores_step_parts_give_the_chunk_parts_bits(monkeypatch):
    """Few tokens run the gate GEMM one program per K step (`mhc.fp32_gemm_step_parts`) and
    the routing adds the step products chunk by chunk (`mhc.add_step_parts`): the bits of the
    chunk partials. Token 0's steps 0 .. 3 (chunks 0 and 1, two steps each) give 1e8, g,
    -1e8, g per expert (g = j / 8, below half an ulp of 1e8): added chunk by chunk both g are
    lost, added in one run the second survives — so the test sees the grouping and the order."""
    from dsv4.ops.triton import mhc as tmhc
    from dsv4.ops.triton import router

    monkeypatch.setitem(tmhc.CONFIG, "CHUNK", 128)  # 2 steps of BLOCK_K 64 a chunk, 3 chunks
    x, gate, bias = _router_case(5, 64, 384, seed=9)
    x[0, :256] = 0
    x[0, [0, 64, 128, 192]] = 1
    g = torch.arange(64) / 8
    gate[:, 0], gate[:, 64], gate[:, 128], gate[:, 192] = 1e8, g, -1e8, g
    x, gate, bias = x.to(DEVICE), gate.to(DEVICE), bias.to(DEVICE)
    part, steps = tmhc.fp32_gemm_step_parts(x, gate)
    assert part.shape[0] == 6 and steps == 2
    monkeypatch.setattr(router, "STEP_PARTS_MAX_ROWS", 0)
    want = router.route_scores(x, gate, bias, 6, 1.7, 2.5, True, 64)
    monkeypatch.setattr(router, "STEP_PARTS_MAX_ROWS", 16)
    got = router.route_scores(x, gate, bias, 6, 1.7, 2.5, True, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="whole chunks"):
        tmhc.fp32_gemm_step_parts(x[:, :320], gate[:, :320].contiguous())


def test_route_scores_breaks_ties_by_lowest_id_and_rejects_bad_inputs():
    from dsv4.ops.triton import router

    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)  # every logit exactly 0
    gate = torch.randn(8, 64, generator=_gen(1)).to(DEVICE)
    w, ids = router.route_scores(x, gate, torch.zeros(8, device=DEVICE), 3, 1.0, 1.0, True)
    assert ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]] and torch.allclose(w.cpu(), torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="top_k"):
        router.route_scores(x, gate, torch.zeros(8, device=DEVICE), 9, 1.0, 1.0, True)
    with pytest.raises(ValueError, match="bf16"):
        router.route_scores(x.float(), gate, torch.zeros(8, device=DEVICE), 2, 1.0, 1.0, True)
    with pytest.raises(ValueError, match="gate fp32"):
        router.route_scores(x, gate.bfloat16(), torch.zeros(8, device=DEVICE), 2, 1.0, 1.0, True)


@pytest.mark.parametrize("t,e,k,normalize,extra,hashed", [(5, 256, 6, True, 256, False), (4, 64, 6, True, None, True), (3, 8, 1, False, 8, False)],
                         ids=["learned", "hash", "top1"])
def test_route_logits_matches_reference(t, e, k, normalize, extra, hashed):
    """V4's routing from bf16 logits against its torch ops: the same experts in the same order,
    weights bit for bit — every bf16 rounding of the torch ops (softplus, sqrt, the sum, + 1e-20,
    the division, the scale) happens in the kernel too; row 0 takes softplus's linear branch
    (25, 21) and its deep tail (-30)."""
    from dsv4.ops import moe as moe_ops
    from dsv4.ops.triton import router

    g = _gen(t * e + k)
    logits = (torch.randn(t, e, generator=g) * 2).bfloat16()
    logits[0, :4] = torch.tensor([25.0, -30.0, 21.0, 19.5]).bfloat16()
    bias = None if hashed else torch.randn(e, generator=g) * 0.1
    fixed = torch.randint(0, e, (t, k), generator=g) if hashed else None
    want_w, want_ids = moe_ops.route_logits(logits, bias, k, 1.5, normalize, fixed, extra)  # CPU: torch
    got_w, got_ids = router.route_logits(logits.to(DEVICE), None if bias is None else bias.to(DEVICE), k, 1.5, normalize,
                                         None if fixed is None else fixed.to(DEVICE), extra)
    width = k + (extra is not None)
    assert got_w.shape == got_ids.shape == (t, width) and got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.cpu(), want_ids)
    assert torch.equal(got_w.cpu(), want_w)
    if hashed:
        assert torch.equal(got_ids.cpu(), fixed)


def test_route_logits_rejects_bad_inputs():
    from dsv4.ops.triton import router

    logits = torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    w, ids = router.route_logits(logits, bias, 3, 1.0, True)  # equal scores: the lowest ids
    assert ids.cpu().tolist() == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ValueError, match="top_k"):
        router.route_logits(logits, bias, 9, 1.0, True)
    with pytest.raises(ValueError, match="bf16"):
        router.route_logits(logits.float(), bias, 2, 1.0, True)
    with pytest.raises(ValueError, match="bias"):
        router.route_logits(logits, None, 2, 1.0, True)
    with pytest.raises(ValueError, match="fixed ids"):
        router.route_logits(logits, None, 2, 1.0, True, torch.zeros(2, 3, dtype=torch.long, device=DEVICE))

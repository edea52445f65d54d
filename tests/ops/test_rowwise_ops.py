"""The row-wise Triton kernels (RMSNorm, RoPE and its tables) against the torch references, in Triton's
interpreter on CPU (tests/ops/conftest.py), on random non-zero bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.storage import QTensor
from dsv4.config import parse_config
from dsv4.ops import attention, kv, norm, rope

pytest.importorskip("triton", reason="triton is not installed")
from dsv4.ops.triton import kv as kv_triton  # noqa: E402
from dsv4.ops.triton import rowwise  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""
    ia, ib = a.cpu().view(torch.int16).int(), b.cpu().view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # order-preserving image of the sign-magnitude bits
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("weight_in_fp32", [False, True])
@pytest.mark.parametrize("shape", [(5, 96), (3, 2, 200)])
def test_rms_norm_matches_reference(shape, weight_in_fp32):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    w = (torch.randn(shape[-1], generator=g) + 1).to(torch.float32 if weight_in_fp32 else torch.bfloat16)
    ref = norm.rms_norm(x, w, 1e-6, weight_in_fp32)
    out = rowwise.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, weight_in_fp32)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert _ulps(out, ref) <= 1  # the mean's summation order may move the last bit
    # a row alone has the bits it has in the batch
    assert torch.equal(rowwise.rms_norm(x[:1].to(DEVICE), w.to(DEVICE), 1e-6, weight_in_fp32), out[:1])


def test_head_norm_matches_reference():
    """V4's q heads: the unweighted norm whose scale is rounded to bf16 before the multiply
    (so not `rms_norm` with unit weights, which rounds the product of the fp32 values once)."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(4, 3, 256, generator=g) * 3).bfloat16()
    ref = norm.head_norm(x, 1e-6)
    out = rowwise.rms_norm(x.to(DEVICE), None, 1e-6, False)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert _ulps(out, ref) <= 1  # the mean's summation order may move the last bit
    assert not torch.equal(ref, norm.rms_norm(x, torch.ones(256), 1e-6, True))  # the rounding point shows
    assert torch.equal(rowwise.rms_norm(x[:1].to(DEVICE), None, 1e-6, False), out[:1])
    # eighths up to 8: every square and sum is exact in fp32 in any order, so the kernel must
    # give the reference's bits, which a product rounded once (no bf16 scale) does not
    exact = (torch.randint(-64, 65, (4, 3, 256), generator=g).float() / 8).bfloat16()
    want = norm.head_norm(exact, 1e-6)
    assert torch.equal(rowwise.rms_norm(exact.to(DEVICE), None, 1e-6, False).cpu(), want)
    assert not torch.equal(want, norm.rms_norm(exact, torch.ones(256), 1e-6, True))


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape,half", [((4, 3, 64), 8), ((6, 48), 16), ((2, 32), 16)])
def test_rope_matches_reference(shape, half, inverse):
    g = torch.Generator().manual_seed(shape[-1] + half)
    x = (torch.randn(*shape, generator=g) * 2).bfloat16()
    angles = torch.randn(shape[0], half, generator=g) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    ref = rope.apply_rope(x, cos, sin, inverse)
    assert torch.equal(ref[..., : -2 * half], x[..., : -2 * half])  # the copy: x itself unchanged
    # the kernel rotates in place; x is the first half of wider rows, whose second half must
    # stay as it was
    wide = torch.full((shape[0], *shape[1:-1], 2 * shape[-1]), 7.0).bfloat16()
    wide[..., : shape[-1]] = x
    wide_dev = wide.to(DEVICE)
    target = wide_dev[..., : shape[-1]]
    out = rowwise.apply_rope_(target, cos.to(DEVICE), sin.to(DEVICE), inverse)
    assert out.data_ptr() == target.data_ptr() and out.shape == x.shape
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(wide_dev[..., shape[-1] :].cpu(), wide[..., shape[-1] :])
    assert not torch.equal(out.cpu()[..., -2 * half :], x[..., -2 * half :])  # it did rotate
    # the torch code in place too
    assert torch.equal(rope.apply_rope_(x.clone(), cos, sin, inverse), ref)


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_rope_tables_match_reference(kind):
    """V4.1-Flash's frequencies (YaRN on the compressed kind) at positions to 1M. The GPU gives
    the same bits (the same libdevice cosf / sinf: scripts/check_kernels.py `rope_tables`); the
    interpreter's numpy cos / sin may round an angle's fp32 value the other way, moving a
    table entry by one bf16 unit now and then."""
    from dsv4.cache.reference_configs import released_v41_config

    cfg = parse_config(released_v41_config())
    inv = rope.inv_freq(cfg, kind)
    g = torch.Generator().manual_seed(len(kind))
    positions = torch.cat([torch.arange(300), torch.randint(0, 1 << 20, (700,), generator=g)])
    cos_ref, sin_ref = rope.cos_sin(positions, inv, torch.bfloat16)
    cos, sin = rowwise.rope_tables(positions.to(DEVICE), inv.to(DEVICE), torch.bfloat16)
    assert cos.shape == (1000, cfg.rope_dim // 2) and cos.dtype == sin.dtype == torch.bfloat16
    for got, ref in ((cos, cos_ref), (sin, sin_ref)):
        assert _ulps(got, ref) <= 1
        assert (got.cpu() == ref).float().mean() > 0.99
    # grouped positions (a compressed entry's angle) are just positions: any int dtype, any order
    cos32, _ = rowwise.rope_tables(positions.flip(0).int().to(DEVICE), inv.to(DEVICE), torch.bfloat16)
    assert torch.equal(cos32.flip(0), cos)
    # the model's entry point serves CPU tensors with the torch code
    tables = rope.RopeTables(cfg, torch.bfloat16, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(tables.cos_sin(positions, kind), (cos_ref, sin_ref)))


def _quantized(width: int) -> QTensor:
    """A quantised cache's descriptor (its codes' content is never read by a round trip)."""
    return QTensor(codes=torch.zeros(1, 1, width, dtype=torch.uint8), scales=torch.zeros(1, 1, 1, dtype=torch.uint8))


def _angles(rows: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(rows, half, generator=torch.Generator().manual_seed(seed)) * 3
    return a.cos().bfloat16(), a.sin().bfloat16()


@pytest.mark.parametrize("weight_in_fp32,fp8", [(False, True), (True, False)])
def test_latent_inputs_match_the_separate_ops(weight_in_fp32, fp8):
    """One launch for the attention's latent inputs: q_res = rms_norm(q_a); kv = the window's
    rounding of RoPE(rms_norm(kv)) — the same bits as the separate kernels (V4.1: bf16
    weights, FP8 ring; V4: fp32 weights, bf16 ring), and within the norms' last bit of the
    torch code."""
    g = torch.Generator().manual_seed(3)
    t, qn, kvn, half = 5, 96, 128, 16
    qkv = (torch.randn(t, qn + kvn + 8, generator=g) * 3).bfloat16()[:, : qn + kvn]  # rows at a wider stride
    dtype = torch.float32 if weight_in_fp32 else torch.bfloat16
    qw, kvw = (torch.randn(qn, generator=g) + 1).to(dtype), (torch.randn(kvn, generator=g) + 1).to(dtype)
    cos, sin = _angles(t, half, 4)
    ring = _quantized(kvn) if fp8 else QTensor(values=torch.zeros(1, 1, kvn))
    dev = [a.to(DEVICE) for a in (qkv, qw, kvw, cos, sin)]
    q, kv_out = rowwise.latent_inputs(dev[0], qn, dev[1], dev[2], 1e-6, weight_in_fp32, dev[3], dev[4], fp8)
    assert q.shape == (t, qn) and kv_out.shape == (t, kvn) and q.dtype == kv_out.dtype == torch.bfloat16
    # the separate kernels, one after the other
    sep_kv = rowwise.apply_rope_(rowwise.rms_norm(dev[0][:, qn:], dev[2], 1e-6, weight_in_fp32), dev[3], dev[4])
    if fp8:
        sep_kv = kv_triton.round_trip("window", sep_kv)
    assert torch.equal(q.cpu(), rowwise.rms_norm(dev[0][:, :qn], dev[1], 1e-6, weight_in_fp32).cpu())
    assert torch.equal(kv_out.cpu(), sep_kv.cpu())
    # the torch code (the op's CPU path), to the norms' last bit before the rotation and rounding
    ref_q, ref_kv = attention.latent_inputs(qkv, qn, qw, kvw, 1e-6, weight_in_fp32, cos, sin, ring)
    assert _ulps(q, ref_q) <= 1
    assert (kv_out.cpu() - ref_kv).abs().max() <= 0.02 * ref_kv.abs().max()
    if fp8:  # the rounding happened: few distinct magnitudes per block
        assert not torch.equal(ref_kv, rope.apply_rope_(norm.rms_norm(qkv[:, qn:], kvw, 1e-6, weight_in_fp32), cos, sin))
    # a row alone has the bits it has in the batch
    q1, kv1 = rowwise.latent_inputs(dev[0][2:3], qn, dev[1], dev[2], 1e-6, weight_in_fp32, dev[3][2:3], dev[4][2:3], fp8)
    assert torch.equal(q1, q[2:3]) and torch.equal(kv1, kv_out[2:3])


@pytest.mark.parametrize("fp4", [True, False])
def test_rope_queries_match_the_separate_ops(fp4):
    """One launch rotates the attention's query heads and the indexer's (their own angles, then
    the keys' FP4 rounding): the same bits as `apply_rope_` and `round_trip`, in place in the
    stacked projection's output; a call without indexer heads rotates q alone."""
    g = torch.Generator().manual_seed(7)
    t, h, d, half, ih, idim, ihalf = 3, 5, 64, 8, 4, 64, 16
    out = (torch.randn(t, h * d + ih * idim, generator=g) * 2).bfloat16()
    cos, sin = _angles(t, half, 1)
    icos, isin = _angles(t, ihalf, 2)
    got = out.clone().to(DEVICE)
    q, idx_q = (p.view(t, -1, w) for p, w in zip(got.split([h * d, ih * idim], dim=-1), (d, idim)))
    rowwise.rope_queries_(q, cos.to(DEVICE), sin.to(DEVICE), idx_q, icos.to(DEVICE), isin.to(DEVICE), fp4)
    want_q = rowwise.apply_rope_(out[:, : h * d].reshape(t, h, d).clone().to(DEVICE), cos.to(DEVICE), sin.to(DEVICE))
    want_i = rowwise.apply_rope_(out[:, h * d :].reshape(t, ih, idim).clone().to(DEVICE), icos.to(DEVICE), isin.to(DEVICE))
    if fp4:
        want_i = kv_triton.round_trip("idx", want_i)
    assert torch.equal(q.cpu(), want_q.cpu()) and torch.equal(idx_q.cpu(), want_i.cpu())
    assert not torch.equal(got.cpu(), out)  # it did change them
    # the op's torch code: the same, in place
    ref = out.clone()
    rq, ri = (p.view(t, -1, w) for p, w in zip(ref.split([h * d, ih * idim], dim=-1), (d, idim)))
    attention.rope_queries_(rq, cos, sin, ri, icos, isin, _quantized(idim) if fp4 else QTensor(values=torch.zeros(1, 1, idim)))
    assert torch.equal(ref, got.cpu())
    # q alone
    q_only = out[:, : h * d].reshape(t, h, d).clone().to(DEVICE)
    rowwise.rope_queries_(q_only, cos.to(DEVICE), sin.to(DEVICE))
    assert torch.equal(q_only.cpu(), want_q.cpu())


def test_bad_shapes_are_refused():
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="weight must be"):
        rowwise.rms_norm(x, torch.ones(32), 1e-6, False)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rowwise.apply_rope_(x, torch.ones(4, 12), torch.ones(4, 12))
    with pytest.raises(ValueError, match="unit channel stride"):
        rowwise.apply_rope_(torch.randn(4, 64, 2).bfloat16()[..., 0], torch.ones(4, 8), torch.ones(4, 8))
    with pytest.raises(ValueError, match="latent_inputs: kv width 48"):
        rowwise.latent_inputs(torch.randn(4, 112).bfloat16(), 64, torch.ones(64), torch.ones(48), 1e-6, False, torch.ones(4, 8), torch.ones(4, 8), True)
    with pytest.raises(ValueError, match="latent_inputs: norm weights"):
        rowwise.latent_inputs(torch.randn(4, 128).bfloat16(), 64, torch.ones(32), torch.ones(64), 1e-6, False, torch.ones(4, 8), torch.ones(4, 8), True)
    with pytest.raises(ValueError, match="rope_queries_: q"):
        rowwise.rope_queries_(torch.randn(4, 2, 64).bfloat16(), torch.ones(3, 8), torch.ones(3, 8))
    with pytest.raises(ValueError, match="rope_queries_: idx_q"):
        rowwise.rope_queries_(torch.randn(4, 2, 64).bfloat16(), torch.ones(4, 8), torch.ones(4, 8), torch.randn(4, 2, 48).bfloat16(),
                              torch.ones(4, 8), torch.ones(4, 8), True)
    with pytest.raises(ValueError, match="rope_tables: positions"):
        rowwise.rope_tables(torch.arange(4), torch.ones(12), torch.bfloat16)

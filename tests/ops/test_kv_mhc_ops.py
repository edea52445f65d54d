"""Masked cache stores and fused mHC: Triton kernels against their torch references.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py);
the real shapes and timings are checked on the H200 by scripts/check_kernels.py (sections
kv_store and mhc).

* stores: the kernel's bytes (codes and scales) equal `kv.store`'s for the valid rows, on
  inputs built to hit every rounding rule (ties, clamps, subnormals, zeros, -0); masked rows
  with garbage indices (out of range, negative, duplicates of valid targets) write nothing.
* mHC: within fp32 rounding of an fp64 evaluation of the same math (as close as the fp32 torch
  reference is), and a row's bits do not depend on its batch or on the split.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.storage import CKV_BLOCK, FP8_BLOCK, IDX_BLOCK, QTensor, _alloc
from dsv4.model import quant
from dsv4.ops import kv as kvops
from dsv4.ops import mhc
from dsv4.ops.norm import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/ops/conftest.py set TRITON_INTERPRET=1

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton) — kernel tests skipped")

from dsv4.ops.triton import kv as tkv
from dsv4.ops.triton import mhc as tmhc

BF16_REL = 2.0**-8  # half a bf16 ulp, relative


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------- stores

KINDS = {"window": ("fp8", FP8_BLOCK), "ckv": ("fp4_e4m3", CKV_BLOCK), "idx": ("fp4_ue8m0", IDX_BLOCK)}


def _e4m3_midpoints() -> torch.Tensor:
    """Every tie of the e4m3 grid (subnormal and normal), and 448."""
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.cat([(grid[1:] + grid[:-1]) / 2, grid[-1:]])


FP4_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
# torch's cast to float8_e4m3fn saturates finite overflow to 448 from 2.12 on (the kernel's rule);
# older torch gives NaN above 464, so there the compressed-KV scales are kept in range (the
# saturation itself: test_ckv_scale_saturates).
E4M3_CAST_SATURATES = bool(torch.tensor(1e4).to(torch.float8_e4m3fn).float() == 448)


def _adversarial(kind: str, t: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows x [t, d] whose blocks hit the quantiser's rules: per block a scale (power of two for
    ue8m0 formats, an E4M3 value for the compressed KV), the block's amax at the top of the grid
    times that scale and the other values on rounding ties (and their neighbours) times it;
    magnitudes from fp32 subnormals to 2**100 (compressed KV: past the E4M3 scale's range where
    torch's cast saturates); plus zero blocks, -0 blocks, mixed signed zeros, and plain random
    blocks."""
    block = KINDS[kind][1]
    nb = d // block
    top = 448.0 if kind == "window" else 6.0
    ties = _e4m3_midpoints() if kind == "window" else FP4_TIES
    ties = torch.cat([ties, torch.nextafter(ties, torch.zeros_like(ties)), torch.nextafter(ties, torch.full_like(ties, 100.0))])
    x = torch.empty(t, nb, block)
    for r in range(t):
        for b in range(nb):
            style = int(torch.randint(0, 8, (1,), generator=g))
            if kind == "ckv":
                codes = torch.randint(1, 127, (1,), generator=g, dtype=torch.uint8)
                scale = codes.view(torch.float8_e4m3fn).float() * 2.0 ** float(torch.randint(-6, 12 if E4M3_CAST_SATURATES else 1, (1,), generator=g))
            else:
                scale = torch.tensor(2.0 ** float(torch.randint(-140, 100, (1,), generator=g)))
            if style == 0:
                vals = torch.zeros(block)
            elif style == 1:
                vals = torch.full((block,), -0.0)
            elif style == 2:  # signed zeros and tiny values around a small amax
                vals = torch.where(torch.rand(block, generator=g) < 0.5, -0.0, 0.0)
                vals[:3] = torch.tensor([1e-30, -3e-41, 2e-5])
            elif style == 3:
                vals = torch.randn(block, generator=g) * scale
            else:  # amax at the top of the grid, the rest on ties and their neighbours
                pick = ties[torch.randint(0, ties.numel(), (block,), generator=g)]
                sign = torch.where(torch.rand(block, generator=g) < 0.5, -1.0, 1.0)
                vals = pick * sign * scale
                vals[int(torch.randint(0, block, (1,), generator=g))] = top * scale
            x[r, b] = vals
    return x.flatten(1).to(dtype)


def _masked_case(t: int, s: int, r: int, g: torch.Generator, frac: float = 0.6):
    """(i0, i1, mask): distinct in-range targets for the valid rows (some given as negative
    indices, which count from the end); masked rows carry garbage — far out of range, negative,
    or a valid row's target (a write there would be seen)."""
    mask = torch.rand(t, generator=g) < frac
    mask[0] = True
    n = int(mask.sum())
    assert n <= s * r
    flat = torch.randperm(s * r, generator=g)[:n]
    i0 = torch.empty(t, dtype=torch.long)
    i1 = torch.empty(t, dtype=torch.long)
    i0[mask], i1[mask] = flat // r, flat % r
    neg = mask & (torch.rand(t, generator=g) < 0.2)
    i0[neg] -= s
    i1[neg] -= r
    garbage = torch.tensor([2**40, -(2**40), 2**31 - 1, -1, s, -s - 1])
    bad = ~mask
    i0[bad] = garbage[torch.randint(0, garbage.numel(), (int(bad.sum()),), generator=g)]
    i1[bad] = garbage[torch.randint(0, garbage.numel(), (int(bad.sum()),), generator=g)]
    dup = bad & (torch.rand(t, generator=g) < 0.5)  # duplicates of row 0's (valid) target
    i0[dup], i1[dup] = i0[0], i1[0]
    return i0, i1, mask


def _filled(shape: tuple, d: int, quant_kind: str | None, dtype: torch.dtype, g: torch.Generator) -> QTensor:
    """A cache tensor with random bytes everywhere, so that a stray write shows."""
    q = _alloc(shape, d, quant_kind, dtype, "cpu")
    for name in ("values", "codes", "scales"):
        ten = getattr(q, name)
        if ten is not None:
            raw = torch.randint(0, 256, (ten.numel() * ten.element_size(),), generator=g, dtype=torch.uint8)
            ten.view(-1).view(torch.uint8).copy_(raw)  # compared as bytes: NaN patterns are fine
    return q


def _bytes(q: QTensor) -> list[torch.Tensor]:
    return [t.cpu().clone().view(-1).view(torch.uint8) for t in (q.values, q.codes, q.scales) if t is not None]


def _on(q: QTensor, device: str) -> QTensor:
    """A copy of q on `device` (never sharing q's memory)."""
    return QTensor(*(t.to(device, copy=True) if t is not None else None for t in (q.values, q.codes, q.scales)))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_rows_bit_exact_with_masks(kind, dtype):
    """Kernel bytes == the reference `store` of the valid rows; nothing else changes."""
    g = _gen(len(kind) * 10 + (dtype == torch.float32))
    quant_kind, block = KINDS[kind]
    d = 4 * block if kind != "window" else 96  # window: 3 blocks (a padded block axis)
    t, s, r = 45, 6, 9
    x = _adversarial(kind, t, d, dtype, g)
    i0, i1, mask = _masked_case(t, s, r, g)
    ref = _filled((s, r), d, quant_kind, torch.bfloat16, g)
    dev = _on(ref, DEVICE)
    kvops.store(ref, (i0[mask], i1[mask]), x[mask], kind)
    tkv.store_rows(dev, kind, x.to(DEVICE), (i0.to(DEVICE), i1.int().to(DEVICE)), mask.to(DEVICE))
    for a, b in zip(_bytes(dev), _bytes(ref)):
        assert torch.equal(a, b)
    # the dispatcher's CPU branch is the same reference
    cpu = _filled((s, r), d, quant_kind, torch.bfloat16, _gen(0))
    again = QTensor(*(t.clone() if t is not None else None for t in (cpu.values, cpu.codes, cpu.scales)))
    kvops.store_rows(cpu, kind, x, (i0, i1.int()), mask)
    kvops.store(again, (i0[mask], i1[mask]), x[mask], kind)
    for a, b in zip(_bytes(cpu), _bytes(again)):
        assert torch.equal(a, b)


def test_ckv_scale_saturates():
    """Blocks whose amax / 6 is past the E4M3 range (just above 448, above 464 where torch < 2.12
    gives NaN, far above) store the scale 448 and the codes of x / 448: the expected bytes come
    from the format's rules (quant's e2m1 rounding), not from torch's cast."""
    g = _gen(14)
    top = torch.tensor([6 * 449.0, 6 * 470.0, 6 * 1e5, 6 * 3e30])
    x = torch.randn(4, 16, generator=g) * top[:, None] / 8
    x[:, 3] = top
    x = x.flatten()[None].bfloat16()
    q = _alloc((1, 1), 64, "fp4_e4m3", torch.bfloat16, "cpu")
    dev = _on(q, DEVICE)
    tkv.store_rows(dev, "ckv", x.to(DEVICE), (torch.zeros(1, dtype=torch.long, device=DEVICE),) * 2, torch.ones(1, dtype=torch.bool, device=DEVICE))
    q_vals = (x.float().view(4, 16) / 448.0).clamp(-6, 6)
    assert torch.equal(dev.scales.cpu().view(torch.uint8).flatten(), torch.full((4,), 0x7E, dtype=torch.uint8))
    assert torch.equal(dev.codes.cpu().flatten(), quant.pack_fp4(quant.e2m1_codes(q_vals).flatten()))


def test_adversarial_inputs_hit_the_rules():
    """The adversarial rows really contain ties (the test above would be weak otherwise)."""
    x = _adversarial("idx", 8, 64, torch.float32, _gen(1))
    codes, exps = quant.quantize_fp4(x, 32, e4m3_scale=False)
    scale = torch.exp2(exps.float() - 127).repeat_interleave(32, -1)
    q = (x / scale).abs()
    assert torch.isin(q, FP4_TIES).sum() > 20 and (x == 0).any() and torch.signbit(x[x == 0]).any()


@pytest.mark.parametrize("x_dtype,cache_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_store_rows_unquantised(x_dtype, cache_dtype):
    """V4 / odd widths: values stored in the cache dtype (fp32 -> bf16 rounds to nearest even)."""
    g = _gen(4)
    t, s, r, d = 30, 5, 7, 40
    x = (torch.randn(t, d, generator=g) * 3).to(x_dtype)
    i0, i1, mask = _masked_case(t, s, r, g)
    ref = _filled((s, r), d, None, cache_dtype, g)
    dev = _on(ref, DEVICE)
    kvops.store(ref, (i0[mask], i1[mask]), x[mask], "window")
    tkv.store_rows(dev, "window", x.to(DEVICE), (i0.to(DEVICE), i1.to(DEVICE)), mask.to(DEVICE))
    assert torch.equal(_bytes(dev)[0], _bytes(ref)[0])


@pytest.mark.parametrize("d", [24, 1100])  # one column tile / two (BLOCK_D 1024) with a partial one
def test_store_plain_fp32_tails(d):
    g = _gen(d)
    t, s, r = 12, 4, 3
    x = torch.randn(t, d, generator=g).bfloat16()
    i0, i1, mask = _masked_case(t, s, r, g)
    dst = torch.randn(s, r, d, generator=g)
    want = dst.clone()
    want[i0[mask], i1[mask]] = x[mask].float()
    got = dst.to(DEVICE, copy=True)
    tkv.store_plain(got, (i0.to(DEVICE), i1.to(DEVICE)), x.to(DEVICE), mask.to(DEVICE))
    assert torch.equal(got.cpu(), want)
    cpu = dst.clone()
    kvops.store_plain(cpu, (i0, i1), x, mask)
    assert torch.equal(cpu, want)


def test_store_rows_all_masked_and_empty():
    g = _gen(6)
    q = _filled((3, 4), 64, "fp4_e4m3", torch.bfloat16, g)
    before = _bytes(q)
    dev = _on(q, DEVICE)
    x = torch.randn(5, 64, generator=g).to(DEVICE)
    junk = torch.full((5,), 2**40, device=DEVICE)
    tkv.store_rows(dev, "ckv", x, (junk, -junk), torch.zeros(5, dtype=torch.bool, device=DEVICE))
    tkv.store_rows(dev, "ckv", x[:0], (junk[:0], junk[:0]), torch.zeros(0, dtype=torch.bool, device=DEVICE))
    for a, b in zip(_bytes(dev), before):
        assert torch.equal(a, b)


def test_store_rows_drops_valid_rows_out_of_range():
    """A valid row whose index is out of range (the torch path raises IndexError) is dropped by
    the kernel, never written past the tensor: the cache is a window into a larger buffer and
    the rows around it must not change."""
    g = _gen(8)
    s, r, d = 3, 4, 64
    big = _filled((s + 2, r), d, "fp8", torch.bfloat16, g)
    dev = _on(big, DEVICE)
    inner = QTensor(codes=dev.codes[1 : s + 1], scales=dev.scales[1 : s + 1])
    x = torch.randn(4, d, generator=g).to(DEVICE)
    i0 = torch.tensor([s, -s - 1, 0, 0], device=DEVICE)  # rows 0, 1: the neighbours' rows
    i1 = torch.tensor([0, 0, r, 1], device=DEVICE)  # row 2: offset r lands in the next row
    tkv.store_rows(inner, "window", x, (i0, i1), torch.ones(4, dtype=torch.bool, device=DEVICE))
    want = _on(big, "cpu")
    kvops.store(QTensor(codes=want.codes[1 : s + 1], scales=want.scales[1 : s + 1]), (torch.tensor([0]), torch.tensor([1])), x[3:].cpu(), "window")
    for a, b in zip(_bytes(dev), _bytes(want)):
        assert torch.equal(a, b)


def test_store_rows_rejects_bad_arguments():
    q = _alloc((3, 4), 64, "fp8", torch.bfloat16, "cpu")
    x = torch.randn(5, 64)
    ix = (torch.zeros(5, dtype=torch.long), torch.arange(5) % 4)
    ok = torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match="kind must be one of"):
        kvops.store_rows(q, "kv", x, ix, ok)
    with pytest.raises(ValueError, match="mask must be bool"):
        kvops.store_rows(q, "window", x, ix, ok.int())
    with pytest.raises(ValueError, match=r"index\[1\] must be int32/int64 \[5\]"):
        kvops.store_rows(q, "window", x, (ix[0], ix[1][:4]), ok)
    with pytest.raises(ValueError, match="width 64"):
        kvops.store_rows(q, "window", x[:, :32], ix, ok)
    with pytest.raises(ValueError, match="holds"):  # a window cache is not an FP4 cache
        kvops.store_rows(q, "ckv", x, ix, ok)
    with pytest.raises(ValueError, match=r"x must be \[T, 8\]"):
        kvops.store_plain(torch.zeros(3, 4, 8), ix, x, ok)


# ----------------------------------------------------------------------------------- mHC


def _mhc_case(t: int, hc: int, d: int, seed: int):
    g = _gen(seed)
    x = (torch.randn(t, hc, d, generator=g) * torch.exp(torch.randn(t, 1, 1, generator=g))).bfloat16()
    n, k = (2 + hc) * hc, hc * d
    fn = torch.randn(n, k, generator=g) * k**-0.5  # mixes of order 1
    base = torch.randn(n, generator=g) * 0.5
    scale = torch.tensor([0.7, 1.3, 2.5])
    return x, fn, base, scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).abs() / b.double().cpu().abs()).max().item()


@pytest.mark.parametrize("t,hc,d,iters", [(70, 4, 72, 20), (3, 2, 72, 3)])
def test_hc_mixes_accuracy_and_split(t, hc, d, iters, monkeypatch):
    """fp32-accurate: against fp64, the kernel is within 2x the fp32 reference's own error (and
    1e-6 absolute-relative level); the split (one program per K chunk) and unsplit launches give
    the same bits. Chunks of 128 inputs: several chunks, the last one partial (K = hc*d)."""
    monkeypatch.setitem(tmhc.CONFIG, "CHUNK", 128)
    x, fn, base, scale = _mhc_case(t, hc, d, seed=t)
    args = (fn.to(DEVICE), base.to(DEVICE), scale.to(DEVICE), hc, iters, 1e-6, 1e-6)
    ref = mhc.hc_mixes(x, fn, base, scale, hc, iters, 1e-6, 1e-6)  # CPU: the torch reference
    exact = mhc.hc_mixes_fp64(x, fn, base, scale, hc, iters, 1e-6, 1e-6)
    assert tmhc.fp32_chunks(hc * d)[1] > 1
    outs = {}
    for sms in (1, 1000):  # never / always split
        monkeypatch.setattr(tmhc, "num_sms", lambda device, sms=sms: sms)
        outs[sms] = tmhc.hc_mixes(x.to(DEVICE), *args)
    for got, again, want, oracle in zip(outs[1], outs[1000], ref, exact):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, again)
        assert _rel(got, oracle) <= max(2e-6, 2 * _rel(want, oracle))
        assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("t,n,k", [(3, 1024, 320), (70, 96, 448)])
def test_fp32_gemm_accuracy_split_and_rows(t, n, k, monkeypatch):
    """`fp32_gemm` (the compressor's and router's fp32 projections): against fp64 within 2x the
    fp32 torch GEMM's own error; split (one program per K chunk, then the in-order chunk sum)
    and unsplit launches give the same bits, and so does a row alone. Chunks of 128 inputs,
    the last one partial; N = 96 pads to 128 columns."""
    from dsv4.ops.linear import linear_fp32

    monkeypatch.setitem(tmhc.CONFIG, "CHUNK", 128)
    g = _gen(t + n)
    x = torch.randn(t, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * 0.05
    exact = x.double() @ w.double().T
    want = x.float() @ w.T
    outs = {}
    for sms in (1, 1000):  # never / always split
        monkeypatch.setattr(tmhc, "num_sms", lambda device, sms=sms: sms)
        outs[sms] = tmhc.fp32_gemm(x.to(DEVICE), w.to(DEVICE)).cpu()
        assert torch.equal(tmhc.fp32_gemm(x[1:2].to(DEVICE), w.to(DEVICE)).cpu()[0], outs[sms][1])
    got = outs[1]
    assert got.dtype == torch.float32 and got.shape == (t, n) and torch.equal(got, outs[1000])
    # errors relative to the output's scale: element by element, the worst is a near-cancelled
    # element, whose ratio depends on the CPU's summation order (torch's own came out 2x apart
    # on two CPUs)
    scaled = lambda a: ((a.double().cpu() - exact).abs().max() / exact.abs().max()).item()
    assert scaled(got) <= max(1e-6, 2 * scaled(want))
    import dsv4.ops

    monkeypatch.setattr(dsv4.ops, "TRITON_ON_CPU", True)  # (on CPU tensors the op runs torch's GEMM otherwise)
    assert torch.equal(linear_fp32(x.to(DEVICE), w.to(DEVICE)).cpu(), got)  # the op dispatches to the kernel


def test_hc_mixes_rows_do_not_depend_on_batch(monkeypatch):
    """A row alone (one tile, split into 2 chunks) has the bits it has in a 200-row batch (4
    tiles, not split on the interpreter's 4 'SMs')."""
    monkeypatch.setitem(tmhc.CONFIG, "CHUNK", 128)
    x, fn, base, scale = _mhc_case(200, 4, 64, seed=9)
    dev = [a.to(DEVICE) for a in (x, fn, base, scale)]
    batch = tmhc.hc_mixes(*dev, 4, 20, 1e-6, 1e-6)
    for i in (0, 131, 199):
        alone = tmhc.hc_mixes(dev[0][i : i + 1], *dev[1:], 4, 20, 1e-6, 1e-6)
        for a, b in zip(alone, batch):
            assert torch.equal(a[0], b[i])


def _mixes_for(x: torch.Tensor, seed: int):
    g = _gen(seed)
    t, hc, _ = x.shape
    pre = torch.rand(t, hc, generator=g) + 0.1
    post = 2 * torch.rand(t, hc, generator=g)
    comb = torch.softmax(torch.randn(t, hc, hc, generator=g), dim=-1)
    return pre, post, comb


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |got - ref| in bf16 ulps of each element of ref."""
    ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(1e-38))) - 7)
    return ((got.float().cpu() - ref.float()).abs() / ulp).max().item()


@pytest.mark.parametrize("d", [72, 256])
@pytest.mark.parametrize("block_d", [1024, 32], ids=["one-slice", "slices"])
def test_hc_collapse_and_norm(monkeypatch, d, block_d):
    """Collapse, and collapse + RMSNorm in both weight roundings (bf16 and fp32 weights),
    against the torch composition: rounding level (same roundings, summation order aside). The
    bf16-weight norm rounds twice, bf16(w * bf16(normed)): a one-ulp flip of bf16(normed) (its
    rstd's sums in another order) is up to two ulps of the result. Rows in one column slice
    or in several (a partial one at d = 72), whose norm adds the slices' partial sums."""
    monkeypatch.setattr(tmhc, "COLLAPSE_BLOCK_D", block_d)
    g = _gen(d)
    x = (torch.randn(40, 4, d, generator=g) * 3).bfloat16()
    pre, _, _ = _mixes_for(x, d)
    xd, pd = x.to(DEVICE), pre.to(DEVICE)
    ref = mhc.hc_collapse(x, pre)
    got = tmhc.hc_collapse(xd, pd)
    assert got.dtype == torch.bfloat16 and (got.float().cpu() - ref.float()).abs().max() <= 2 * BF16_REL * ref.float().abs().max()
    for weight_in_fp32, w in ((False, torch.randn(d, generator=g).bfloat16()), (True, torch.randn(d, generator=g))):
        ref = rms_norm(mhc.hc_collapse(x, pre), w, 1e-6, weight_in_fp32)
        assert torch.equal(mhc.hc_collapse_norm(x, pre, w, 1e-6, weight_in_fp32), ref)  # CPU: the composition
        got = tmhc.hc_collapse_norm(xd, pd, w.to(DEVICE), 1e-6, weight_in_fp32)
        assert got.dtype == torch.bfloat16
        assert _ulps(got, ref) <= (1 if weight_in_fp32 else 2)
        assert torch.equal(tmhc.hc_collapse_norm(xd[7:8], pd[7:8], w.to(DEVICE), 1e-6, weight_in_fp32)[0], got[7])


@pytest.mark.parametrize("fp32", [True, False], ids=["v41", "v4"])
def test_hc_expand(monkeypatch, fp32):
    """The expand against the reference, in V4.1's fp32 and V4's activation-dtype roundings
    (the latter bit for bit: exact products, four-term fp32 sums); several column tiles (a
    partial one); batch invariant."""
    monkeypatch.setattr(tmhc, "EXPAND_BLOCK_D", 32)
    g = _gen(12)
    t, hc, d = 25, 4, 72
    residual = (torch.randn(t, hc, d, generator=g) * 2).bfloat16()
    y = torch.randn(t, d, generator=g).bfloat16()
    _, post, comb = _mixes_for(residual, 12)
    ref = mhc.hc_expand_reference(y, residual, post, comb, fp32)
    dev = [a.to(DEVICE) for a in (y, residual, post, comb)]
    got = tmhc.hc_expand(*dev, fp32)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    if fp32:
        assert ((got.float().cpu() - ref.float()).abs() <= 2 * BF16_REL * ref.float().abs() + 1e-6).all()
    else:
        assert torch.equal(got.cpu(), ref)
        assert not torch.equal(got.cpu(), mhc.hc_expand_reference(y, residual, post, comb, True))  # the two roundings differ
    alone = tmhc.hc_expand(*(a[3:4] for a in dev), fp32)
    assert torch.equal(alone[0], got[3])


@pytest.mark.parametrize("d", [72, 256])
@pytest.mark.parametrize("block_d", [1024, 32], ids=["one-slice", "slices"])
def test_hc_expand_collapse_norm_is_the_two_kernels(monkeypatch, d, block_d):
    """V4.1's expand and the next site's collapse + norm in one pass over the streams: the
    same bits as the two kernels one after the other (streams and h), and the op's CPU path is
    the torch composition; a row alone keeps its bits; one column slice a row or several."""
    monkeypatch.setattr(tmhc, "COLLAPSE_BLOCK_D", block_d)
    g = _gen(d + 1)
    t, hc = 9, 4
    residual = (torch.randn(t, hc, d, generator=g) * 2).bfloat16()
    y = torch.randn(t, d, generator=g).bfloat16()
    pre, post, comb = _mixes_for(residual, d)
    w = torch.randn(d, generator=g).bfloat16()
    dev = [a.to(DEVICE) for a in (y, residual, post, comb, pre, w)]
    streams, h = tmhc.hc_expand_collapse_norm(*dev, 1e-6)
    want_streams = tmhc.hc_expand(*dev[:4], True)
    assert torch.equal(streams.cpu(), want_streams.cpu())
    assert torch.equal(h.cpu(), tmhc.hc_collapse_norm(want_streams, dev[4], dev[5], 1e-6, False).cpu())
    ref_streams, ref_h = mhc.hc_expand_collapse_norm(y, residual, post, comb, pre, w, 1e-6)
    assert torch.equal(ref_streams, mhc.hc_expand_reference(y, residual, post, comb, True))
    assert torch.equal(ref_h, rms_norm(mhc.hc_collapse(ref_streams, pre), w, 1e-6, False))
    alone = tmhc.hc_expand_collapse_norm(*(a[4:5] for a in dev[:5]), dev[5], 1e-6)
    assert torch.equal(alone[0][0], streams[4]) and torch.equal(alone[1][0], h[4])
    with pytest.raises(ValueError, match=r"weight \[%d\]" % d):
        mhc.hc_expand_collapse_norm(y, residual, post, comb, pre, w[:8], 1e-6)


def test_mhc_rejects_bad_arguments():
    x, fn, base, scale = _mhc_case(3, 4, 16, seed=1)
    with pytest.raises(ValueError, match=r"fn must be \[24, 64\]"):
        mhc.hc_mixes(x, fn[:, :32], base, scale, 4, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"streams must be \[T, hc=2, D\]"):
        mhc.hc_mixes(x, fn, base, scale, 2, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="iters"):
        mhc.hc_mixes(x, fn, base, scale, 4, 0, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"pre must be \[3, 4\]"):
        mhc.hc_collapse(x, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        mhc.hc_collapse_norm(x, torch.ones(3, 4), torch.ones(8), 1e-6, False)
    with pytest.raises(ValueError, match=r"comb must be \[3, 4, 4\]"):
        mhc.hc_expand(x[:, 0], x, torch.ones(3, 4), torch.ones(3, 4), True)

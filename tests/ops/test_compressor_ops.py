"""The compressor's fused entry kernel against its torch reference (`ops.compressor`).

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py).
One batch holds every case the step meets: a decode row whose group started in an earlier
step (its first position from the tail slot), a prefill from position 0 with a trailing
incomplete group, a chunk that starts mid-group and ends with one, a prefix hit whose first
groups are cached already (emit_from), and a padding request (no blocks, writes nothing).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.storage import _alloc
from dsv4.ops import compressor
from dsv4.ops import kv as kvops
from dsv4.ops.rope import apply_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/ops/conftest.py set TRITON_INTERPRET=1

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton) — kernel tests skipped")

from dsv4.ops.triton import compressor as tcompressor

W, ROPE_PAIRS, BLOCK_SIZE = 128, 16, 8
# (start, count, emit_from) per request; the last is the padding request
REQUESTS = [(9, 1, 0), (0, 7, 0), (5, 2, 0), (2, 4, 4), (0, 1, 1 << 62)]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""
    ia, ib = a.cpu().view(torch.int16).int(), b.cpu().view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


def _case(ratio: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    starts, counts, emit_from = (torch.tensor([r[i] for r in REQUESTS]) for i in range(3))
    b = len(REQUESTS)
    req = torch.repeat_interleave(torch.arange(b), counts).int()
    row0 = (torch.cumsum(counts, 0) - counts).int()
    positions = starts[req.long()] + torch.arange(req.numel()) - row0[req.long()]
    write = req != b - 1
    n_rows = req.numel()
    n_blocks = 16
    tables = torch.randperm(n_blocks, generator=g)[: (b - 1) * 2].view(b - 1, 2).int()
    tables = torch.cat([tables, torch.full((1, 2), -1, dtype=torch.int32)])  # the padding request has no blocks
    slots = torch.tensor([3, 0, 2, 1, 0])
    ckv = _alloc((n_blocks, BLOCK_SIZE // ratio), W, "fp4_e4m3", torch.bfloat16, "cpu")
    ckv.codes.copy_(torch.randint(0, 256, ckv.codes.shape, generator=g, dtype=torch.uint8))  # garbage where nothing is written
    ckv.scales.copy_(torch.rand(ckv.scales.shape, generator=g).to(torch.float8_e4m3fn))
    angles = torch.randn(n_rows, ROPE_PAIRS, generator=g) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    norm_w = (torch.rand(W, generator=g) + 0.5).bfloat16()
    if ratio > 1:
        both = torch.randn(n_rows, 2 * W, generator=g) * 2  # kv and gate: column halves of one GEMM output
        kv, gate = both[:, :W], both[:, W:]
        tail_kv, tail_gate = (torch.randn(4, ratio, W, generator=g) * 2 for _ in range(2))
    else:
        kv, gate, tail_kv, tail_gate = (torch.randn(n_rows, W, generator=g) * 2).bfloat16(), None, None, None
    args = [kv, gate, tail_kv, tail_gate, req, positions, starts, row0, write, slots, emit_from, tables, norm_w, 1e-6, cos, sin, ckv]
    return args, ratio


def _on(device, args):
    return [a.to(device) if isinstance(a, torch.Tensor) else (type(a)(codes=a.codes.clone().to(device), scales=a.scales.clone().to(device))
            if hasattr(a, "codes") else a) for a in args]


@pytest.mark.parametrize("ratio", [2, 1])
def test_compress_entries_kernel_matches_reference(ratio):
    args, r = _case(ratio, seed=ratio)
    before = (args[-1].codes.clone(), args[-1].scales.clone())
    ref_args = _on("cpu", args)
    ref_latent, ref_where, ref_emit = compressor.compress_entries(*ref_args, r, BLOCK_SIZE, torch.bfloat16)
    dev_args = _on(DEVICE, args)
    latent, where, emit = tcompressor.compress_entries(*dev_args, r, BLOCK_SIZE, torch.bfloat16)
    assert latent.dtype == torch.bfloat16 and latent.shape == ref_latent.shape
    assert _ulps(latent, ref_latent) <= 2  # the norm's sum of squares in another order (2: then x the weight)
    assert torch.equal(emit.cpu(), ref_emit) and torch.equal(where[1].cpu(), ref_where[1])
    # the block ids of the emitting rows (the others' are only read for masked stores)
    assert torch.equal(where[0].cpu()[ref_emit], ref_where[0][ref_emit])
    expect = {2: [True, False, True, False, True, False, True, False, True, False, False, False, False, True, False],
              1: None}[r]
    if expect is not None:  # which rows complete a group that is not cached yet
        assert ref_emit.tolist() == expect
    # the cache: exactly what the torch store writes for the kernel's own entries, nothing else
    want = _on("cpu", [ref_args[-1]])[0]
    want.codes.copy_(before[0])
    want.scales.copy_(before[1])
    kvops.store_rows(want, "ckv", apply_rope(latent.cpu(), ref_args[14], ref_args[15]), ref_where, ref_emit)
    got = dev_args[-1]
    assert torch.equal(got.codes.cpu(), want.codes)
    assert torch.equal(got.scales.cpu().view(torch.uint8), want.scales.view(torch.uint8))
    assert not torch.equal(got.codes.cpu(), before[0])  # it did store
    # and the torch reference's own cache where the entries agree bit for bit
    same = (latent.cpu() == ref_latent).all(dim=1)
    rows = ref_emit & same
    loc = (ref_where[0][rows], ref_where[1][rows])
    assert torch.equal(got.codes.cpu()[loc], ref_args[-1].codes[loc])


def test_compress_entries_kernel_rejects_widths_it_cannot_tile():
    args, r = _case(1, seed=6)
    bad = list(args)
    bad[0] = args[0][:, :96]  # 48 pairs: not a power of two
    with pytest.raises(ValueError, match="power-of-two entry width"):
        tcompressor.compress_entries(*_on(DEVICE, bad), r, BLOCK_SIZE, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 entries"):
        tcompressor.compress_entries(*_on(DEVICE, args), r, BLOCK_SIZE, torch.float32)


def test_compress_entries_rejects_bad_arguments():
    args, r = _case(2, seed=5)
    call = lambda a, ratio=2: compressor.compress_entries(*a, ratio, BLOCK_SIZE, torch.bfloat16)
    bad = list(args)
    bad[2] = args[2][:, :1]
    with pytest.raises(ValueError, match="tail_kv must be fp32"):
        call(bad)
    bad = list(args)
    bad[1] = None
    with pytest.raises(ValueError, match="torch.float32 kv and gate"):
        call(bad)
    bad = list(args)
    bad[14] = args[14][:3]
    with pytest.raises(ValueError, match="cos / sin must be"):
        call(bad)
    bad = list(args)
    bad[4] = args[4][:2]
    with pytest.raises(ValueError, match="req and positions"):
        call(bad)
    with pytest.raises(ValueError, match="ratio 1 takes the entries"):
        call(args, ratio=1)
    with pytest.raises(ValueError, match="ratio must be >= 1"):
        call(args, ratio=0)

"""The compressor's fused entry kernel against its torch reference (`ops.compressor`).

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py).
One batch holds every case the step meets: a decode row whose group started in an earlier
step (its first position from the tail slot), a prefill from position 0 with a trailing
incomplete group, a chunk that starts mid-group and ends with one, a prefix hit whose first
groups are cached already (emit_from), and a padding request (no blocks, writes nothing).
V4.1 (fp32 pooling, FP4 cache) and V4 (position bias, bf16 pooling, bf16 cache; CSA's
overlapping windows read from and then update the overlap state, HCA's ratio 128).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.storage import QTensor, _alloc
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


# V4 (bf16 projections, position bias, bf16 cache): (start, count, emit_from, slot) per request,
# the last one padding (its rows write nothing). Entries of E channels, RoPE on 4 pairs.
V4_E, V4_ROPE_PAIRS = 16, 4
V4_CSA = [  # ratio 4, overlapping windows (projections 2E wide, the overlap state)
    (11, 1, 0, 5),  # decode completing window 2: positions 8-10 from the tail, window 1's Ca from the state
    (0, 10, 0, 1),  # prefill: window 0 (nothing before it), window 1 (window 0's Ca from the step), a trailing part
    (6, 7, 0, 3),  # a chunk from mid-window: window 1 (4-5 from the tail, window 0's Ca from the state), window 2
    #                (window 1's Ca from the tail and the step), a trailing part
    (0, 12, 8, 0),  # a prefix hit: windows 0 and 1 cached already (not stored; the state still moves)
    (1, 2, 0, 2),  # completes nothing: its state stays
    (0, 4, 1 << 62, 1),  # padding that would complete window 0, on the prefill's slot: writes nothing
]
V4_HCA = [  # ratio 128, no overlap (a prefix hit: as CSA's; each pooling row costs the interpreter ~0.5 s here)
    (255, 1, 0, 1),  # decode completing group 1, its first 127 positions from the tail
    (120, 10, 0, 0),  # a chunk completing group 0 (positions 0-119 from the tail), a trailing part
    (300, 1, 0, 2),  # decode inside a group: pools nothing
    (0, 1, 1 << 62, 0),  # padding
]


def _v4_case(ratio: int, requests, overlap: bool, seed: int, block_size: int):
    """compress_entries' arguments (and V4Pooling) for V4's compressor over `requests`."""
    g = torch.Generator().manual_seed(seed)
    starts, counts, emit_from, slots = (torch.tensor([r[i] for r in requests]) for i in range(4))
    b, width = len(requests), 2 * V4_E if overlap else V4_E
    req = torch.repeat_interleave(torch.arange(b), counts).int()
    row0 = (torch.cumsum(counts, 0) - counts).int()
    positions = starts[req.long()] + torch.arange(req.numel()) - row0[req.long()]
    write = req != b - 1
    n_rows, n_slots, per_block = req.numel(), 6, block_size // ratio
    n_blocks = 4 * b
    tables = torch.randperm(n_blocks, generator=g)[: (b - 1) * 4].view(b - 1, 4).int()
    tables = torch.cat([tables, torch.full((1, 4), -1, dtype=torch.int32)])  # the padding request has no blocks
    ckv = QTensor(values=torch.randn(n_blocks, per_block, V4_E, generator=g).bfloat16())  # garbage where nothing is written
    angles = torch.randn(n_rows, V4_ROPE_PAIRS, generator=g) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    norm_w = torch.rand(V4_E, generator=g) + 0.5  # V4 multiplies by it in fp32: fp32 values show it (the model's are bf16)
    kv, gate = ((torch.randn(n_rows, width, generator=g) * 2).bfloat16() for _ in range(2))
    # the tails and state hold fp32 of bf16 values; arbitrary fp32 here checks they are read as the reference reads them
    tail_kv, tail_gate = (torch.randn(n_slots, ratio, width, generator=g) * 2 for _ in range(2))
    ape = torch.randn(ratio, width, generator=g)
    prev = [torch.randn(n_slots, ratio, V4_E, generator=g) * 2 for _ in range(2)] if overlap else [None, None]
    v4 = compressor.V4Pooling(ape, overlap, *prev, counts)
    args = [kv, gate, tail_kv, tail_gate, req, positions, starts, row0, write, slots, emit_from, tables, norm_w, 1e-6, cos, sin, ckv]
    return args, v4


def _v4_on(device, args, v4):
    moved = [a.to(device) if isinstance(a, torch.Tensor) else QTensor(values=a.values.clone().to(device)) if isinstance(a, QTensor) else a
             for a in args]
    state = [None if t is None else t.clone().to(device) for t in (v4.prev_kv, v4.prev_gate)]
    return moved, compressor.V4Pooling(v4.ape.to(device), v4.overlap, *state, v4.count.to(device))


def _expected_state(args, v4, ratio):
    """The overlap state after the step, request by request from its definition: a request whose
    written rows complete a window keeps the Ca half of the last one (kv, gate + ape) — its
    positions from the step's rows or, before them, the tail as bf16."""
    kv, gate, tail_kv, tail_gate, req, positions, starts, row0, write, slots = args[:10]
    prev_kv, prev_gate = v4.prev_kv.clone(), v4.prev_gate.clone()
    for b, (first, count) in enumerate(zip(starts.tolist(), v4.count.tolist())):
        rows = [t for t in range(len(req)) if req[t] == b]
        done = [t for t in rows if positions[t] % ratio == ratio - 1]
        if not done or not write[done[-1]]:
            continue
        window = range(int(positions[done[-1]]) - ratio + 1, int(positions[done[-1]]) + 1)
        slot, e = int(slots[b]), V4_E
        for j, q in enumerate(window):
            at = int(row0[b]) + q - first
            k, g = (kv[at], gate[at]) if q >= first else (tail_kv[slot, j].bfloat16(), tail_gate[slot, j].bfloat16())
            prev_kv[slot, j] = k[:e].float()
            prev_gate[slot, j] = g[:e].float() + v4.ape[j, :e]
    return prev_kv, prev_gate


@pytest.mark.parametrize("ratio, overlap, block_size, apart_tile", [(4, True, 8, None), (128, False, 256, None), (128, False, 256, 256)],
                         ids=["csa", "hca", "hca-4-slices"])
def test_compress_entries_kernel_matches_reference_v4(ratio, overlap, block_size, apart_tile, monkeypatch):
    """V4's compressors: the position bias, bf16 pooling, the fp32-weight norm, the bf16 cache;
    CSA's overlapping windows and their state (read from it, then its update). HCA's groups
    pool in a launch of their own (`_pool_kernel`), its rows' channels in one slice or four."""
    assert (2 * ratio if overlap else ratio) > tcompressor.FUSED_MAX_SLOTS or ratio == 4
    if apart_tile is not None:  # 2 of the 8 pairs a program
        monkeypatch.setattr(tcompressor, "APART_TILE", apart_tile)
    requests = V4_CSA if overlap else V4_HCA
    args, v4 = _v4_case(ratio, requests, overlap, seed=ratio, block_size=block_size)
    before = args[-1].values.clone()
    ref_args, ref_v4 = _v4_on("cpu", args, v4)
    ref_latent, ref_where, ref_emit = compressor.compress_entries(*ref_args, ratio, block_size, torch.bfloat16, v4=ref_v4)
    dev_args, dev_v4 = _v4_on(DEVICE, args, v4)
    latent, where, emit = tcompressor.compress_entries(*dev_args, ratio, block_size, torch.bfloat16, v4=dev_v4)
    if overlap:  # the op's second launch (`update_overlap_state` on CUDA), after the pooling read the state
        kv, gate, tail_kv, tail_gate, _, _, starts, row0, write, slots = dev_args[:10]
        tcompressor.overlap_state(dev_v4, kv, gate, tail_kv, tail_gate, starts, row0, write, slots, ratio)
    latent = latent.cpu()
    assert latent.dtype == torch.bfloat16 and latent.shape == ref_latent.shape == (len(args[4]), V4_E)
    completes = args[5] % ratio == ratio - 1
    # as V4.1's; on CUDA also expf against the CPU's exp (a weight's bf16 rounding may move)
    assert _ulps(latent[completes], ref_latent[completes]) <= 2
    assert not latent[~completes].any() and not ref_latent[~completes].any()  # rows that complete no group: zeros
    assert torch.equal(emit.cpu(), ref_emit) and torch.equal(where[1].cpu(), ref_where[1])
    assert torch.equal(where[0].cpu()[ref_emit], ref_where[0][ref_emit])
    stored = [q % ratio == ratio - 1 and q - q % ratio >= emit_from and b < len(requests) - 1  # padding stores nothing
              for b, (first, count, emit_from, _) in enumerate(requests) for q in range(first, first + count)]
    assert ref_emit.tolist() == stored
    # the cache: exactly the kernel's own entries where a row emits, nothing else
    want = QTensor(values=before.clone())
    kvops.store_rows(want, "ckv", apply_rope(latent, ref_args[14], ref_args[15]), ref_where, ref_emit)
    got = dev_args[-1].values.cpu()
    assert torch.equal(got.view(torch.int16), want.values.view(torch.int16))
    assert not torch.equal(got, before)  # it did store
    same = (latent == ref_latent).all(dim=1) & ref_emit
    loc = (ref_where[0][same], ref_where[1][same])
    assert same.any() and torch.equal(got[loc], ref_args[-1].values[loc])
    if overlap:  # the state: each request's last completed window, as the reference leaves it
        want_kv, want_gate = _expected_state(args, v4, ratio)
        assert not torch.equal(want_kv, v4.prev_kv)  # the step moves it
        for got_state, ref_state, want_state in ((dev_v4.prev_kv, ref_v4.prev_kv, want_kv), (dev_v4.prev_gate, ref_v4.prev_gate, want_gate)):
            assert torch.equal(ref_state, want_state) and torch.equal(got_state.cpu(), want_state)


def test_compress_entries_kernel_rejects_widths_it_cannot_tile():
    args, r = _case(1, seed=6)
    bad = list(args)
    bad[0] = args[0][:, :96]  # 48 pairs: not a power of two
    with pytest.raises(ValueError, match="power-of-two entry width"):
        tcompressor.compress_entries(*_on(DEVICE, bad), r, BLOCK_SIZE, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 entries"):
        tcompressor.compress_entries(*_on(DEVICE, args), r, BLOCK_SIZE, torch.float32)


def test_compress_entries_kernel_rejects_bad_v4_arguments():
    args, v4 = _v4_case(4, V4_CSA, True, seed=7, block_size=8)
    dev_args, dev_v4 = _v4_on(DEVICE, args, v4)
    call = lambda a, v: tcompressor.compress_entries(*a, 4, 8, torch.bfloat16, v4=v)
    bf16_ape = compressor.V4Pooling(dev_v4.ape.bfloat16(), True, dev_v4.prev_kv, dev_v4.prev_gate, dev_v4.count)
    with pytest.raises(ValueError, match="ape in fp32"):
        call(dev_args, bf16_ape)
    kv, gate, tail_kv, tail_gate, _, _, starts, row0, write, slots = dev_args[:10]
    with pytest.raises(ValueError, match="ape in fp32"):
        tcompressor.overlap_state(bf16_ape, kv, gate, tail_kv, tail_gate, starts, row0, write, slots, 4)
    with pytest.raises(ValueError, match="share their strides"):
        tcompressor.overlap_state(dev_v4, kv, gate.contiguous().clone()[:, :], tail_kv, tail_gate.transpose(1, 2).contiguous().transpose(1, 2),
                                  starts, row0, write, slots, 4)
    bad = list(dev_args)
    bad[0], bad[1] = dev_args[0][:, :24], dev_args[1][:, :24]  # entries of 12 channels: 6 pairs
    with pytest.raises(ValueError, match="power-of-two entry width"):
        call(bad, dev_v4)


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

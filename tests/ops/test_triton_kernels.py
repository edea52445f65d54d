"""Triton kernels against their torch references on random non-zero inputs, at small shapes.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before the
kernels are imported); with CUDA they are compiled for the GPU. The real shapes and timings are
checked on the H200 by scripts/check_kernels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4.cache.storage import QTensor
from dsv4.model import quant
from dsv4.ops import kv as kvops
from dsv4.ops import moe as moe_ref
from dsv4.ops.linear import Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton) — kernel tests skipped")


def _patch_interpreter() -> None:
    """Work around three defects of Triton 3.6's interpreter so that it computes what the GPU
    computes: (1) scalars are 1-element arrays and `int()` of them fails with numpy 2.4 (here)
    (loop bounds derived from program ids); (2) `tl.dot` of bf16 operands multiplies their raw
    uint16 bit patterns; (3) fp32 -> bf16 casts truncate instead of rounding to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp, "_dsv4_patched", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_fp32(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    create_dot = interp.InterpreterBuilder.create_dot

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    cast_impl = interp.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            return interp.TensorHandle(rounded, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interp._patch_lang_tensor = patched_tensor
    interp.InterpreterBuilder.create_dot = patched_dot
    interp.InterpreterBuilder.cast_impl = patched_cast
    interp._dsv4_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()

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


# ----------------------------------------------------------------------------------- fp8 GEMM


@pytest.mark.parametrize(
    "m,n,k,block",
    [
        (1, 70, 100, 32),  # decode row, partial N and K tiles
        (20, 64, 96, 32),  # BLOCK_M 32, partial M
        (5, 50, 300, 128),  # V4 block
        (40, 64, 640, 32),  # split-K
        (70, 130, 64, 16),  # BLOCK_M 64, BLOCK_N 128, block 16
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


def test_fp8_linear_w8a16_rows_do_not_depend_on_batch(monkeypatch):
    """Single rows (split-K over chunks) and a 200-row batch (chunks in one program, row tile
    64) give the same bits."""
    monkeypatch.setattr(fp8_gemm, "num_sms", lambda device: 4)
    g = _gen(9)
    x = torch.randn(200, 640, generator=g).bfloat16().to(DEVICE)
    w, s = (a.to(DEVICE) for a in _fp8_weight(64, 640, 32, g))
    assert fp8_gemm.w8a16_chunks(64, 640, 32, x.device)[1] > 1
    batch = fp8_gemm.fp8_linear_w8a16(x, w, s, 32)
    for i in (0, 17, 199):
        assert torch.equal(fp8_gemm.fp8_linear_w8a16(x[i : i + 1], w, s, 32)[0], batch[i])


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
@pytest.mark.parametrize("t,top_k,n_exp", [(5, 3, 8), (40, 2, 4)])
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


def test_moe_experts_rows_do_not_depend_on_batch():
    """A token alone (row tile 16) and in a 40-token batch (row tile 64) gives the same bits."""
    d, inter, n_exp = 64, 64, 4
    g = _gen(21)
    x = torch.randn(40, d, generator=g).bfloat16()
    w13, s13, w2, s2 = _experts(n_exp, d, inter, g)
    weights, ids = moe_ref.route(moe_ref.sqrtsoftplus(torch.randn(40, n_exp, generator=g)), torch.zeros(n_exp), 2, None, 1.5, True)
    dev = [a.to(DEVICE) for a in (x, ids, weights, w13, s13, w2, s2)]
    assert moe._row_tile(80, n_exp) != moe._row_tile(2, n_exp)
    batch = moe.moe_experts(*dev, 10.0, True)
    for i in (0, 39):
        alone = moe.moe_experts(dev[0][i : i + 1], dev[1][i : i + 1], dev[2][i : i + 1], *dev[3:], 10.0, True)
        assert torch.equal(alone[0], batch[i])


def test_align_by_expert_layout():
    ids = torch.tensor([3, 0, 3, 3, 1, 0])
    rows, tile_expert = moe.align_by_expert(ids, 5, 4)
    tiles = rows.view(-1, 4)
    used = tile_expert < 5
    assert tile_expert[used].tolist() == [0, 1, 3]
    for tile, e in zip(tiles[used], tile_expert[used]):
        real = tile[tile < ids.numel()]
        assert (ids[real] == e).all()
    assert sorted(rows[rows < ids.numel()].tolist()) == list(range(6))


# ----------------------------------------------------------------------------------- attention


def _attention_case(g, *, heads, dim, window, per_block, n_top, requests):
    """A batch over random FP8 rings and FP4 paged compressed KV. `requests`: (start, count,
    floor) per request. Returns the kernel arguments and the QTensors for the model path."""
    n_slots, n_blocks = len(requests) + 1, 12
    ring_vals = torch.randn(n_slots, window, dim, generator=g)
    ring_codes, ring_scales = quant.quantize_fp8_ue8m0(ring_vals, 32)
    ckv_codes, ckv_scales = quant.quantize_fp4(torch.randn(n_blocks, per_block, dim, generator=g) * 2, 16, e4m3_scale=True)
    t = sum(c for _, c, _ in requests)
    q = (torch.randn(t, heads, dim, generator=g) * 2).bfloat16()
    kv_new = quant.fake_quant_fp8(torch.randn(t, dim, generator=g).bfloat16())
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
    ring = QTensor(codes=ring_codes, scales=ring_scales)
    ckv = QTensor(codes=ckv_codes, scales=ckv_scales)
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
    # partial head block; one key tile per chunk
    "mixed": {"heads": 20, "dim": 64, "window": 16, "per_block": 8, "n_top": 20, "requests": [(0, 6, 0), (21, 5, 0), (40, 1, 30)]},
    # one decode token with a long top-k, default chunks (window and top-k share one)
    "decode": {"heads": 16, "dim": 64, "window": 32, "per_block": 16, "n_top": 100, "requests": [(150, 1, 0)]},
}
CHUNK_TILES = {"mixed": 1, "decode": tattn.CONFIG["CHUNK_TILES"]}


@pytest.mark.parametrize("case", ATTN_CASES)
def test_sparse_attention_reference_matches_definition(case):
    spec = ATTN_CASES[case]
    args, ring, ckv = _attention_case(_gen(11), **spec)
    ref = tattn.sparse_attention_reference(**args)
    naive = _naive_attention(args, ring, ckv, spec["per_block"])
    assert _rel_err(ref, naive) <= 2 * BF16_REL


def _token_alone(args: dict, t: int) -> dict:
    """The arguments for token t of the batch on its own; t must be its request's only token
    (a decode step), whose key row then moves from row t to row 0."""
    one = slice(t, t + 1)
    picked = {k: args[k][one] for k in ("q", "kv_new", "topk", "token_req", "positions")}
    return dict(args, **picked, row_start=args["row_start"] - t)


@pytest.mark.parametrize("case", ATTN_CASES)
def test_sparse_attention_matches_reference(case, monkeypatch):
    spec = ATTN_CASES[case]
    args, _, _ = _attention_case(_gen(11), **spec)
    ref = tattn.sparse_attention_reference(**args)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for policy in ("never", "always"):  # one program per token and head block / per chunk too
        monkeypatch.setattr(tattn, "CONFIG", dict(tattn.CONFIG, CHUNK_TILES=CHUNK_TILES[case], SPLIT=policy))
        y = tattn.sparse_attention(**dev)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        assert torch.isfinite(y.float()).all()
        # probabilities are rounded to bf16 unnormalised (online softmax) vs normalised (reference)
        assert (y.float().cpu() - ref.float()).abs().max() <= 4 * BF16_REL * ref.float().abs().max()
        # either fixed policy is batch-invariant: the last token alone has its bits in the batch
        last = y.shape[0] - 1
        assert torch.equal(tattn.sparse_attention(**_token_alone(dev, last))[0], y[last])


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

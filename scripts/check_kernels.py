#!/usr/bin/env python3
"""Device check of the Triton kernels (dsv4/ops/triton) at the real V4.1-Flash shapes.

For every kernel and size: the result against its torch reference, the median time of the
kernel and of the torch path (CUDA events, L2 flushed before each call), achieved TB/s and
TFLOP/s, and the fraction of the H200 floor reached (max(bytes / 4.2 TB/s, FLOPs / peak), peak
FP8 1365 or BF16 758 TFLOP/s; DESIGN.md "Performance model"). Also checks that a row's bits do
not depend on its batch (batch invariance) and times a few attention tilings.

    python scripts/check_kernels.py [--sections a,b] [--budget 480]
    python scripts/check_kernels.py --compile-only   # any machine: sm_90 compile, registers, spills

Each section runs in its own process (a kernel that faults cannot take the others down) under
a share of the time budget; a failing case is reported and the rest go on. Prints a table and
writes every record to $OUT/kernels.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HBM = 4.2e12
PEAK = {"fp8": 1365e12, "bf16": 758e12}
ROWS = (1, 8, 64, 256, 4096)
# V4.1-Flash FP8 projections (name, N, K, block); last two: V4-Flash's 128x128 blocks.
PROJECTIONS = [
    ("wq_a", 1280, 5120, 32),
    ("wq_b", 32768, 1280, 32),
    ("wkv", 512, 5120, 32),
    ("wo_a.group", 1024, 4096, 32),
    ("wo_b", 5120, 8192, 32),
    ("shared.w13", 4608, 5120, 32),
    ("shared.w2", 5120, 2304, 32),
    ("indexer.wq_b", 4096, 1280, 32),
    ("v4.wq_b", 32768, 1024, 128),
    ("v4.wo_b", 4096, 8192, 128),
]
SECTIONS = {  # name -> share of the time budget, in running order
    "act_quant": 0.05,
    "fp8_linear": 0.3,
    "moe": 0.2,
    "attention": 0.15,
    "invariance": 0.15,
    "attention_configs": 0.15,
}

RECORDS: list[dict] = []
JSON_PATH: list[Path] = []  # the child's output file, rewritten after every record


def record(kernel: str, case: str, impl: str, **fields) -> None:
    """Keep a result; the file is rewritten each time so that a timeout loses nothing."""
    RECORDS.append({"kernel": kernel, "case": case, "impl": impl, **fields})
    if JSON_PATH:
        tmp = JSON_PATH[0].with_suffix(".tmp")
        tmp.write_text(json.dumps(RECORDS))
        tmp.replace(JSON_PATH[0])


def guarded(kernel: str, case: str, fn, *args) -> None:
    """Run one case; an exception becomes an error record and the next case goes on."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - any failure is reported, the others still run
        record(kernel, case, "error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ timing

_FLUSH: list = []


def median_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` over `reps` calls, L2 flushed (256 MiB write) before each."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _FLUSH[0].zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def perf(seconds: float, nbytes: float, flops: float, peak: str) -> dict:
    floor = max(nbytes / HBM, flops / PEAK[peak])
    return {
        "ms": seconds * 1e3,
        "tb_s": nbytes / seconds / 1e12,
        "tflop_s": flops / seconds / 1e12,
        "floor_ms": floor * 1e3,
        "of_floor": floor / seconds,
        "bytes": nbytes,
        "flops": flops,
        "peak": peak,
    }


def rel_err(y: torch.Tensor, ref: torch.Tensor, floor: float = 1e-2) -> float:
    """Max |y - ref| relative to |ref| elementwise, |ref| floored at `floor` x max|ref|."""
    y, ref = y.double(), ref.double()
    return ((y - ref).abs() / (ref.abs() + floor * ref.abs().max())).max().item()


def norm_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |y - ref| over max |ref|."""
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ------------------------------------------------------------------------------ FP8 GEMM


def fp8_weight(n: int, k: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(112, 118, (-(-n // block), -(-k // block)), device="cuda", generator=g, dtype=torch.uint8)
    return w, s


def act_quant_case(m: int, k: int, block: int) -> None:
    from dsv4.model import quant
    from dsv4.ops.triton import fp8_gemm

    case = f"M={m} K={k} b={block}"
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-6, 3, k, device="cuda")).bfloat16()
    q, s = fp8_gemm.fp8_act_quant(x, block)
    rq, rs = quant.quantize_fp8_ue8m0(x, block)
    exact = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    nbytes = m * k * 3 + m * k // block
    t = median_time(lambda: fp8_gemm.fp8_act_quant(x, block))
    record("fp8_act_quant", case, "triton", ok=exact, err=0.0 if exact else 1.0, **perf(t, nbytes, 0, "bf16"))
    t = median_time(lambda: quant.quantize_fp8_ue8m0(x, block))
    record("fp8_act_quant", case, "torch", **perf(t, nbytes, 0, "bf16"))


def section_act_quant() -> None:
    for m, k, block in ((4096, 5120, 32), (4096, 8192, 128), (1, 5120, 32)):
        guarded("fp8_act_quant", f"M={m} K={k} b={block}", act_quant_case, m, k, block)


def fp8_linear_case(name: str, m: int, w: torch.Tensor, s: torch.Tensor, wd: torch.Tensor, wb: torch.Tensor, block: int) -> None:
    """w8a16 against the exact product, w8a8 (M >= 64) against the exact product of the
    FP8-quantised activations, and the bf16 cuBLAS GEMM on pre-dequantised weights."""
    import torch.nn.functional as F

    from dsv4.model import quant
    from dsv4.ops.triton import fp8_gemm

    n, k = w.shape
    case = f"{name} M={m} N={n} K={k} b={block}"
    x = torch.randn(m, k, device="cuda").bfloat16()
    exact = x.double() @ wd.double().T
    w_bytes = n * k + s.numel()
    io = m * k * 2 + m * n * 2
    flops = 2 * m * n * k
    err = rel_err(fp8_gemm.fp8_linear_w8a16(x, w, s, block), exact)
    t = median_time(lambda: fp8_gemm.fp8_linear_w8a16(x, w, s, block))
    record("fp8_linear", case, "w8a16", ok=err <= 2**-8 * 1.1, err=err, **perf(t, w_bytes + io, flops, "bf16"))
    if m >= 64:
        y8 = fp8_gemm.fp8_linear_w8a8(x, w, s, block)
        xq = quant.dequantize_fp8_ue8m0(*quant.quantize_fp8_ue8m0(x, block), torch.float64, block)
        err8 = rel_err(y8, xq @ wd.double().T)
        t = median_time(lambda: fp8_gemm.fp8_linear_w8a8(x, w, s, block))
        record(
            "fp8_linear", case, "w8a8", ok=err8 <= 2**-8 * 1.1, err=err8, err_vs_unquantised=norm_err(y8, exact),
            config=str(getattr(fp8_gemm._w8a8_kernel, "best_config", None)), **perf(t, w_bytes + io + m * k * 3, flops, "fp8"),
        )
    t = median_time(lambda: F.linear(x, wb))
    record("fp8_linear", case, "torch_bf16", err=rel_err(F.linear(x, wb), exact), **perf(t, 2 * n * k + io, flops, "bf16"))


def section_fp8_linear() -> None:
    from dsv4.model import quant

    for name, n, k, block in PROJECTIONS:
        w, s = fp8_weight(n, k, block, seed=n + k)
        wd = quant.dequant_fp8_block(w, s, block)
        wb = wd.bfloat16()
        for m in ROWS:
            guarded("fp8_linear", f"{name} M={m}", fp8_linear_case, name, m, w, s, wd, wb, block)


# ------------------------------------------------------------------------------ MoE


def moe_data(t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """V4.1-Flash routed experts (384 x 2304, top-6) with FP4-valued FP8 weights (the exact
    conversion of the released experts) and random routing of t tokens."""
    from dsv4.model import quant
    from dsv4.ops import moe as moe_ref

    e, d, inter, top_k = 384, 5120, 2304, 6
    g = torch.Generator(device="cuda").manual_seed(seed)
    lut = quant.fp4_lut(torch.device("cuda"))
    w13 = torch.empty(e, 2 * inter, d, dtype=torch.float8_e4m3fn, device="cuda")
    w2 = torch.empty(e, d, inter, dtype=torch.float8_e4m3fn, device="cuda")
    for i in range(e):
        w13[i] = lut[torch.randint(0, 16, (2 * inter, d), device="cuda", generator=g)].to(torch.float8_e4m3fn)
        w2[i] = lut[torch.randint(0, 16, (d, inter), device="cuda", generator=g)].to(torch.float8_e4m3fn)
    s13 = torch.randint(118, 121, (e, 2 * inter, d // 32), device="cuda", generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 121, (e, d, inter // 32), device="cuda", generator=g, dtype=torch.uint8)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    scores = moe_ref.sqrtsoftplus(torch.randn(t, e, device="cuda", generator=g))
    weights, ids = moe_ref.route(scores, torch.zeros(e, device="cuda"), top_k, None, 1.5, True)
    return x, ids, weights, w13, s13, w2, s2


def dense_experts(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> tuple[list, list, list]:
    """bf16 copies of the experts as `Linear`s for the torch reference (exact: FP8 x 2**k)."""
    from dsv4.ops.linear import Linear

    e, two_i, d = w13.shape
    inter = two_i // 2
    w13b = torch.empty(e, two_i, d, dtype=torch.bfloat16, device="cuda")
    w2b = torch.empty(e, d, inter, dtype=torch.bfloat16, device="cuda")
    for i in range(e):
        w13b[i] = (w13[i].float() * torch.exp2(s13[i].float() - 127).repeat_interleave(32, -1)).bfloat16()
        w2b[i] = (w2[i].float() * torch.exp2(s2[i].float() - 127).repeat_interleave(32, -1)).bfloat16()
    return [Linear(w13b[i, :inter]) for i in range(e)], [Linear(w2b[i]) for i in range(e)], [Linear(w13b[i, inter:]) for i in range(e)]


def moe_case(t: int, data: tuple, dense: tuple) -> None:
    from dsv4.ops import moe as moe_ref
    from dsv4.ops.triton import moe

    x, ids, weights, w13, s13, w2, s2 = data
    w1, w2l, w3 = dense
    e, two_i, d = w13.shape
    inter = two_i // 2
    case = f"T={t} E={e} D={d} I={inter} k={ids.shape[1]}"
    xt, it, wt = x[:t], ids[:t], weights[:t]
    used = int(torch.unique(it).numel())
    w_bytes = used * (3 * inter * d) * (1 + 1 / 32)
    io = t * d * 2 + t * d * 4 + it.numel() * 12
    flops = 2 * it.numel() * 3 * inter * d
    ref = moe_ref.experts_forward(xt, wt, it, w1, w2l, w3, 10.0, True).float()
    err = norm_err(moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True), ref)
    t_k = median_time(lambda: moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True), reps=10)
    record("moe_experts", case, "triton", ok=err <= 4 * 2**-8, err=err, experts_used=used, **perf(t_k, w_bytes + io, flops, "bf16"))
    t_r = median_time(lambda: moe_ref.experts_forward(xt, wt, it, w1, w2l, w3, 10.0, True), reps=5, warmup=1)
    record("moe_experts", case, "torch_bf16", experts_used=used, **perf(t_r, 2 * w_bytes + io, flops, "bf16"))


def section_moe() -> None:
    data = moe_data(max(ROWS))
    dense = dense_experts(*data[3:])
    for t in ROWS:
        guarded("moe_experts", f"T={t}", moe_case, t, data, dense)


# ------------------------------------------------------------------------------ attention


def attention_data(t: int, decode: bool, seed: int = 0) -> dict:
    """Real-shape caches: 64 heads x 512, window 128, top-k 512 over a ratio-2 source (128
    entries per 256-token block) with 64K-token contexts. decode: t requests of one token;
    else one request's chunk of t tokens continuing at position 60000."""
    from dsv4.model import quant

    h, dim, window, top, per_block, n_blocks = 64, 512, 128, 512, 128, 8192
    g = torch.Generator(device="cuda").manual_seed(seed)
    reqs = t if decode else 1
    ring_codes, ring_scales = quant.quantize_fp8_ue8m0(torch.randn(reqs, window, dim, device="cuda", generator=g), 32)
    ckv_codes = torch.empty(n_blocks, per_block, dim // 2, dtype=torch.uint8, device="cuda")
    ckv_scales = torch.empty(n_blocks, per_block, dim // 16, dtype=torch.float8_e4m3fn, device="cuda")
    for b0 in range(0, n_blocks, 256):
        c, s = quant.quantize_fp4(torch.randn(256, per_block, dim, device="cuda", generator=g), 16, e4m3_scale=True)
        ckv_codes[b0 : b0 + 256], ckv_scales[b0 : b0 + 256] = c, s
    block_tables = torch.randint(0, n_blocks, (reqs, 256), device="cuda", generator=g)
    if decode:
        positions = 65536 + torch.randint(0, 1000, (t,), device="cuda", generator=g)
        start_pos, token_req, row_start = positions.clone(), torch.arange(t, device="cuda"), torch.arange(t, device="cuda")
    else:
        positions = 60000 + torch.arange(t, device="cuda")
        start_pos, token_req = positions[:1].clone(), torch.zeros(t, dtype=torch.long, device="cuda")
        row_start = torch.zeros(1, dtype=torch.long, device="cuda")
    topk = torch.rand(t, 30000, device="cuda", generator=g).topk(top, dim=1).indices  # 30000 entries visible
    return {
        "q": torch.randn(t, h, dim, device="cuda", generator=g).bfloat16(),
        "kv_new": quant.fake_quant_fp8(torch.randn(t, dim, device="cuda", generator=g).bfloat16()),
        "ring_codes": ring_codes,
        "ring_scales": ring_scales,
        "ckv_codes": ckv_codes,
        "ckv_scales": ckv_scales,
        "topk": topk,
        "token_req": token_req,
        "positions": positions,
        "start_pos": start_pos,
        "row_start": row_start,
        "slots": torch.arange(reqs, device="cuda"),
        "floors": torch.zeros(reqs, dtype=torch.long, device="cuda"),
        "block_tables": block_tables,
        "sink": torch.randn(h, device="cuda", generator=g),
        "softmax_scale": dim**-0.5,
    }


def attention_cost(args: dict, decode: bool) -> tuple[float, float]:
    """(bytes, FLOPs) of one call: q and out, window keys (ring FP8 per decode token; the
    chunk's own bf16 keys once in prefill), the distinct top-k entries (FP4 + scales)."""
    t, h, dim = args["q"].shape
    window, top = args["ring_codes"].shape[1], args["topk"].shape[1]
    entry = dim // 2 + dim // 16
    if decode:
        keys = t * (window * (dim + dim // 32) + top * entry)
    else:
        per_block = args["ckv_codes"].shape[1]
        loc = args["block_tables"][0][args["topk"] // per_block] * per_block + args["topk"] % per_block
        keys = t * dim * 2 + window * (dim + dim // 32) + int(torch.unique(loc).numel()) * entry
    return 2 * t * h * dim * 2 + keys + args["topk"].numel() * 8, 4 * t * h * dim * (window + top)


def attention_case(t: int) -> None:
    from dsv4.ops.triton import attention

    decode = t <= 256
    args = attention_data(t, decode)
    _, h, dim = args["q"].shape
    case = f"T={t} {'decode' if decode else 'prefill chunk'} H={h} D={dim} W={args['ring_codes'].shape[1]} k={args['topk'].shape[1]}"
    nbytes, flops = attention_cost(args, decode)
    ref = attention.sparse_attention_reference(**args)
    err = norm_err(attention.sparse_attention(**args), ref)
    t_k = median_time(lambda: attention.sparse_attention(**args), reps=10)
    record("sparse_attention", case, "triton", ok=err <= 4 * 2**-8, err=err, **perf(t_k, nbytes, flops, "bf16"))
    t_r = median_time(lambda: attention.sparse_attention_reference(**args), reps=3, warmup=1)
    record("sparse_attention", case, "torch_gather", **perf(t_r, nbytes, flops, "bf16"))


def section_attention() -> None:
    for t in ROWS:
        guarded("sparse_attention", f"T={t}", attention_case, t)


ATTN_CONFIGS = [  # the default first; SPLIT "always" / "never" are the batch-invariant policies
    {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "auto", "num_warps": 8, "num_stages": 2},
    {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "always", "num_warps": 8, "num_stages": 2},
    {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 20, "SPLIT": "always", "num_warps": 8, "num_stages": 2},
    {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "never", "num_warps": 8, "num_stages": 2},
    {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "auto", "num_warps": 8, "num_stages": 1},
    {"BLOCK_H": 16, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "auto", "num_warps": 4, "num_stages": 2},
    {"BLOCK_H": 32, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "auto", "num_warps": 8, "num_stages": 2},
    {"BLOCK_H": 64, "BLOCK_N": 16, "CHUNK_TILES": 8, "SPLIT": "auto", "num_warps": 8, "num_stages": 1},
]


def attention_config_case(t: int, args: dict, decode: bool, base: torch.Tensor, cfg: dict) -> None:
    """Time one tiling (and its difference to the default tiling's result)."""
    from dsv4.ops.triton import attention

    nbytes, flops = attention_cost(args, decode)
    default = attention.CONFIG
    attention.CONFIG = cfg
    try:
        err = norm_err(attention.sparse_attention(**args), base)
        t_k = median_time(lambda: attention.sparse_attention(**args), reps=10)
    finally:
        attention.CONFIG = default
    record("attention_config", f"T={t} " + " ".join(f"{k}={v}" for k, v in cfg.items()), "triton", err=err, **perf(t_k, nbytes, flops, "bf16"))


def section_attention_configs() -> None:
    from dsv4.ops.triton import attention

    for t in (1, 64, 4096):
        decode = t <= 256
        args = attention_data(t, decode)
        base = attention.sparse_attention(**args)
        for cfg in ATTN_CONFIGS:
            guarded("attention_config", f"T={t} {cfg}", attention_config_case, t, args, decode, base, cfg)


# ------------------------------------------------------------------------------ batch invariance


def invariance_fp8_linear(name: str, n: int, k: int, block: int) -> None:
    from dsv4.ops.triton import fp8_gemm

    w, s = fp8_weight(n, k, block, seed=1)
    x = torch.randn(256, k, device="cuda").bfloat16()
    batch = fp8_gemm.fp8_linear_w8a16(x, w, s, block)
    same = all(torch.equal(fp8_gemm.fp8_linear_w8a16(x[:m], w, s, block)[:1], batch[:1]) for m in (1, 8, 64))
    record("invariance", f"fp8_linear_w8a16 {name}: row 0 of M=1,8,64 vs M=256", "triton", ok=same)


def invariance_moe() -> None:
    from dsv4.ops.triton import moe

    x, ids, weights, w13, s13, w2, s2 = moe_data(4096, seed=1)
    batch = moe.moe_experts(x, ids, weights, w13, s13, w2, s2, 10.0, True)
    same = all(torch.equal(moe.moe_experts(x[:m], ids[:m], weights[:m], w13, s13, w2, s2, 10.0, True)[:1], batch[:1]) for m in (1, 64))
    record("invariance", "moe_experts: token 0 of T=1,64 (row tile 16) vs T=4096 (64)", "triton", ok=same)


def invariance_attention() -> None:
    """Token 0 alone (one program per chunk under "auto") and in a 64-token decode batch
    (unsplit under "auto"): same bits under the fixed policies; "auto" is reported."""
    from dsv4.ops.triton import attention

    args = attention_data(64, True, seed=1)
    alone = dict(args, **{k: args[k][:1] for k in ("q", "kv_new", "topk", "token_req", "positions")})
    default = attention.CONFIG
    try:
        for policy in ("always", "never", "auto"):
            attention.CONFIG = dict(default, SPLIT=policy)
            same = torch.equal(attention.sparse_attention(**alone)[0], attention.sparse_attention(**args)[0])
            case = f"sparse_attention SPLIT={policy}: token 0 alone vs in T=64"
            record("invariance", case, "triton", **({"ok": same} if policy != "auto" else {"same_bits": same}))
    finally:
        attention.CONFIG = default


def section_invariance() -> None:
    """A row computed alone must have the bits it has inside a batch."""
    for name, n, k, block in (p for p in PROJECTIONS if p[0] in ("wq_a", "wo_b")):
        guarded("invariance", f"fp8_linear_w8a16 {name}", invariance_fp8_linear, name, n, k, block)
    guarded("invariance", "moe_experts", invariance_moe)
    guarded("invariance", "sparse_attention", invariance_attention)


# ------------------------------------------------------------------------------ sm_90 compile


def compile_targets() -> list[tuple]:
    """(label, kernel, argument types, constexprs, options) of every kernel variant the
    wrappers launch at the real shapes (index tensors int64, as the tests pass them)."""
    from dsv4.ops.triton import attention, fp8_gemm, moe

    i, f = "i32", "fp32"
    out = []
    w8a16 = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "out_ptr": "*fp32", "M": i, "N": i, "K": i, "stride_xm": i, "stride_wn": i, "stride_sn": i, "stride_om": i, "stride_chunk": i, "K_STEPS": i, "CHUNK_STEPS": i, "CHUNKS_PER_PROGRAM": i}
    for bm in (16, 64):
        for block in (32, 128):
            consts = {"QBLOCK": block, "BLOCK_M": bm, "BLOCK_N": fp8_gemm.W8A16_BLOCK_N, "BLOCK_K": fp8_gemm.W8A16_BLOCK_K}
            out.append((f"w8a16 BM={bm} b={block}", fp8_gemm._w8a16_kernel, w8a16, consts, {"num_warps": 4 if bm == 16 else 8, "num_stages": 6 if bm == 16 else 4}))
    out.append(("w8a16 chunk sum", fp8_gemm._chunk_sum_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "numel": i, "CHUNKS": i}, {"BLOCK": 1024}, {"num_warps": 4}))
    act = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*u8", "M": i, "K": i, "stride_xm": i, "stride_qm": i, "stride_sm": i}
    for block in (32, 128):
        out.append((f"act quant b={block}", fp8_gemm._act_quant_kernel, act, {"QBLOCK": block, "BLOCK_R": min(64, 4096 // block)}, {"num_warps": 4}))
    w8a8 = {"a_ptr": "*fp8e4nv", "as_ptr": "*u8", "w_ptr": "*fp8e4nv", "ws_ptr": "*u8", "out_ptr": "*bf16", "M": i, "N": i, "K": i, "ROW_CLASS": i, "stride_am": i, "stride_asm": i, "stride_wn": i, "stride_wsn": i, "stride_om": i}
    for cfg in fp8_gemm.w8a8_configs(gpu=True):
        for block in (32, 128):
            consts = dict(cfg.kwargs, QBLOCK=block, BLOCK_K=32)
            out.append((f"w8a8 {cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']} b={block}", fp8_gemm._w8a8_kernel.fn, w8a8, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}))
    common = {"w_ptr": "*fp8e4nv", "s_ptr": "*u8", "rows_ptr": "*i64", "tile_expert_ptr": "*i64", "rw_ptr": "*fp32", "n_pairs": i, "n_experts": i, "D": i, "I": i, "stride_we": "i64", "stride_wn": i, "stride_se": i, "stride_sn": i}
    gate_up = dict(common, x_ptr="*bf16", act_ptr="*bf16", stride_x=i, stride_act=i, limit=f)
    down = dict(common, act_ptr="*bf16", y_ptr="*bf16", stride_act=i, stride_y=i)
    for bm in (16, 64):
        opts = {"num_warps": 4 if bm == 16 else 8, "num_stages": 4}
        for before in (True, False):
            tiles = {"WEIGHT_BEFORE_DOWN": before, "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": moe.SCALE_BLOCK}
            out.append((f"moe gate_up BM={bm} before={before}", moe._gate_up_kernel, gate_up, dict(tiles, TOPK=6, HAS_LIMIT=True), opts))
            out.append((f"moe down BM={bm} before={before}", moe._down_kernel, down, tiles, opts))
    out.append(("moe slot sum", moe._sum_slots_kernel, {"y_ptr": "*bf16", "out_ptr": "*fp32", "D": i}, {"TOPK": 6, "BLOCK": 1024}, {"num_warps": 4}))
    idx = {n: "*i64" for n in ("topk_ptr", "token_req_ptr", "pos_ptr", "start_ptr", "row_ptr", "slot_ptr", "floor_ptr", "block_table_ptr")}
    attn = dict(
        idx, q_ptr="*bf16", kv_new_ptr="*bf16", ring_ptr="*fp8e4nv", ring_scale_ptr="*u8", ckv_ptr="*u8", ckv_scale_ptr="*fp8e4nv", sink_ptr="*fp32",
        out_ptr="*bf16", part_ptr="*fp32", part_ml_ptr="*fp32", H=i, n_top=i, sm_scale=f,
        stride_qt=i, stride_qh=i, stride_kv=i, stride_top=i, stride_bt=i, stride_ot=i, stride_oh=i,
    )
    cfg = attention.CONFIG
    tiles = {k: cfg[k] for k in ("BLOCK_H", "BLOCK_N", "CHUNK_TILES")}
    for split in (False, True):
        consts = dict(tiles, WINDOW=128, PER_BLOCK=128, DIM=512, SPLIT=split)
        out.append((f"attention split={split}", attention._sparse_attn_kernel, attn, consts, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}))
    combine = {"part_ptr": "*fp32", "part_ml_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16", "H": i, "CHUNKS": i, "stride_ot": i, "stride_oh": i}
    out.append(("attention combine", attention._combine_kernel, combine, {"DIM": 512, "BLOCK_H": cfg["BLOCK_H"]}, {"num_warps": cfg["num_warps"]}))
    return out


def compile_case(label: str, kernel, types: dict, consts: dict, options: dict) -> None:
    """Compile for sm_90 with the wheel's ptxas (no GPU needed); registers, spill stack and
    shared memory per thread block from cuobjdump."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    start = time.time()
    compiled = triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", 90, 32), options=options)
    usage = {}
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=False).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
        if found:
            usage = {"registers": int(found[1]), "spill_stack_bytes": int(found[2])}
    mma = "wgmma" if "wgmma" in compiled.asm["ptx"] else "mma.sync" if "mma.sync" in compiled.asm["ptx"] else "none"
    record("compile_sm90", label, "triton", ok=True, seconds=time.time() - start, shared_bytes=compiled.metadata.shared, mma=mma, **usage)


def section_compile() -> None:
    for target in compile_targets():
        guarded("compile_sm90", target[0], compile_case, *target)


# ------------------------------------------------------------------------------ driver


def run_section(name: str, json_path: str) -> int:
    """Child process: run one section, writing its records as they come."""
    JSON_PATH.append(Path(json_path))
    start = time.time()
    try:
        globals()[f"section_{name}"]()
    except Exception as exc:  # noqa: BLE001 - reported as the section's error record
        record(name, "section", "error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
    record(name, "section", "wall", seconds=time.time() - start)
    return 0


def summary(records: list[dict]) -> list[str]:
    """One line per (kernel, case): the floor, then each implementation's time, TB/s,
    TFLOP/s, fraction of the floor, error and verdict."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["impl"] not in ("error", "wall"):
            groups.setdefault((r["kernel"], r["case"]), []).append(r)
    lines = []
    for (kernel, case), rs in groups.items():
        parts = [f"{kernel:<16} {case:<44}"]
        if "floor_ms" in rs[0]:
            parts.append(f"floor {rs[0]['floor_ms']:8.4f} ms")
        for r in rs:
            item = f"| {r['impl']}"
            if "ms" in r:
                item += f" {r['ms']:8.4f} ms {r['tb_s']:5.2f} TB/s {r['tflop_s']:6.1f} TF/s {r['of_floor']:4.0%}"
            if isinstance(r.get("err"), float):
                item += f" err {r['err']:.1e}"
            if "registers" in r:
                item += f" {r['registers']} regs, {r['spill_stack_bytes']} B spilled, {r['shared_bytes']} B smem, {r['mma']}"
            if "same_bits" in r:
                item += f" same bits: {r['same_bits']}"
            item += {True: " ok", False: " FAIL"}.get(r.get("ok"), "")
            parts.append(item)
        lines.append(" ".join(parts))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all sections together")
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_90 here (no GPU needed) and report registers / spills")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        return run_section(args.section, args.json)
    if args.compile_only:
        section_compile()
        for line in summary(RECORDS):
            print(line)
        errors = [r for r in RECORDS if r["impl"] == "error"]
        for r in errors:
            print(f"ERROR {r['case']}: {r['error']}\n{r['trace']}")
        return 1 if errors else 0
    if not torch.cuda.is_available():
        print("check_kernels: needs a CUDA device (the CPU checks are tests/ops/test_triton_kernels.py)")
        return 2
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    deadline = time.time() + args.budget
    records: list[dict] = []
    for i, name in enumerate(names):
        left = deadline - time.time()
        later = sum(SECTIONS[s] for s in names[i + 1 :])
        timeout = max(30.0, left * SECTIONS[name] / (SECTIONS[name] + later)) if later else max(30.0, left)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = Path(f.name)
        cmd = [sys.executable, __file__, "--section", name, "--json", str(path)]
        started = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)
            got = json.loads(path.read_text() or "[]")
            if proc.returncode or not got:
                got.append({"kernel": name, "case": "section", "impl": "error", "error": f"exit {proc.returncode}", "trace": proc.stderr[-3000:]})
        except subprocess.TimeoutExpired as exc:
            got = json.loads(path.read_text() or "[]")
            tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            got.append({"kernel": name, "case": "section", "impl": "error", "error": f"timed out after {timeout:.0f} s", "trace": tail[-3000:]})
        path.unlink()
        records.extend(got)
        errors = [r for r in got if r["impl"] == "error"]
        print(f"== {name}: {len(got) - len(errors)} records, {len(errors)} errors, {time.time() - started:.0f} s (limit {timeout:.0f} s)", flush=True)
        for r in errors:
            print(f"   ERROR {r['kernel']} {r['case']}: {r['error']}\n{r.get('trace', '')[-1500:]}", flush=True)
    print()
    for line in summary(records):
        print(line)
    failed = [r for r in records if r.get("ok") is False or r["impl"] == "error"]
    print(f"\n{len(failed)} failed / errored of {sum(r['impl'] not in ('wall',) for r in records)} records")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_bytes_per_s": HBM, "peak_flops": PEAK, "records": records}
        (Path(out) / "kernels.json").write_text(json.dumps(payload, indent=1))
        print(f"wrote {Path(out) / 'kernels.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

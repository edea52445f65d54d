#!/usr/bin/env python3
"""Device check of the Triton kernels (dsv4/ops/triton) at the real V4.1-Flash shapes.

For every kernel and size: the result against its torch reference, the median time of the
kernel and of the torch path (CUDA events, L2 flushed before each call), achieved TB/s and
TFLOP/s, and the fraction of the H200 floor reached (max(bytes / 4.2 TB/s, FLOPs / peak), peak
FP8 1365 or BF16 758 TFLOP/s; DESIGN.md "Performance model"). Also checks that a row's bits do
not depend on its batch (batch invariance).

    python scripts/check_kernels.py [--sections a,b] [--budget 480]
    python scripts/check_kernels.py --compile-only   # any machine: sm_90 compile, registers, spills

Section gemm_sweep times candidate tilings of the decode-regime FP8 GEMM and MoE kernels
(replayed from CUDA graphs) and prints the best per shape and the knob settings they suggest;
w8a16_sweep and moe_sweep run one half each.
Section attention_sweep (under 110 s: `--sections attention_sweep --budget 140`) times candidate
sparse-attention tilings at decode T = 1, 8, 64, 256 and a 4096-token prefill chunk, replayed
from CUDA graphs over rotating input sets, and prints each size's fastest correct one ("BEST")
with its fraction of the floor.
Section defaults (only when named) times each swept kernel's default configuration alone, as
the sweeps time it: a kernel A/B of two trees is one run in each (device_run.sh STEPS=kernels_ab).

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
from unittest.mock import patch

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HBM = 4.2e12
PEAK = {"fp8": 1365e12, "bf16": 758e12}
ROWS = (1, 8, 64, 256, 4096)
# V4.1-Flash FP8 projections (name, N, K, block); last two: V4-Flash's 128x128 blocks.
PROJECTIONS = [
    ("wq_a+wkv", 1792, 5120, 32),  # the two stacked, as the fast path runs them (`Attention.wq_a_kv`)
    ("wq_a", 1280, 5120, 32),  # wq_a and wkv alone: what the stacking saves
    ("wq_b", 32768, 1280, 32),
    ("wq_b+indexer.wq_b", 36864, 1280, 32),  # the indexer layers' stacked query projections (`Attention.forward_fast`)
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
    "moe_prefill": 0.1,
    "router": 0.05,
    "attention": 0.15,
    "invariance": 0.3,  # 0.15 ran out before its mHC / engram checks (S3-5)
    "attention_sweep": 0.15,
    "attention_prefill": 0.1,
    "indexer": 0.15,
    "indexer_v4": 0.08,
    "attention_v4": 0.08,
    "kv_store": 0.08,
    "rope": 0.03,
    "engram": 0.1,
    "mhc": 0.15,
    "gemm_sweep": 0.25,
    "w8a16_sweep": 0.15,
    "dequant_sweep": 0.05,
    "moe_sweep": 0.15,
    "defaults": 0.3,
}
# Sections run only when named: `defaults` times what the sweeps time, for kernel A/Bs
ON_REQUEST = ("defaults",)
# Set by section `defaults` (in the environment, so that the sweeps' compile workers see it):
# every sweep runs its default candidate only (`swept`)
DEFAULTS_ONLY_ENV = "CHECK_KERNELS_DEFAULTS_ONLY"


def swept(candidates: list) -> list:
    """The candidates a sweep runs: all of them, or under section `defaults` only the first
    (every sweep lists its default first)."""
    return candidates[:1] if os.environ.get(DEFAULTS_ONLY_ENV) == "1" else candidates

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
        if torch.cuda.is_available():  # --compile-only runs on machines without one
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
    # as decode runs it: from a CUDA graph (no host launch time), weights streamed from HBM
    t = graph_time([lambda wi=wi, si=si: fp8_gemm.fp8_linear_w8a16(x, wi, si, block) for wi, si in rotated(w, s)])
    record("fp8_linear", case, "w8a16_graph", **perf(t, w_bytes + io, flops, "bf16"))

    def variant(label: str, knobs: dict, same_as: torch.Tensor | None) -> None:
        """The graph timing under other W8A16 knobs; `same_as`: the bits it must keep."""
        with patch.dict(fp8_gemm.W8A16, knobs):
            y = fp8_gemm.fp8_linear_w8a16(x, w, s, block)
            err, same = rel_err(y, exact), None if same_as is None else torch.equal(y, same_as)
            t = graph_time([lambda wi=wi, si=si: fp8_gemm.fp8_linear_w8a16(x, wi, si, block) for wi, si in rotated(w, s)])
        record("fp8_linear", case, f"w8a16_graph {label}", ok=err <= 2**-8 * 1.1 and same is not False, err=err, same_bits=same, **perf(t, w_bytes + io, flops, "bf16"))

    if m <= 256:  # the decode regime: the other weight reads, which must keep the bits
        other = "bytes" if fp8_gemm.W8A16["DEQUANT"] == "words" else "words"
        variant(other, {"DEQUANT": other}, fp8_gemm.fp8_linear_w8a16(x, w, s, block))
        variant(f"step={not fp8_gemm.W8A16['STEP']}", {"STEP": not fp8_gemm.W8A16["STEP"]}, fp8_gemm.fp8_linear_w8a16(x, w, s, block))
        if fp8_gemm.w8a16_fragment(False, block, k, fp8_gemm.w8a16_config(m)["BLOCK_K"]):  # natural K order: other bits
            variant("fragment=False", {"FRAGMENT": False}, None)
    chunks = -(-k // fp8_gemm.w8a16_chunk_k(n, k, block, x.device))
    if m <= 8 and k // (2 * chunks) >= fp8_gemm.CHUNK_ALIGN:  # twice the K chunks (other bits: the chunking is numerics)
        variant(f"{2 * chunks} chunks (default {chunks})", {"CHUNKS": {**fp8_gemm.W8A16["CHUNKS"], (n, k, block): 2 * chunks}}, None)
    if m <= 256:  # FP8 activations at decode (x_scale): FP8 codes of x into the same kernel
        codes, exps = fp8_gemm.fp8_act_quant(x, 32)
        xq32 = quant.fake_quant_act(x, 32).double()
        err8 = rel_err(fp8_gemm.fp8_linear_w8a16(codes, w, s, block, x_scale=exps), xq32 @ wd.double().T)
        t = graph_time([lambda wi=wi, si=si: fp8_gemm.fp8_linear_w8a16(codes, wi, si, block, x_scale=exps) for wi, si in rotated(w, s)])
        record("fp8_linear", case, "w8a16_graph fp8 inputs", ok=err8 <= 2**-8 * 1.1, err=err8, **perf(t, w_bytes + io, flops, "fp8"))
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
    t = graph_time([lambda wi=wi: F.linear(x, wi) for wi, _ in rotated(wb, s)])
    record("fp8_linear", case, "torch_bf16_graph", **perf(t, 2 * n * k + io, flops, "bf16"))


def dequant_words_case() -> None:
    """Every e4m3 code under every scale byte the loader lets the FP8 kernels take (1 ..
    `quant.FP8_MAX_SCALE_BYTE`) through the word dequantisers (`dequant_word_step`: a scale
    per 32 inputs; `dequant_words`: one per row): code x 2**(byte - 127) rounded to bf16, as
    the reference does; compiled PTX only, the interpreter never runs them."""
    import triton
    import triton.language as tl

    from dsv4.ops.triton import fp8_gemm

    @triton.jit
    def kernel(w_ptr, s_ptr, step_ptr, row_ptr):
        r = tl.program_id(0)  # one scale byte a program; the 256 codes as two rows of 32 words
        rows = tl.arange(0, 2)[:, None]
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rows * 32 + tl.arange(0, 32)[None, :])
        sb = tl.load(s_ptr + r + 0 * tl.arange(0, 2)).to(tl.int32)
        out = r * 256 + rows * 128 + tl.arange(0, 128)[None, :]
        tl.store(step_ptr + out, fp8_gemm.dequant_word_step(words, sb * 0x01010101, 0, 128))
        tl.store(row_ptr + out, fp8_gemm.dequant_words(words, sb))

    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    from dsv4.model import quant

    scales = torch.arange(quant.FP8_MIN_SCALE_BYTE, quant.FP8_MAX_SCALE_BYTE + 1, dtype=torch.uint8, device="cuda")
    step = torch.empty(len(scales), 256, dtype=torch.bfloat16, device="cuda")
    row = torch.empty_like(step)
    kernel[(len(scales),)](codes, scales, step, row)
    values = codes.view(torch.float8_e4m3fn).float()
    ref = (values[None, :].double() * torch.exp2(scales.double() - 127)[:, None]).bfloat16()
    finite = ~values.isnan()
    for label, got in (("dequant_word_step", step), ("dequant_words", row)):
        wrong = int((got[:, finite].view(torch.int16) != ref[:, finite].view(torch.int16)).sum())
        record("fp8_dequant", f"256 codes x scale bytes {int(scales[0])}..{int(scales[-1])}", label, ok=wrong == 0, same_bits=wrong == 0, wrong=wrong)


def section_fp8_linear() -> None:
    from dsv4.model import quant

    guarded("fp8_dequant", "every code", dequant_words_case)
    for name, n, k, block in PROJECTIONS:
        w, s = fp8_weight(n, k, block, seed=n + k)
        wd = quant.dequant_fp8_block(w, s, block)
        wb = wd.bfloat16()
        for m in ROWS:
            guarded("fp8_linear", f"{name} M={m}", fp8_linear_case, name, m, w, s, wd, wb, block)


# ------------------------------------------------------------------------------ MoE


def moe_data(t: int, seed: int = 0, e: int = 384) -> tuple[torch.Tensor, ...]:
    """V4.1-Flash routed experts (e x 2304, top-6) with FP4-valued FP8 weights (the exact
    conversion of the released experts) and random routing of t tokens."""
    from dsv4.model import quant
    from dsv4.ops import moe as moe_ref

    d, inter, top_k = 5120, 2304, 6
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


def fp4_stack(w: torch.Tensor) -> torch.Tensor:
    """FP4-valued FP8 experts [E, rows, inputs] -> the compact FP4 stack (kernel layout) of the
    same values, expert by expert (the loader's form of the released experts)."""
    from dsv4.model import quant

    lut = quant.fp4_lut(w.device).to(torch.float8_e4m3fn).view(torch.uint8).long()
    code_of = torch.zeros(256, dtype=torch.uint8, device=w.device)
    code_of[lut] = torch.arange(16, dtype=torch.uint8, device=w.device)
    out = torch.empty(*w.shape[:2], w.shape[2] // 2, dtype=torch.uint8, device=w.device)
    for i in range(w.shape[0]):
        out[i] = quant.fp4_kernel_layout(quant.pack_fp4(code_of[w[i].view(torch.uint8).long()]))
    return out


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


def moe_case(t: int, data: tuple, dense: tuple, fp4s: tuple) -> None:
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
    y_k = moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True)
    err = norm_err(y_k, ref)
    t_k = median_time(lambda: moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True), reps=10)
    record("moe_experts", case, "triton", ok=err <= 4 * 2**-8, err=err, experts_used=used, **perf(t_k, w_bytes + io, flops, "bf16"))
    if t <= max(SWEEP_TOKENS):  # as decode runs it: from a CUDA graph, each call with its own routing
        calls = [lambda ids=ids, wts=wts: moe.moe_experts(xt, ids, wts, w13, s13, w2, s2, 10.0, True) for ids, wts in moe_routings(t, e, seed=t)]
        record("moe_experts", case, "triton_graph", experts_used=used, **perf(graph_time(calls, reps=5), w_bytes + io, flops, "bf16"))
        cfg = moe.moe_config(it.numel(), e)
        with moe_knobs({"cfg": cfg, "knobs": {"DEQUANT": "bytes"}}):  # the other dequantisation: the same bits
            same = torch.equal(moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True), y_k)
            record("moe_experts", case, "triton_graph bytes", ok=same, same_bits=same, experts_used=used,
                   **perf(graph_time(calls, reps=5), w_bytes + io, flops, "bf16"))
    # compact FP4 stacks (`--fp4-experts`): the same values, so the FP8 stacks' bits; half the bytes
    p13, p2 = fp4s
    fp4_bytes = used * (3 * inter * d) * (0.5 + 1 / 32)
    same = torch.equal(moe.moe_experts(xt, it, wt, p13, s13, p2, s2, 10.0, True), y_k)
    t_4 = median_time(lambda: moe.moe_experts(xt, it, wt, p13, s13, p2, s2, 10.0, True), reps=10)
    record("moe_experts", case, "triton_fp4", ok=same, same_bits=same, experts_used=used, **perf(t_4, fp4_bytes + io, flops, "bf16"))
    if t <= max(SWEEP_TOKENS):
        calls = [lambda ids=ids, wts=wts: moe.moe_experts(xt, ids, wts, p13, s13, p2, s2, 10.0, True) for ids, wts in moe_routings(t, e, seed=t)]
        record("moe_experts", case, "triton_fp4_graph", experts_used=used, **perf(graph_time(calls, reps=5), fp4_bytes + io, flops, "bf16"))
    if t >= 256 and moe.dense_fits(w13):  # the prefill path (where the layer could take it)
        err = norm_err(moe.moe_experts_dense(xt, it, wt, w13, s13, w2, s2, 10.0, True), ref)
        t_d = median_time(lambda: moe.moe_experts_dense(xt, it, wt, w13, s13, w2, s2, 10.0, True), reps=5)
        record("moe_experts", case, "dense_grouped", ok=err <= 4 * 2**-8, err=err, experts_used=used, **perf(t_d, w_bytes + io, flops, "bf16"))
    t_r = median_time(lambda: moe_ref.experts_forward(xt, wt, it, w1, w2l, w3, 10.0, True), reps=5, warmup=1)
    record("moe_experts", case, "torch_bf16", experts_used=used, **perf(t_r, 2 * w_bytes + io, flops, "bf16"))
    # FP8 activations (FP8 x FP8 kernels) against the reference whose Linears quantise their inputs
    from dsv4.ops.linear import Linear

    quantised = [[Linear(lin.weight, quant_input=True) for lin in part] for part in dense]
    ref8 = moe_ref.experts_forward(xt, wt, it, *quantised, 10.0, True).float()
    err = norm_err(moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True, fp8_act=True), ref8)
    t_8 = median_time(lambda: moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True, fp8_act=True), reps=10)
    record("moe_experts", case, "triton_fp8act", ok=err <= 4 * 2**-8, err=err, vs_bf16_ref=norm_err(ref8, ref), experts_used=used,
           **perf(t_8, w_bytes + io, flops, "fp8"))
    if t <= max(SWEEP_TOKENS):
        calls = [lambda ids=ids, wts=wts: moe.moe_experts(xt, ids, wts, w13, s13, w2, s2, 10.0, True, fp8_act=True)
                 for ids, wts in moe_routings(t, e, seed=t)]
        record("moe_experts", case, "triton_fp8act_graph", experts_used=used, **perf(graph_time(calls, reps=5), w_bytes + io, flops, "fp8"))
    if t >= 256 and moe.dense_fits(w13):
        err = norm_err(moe.moe_experts_dense(xt, it, wt, w13, s13, w2, s2, 10.0, True, fp8_act=True), ref8)
        record("moe_experts", case, "dense_grouped_fp8act", ok=err <= 4 * 2**-8, err=err, experts_used=used)


# tokens of the prefill-regime comparison: the 64-expert benchmark layer (65 with the shared
# one, top-6 + shared), where the layer picks the grouped kernels or the dense grouped path by
# layers.moe.DENSE_EXPERT_PAIRS
MOE_PREFILL_TOKENS = (256, 512, 1024, 2048, 4096, 8192)


def moe_prefill_case(t: int, data: tuple) -> None:
    from dsv4.model.layers.moe import DENSE_EXPERT_PAIRS
    from dsv4.ops.triton import moe

    x, ids, weights, w13, s13, w2, s2 = data
    e, two_i, d = w13.shape
    xt, it, wt = x[:t], ids[:t], weights[:t]
    case = f"T={t} E={e} k={it.shape[1]} pairs/expert={it.numel() / e:.0f}"
    flops = 2 * it.numel() * 3 * (two_i // 2) * d
    w_bytes = e * 3 * (two_i // 2) * d * (1 + 1 / 32)
    y_k = moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True)
    y_d = moe.moe_experts_dense(xt, it, wt, w13, s13, w2, s2, 10.0, True)
    err = norm_err(y_d, y_k)
    t_k = median_time(lambda: moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True), reps=5)
    t_d = median_time(lambda: moe.moe_experts_dense(xt, it, wt, w13, s13, w2, s2, 10.0, True), reps=5)
    layer = "dense_grouped" if it.numel() >= DENSE_EXPERT_PAIRS * e else "triton"
    record("moe_prefill", case, "triton", **perf(t_k, w_bytes, flops, "bf16"))
    record("moe_prefill", case, "dense_grouped", ok=err <= 4 * 2**-8, err=err, faster="dense_grouped" if t_d < t_k else "triton",
           layer_uses=layer, **perf(t_d, w_bytes, flops, "bf16"))


def section_moe() -> None:
    data = moe_data(max(ROWS))
    dense = dense_experts(*data[3:])
    fp4s = (fp4_stack(data[3]), fp4_stack(data[5]))
    for t in ROWS:
        guarded("moe_experts", f"T={t}", moe_case, t, data, dense, fp4s)


def section_moe_prefill() -> None:
    x, ids, weights, w13, s13, w2, s2 = moe_data(max(MOE_PREFILL_TOKENS), seed=1, e=64)
    shared = torch.full_like(ids[:, :1], 64)  # the shared expert as expert 64, weight 1
    w13 = torch.cat([w13, w13[:1]])
    s13, w2, s2 = torch.cat([s13, s13[:1]]), torch.cat([w2, w2[:1]]), torch.cat([s2, s2[:1]])
    data = (x, torch.cat([ids, shared], 1), torch.cat([weights, torch.ones_like(weights[:, :1])], 1), w13, s13, w2, s2)
    for t in MOE_PREFILL_TOKENS:
        guarded("moe_prefill", f"T={t}", moe_prefill_case, t, data)
    guarded("moe_prefill", "parts", moe_prefill_parts, data)
    for t in (1152, 4096, 8192):  # 1152: hit=1024@100000's encoder rows (~124 pairs per expert)
        guarded("moe_prefill", f"tiles T={t}", moe_prefill_tiles, t, data)
    del data, x, ids, weights, w13, s13, w2, s2
    torch.cuda.empty_cache()
    guarded("moe_prefill", "tiles E=385", moe_prefill_tiles_real)


def moe_prefill_tiles_real() -> None:
    """The tilings at V4.1-Flash's 384 routed experts + the shared one: 4096 tokens (~74 pairs
    per expert, the prefill class from ~2700) and 8192 (~149), where 65 experts at 1152 rows
    give as many pairs per expert but, measured (docs/PERF.md fifteenth session), other tiles win."""
    x, ids, weights, w13, s13, w2, s2 = moe_data(8192, seed=2, e=384)
    w13, s13 = torch.cat([w13, w13[:1]]), torch.cat([s13, s13[:1]])
    w2, s2 = torch.cat([w2, w2[:1]]), torch.cat([s2, s2[:1]])
    ids = torch.cat([ids, torch.full_like(ids[:, :1], 384)], 1)
    weights = torch.cat([weights, torch.ones_like(weights[:, :1])], 1)
    for t in (4096, 8192):
        moe_prefill_tiles(t, (x, ids, weights, w13, s13, w2, s2))


def router_case(t: int, e: int) -> None:
    """The router (fp32 gate GEMM + routing kernel) against its torch code (`ops.moe.route_scores`
    under torch_only: cuBLAS fp32 GEMM and torch ops), both replayed from CUDA graphs (in a
    decode step they are launch bound). The same experts; weights within 1e-5 (the logits'
    fp32 sums in another order)."""
    import dsv4.ops
    from dsv4.ops import moe as moe_ops
    from dsv4.ops.triton import router

    g = torch.Generator(device="cuda").manual_seed(t + e)
    x = torch.randn(t, 5120, device="cuda", generator=g).bfloat16()
    gate = torch.randn(e, 5120, device="cuda", generator=g) * 0.04
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    args = (x, gate, bias, 6, 1.5, 2.5, True, e)
    def torch_call():
        with dsv4.ops.torch_only():
            return moe_ops.route_scores(*args)

    w, ids = router.route_scores(*args)
    rw, rids = torch_call()
    same = torch.equal(ids, rids)
    err = rel_err(w, rw)
    case = f"T={t} E={e} k=6+1"
    nbytes, flops = e * 5120 * 4 + t * 5120 * 2, 2 * t * e * 5120
    record("router", case, "triton_graph", ok=same and err <= 1e-5, same_ids=same, err=err, **perf(graph_time([lambda: router.route_scores(*args)]), nbytes, flops, "bf16"))
    record("router", case, "torch_graph", **perf(graph_time([torch_call]), nbytes, flops, "bf16"))


def section_router() -> None:
    for e in (64, 384):
        for t in (1, 64, 256, 4096):
            guarded("router", f"T={t} E={e}", router_case, t, e)


# Grouped-kernel tilings tried at prefill sizes: (BLOCK_T, gate_up (BLOCK_N, BLOCK_K, warps,
# stages[, STACK[, maxnreg]]), down (...)[, MOE knobs]); the first is the default of the class up
# to 200 pairs an expert, the fourth that of the class above. Prefill at V4.1-Flash's 385
# experts always takes these kernels (its bf16 expert copies would not fit
# `MOE["DENSE_TEMP_BYTES"]`): 8K tokens are ~150 pairs per expert.
MOE_PREFILL_TILES = [
    (128, (128, 128, 8, 3), (256, 64, 8, 3)),
    (128, (64, 64, 4, 3), (128, 64, 8, 3)),
    (128, (128, 64, 8, 3), (128, 64, 8, 3)),
    # stacked, under a register cap of 128 (no spill; without it 144 registers, one program an
    # SM) — and uncapped, and with 256 down rows
    (128, (128, 64, 8, 3, True, 128), (128, 64, 8, 3)),
    (128, (128, 64, 8, 3, True), (128, 64, 8, 3)),
    (128, (128, 64, 8, 3, True, 128), (256, 64, 8, 3)),
    (128, (128, 128, 8, 3, True), (256, 64, 8, 3)),
    (128, (128, 128, 8, 3, True), (128, 128, 8, 3)),
    (256, (128, 64, 8, 3, True), (128, 64, 8, 3)),
    (128, (128, 64, 8, 4), (256, 64, 8, 3)),
    (128, (128, 64, 8, 3), (256, 64, 8, 3)),
    (128, (64, 64, 4, 3), (256, 64, 8, 3)),
    (64, (128, 64, 8, 4), (128, 64, 8, 4)),
    # byte reads: the FP8 tile taken from shared memory, no word permute
    (128, (128, 64, 8, 3, True), (128, 64, 8, 3), {"DEQUANT": "bytes"}),
    (128, (64, 64, 4, 3), (128, 64, 8, 3), {"DEQUANT": "bytes"}),
]


# dequant_sweep: `fp8_gemm.DEQUANT_TILE` candidates (BLOCK_R, BLOCK_C, num_warps) on the prefill
# MoE's stacked experts (65 of V4.1-Flash's: gate_up 65 x 4608 x 5120, down 65 x 5120 x 2304,
# one E8M0 byte per 32 inputs), timed after the default; every one must give the default's bits.
DEQUANT_TILES = [(32, 256, 8), (64, 256, 8), (32, 512, 8), (64, 512, 8), (128, 256, 8), (16, 256, 4), (32, 256, 4), (32, 128, 4), (64, 512, 16)]


def dequant_sweep_case(name: str, rows: int, inputs: int) -> None:
    from dsv4.ops.triton import fp8_gemm

    w = torch.randn(rows, inputs, device="cuda").to(torch.float8_e4m3fn)
    s = torch.randint(110, 140, (rows, inputs // 32), dtype=torch.uint8, device="cuda")
    default = dict(fp8_gemm.DEQUANT_TILE)
    tiles = [(default["BLOCK_R"], default["BLOCK_C"], default["num_warps"])]
    tiles += [tile for tile in DEQUANT_TILES if tile != tiles[0]]
    first = None
    try:
        for block_r, block_c, warps in tiles:
            fp8_gemm.DEQUANT_TILE.update(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
            out = fp8_gemm.dequant_fp8(w, s, 0, True)
            first = out if first is None else first
            t = median_time(lambda: fp8_gemm.dequant_fp8(w, s, 0, True), reps=10)
            record("dequant_sweep", f"{name} {rows}x{inputs}", f"R{block_r} C{block_c} w{warps}", ok=torch.equal(out, first),
                   **perf(t, 3 * w.numel() + s.numel(), 0, "bf16"))
    finally:
        fp8_gemm.DEQUANT_TILE.clear()
        fp8_gemm.DEQUANT_TILE.update(default)


def section_dequant_sweep() -> None:
    guarded("dequant_sweep", "gate_up", dequant_sweep_case, "gate_up", 65 * 4608, 5120)
    guarded("dequant_sweep", "down", dequant_sweep_case, "down", 65 * 5120, 2304)


def moe_prefill_parts(data: tuple) -> None:
    """Where the dense grouped path's time goes at T=8192: the one-pass dequantisation of the
    stacked experts and the two bf16 grouped GEMMs alone."""
    from dsv4.ops.triton import fp8_gemm

    x, ids, weights, w13, s13, w2, s2 = data
    e, two_i, d = w13.shape
    inter = two_i // 2
    t_13 = median_time(lambda: fp8_gemm.dequant_fp8(w13.view(-1, d), s13.view(-1, d // 32), 0, True), reps=5)
    t_2 = median_time(lambda: fp8_gemm.dequant_fp8(w2.view(-1, inter), s2.view(-1, inter // 32), 0, True), reps=5)
    n = e * 3 * inter * d
    record("moe_prefill", f"dequant E={e}", "dequant_fp8", **perf(t_13 + t_2, 3 * n, 0, "bf16"))
    g13 = fp8_gemm.dequant_fp8(w13.view(-1, d), s13.view(-1, d // 32), 0, True).view(e, two_i, d)
    g2 = fp8_gemm.dequant_fp8(w2.view(-1, inter), s2.view(-1, inter // 32), 0, True).view(e, d, inter)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=e).cumsum(0).int()
    xs = x[order // ids.shape[1]]
    act = torch.randn(xs.shape[0], inter, device="cuda").bfloat16()
    t_a = median_time(lambda: torch._grouped_mm(xs, g13.transpose(1, 2), offs=offs), reps=5)
    t_b = median_time(lambda: torch._grouped_mm(act, g2.transpose(1, 2), offs=offs), reps=5)
    flops = 2 * xs.shape[0] * 3 * inter * d
    record("moe_prefill", f"grouped_mm T={x.shape[0]} E={e}", "torch._grouped_mm", gate_up_ms=t_a * 1e3, down_ms=t_b * 1e3, **perf(t_a + t_b, 0, flops, "bf16"))


def moe_prefill_tiles(t: int, data: tuple) -> None:
    from dsv4.ops.triton import moe

    x, ids, weights, w13, s13, w2, s2 = data
    e, two_i, d = w13.shape
    xt, it, wt = x[:t], ids[:t], weights[:t]
    flops = 2 * it.numel() * 3 * (two_i // 2) * d
    ref = moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True)
    for bt, gu, dn, *knobs in swept(MOE_PREFILL_TILES):
        keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "STACK", "maxnreg")
        cand = {"cfg": {"BLOCK_T": bt, "gate_up": dict(zip(keys, gu)), "down": dict(zip(keys, dn))}, "knobs": knobs[0] if knobs else {}}
        label = moe_label(cand)
        try:
            with moe_knobs(cand):
                y = moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True)
                secs = median_time(lambda: moe.moe_experts(xt, it, wt, w13, s13, w2, s2, 10.0, True), reps=5)
            record("moe_prefill", f"T={t} E={e} {label}", "triton_tile", ok=torch.equal(y, ref), same_bits=torch.equal(y, ref), **perf(secs, 0, flops, "bf16"))
        except Exception as exc:  # noqa: BLE001 - one failing tiling does not stop the others
            record("moe_prefill", f"T={t} E={e} {label}", "error", error=f"{type(exc).__name__}: {exc}"[:300], trace="")


# ------------------------------------------------------------------------------ GEMM sweep
#
# Candidate tilings of the decode-regime kernels — fp8_linear_w8a16 on PROJECTIONS at
# SWEEP_ROWS rows, moe_experts at SWEEP_MOE (experts incl. the shared one, top-6 + shared) — each
# checked against its reference and timed as decode will run it: replayed from a CUDA graph (no
# host launch overhead), rotating over weight copies (MoE: routings) that together exceed the
# 60 MB L2, so that every call streams its weights from HBM. Prints per shape the default and
# the best candidate with their fraction of the floor, then the knob settings the results
# suggest (fp8_gemm.W8A16, moe.MOE). Compilation runs first, spread over SWEEP_WORKERS
# processes that warm Triton's disk cache.

SWEEP_ROWS = (1, 32, 64, 256)  # one per row class (M = 1 stands for the 16-row class, 8 times as M = 1)
SWEEP_TOKENS = (1, 8, 64, 256)  # MoE section: the sizes also timed from a CUDA graph
# (experts, tokens) of the MoE sweep, as the model calls it: the routed experts plus the shared
# one as the last expert (every token's 7th slot, weight 1); V4.1-Flash and the 64-expert
# benchmark config
SWEEP_MOE = ((385, (1, 8, 64, 256)), (65, (1, 8, 64, 256)))
# A device call can narrow the sweeps (the whole of both takes several minutes):
# SWEEP_ROWS="256" (w8a16 rows), SWEEP_MOE="65:64,256;385:1" (experts:tokens per shape)
if os.environ.get("SWEEP_ROWS"):
    SWEEP_ROWS = tuple(int(m) for m in os.environ["SWEEP_ROWS"].split(","))
if os.environ.get("SWEEP_MOE"):
    SWEEP_MOE = tuple((int(e), tuple(int(t) for t in ts.split(","))) for e, ts in (part.split(":") for part in os.environ["SWEEP_MOE"].split(";")))
# SWEEP_FP8=1: the MoE sweep times the FP8-activation kernels (moe_experts(fp8_act=True), their
# table MOE["fp8_rows"]) against the reference that quantises its inputs
SWEEP_FP8 = os.environ.get("SWEEP_FP8") == "1"
SWEEP_WORKERS = 8
SWEEP_ROUTINGS = 4  # MoE calls per graph, each with its own routing
ROTATE_BYTES = 192 << 20  # weight bytes the calls of one graph cycle through (> 3x the L2)
# w8a16 candidates per row tile BLOCK_T: (BLOCK_N, BLOCK_K, GROUP_T, num_warps, num_stages).
# Every tile is a whole-warp-group wgmma (fp8_gemm.wgmma_tile_error), so all candidates with
# the same chunking must give the same bits across row tiles too (the first run's T32 / T64
# mismatch). At decode the weight stream is the work: more weight rows or warps per program
# (BLOCK_N 256, 8 warps) and deeper pipelines put more bytes in flight per SM; 64-row tiles
# give small weights more programs.
W8A16_TILES = {
    16: [(128, 128, 1, 4, 3), (128, 128, 1, 4, 4), (64, 128, 1, 4, 4), (64, 128, 1, 4, 6), (128, 128, 1, 8, 3), (256, 128, 1, 8, 3), (256, 64, 1, 8, 4)],
    32: [(128, 128, 1, 4, 3), (128, 128, 2, 4, 3), (64, 128, 1, 4, 4)],  # GROUP_T 2: both row tiles of M=64 share the weight tile in L2
    # (a sixth entry: the register cap `maxnreg`; the old 8-warp 64-row default and the 128-row
    # default take 153 and 193 registers, one program an SM: capped at 128, two, at 32 and 264
    # bytes spilled)
    64: [(128, 128, 1, 4, 3), (128, 64, 1, 4, 6), (64, 128, 1, 4, 4), (128, 128, 1, 8, 3), (256, 64, 1, 8, 3), (128, 128, 1, 8, 3, 128)],
    128: [(128, 64, 8, 8, 3), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (128, 64, 8, 8, 3, 128), (128, 64, 8, 8, 3, 168),
          # one warp group of 64 weight rows (64 accumulator registers a thread): three programs an SM under 168
          (64, 64, 8, 4, 3), (64, 64, 8, 4, 3, 168), (64, 128, 8, 4, 3, 168)],
    256: [(128, 64, 8, 8, 2)],
}
SWEEP_ROW_TILES = {1: (16,), 32: (32,), 64: (64, 32), 256: (128, 64, 256)}  # rows -> row tiles tried
# MoE candidates per row tile: ((BLOCK_N, BLOCK_K, num_warps, num_stages) of gate_up, of down),
# whole-warp-group wgmma tiles too; each with the default MOE knobs. Besides them
# `moe_candidates` times the previous path ("old": byte dequantisation, always a layout) and
# pair tiles off / on where the default has them on / the pairs are few.
MOE_TILES = {
    16: [((64, 128, 4, 4), (128, 128, 4, 4)), ((64, 128, 4, 3), (128, 128, 4, 3)), ((64, 64, 4, 6), (128, 64, 4, 6)),
         ((128, 128, 8, 3), (256, 128, 8, 3)), ((64, 128, 4, 4), (64, 128, 4, 4)),
         # less shared memory per program, for more programs per SM (ncu, S3-3: 25% theoretical
         # occupancy, bound by shared memory; stalls on shared-memory loads)
         ((64, 64, 4, 3), (128, 64, 4, 3)), ((64, 64, 4, 2), (64, 64, 4, 3)), ((64, 128, 4, 2), (128, 128, 4, 2)),
         # gate_up STACK (fifth field): 32 gate + 32 up rows a program, twice the programs
         ((64, 128, 4, 3, True), (128, 128, 4, 3)), ((64, 128, 4, 3, True), (64, 128, 4, 3)), ((64, 64, 4, 3, True), (64, 64, 4, 3)),
         ((128, 128, 8, 3, True), (128, 128, 4, 3))],
    32: [((64, 128, 4, 4), (128, 128, 4, 4)), ((64, 128, 4, 3), (128, 128, 4, 3)), ((128, 128, 8, 3), (128, 128, 8, 3)),
         ((64, 64, 4, 3), (128, 64, 4, 3)), ((64, 64, 4, 2), (64, 64, 4, 3)), ((64, 128, 4, 2), (128, 128, 4, 2)),
         ((64, 128, 4, 3, True), (128, 128, 4, 3)), ((64, 64, 4, 3, True), (64, 64, 4, 3))],
    64: [((64, 128, 4, 3), (128, 128, 4, 3)), ((128, 64, 8, 4), (128, 64, 8, 4)), ((64, 64, 4, 4), (64, 128, 4, 3)),
         ((64, 64, 4, 3), (128, 64, 4, 3)), ((64, 64, 4, 2), (64, 64, 4, 3)),
         # 256 tokens of 65 experts (~27 pairs each, one 64-row tile): 39% of the floor in the
         # fourth session's profile; stacked gate/up and fewer stages for more programs per SM
         ((64, 128, 4, 3, True), (128, 128, 4, 3)), ((64, 128, 4, 2, True), (128, 128, 4, 2)), ((128, 128, 8, 2, True), (128, 128, 8, 2))],
    128: [((64, 64, 4, 3), (128, 64, 8, 3))],
}
SWEEP_RESULTS: list[dict] = []  # every candidate's outcome, for the suggested knobs


def join_workers(workers: list, deadline: float, least: float) -> list[str]:
    """Wait for compile warm-up processes until `deadline` (each gets at least `least` s; late
    ones are killed) -> a line per failed worker."""
    failed = []
    for i, proc in enumerate(workers):
        try:
            err = proc.communicate(timeout=max(least, deadline - time.time()))[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1] + "\n(timed out)"
        if proc.returncode:
            failed.append(f"worker {i}: exit {proc.returncode}: {err[-600:]}")
    return failed


def graph_time(calls: list, reps: int = 10) -> float:
    """Median seconds per call of `calls`, run in turn, replayed from one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del graph
    return statistics.median(times) / len(calls)


def rotated(w: torch.Tensor, s: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of a weight whose bytes together reach ROTATE_BYTES (at least 2, at most 128)."""
    copies = min(128, max(2, -(-ROTATE_BYTES // (w.numel() + s.numel()))))
    return [(w, s)] + [(w.clone(), s.clone()) for _ in range(copies - 1)]


def tile_label(tile: dict) -> str:
    cap = f" r{tile['maxnreg']}" if tile.get("maxnreg") else ""  # the register cap (launch_options)
    return f"T{tile['BLOCK_T']} N{tile['BLOCK_N']} K{tile['BLOCK_K']} g{tile['GROUP_T']} w{tile['num_warps']} s{tile['num_stages']}{cap}"


def w8a16_candidates(m: int, n: int, k: int, block: int) -> list[dict]:
    """The default knobs first, then other tiles (default chunks), other chunk counts (default
    tile), at every M the other weight reads at the default tile (W8A16 "DEQUANT") and, at one
    row (their bits do not depend on M), the unsplit policy and the fp32 dequantisation; all
    must give the default's bits."""
    from dsv4.ops.triton import fp8_gemm

    default = dict(fp8_gemm.w8a16_config(m))
    cands = [{"tile": default}]
    for bt in SWEEP_ROW_TILES[m]:
        for bn, bk, group, warps, stages, *cap in W8A16_TILES[bt]:
            tile = {"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_T": group, "num_warps": warps, "num_stages": stages, **({"maxnreg": cap[0]} if cap else {})}
            if tile != default:
                cands.append({"tile": tile})
    chunks = -(-k // fp8_gemm.w8a16_chunk_k(n, k, block, torch.device("cuda")))
    if m <= 64:
        for alt in sorted({max(1, chunks // 2), chunks * 2, chunks * 4} - {chunks}):
            if k // alt >= fp8_gemm.CHUNK_ALIGN:
                cands.append({"tile": default, "chunks": alt})
    cands.append({"tile": default, "dequant": "bytes" if fp8_gemm.W8A16["DEQUANT"] == "words" else "words"})
    cands.append({"tile": default, "step": not fp8_gemm.W8A16["STEP"]})
    if m == 1:
        if chunks > 1:
            cands.append({"tile": default, "split": 0.0})
        cands.append({"tile": default, "convert": "fp32"})
    return swept(cands)


class w8a16_knobs:
    """Applies a candidate to fp8_gemm's knobs (its chunks pinned, since the default chunk count
    follows the first row class's BLOCK_N) and restores them."""

    def __init__(self, cand: dict, n: int, k: int, block: int):
        self.cand, self.key = cand, (n, k, block)

    def __enter__(self):
        from dsv4.ops.triton import fp8_gemm

        knobs = fp8_gemm.W8A16
        self.saved = (knobs["rows"], knobs["CHUNKS"], knobs["SPLIT_TILES_PER_SM"], knobs["DEQUANT"], fp8_gemm.FP8_CONVERT, knobs["STEP"])
        n, k, block = self.key
        chunks = self.cand.get("chunks") or -(-k // fp8_gemm.w8a16_chunk_k(n, k, block, torch.device("cuda")))
        knobs["CHUNKS"] = {**self.saved[1], self.key: chunks}
        knobs["rows"] = ((None, self.cand["tile"]),)
        knobs["SPLIT_TILES_PER_SM"] = self.cand.get("split", self.saved[2])
        knobs["DEQUANT"] = self.cand.get("dequant", self.saved[3])
        fp8_gemm.FP8_CONVERT = self.cand.get("convert", self.saved[4])
        knobs["STEP"] = self.cand.get("step", self.saved[5])
        self.chunks = -(-k // fp8_gemm.w8a16_chunk_k(n, k, block, torch.device("cuda")))
        return self

    def __exit__(self, *exc):
        from dsv4.ops.triton import fp8_gemm

        knobs = fp8_gemm.W8A16
        knobs["rows"], knobs["CHUNKS"], knobs["SPLIT_TILES_PER_SM"], knobs["DEQUANT"], fp8_gemm.FP8_CONVERT, knobs["STEP"] = self.saved


def cand_label(cand: dict, chunks: int) -> str:
    extra = {"split": " unsplit", "convert": " fp32-dequant", "dequant": f" {cand.get('dequant')}", "step": f" step={cand.get('step')}"}
    return tile_label(cand["tile"]) + f" c{chunks}" + "".join(v for key, v in extra.items() if key in cand)


def sweep_w8a16_shape(name: str, n: int, k: int, block: int) -> None:
    """Every candidate at every SWEEP_ROWS for one projection; records default and best."""
    from dsv4.model import quant
    from dsv4.ops.triton import fp8_gemm

    w, s = fp8_weight(n, k, block, seed=n + k)
    wd = quant.dequant_fp8_block(w, s, block).double()
    copies = rotated(w, s)
    for m in SWEEP_ROWS:
        case = f"w8a16 {name} M={m} N={n} K={k} b={block}"
        x = torch.randn(m, k, device="cuda").bfloat16()
        exact = x.double() @ wd.T
        nbytes, flops = n * k + s.numel() + m * k * 2 + m * n * 2, 2 * m * n * k
        first: dict[int, torch.Tensor] = {}  # chunk count -> the first candidate's output
        rows = []
        for cand in w8a16_candidates(m, n, k, block):
            try:
                with w8a16_knobs(cand, n, k, block) as knobs:
                    y = fp8_gemm.fp8_linear_w8a16(x, w, s, block)
                    err = rel_err(y, exact)
                    same = torch.equal(y, first.setdefault(knobs.chunks, y))
                    t = graph_time([lambda wi=wi, si=si: fp8_gemm.fp8_linear_w8a16(x, wi, si, block) for wi, si in copies])
                    rows.append(dict(label=cand_label(cand, knobs.chunks), chunks=knobs.chunks, err=err, same_bits=same, ok=err <= 2**-8 * 1.1, **perf(t, nbytes, flops, "bf16")))
                    SWEEP_RESULTS.append(dict(kind="w8a16", shape=(n, k, block), m=m, cand=cand, **rows[-1]))
            except Exception as exc:  # noqa: BLE001 - one failing candidate does not stop the sweep
                rows.append(dict(label=cand_label(cand, 0), error=f"{type(exc).__name__}: {exc}"[:300], ok=False))
        report_sweep(case, rows)
    torch.cuda.empty_cache()


def report_sweep(case: str, rows: list[dict]) -> None:
    """One record per shape: the fastest correct candidate, with the default's (first) time and
    fraction in its name (one short line each, so that the whole table fits the tail of the
    output); every candidate is in the record's `candidates`. `ok` also requires that the
    candidates with the same chunking gave the same bits."""
    timed = [r for r in rows if "ms" in r]
    slim = [{k: r.get(k) for k in ("label", "ms", "of_floor", "err", "same_bits", "error")} for r in rows]
    if not timed:
        record("gemm_sweep", case, "error", error="no candidate ran", trace=json.dumps(slim)[-2000:])
        return
    same = all(r["same_bits"] for r in timed)
    best = min([r for r in timed if r["ok"]] or timed, key=lambda r: r["ms"])
    default = f"default {rows[0]['of_floor']:.0%} {rows[0]['ms']:.4f} ms" if "ms" in rows[0] else "default failed"
    keep = ("ms", "tb_s", "tflop_s", "floor_ms", "of_floor", "bytes", "flops", "peak", "err")
    record("gemm_sweep", case, f"best {best['label']} ({default})", ok=best["ok"] and same and "ms" in rows[0], same_bits=same, candidates=slim, **{k: best[k] for k in keep})


def moe_routings(t: int, experts: int, seed: int, shared: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """SWEEP_ROUTINGS random top-6 routings of t tokens; shared: over the first experts - 1,
    with the last expert appended to every token at weight 1 (the model's shared expert)."""
    from dsv4.ops import moe as moe_ref

    g = torch.Generator(device="cuda").manual_seed(seed)
    routed = experts - 1 if shared else experts
    out = []
    for _ in range(SWEEP_ROUTINGS):
        scores = moe_ref.sqrtsoftplus(torch.randn(t, routed, device="cuda", generator=g))
        weights, ids = moe_ref.route(scores, torch.zeros(routed, device="cuda"), 6, None, 1.5, True)
        weights = weights.float()
        if shared:
            ids = torch.cat([ids, torch.full_like(ids[:, :1], experts - 1)], dim=1)
            weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)
        out.append((ids, weights))
    return out


class LazyExperts:
    """`experts_forward`'s per-expert Linears, dequantised to bf16 (exactly) when used."""

    def __init__(self, w: torch.Tensor, s: torch.Tensor, rows: slice):
        self.w, self.s, self.rows = w, s, rows

    def __len__(self) -> int:
        return self.w.shape[0]

    def __getitem__(self, e: int):
        from dsv4.ops.linear import Linear

        w, s = self.w[e, self.rows], self.s[e, self.rows]
        return Linear((w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, -1)).bfloat16(), quant_input=SWEEP_FP8)


def moe_candidates(pairs: int, experts: int) -> list[dict]:
    """{"cfg": row-class knobs, "knobs": other MOE overrides}: the defaults first, the previous
    path ("old": byte dequantisation, a layout at any size), pair tiles toggled where they are
    on by default or the pairs are few (<= 64), the other tiles of the default row tile and
    the neighbouring row tiles' first tiles."""
    from dsv4.ops.triton import moe

    def make(bt, gu, dn):
        return {"BLOCK_T": bt, "gate_up": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "STACK"), gu)),
                "down": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), dn))}

    default = moe.moe_config(pairs, experts, SWEEP_FP8)
    bt = default["BLOCK_T"]
    cands = [{"cfg": default, "knobs": {}}]
    if not SWEEP_FP8:  # (the FP8 kernels have no byte path)
        cands.append({"cfg": default, "knobs": {"DEQUANT": "bytes", "PAIR_TILES_MAX_PAIRS": 0}})
    if pairs <= moe.MOE["PAIR_TILES_MAX_PAIRS"]:
        cands.append({"cfg": default, "knobs": {"PAIR_TILES_MAX_PAIRS": 0}})
    elif pairs <= 64:
        cands.append({"cfg": default, "knobs": {"PAIR_TILES_MAX_PAIRS": pairs}})
    tiles = [make(bt, gu, dn) for gu, dn in MOE_TILES.get(bt, [])]
    tiles += [make(b, *MOE_TILES[b][0]) for b in (bt // 2, bt * 2) if b in MOE_TILES]
    listed = [c["cfg"] for c in cands]
    cands += [{"cfg": cfg, "knobs": {}} for cfg in tiles if cfg not in listed]
    return swept(cands)


class moe_knobs:
    """Applies a MoE candidate (its row class for every load, its MOE overrides) and restores
    the knobs."""

    def __init__(self, cand: dict):
        self.cand = cand

    def __enter__(self):
        from dsv4.ops.triton import moe

        self.saved = dict(moe.MOE)
        moe.MOE.update(self.cand["knobs"], **{"fp8_rows" if SWEEP_FP8 else "rows": ((None, self.cand["cfg"]),)})
        return self

    def __exit__(self, *exc):
        from dsv4.ops.triton import moe

        moe.MOE.clear()
        moe.MOE.update(self.saved)


def moe_label(cand: dict) -> str:
    cfg, knobs = cand["cfg"], cand["knobs"]
    gu, dn = cfg["gate_up"], cfg["down"]
    cap = f" r{gu['maxnreg']}" if gu.get("maxnreg") else ""  # the register cap (launch_options)
    label = f"T{cfg['BLOCK_T']} gu N{gu['BLOCK_N']}{' stacked' if gu.get('STACK') else ''} K{gu['BLOCK_K']} w{gu['num_warps']} s{gu['num_stages']}{cap} dn N{dn['BLOCK_N']} K{dn['BLOCK_K']} w{dn['num_warps']} s{dn['num_stages']}"
    if knobs.get("DEQUANT") == "bytes" and knobs.get("PAIR_TILES_MAX_PAIRS") == 0:
        return label + " old"
    return label + "".join(f" {k}={v}" for k, v in knobs.items())


def sweep_moe_experts(experts: int, tokens: tuple, data: tuple) -> None:
    """Every candidate at each of `tokens` for one expert count (the first `experts` of those
    generated, the last as the shared expert); records per shape the best candidate (with the
    default's time) and the previous path ("old") beside it."""
    from dsv4.ops import moe as moe_ref
    from dsv4.ops.triton import moe

    x, w13, s13, w2, s2 = data
    w13, s13, w2, s2 = w13[:experts], s13[:experts], w2[:experts], s2[:experts]
    inter, d = w2.shape[2], w2.shape[1]
    dense = (LazyExperts(w13, s13, slice(0, inter)), LazyExperts(w2, s2, slice(None)), LazyExperts(w13, s13, slice(inter, 2 * inter)))
    for t in tokens:
        case = f"moe E={experts} T={t} D={d} I={inter} k=6+1"
        routings = moe_routings(t, experts, seed=t + experts, shared=True)
        xt = x[:t]
        k = routings[0][0].shape[1]
        used = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in routings)
        nbytes = used * 3 * inter * d * (1 + 1 / 32) + t * d * 6 + t * k * 12
        flops = 2 * t * k * 3 * inter * d
        ids0, wts0 = routings[0]
        probe = min(t, 4)  # rows checked against the reference (each row's result is independent)
        ref = moe_ref.experts_forward(xt[:probe], wts0[:probe], ids0[:probe], dense[0], dense[1], dense[2], 10.0, True).float()
        first = None
        rows = []
        for cand in moe_candidates(t * k, experts):
            try:
                with moe_knobs(cand):
                    y = moe.moe_experts(xt, ids0, wts0, w13, s13, w2, s2, 10.0, True, fp8_act=SWEEP_FP8)
                    err = norm_err(y[:probe], ref)
                    first = y if first is None else first
                    calls = [lambda ids=ids, wts=wts: moe.moe_experts(xt, ids, wts, w13, s13, w2, s2, 10.0, True, fp8_act=SWEEP_FP8) for ids, wts in routings]
                    rows.append(dict(label=moe_label(cand), err=err, same_bits=torch.equal(y, first), ok=err <= 4 * 2**-8, **perf(graph_time(calls, reps=5), nbytes, flops, "bf16")))
                SWEEP_RESULTS.append(dict(kind="moe", shape=experts, m=t, k=k, cand=cand, **rows[-1]))
            except Exception as exc:  # noqa: BLE001 - one failing candidate does not stop the sweep
                rows.append(dict(label=moe_label(cand), error=f"{type(exc).__name__}: {exc}"[:300], ok=False))
        report_sweep(case + (" fp8-act" if SWEEP_FP8 else ""), rows)
        old = rows[1]
        if "ms" in old and not SWEEP_FP8:
            keep = ("ms", "tb_s", "tflop_s", "floor_ms", "of_floor", "bytes", "flops", "peak", "err")
            record("gemm_sweep", case, "old (bytes, layout)", ok=old["ok"], same_bits=old["same_bits"], **{key: old[key] for key in keep})


def suggested_knobs() -> str:
    """Per row class the tile with the best geometric mean fraction of the floor over the
    shapes it was tried on (all correct); per projection the chunk count with the best mean
    over M <= 64 where it beats the default by more than 3%."""
    from dsv4.ops.triton import fp8_gemm, moe

    def best_tiles(results: list[dict], cls) -> dict:
        by_class: dict = {}
        for r in results:
            by_class.setdefault(cls(r), {}).setdefault(json.dumps(r["cand"], sort_keys=True), []).append(r)
        out = {}
        for c, cands in by_class.items():
            complete = {key: rs for key, rs in cands.items() if all(r["ok"] for r in rs) and len(rs) == max(len(v) for v in cands.values())}
            if complete:
                key = max(complete, key=lambda key: statistics.geometric_mean(max(r["of_floor"], 1e-9) for r in complete[key]))
                out[c] = (json.loads(key), statistics.geometric_mean(r["of_floor"] for r in complete[key]))
        return out

    tiles = [r for r in SWEEP_RESULTS if r["kind"] == "w8a16" and set(r["cand"]) == {"tile"}]
    parts = []
    for c, (cand, frac) in sorted(best_tiles(tiles, lambda r: fp8_gemm.w8a16_config(r["m"])["BLOCK_T"]).items()):
        parts.append(f"W8A16 rows(T{c}) {tile_label(cand['tile'])} ({frac:.0%})")
    chunks = {}
    for r in SWEEP_RESULTS:
        if r["kind"] == "w8a16" and r["m"] <= 64 and set(r["cand"]) <= {"tile", "chunks"} and r["ok"] and r["cand"]["tile"] == fp8_gemm.w8a16_config(r["m"]):
            chunks.setdefault(r["shape"], {}).setdefault(r["chunks"], []).append(r["of_floor"])
    for shape, by_count in chunks.items():
        n, k, block = shape
        default = -(-k // fp8_gemm.w8a16_chunk_k(n, k, block, torch.device("cuda")))
        full = {c: statistics.mean(v) for c, v in by_count.items() if len(v) == len(by_count.get(default, []))}
        if default in full and max(full.values()) > 1.03 * full[default]:
            best = max(full, key=full.get)
            parts.append(f"W8A16 CHUNKS[{shape}]={best} ({full[default]:.0%}->{full[best]:.0%})")
    moes = [r for r in SWEEP_RESULTS if r["kind"] == "moe"]
    for c, (cand, frac) in sorted(best_tiles(moes, lambda r: moe.moe_config(r["m"] * r["k"], r["shape"], SWEEP_FP8)["BLOCK_T"]).items()):
        parts.append(f"MOE {'fp8_rows' if SWEEP_FP8 else 'rows'}(T{c} class) {moe_label(cand)} ({frac:.0%})")
    return "; ".join(parts)


def sweep_jobs(kinds: tuple[str, ...] = ("w8a16", "moe")) -> list[tuple]:
    """Every (kind, shape, size, candidate) the sweep launches, for the compile warm-up."""
    jobs = []
    if "w8a16" in kinds:
        for name, n, k, block in PROJECTIONS:
            for m in SWEEP_ROWS:
                jobs += [("w8a16", n, k, block, m, cand) for cand in w8a16_candidates(m, n, k, block)]
    if "moe" in kinds:
        for experts, tokens in SWEEP_MOE:
            for t in tokens:
                jobs += [("moe", experts, t, cand) for cand in moe_candidates(t * 7, experts)]
    return jobs


def sweep_warm(index: int, count: int, kinds: tuple[str, ...] = ("w8a16", "moe")) -> None:
    """Worker process: compile (by running once, on zero data) its share of the sweep's
    launches; the main process then finds them in Triton's disk cache. The MoE GEMMs compile
    the same for any expert count, so 64 experts stand in for 384 (the layout kernel, whose
    tile depends on the count, is warmed at the real count)."""
    from dsv4.ops.triton import fp8_gemm, moe

    weights: dict = {}
    experts = None
    for job in sweep_jobs(kinds)[index::count]:
        try:
            if job[0] == "w8a16":
                _, n, k, block, m, cand = job
                if (n, k, block) not in weights:
                    weights[(n, k, block)] = fp8_weight(n, k, block, seed=0)
                w, s = weights[(n, k, block)]
                with w8a16_knobs(cand, n, k, block):
                    fp8_gemm.fp8_linear_w8a16(torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), w, s, block)
            else:
                _, e, t, cand = job
                if experts is None:
                    experts = (torch.zeros(64, 2 * 2304, 5120, dtype=torch.float8_e4m3fn, device="cuda"), torch.full((64, 2 * 2304, 160), 120, dtype=torch.uint8, device="cuda"),
                               torch.zeros(64, 5120, 2304, dtype=torch.float8_e4m3fn, device="cuda"), torch.full((64, 5120, 72), 120, dtype=torch.uint8, device="cuda"))
                with moe_knobs(cand):
                    ids = torch.randint(0, 64, (t, 7), device="cuda")
                    moe.moe_experts(torch.zeros(t, 5120, device="cuda", dtype=torch.bfloat16), ids, torch.ones(t, 7, device="cuda"), *experts, 10.0, True,
                                    fp8_act=SWEEP_FP8)
                    if t * 7 > moe.MOE["PAIR_TILES_MAX_PAIRS"]:
                        moe.align_by_expert(torch.randint(0, e, (t * 7,), device="cuda"), e, cand["cfg"]["BLOCK_T"])
        except Exception:  # noqa: BLE001 - the main process meets and reports the same failure
            traceback.print_exc()
    torch.cuda.synchronize()


def run_gemm_sweep(kinds: tuple[str, ...]) -> None:
    """The candidates of `kinds` ("w8a16", "moe"): compiled by worker processes first, then timed."""
    start = time.time()
    code = f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import check_kernels as ck; ck.sweep_warm(int(sys.argv[1]), {SWEEP_WORKERS}, {kinds!r})"
    workers = [subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(SWEEP_WORKERS)]
    failed = join_workers(workers, start + 240, 10.0)
    record("gemm_sweep", "compile warm-up", f"{SWEEP_WORKERS} workers, {time.time() - start:.0f} s, {len(failed)} failed", failed=failed)
    if "w8a16" in kinds:
        for name, n, k, block in PROJECTIONS:
            guarded("gemm_sweep", f"w8a16 {name}", sweep_w8a16_shape, name, n, k, block)
    if "moe" in kinds:
        x, _, _, w13, s13, w2, s2 = moe_data(max(t for _, tokens in SWEEP_MOE for t in tokens), e=max(e for e, _ in SWEEP_MOE))
        for experts, tokens in SWEEP_MOE:
            guarded("gemm_sweep", f"moe E={experts}", sweep_moe_experts, experts, tokens, (x, w13, s13, w2, s2))
    record("gemm_sweep", "suggested knobs", suggested_knobs() or "none (no complete results)")


def section_gemm_sweep() -> None:
    run_gemm_sweep(("w8a16", "moe"))


def section_w8a16_sweep() -> None:
    """The weight-only half of gemm_sweep alone."""
    run_gemm_sweep(("w8a16",))


def section_moe_sweep() -> None:
    """The MoE half of gemm_sweep alone."""
    run_gemm_sweep(("moe",))


def section_defaults() -> None:
    """Each swept kernel's default configuration alone, timed as its sweep times it: attention
    at ATTN_SWEEP_ROWS, the weight-only projections at SWEEP_ROWS, the MoE loads of SWEEP_MOE,
    the prefill MoE class at 385 experts. Run once per tree (or knob setting) for a kernel A/B:
    scripts/device_run.sh STEPS=kernels_ab. Only when named (ON_REQUEST)."""
    os.environ[DEFAULTS_ONLY_ENV] = "1"
    section_attention_sweep()
    run_gemm_sweep(("w8a16", "moe"))
    guarded("moe_prefill", "tiles E=385", moe_prefill_tiles_real)



# ------------------------------------------------------------------------------ attention


ATTN_SHAPE = {"h": 64, "dim": 512, "window": 128, "top": 512, "per_block": 128, "rope_half": 32}  # V4.1-Flash (64 RoPE channels)


def attention_caches(slots: int, g: torch.Generator, n_blocks: int = 8192) -> dict:
    """Real-shape caches: an FP8 ring of `slots` request slots and a paged FP4 compressed cache
    of n_blocks blocks (8192: 268 MB, several times the L2), and the per-head sink."""
    from dsv4.model import quant

    dim, window, per_block = ATTN_SHAPE["dim"], ATTN_SHAPE["window"], ATTN_SHAPE["per_block"]
    ring_codes, ring_scales = quant.quantize_fp8_ue8m0(torch.randn(slots, window, dim, device="cuda", generator=g), 32)
    ckv_codes = torch.empty(n_blocks, per_block, dim // 2, dtype=torch.uint8, device="cuda")
    ckv_scales = torch.empty(n_blocks, per_block, dim // 16, dtype=torch.float8_e4m3fn, device="cuda")
    for b0 in range(0, n_blocks, 256):
        c, s = quant.quantize_fp4(torch.randn(min(256, n_blocks - b0), per_block, dim, device="cuda", generator=g), 16, e4m3_scale=True)
        ckv_codes[b0 : b0 + 256], ckv_scales[b0 : b0 + 256] = c, s
    sink = torch.randn(ATTN_SHAPE["h"], device="cuda", generator=g)
    return {"ring_codes": ring_codes, "ring_scales": ring_scales, "ckv_codes": ckv_codes, "ckv_scales": ckv_scales, "sink": sink}


def attention_inputs(caches: dict, t: int, decode: bool, g: torch.Generator, slot0: int = 0) -> dict:
    """One call's arguments over `caches`: top-k 512 over a ratio-2 source (128 entries per
    256-token block) with 64K-token contexts, random block tables. decode: t requests of one
    token (ring slots slot0 ..); else one request's chunk of t tokens continuing at position
    60000 (slot slot0)."""
    from dsv4.model import quant

    h, dim = ATTN_SHAPE["h"], ATTN_SHAPE["dim"]
    reqs = t if decode else 1
    block_tables = torch.randint(0, caches["ckv_codes"].shape[0], (reqs, 256), device="cuda", generator=g)
    if decode:
        positions = 65536 + torch.randint(0, 1000, (t,), device="cuda", generator=g)
        start_pos, token_req, row_start = positions.clone(), torch.arange(t, device="cuda"), torch.arange(t, device="cuda")
    else:
        positions = 60000 + torch.arange(t, device="cuda")
        start_pos, token_req = positions[:1].clone(), torch.zeros(t, dtype=torch.long, device="cuda")
        row_start = torch.zeros(1, dtype=torch.long, device="cuda")
    topk = torch.rand(t, 30000, device="cuda", generator=g).topk(ATTN_SHAPE["top"], dim=1).indices  # 30000 entries visible
    return {
        "q": torch.randn(t, h, dim, device="cuda", generator=g).bfloat16(),
        "kv_new": quant.fake_quant_fp8(torch.randn(t, dim, device="cuda", generator=g).bfloat16()),
        **{k: caches[k] for k in ("ring_codes", "ring_scales", "ckv_codes", "ckv_scales")},
        "topk": topk,
        "token_req": token_req,
        "positions": positions,
        "start_pos": start_pos,
        "row_start": row_start,
        "slots": slot0 + torch.arange(reqs, device="cuda"),
        "floors": torch.zeros(reqs, dtype=torch.long, device="cuda"),
        "block_tables": block_tables,
        "sink": caches["sink"],
        "softmax_scale": dim**-0.5,
    }


def attention_data(t: int, decode: bool, seed: int = 0) -> dict:
    """One call's arguments over its own real-shape caches (attention_inputs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return attention_inputs(attention_caches(t if decode else 1, g), t, decode, g)


def attention_plan(t: int, device: torch.device, cfg: dict) -> dict:
    """The launch plan of an `attention_inputs` call at t tokens (its block tables: one per
    request, 256 blocks)."""
    from dsv4.ops.triton import attention

    reqs = t if t <= 256 else 1
    return attention.launch_plan(t, ATTN_SHAPE["h"], ATTN_SHAPE["dim"], ATTN_SHAPE["window"], ATTN_SHAPE["top"], device, cfg, reqs, 256 * ATTN_SHAPE["per_block"])


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
    from dsv4.ops import attention as attention_ops
    from dsv4.ops.triton import attention, fp8_gemm

    decode = t <= 256
    args = attention_data(t, decode)
    _, h, dim = args["q"].shape
    case = f"T={t} {'decode' if decode else 'prefill chunk'} H={h} D={dim} W={args['ring_codes'].shape[1]} k={args['topk'].shape[1]}"
    nbytes, flops = attention_cost(args, decode)
    ref = attention_ops.sparse_attention_reference(**args)
    err = norm_err(attention.sparse_attention(**args), ref)
    t_k = median_time(lambda: attention.sparse_attention(**args), reps=10)
    record("sparse_attention", case, "triton", ok=err <= 4 * 2**-8, err=err, **perf(t_k, nbytes, flops, "bf16"))
    t_r = median_time(lambda: attention_ops.sparse_attention_reference(**args), reps=3, warmup=1)
    record("sparse_attention", case, "torch_gather", **perf(t_r, nbytes, flops, "bf16"))
    # the FP4 decoding in PTX (the compiled path) against Triton's fp32 form: the same values,
    # so the same bits, with all channels in one slice (DSPLIT 1) and in 16, from the cache (and
    # the dense copy where the default reads it)
    for cfg in ({"DSPLIT": 1, "DENSE_CKV": False}, {"DSPLIT": 16, "DENSE_CKV": False}, {}):
        y = attention.sparse_attention(**args, config=cfg)
        with patch.object(fp8_gemm, "FP8_CONVERT", "fp32"):
            same = torch.equal(attention.sparse_attention(**args, config=cfg), y)
        record("sparse_attention", f"{case} {attention_label(cfg)}", "ptx fp4 vs fp32 decode", ok=same, same_bits=same)
    # the epilogue's inverse RoPE (PTX mul.rn products) against the separate rotation kernel
    # on the output: the same bits
    from dsv4.ops.triton import rowwise

    angle = torch.rand(t, ATTN_SHAPE["rope_half"], device="cuda") * 6.3
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    want = rowwise.apply_rope_(attention.sparse_attention(**args), cos, sin, inverse=True)
    same = torch.equal(attention.sparse_attention(**args, inverse_rope=(cos, sin)), want)
    record("sparse_attention", case, "inverse rope in the epilogue vs its own kernel", ok=same, same_bits=same)
    # the output quantised for an FP8 projection in the epilogue (`fp8_output`) against
    # fp8_act_quant on the bf16 output: the same codes and exponent bytes
    codes, exps = attention.sparse_attention(**args, inverse_rope=(cos, sin), fp8_output=True)
    want_codes, want_exps = fp8_gemm.fp8_act_quant(attention.sparse_attention(**args, inverse_rope=(cos, sin)).view(t, -1), 32)
    code_diff = codes.view(t, -1).view(torch.uint8) != want_codes.view(torch.uint8)
    exp_diff = exps != want_exps
    same = not code_diff.any() and not exp_diff.any()
    # where they differ: how many codes and exponent bytes, and in which channels of a block
    where = code_diff.nonzero()
    record("sparse_attention", case, "fp8 output in the epilogue vs fp8_act_quant", ok=same, same_bits=same,
           codes_differing=int(code_diff.sum()), codes=code_diff.numel(), exps_differing=int(exp_diff.sum()),
           first_differing=[(int(r), int(c), int(codes.view(t, -1).view(torch.uint8)[r, c]), int(want_codes.view(torch.uint8)[r, c]))
                            for r, c in where[:6].tolist()],
           channels_mod_32=sorted({int(c) % 32 for c in where[:, 1].tolist()})[:32] if len(where) else [])
    plan = attention_plan(t, args["q"].device, attention.CONFIG)
    if plan["DENSE_CKV"]:  # the default read the dense copy: the cache-key form too, and its bits
        y = attention.sparse_attention(**args)
        cached = {"DENSE_CKV": False}
        same = torch.equal(attention.sparse_attention(**args, config=cached), y)
        t_c = median_time(lambda: attention.sparse_attention(**args, config=cached), reps=10)
        record("sparse_attention", case, "triton cache keys", same_bits=same, **perf(t_c, nbytes, flops, "bf16"))


def section_attention() -> None:
    for t in ROWS:
        guarded("sparse_attention", f"T={t}", attention_case, t)


# V4-Flash's attention: bf16 ring and compressed KV. CSA layers attend a top-512 over a ratio-4
# source (64 entries per 256-token block); HCA layers every visible entry of a ratio-128 source
# (2 per block), in a table as wide as the block tables reach (the capacity under CUDA graphs).
def attention_v4_args(t: int, kind: str, context: int, capacity: int, g: torch.Generator) -> dict:
    """One call: decode (t requests of one token at `context`) or, t > 256, one request's
    chunk of t tokens ending at `context`; block tables reach `capacity` tokens."""
    h, dim, window = ATTN_SHAPE["h"], ATTN_SHAPE["dim"], ATTN_SHAPE["window"]
    ratio = 4 if kind == "csa" else 128
    per_block, blocks = 256 // ratio, capacity // 256
    decode = t <= 256
    reqs = t if decode else 1
    ckv = torch.randn(reqs * blocks, per_block, dim, device="cuda", generator=g).bfloat16()
    block_tables = torch.randperm(reqs * blocks, device="cuda", generator=g).view(reqs, blocks)
    if decode:
        positions = torch.full((t,), context - 1, device="cuda")
        start_pos, token_req, row_start = positions.clone(), torch.arange(t, device="cuda"), torch.arange(t, device="cuda")
    else:
        positions = context - t + torch.arange(t, device="cuda")
        start_pos, token_req = positions[:1].clone(), torch.zeros(t, dtype=torch.long, device="cuda")
        row_start = torch.zeros(1, dtype=torch.long, device="cuda")
    visible = (positions + 1) // ratio
    if kind == "csa":
        topk = torch.rand(t, int(visible.max()), device="cuda", generator=g).masked_fill(
            torch.arange(int(visible.max()), device="cuda") >= visible.unsqueeze(1), 2.0).topk(512, dim=1, largest=False).indices.sort(dim=1).values
        topk = torch.where(topk < visible.unsqueeze(1), topk, -1)
    else:
        cols = torch.arange(capacity // ratio, device="cuda")
        topk = torch.where(cols < visible.unsqueeze(1), cols, -1)
    return {
        "q": torch.randn(t, h, dim, device="cuda", generator=g).bfloat16(),
        "kv_new": torch.randn(t, dim, device="cuda", generator=g).bfloat16(),
        "ring_codes": torch.randn(reqs, window, dim, device="cuda", generator=g).bfloat16(), "ring_scales": None,
        "ckv_codes": ckv, "ckv_scales": None, "topk": topk, "token_req": token_req, "positions": positions,
        "start_pos": start_pos, "row_start": row_start, "slots": torch.arange(reqs, device="cuda"),
        "floors": torch.zeros(reqs, dtype=torch.long, device="cuda"), "block_tables": block_tables,
        "sink": torch.randn(h, device="cuda", generator=g), "softmax_scale": dim**-0.5,
    }


def attention_v4_case(t: int, kind: str, context: int, capacity: int) -> None:
    """The kernels against the reference (norm error), timed; bytes: q and out, the window keys
    and the distinct selected entries once (bf16), the table."""
    from dsv4.ops import attention as attention_ops
    from dsv4.ops.triton import attention

    args = attention_v4_args(t, kind, context, capacity, torch.Generator(device="cuda").manual_seed(t + context))
    _, h, dim = args["q"].shape
    topk = args["topk"]
    selected = int((topk >= 0).sum()) if t <= 256 else int((topk[-1] >= 0).sum())
    window = args["ring_codes"].shape[1]
    keys = (t * window if t <= 256 else t + window) * dim * 2 + selected * dim * 2
    nbytes = 2 * t * h * dim * 2 + keys + topk.numel() * 8
    flops = 4 * h * dim * (t * window + int((topk >= 0).sum()))
    case = f"v4 {kind} T={t} ctx={context} table={topk.shape[1]}"
    ref = attention_ops.sparse_attention_reference(**args)
    err = norm_err(attention.sparse_attention(**args), ref)
    t_k = median_time(lambda: attention.sparse_attention(**args), reps=10)
    record("sparse_attention", case, "triton", ok=err <= 4 * 2**-8, err=err, **perf(t_k, nbytes, flops, "bf16"))
    if t == 8:  # a token alone has the bits it has in the batch
        one = {k: (v[:1] if k in ("q", "kv_new", "topk", "token_req", "positions", "start_pos", "row_start", "slots", "floors", "block_tables")
                   else v) for k, v in args.items()}
        same = torch.equal(attention.sparse_attention(**one)[0], attention.sparse_attention(**args)[0])
        record("attention_invariance", f"{case}: token 0 alone vs in batch", "triton", ok=same)


def section_attention_v4() -> None:
    for kind in ("csa", "hca"):
        for t, context, capacity in ((1, 32768, 32768), (8, 32768, 32768), (64, 32768, 32768), (256, 8192, 8192), (4096, 32768, 32768)):
            guarded("sparse_attention", f"v4 {kind} T={t}", attention_v4_case, t, kind, context, capacity)
    for t in (1, 64):  # HCA under CUDA graphs: the table as wide as a 1M-token capacity, 8K of context
        guarded("sparse_attention", f"v4 hca T={t} capacity 1M", attention_v4_case, t, "hca", 8192, 1 << 20)


# attention_sweep candidates: overrides of attention.CONFIG, the default ({}) first.
# LOGIT_BLOCK_H, TILES_PER_PROGRAM, DSPLIT and the warps / stages only spread or schedule the
# work (same bits); LOGIT_BLOCK_N changes the statistics tiles (rounding), so it could only
# become the default for every batch size at once.
ATTN_SWEEP = [
    {},
    {"LOGIT_BLOCK_H": 64},
    {"LOGIT_BLOCK_H": 32},
    {"TILES_PER_PROGRAM": 1},
    {"TILES_PER_PROGRAM": 2},  # the 64-token choice before whole waves were counted (192 programs)
    {"DSPLIT": 1},
    {"DSPLIT": 2},
    {"DSPLIT": 4},
    {"DSPLIT": 8},
    {"pv_stages": 2},
    {"pv_warps": 4, "DSPLIT": 8},
    {"LOGIT_BLOCK_N": 64, "logit_warps": 4},
    # decode's PV runs 8 programs at T=1, each through 20 key tiles in turn: more channel
    # slices, or half as many (wider) tiles
    {"DSPLIT": 16},
    {"DSPLIT": 8, "PV_BLOCK_N": 64},  # (at DSPLIT 1, 64-key tiles need 280 KB of shared memory)
    {"DSPLIT": 16, "PV_BLOCK_N": 64},
]
ATTN_SWEEP_ROWS = (1, 8, 64, 256, 4096)
ATTN_SWEEP_SECONDS = 100.0  # compile warm-up included; candidates left when this runs out are skipped (and reported)
ATTN_SWEEP_WORKERS = 4
ATTN_SWEEP_REPS = 20
# Calls of one graph cycle through input sets (own top-k, block tables, ring slots and queries
# over one 268 MB compressed cache) whose keys together reach ATTN_ROTATE_BYTES, so that a
# call finds its keys in HBM as in a decode step (where the rest of the layer evicts them from
# the 50 MB L2): 3 sets of one token (0.2 MB of keys each) would all stay in L2.
ATTN_ROTATE_BYTES = 128 << 20
ATTN_MAX_SETS = 256
ATTN_LOGIT_KEYS = ("LOGIT_BLOCK_N", "PIECE", "logit_warps", "logit_stages")
ATTN_PV_KEYS = ("BLOCK_H", "PV_BLOCK_N", "pv_warps", "pv_stages", "LOGIT_BLOCK_N")  # the last: how many statistics tiles it merges (unrolled)


def attention_spreads(cand: dict) -> set[tuple[int, int, bool]]:
    """(logits head block, PV channel slices, one tile per program) a candidate launches with:
    at the sweep's sizes on a GPU, every choice "auto" can make on a compile-only machine."""
    from dsv4.ops.triton import attention

    cfg = {**attention.CONFIG, **cand}
    if torch.cuda.is_available():
        plans = [attention_plan(t, torch.device("cuda"), cfg) for t in ATTN_SWEEP_ROWS]
        return {(p["LOGIT_BLOCK_H"], p["DSPLIT"], p["tiles_per_program"] == 1) for p in plans}
    heads = attention.LOGIT_BLOCK_HS if cfg["LOGIT_BLOCK_H"] == "auto" else (cfg["LOGIT_BLOCK_H"],)
    splits = (*attention.AUTO_DSPLITS, *attention.WIDE_DSPLITS) if cfg["DSPLIT"] == "auto" else (cfg["DSPLIT"],)
    return {(b, d, False) for b in heads for d in splits}


def attention_logit_variants() -> list[dict]:
    """The logits-kernel knobs of the sweep's candidates, with every head block they launch
    (distinct compilations)."""
    from dsv4.ops.triton import attention

    out = []
    for c in ATTN_SWEEP:
        cfg = {**attention.CONFIG, **c}
        out.extend({**{k: cfg[k] for k in ATTN_LOGIT_KEYS}, "LOGIT_BLOCK_H": b} for b in sorted({b for b, _, _ in attention_spreads(c)}))
    return _distinct(out)


def attention_pv_variants() -> list[dict]:
    """The PV-kernel knobs of the sweep's candidates, with every channel split they launch."""
    from dsv4.ops.triton import attention

    out = []
    for c in ATTN_SWEEP:
        cfg = {**attention.CONFIG, **c}
        out.extend({**{k: cfg[k] for k in ATTN_PV_KEYS}, "DSPLIT": d, "PV_BLOCK_N": attention.pv_block_n(d, cfg)} for d in sorted({d for _, d, _ in attention_spreads(c)}))
    return _distinct(out)


def _distinct(cfgs: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in cfgs:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def attention_label(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def attention_set_count(t: int) -> int:
    """Input sets per graph at t tokens (ATTN_ROTATE_BYTES): 256 at T=1 .. 3 from T=256."""
    dim = ATTN_SHAPE["dim"]
    keys = t * (ATTN_SHAPE["window"] * (dim + dim // 32) + ATTN_SHAPE["top"] * (dim // 2 + dim // 16))
    return min(ATTN_MAX_SETS, max(3, -(-ATTN_ROTATE_BYTES // keys)))


def attention_sweep_jobs() -> list[tuple[int, dict]]:
    """One (size, candidate) per distinct pair of compiled kernels the sweep launches."""
    from dsv4.ops.triton import attention

    seen, jobs = set(), []
    for t in ATTN_SWEEP_ROWS:
        for cand in swept(ATTN_SWEEP):
            cfg = {**attention.CONFIG, **cand}
            plan = attention_plan(t, torch.device("cuda"), cfg)
            key = (plan["LOGIT_BLOCK_H"], plan["DSPLIT"], plan["tiles_per_program"] == 1, plan["DENSE_CKV"], *(cfg[k] for k in ATTN_LOGIT_KEYS + ATTN_PV_KEYS))
            if key not in seen:
                seen.add(key)
                jobs.append((t, cand))
    return jobs


def attention_sweep_warm(index: int, count: int) -> None:
    """Worker process: compile its share of the sweep's kernels into Triton's disk cache, one
    launch each on caches of the real shapes but only 16 compressed blocks (the argument types
    and the sizes the launch specialises on are those of the sweep's calls)."""
    from dsv4.ops.triton import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    for t, cand in attention_sweep_jobs()[index::count]:
        try:
            decode = t <= 256
            attention.sparse_attention(**attention_inputs(attention_caches(t if decode else 1, g, n_blocks=16), t, decode, g), config=cand)
        except Exception:  # noqa: BLE001 - the main process meets and reports the same failure
            traceback.print_exc()
    torch.cuda.synchronize()


def attention_sweep_shape(t: int, deadline: float) -> None:
    """Every candidate at one size: error against the reference, bits against the default's
    result (both on the first input set), then the time per call replayed from a CUDA graph of
    one call per input set (attention_set_count), median of ATTN_SWEEP_REPS replays; then one
    record with the fastest correct candidate."""
    from dsv4.ops import attention as attention_ops
    from dsv4.ops.triton import attention

    decode = t <= 256
    reqs = t if decode else 1
    g = torch.Generator(device="cuda").manual_seed(t)
    n_sets = attention_set_count(t)
    caches = attention_caches(n_sets * reqs, g)
    sets = [attention_inputs(caches, t, decode, g, slot0=i * reqs) for i in range(n_sets)]
    nbytes, flops = attention_cost(sets[0], decode)
    ref = attention_ops.sparse_attention_reference(**sets[0])
    base, rows = None, []
    for cand in swept(ATTN_SWEEP):
        label = attention_label(cand)
        if time.time() > deadline:
            record("attention_sweep", f"T={t} {label}", "skipped", reason=f"sweep past {ATTN_SWEEP_SECONDS:.0f} s")
            continue
        plan = attention_plan(t, sets[0]["q"].device, {**attention.CONFIG, **cand})
        y = attention.sparse_attention(**sets[0], config=cand)
        base = y if base is None else base
        err = norm_err(y, ref)
        calls = [lambda a=a: attention.sparse_attention(**a, config=cand) for a in sets]
        t_k = graph_time(calls, reps=ATTN_SWEEP_REPS)
        row = dict(ok=err <= 4 * 2**-8, err=err, same_bits=torch.equal(y, base), plan=plan, input_sets=n_sets, **perf(t_k, nbytes, flops, "bf16"))
        record("attention_sweep", f"T={t} {label}", "graph", **row)
        rows.append((label, row))
    good = [r for r in rows if r[1]["ok"]]
    if good:
        label, row = min(good, key=lambda r: r[1]["ms"])
        default_ms = rows[0][1]["ms"] if rows and rows[0][0] == "default" else float("nan")
        record("attention_sweep", f"T={t} BEST {label}", f"best (default {default_ms:.4f} ms)", default_ms=default_ms, **{k: v for k, v in row.items() if k != "ok"})
    del sets, caches
    torch.cuda.empty_cache()


def section_attention_sweep() -> None:
    """Candidate tilings of sparse_attention at decode T = 1, 8, 64, 256 (T requests of one
    token at 64K context) and a 4096-token prefill chunk, real shapes, timed as CUDA-graph
    replays (a decode step's launches); the best per size. The kernels compile first, spread
    over ATTN_SWEEP_WORKERS processes that warm Triton's disk cache."""
    start = time.time()
    deadline = start + ATTN_SWEEP_SECONDS
    code = f"import sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import check_kernels as ck; ck.attention_sweep_warm(int(sys.argv[1]), {ATTN_SWEEP_WORKERS})"
    workers = [subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(ATTN_SWEEP_WORKERS)]
    failed = join_workers(workers, start + 0.6 * ATTN_SWEEP_SECONDS, 5.0)
    record("attention_sweep", "compile warm-up", f"{ATTN_SWEEP_WORKERS} workers, {len(attention_sweep_jobs())} kernel pairs, {time.time() - start:.0f} s, {len(failed)} failed", failed=failed)
    for t in ATTN_SWEEP_ROWS:
        guarded("attention_sweep", f"T={t}", attention_sweep_shape, t, deadline)


# Prefill chunks of one request (64K context, 256 blocks of 128 entries), the compressed keys
# from the cache (FP4, decoded at every use) and from the dense copy under pipeline depths /
# warps; every candidate must give the default's bits.
ATTN_PREFILL_ROWS = (1024, 4096, 8192)
ATTN_PREFILL = [
    {},
    {"DENSE_CKV": False},
    {"dense_stages": 2},
    {"dense_stages": 4},
    {"logit_warps": 4},  # other bits (the wgmma tiles of 4 warps): timed, not a candidate default
    {"pv_stages": 2},
    {"DSPLIT": 2},
    {"DSPLIT": 4},
    {"dense_logit_maxnreg": None},  # one logits program per SM (211 registers)
    {"dense_logit_maxnreg": 168},
    {"PV_BLOCK_N": 64, "pv_stages": 2},
]


def attention_prefill_shape(t: int) -> None:
    from dsv4.ops import attention as attention_ops
    from dsv4.ops.triton import attention

    args = attention_data(t, False, seed=t)
    nbytes, flops = attention_cost(args, False)
    ref = attention_ops.sparse_attention_reference(**args)
    base = None
    for cand in ATTN_PREFILL:
        plan = attention_plan(t, args["q"].device, {**attention.CONFIG, **cand})
        y = attention.sparse_attention(**args, config=cand)
        base = y if base is None else base
        err = norm_err(y, ref)
        t_k = graph_time([lambda: attention.sparse_attention(**args, config=cand)], reps=10)
        record("attention_prefill", f"T={t} {attention_label(cand)}", "graph", ok=err <= 4 * 2**-8, err=err, same_bits=torch.equal(y, base),
               dense=plan["DENSE_CKV"], **perf(t_k, nbytes, flops, "bf16"))
    t_d = graph_time([lambda: attention.dense_ckv(args["ckv_codes"], args["ckv_scales"], args["block_tables"], attention.CONFIG["PIECE"])], reps=10)
    entries = args["block_tables"].numel() * ATTN_SHAPE["per_block"]
    dim = ATTN_SHAPE["dim"]
    record("attention_prefill", f"T={t} dense copy alone ({entries} entries)", "graph", **perf(t_d, entries * (dim // 2 + dim // 16 + 2 * dim), 0, "bf16"))
    del args, ref
    torch.cuda.empty_cache()


def section_attention_prefill() -> None:
    for t in ATTN_PREFILL_ROWS:
        guarded("attention_prefill", f"T={t}", attention_prefill_shape, t)


# ------------------------------------------------------------------------------ indexer

# V4.1 indexer: 32 heads x 128, FP4 keys (ratio-2 source: 128 entries per 256-token block).
# Decode: T requests of one row with `length` visible entries each (every row its own keys, so
# nothing is shared in L2); prefill: one request's 4096-row chunk at positions 28672..32767
# (causal lengths 14336..16384); reindex: 2048 candidate blocks x 8 = 16384 entries per row.
IDX_HEADS, IDX_DIM, IDX_PER_BLOCK = 32, 128, 128
IDX_DECODE = [(t, n) for n in (4096, 16384, 65536, 524288) for t in (1, 8, 64)]
IDX_KEY_BYTES = IDX_DIM // 2 + IDX_DIM // 32  # codes + ue8m0 scales per entry


class IndexerCache:
    """One pool of random FP4 indexer keys (random code bytes, scale bytes in `scale_bytes`,
    by default 118..126) that every case takes distinct blocks from."""

    def __init__(self, n_blocks: int, seed: int = 0, scale_bytes: tuple[int, int] = (118, 127)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.codes = torch.randint(0, 256, (n_blocks, IDX_PER_BLOCK, IDX_DIM // 2), dtype=torch.uint8, device="cuda", generator=g)
        self.scales = torch.randint(*scale_bytes, (n_blocks, IDX_PER_BLOCK, IDX_DIM // 32), dtype=torch.uint8, device="cuda", generator=g)
        self.g = g

    def args(self, n_req: int, entries: int, row_req: torch.Tensor, lengths: torch.Tensor, width: int, rows_entries=None) -> list:
        """index_scores arguments: n_req requests of `entries` entries in distinct random blocks,
        FP4-rounded queries and per-head weights for each row."""
        from dsv4.model import quant

        g, t = self.g, row_req.numel()
        per_req = -(-entries // IDX_PER_BLOCK)
        blocks = torch.randperm(self.codes.shape[0], device="cuda", generator=g)[: n_req * per_req]
        q = quant.fake_quant_fp4(torch.randn(t, IDX_HEADS, IDX_DIM, device="cuda", generator=g) * 2, 32, e4m3_scale=False).bfloat16()
        weights = torch.randn(t, IDX_HEADS, device="cuda", generator=g) * IDX_HEADS**-0.5
        return [q, weights, self.codes, self.scales, blocks.view(n_req, per_req).int(), row_req.int(), lengths.int(), IDX_PER_BLOCK, width, rows_entries]


def indexer_candidates(visible: torch.Tensor, n_blocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A reindex row's candidates: 2048 random blocks of 8 among its visible entries,
    ascending, and their 16384 entries (-1 for entries past the visible ones)."""
    t = visible.numel()
    nb = -(-visible // 8)
    keys = torch.rand(t, n_blocks, device="cuda", generator=g).masked_fill(torch.arange(n_blocks, device="cuda") >= nb.unsqueeze(1), 2.0)
    blocks = keys.topk(2048, dim=1, largest=False).indices.sort(dim=1).values
    entries = (blocks.unsqueeze(2) * 8 + torch.arange(8, device="cuda")).flatten(1)
    return blocks, torch.where(entries < visible.unsqueeze(1), entries, -1).int()


def scores_err(y: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor) -> float:
    """Max over rows of max |y - ref| / max |ref| on the columns the row has (finite ones);
    inf when -inf columns differ."""
    have = torch.arange(ref.shape[1], device=ref.device) < lengths.long().unsqueeze(1)
    if not torch.equal(torch.isneginf(y) & have, torch.isneginf(ref) & have):
        return float("inf")
    fin = have & torch.isfinite(ref)
    diff = torch.where(fin, (y.double() - ref.double()).abs(), 0.0).amax(1)
    return (diff / torch.where(fin, ref.double().abs(), 0.0).amax(1).clamp_min(1e-30)).max().item()


def scores_cost(args: list, key_bytes: float) -> tuple[float, float]:
    """(bytes, FLOPs) of an index_scores call: the distinct keys read, q, weights, entries and
    the columns written; 2 x H x Dk per scored column."""
    q, lengths, entries = args[0], args[6], args[9]
    t, h, dk = q.shape
    cols = int(lengths.long().sum())
    nbytes = key_bytes + q.numel() * 2 + t * h * 4 + cols * 4 + (entries.numel() * 4 if entries is not None else 0)
    return nbytes, 2 * cols * h * dk


def indexer_scores_case(label: str, args: list, key_bytes: float) -> tuple[torch.Tensor, torch.Tensor]:
    """index_scores against its reference (within 1e-5 of each row's largest score); time
    both. -> (kernel scores, reference scores)."""
    from dsv4.ops import indexer as ref_ops
    from dsv4.ops.triton import indexer

    nbytes, flops = scores_cost(args, key_bytes)
    y = indexer.index_scores(*args)
    ref = ref_ops.index_scores_reference(*args)
    err = scores_err(y, ref, args[6])
    t_k = median_time(lambda: indexer.index_scores(*args), reps=10)
    record("index_scores", label, "triton", ok=err <= 1e-5, err=err, **perf(t_k, nbytes, flops, "bf16"))
    t_r = median_time(lambda: ref_ops.index_scores_reference(*args), reps=3, warmup=1)
    record("index_scores", label, "torch", **perf(t_r, nbytes, flops, "bf16"))
    return y, ref


IDX_SCORES_CONFIGS = [  # the default first
    {"BLOCK_N": 128, "num_warps": 4, "ROWS": 4, "PROGRAMS_PER_SM": 8},
    {"BLOCK_N": 128, "num_warps": 4, "ROWS": 4, "PROGRAMS_PER_SM": 4},
    {"BLOCK_N": 128, "num_warps": 4, "ROWS": 2, "PROGRAMS_PER_SM": 8},
    {"BLOCK_N": 128, "num_warps": 4, "ROWS": 4, "PROGRAMS_PER_SM": 16},
    {"BLOCK_N": 64, "num_warps": 4, "ROWS": 8, "MAX_STACKED_N": 256, "PROGRAMS_PER_SM": 8},
    {"BLOCK_N": 64, "num_warps": 4, "ROWS": 4, "PROGRAMS_PER_SM": 8},
]
IDX_TOPK_CONFIGS = [  # the default first
    {"BLOCK": 2048, "num_warps": 8},
    {"BLOCK": 2048, "num_warps": 8, "RESIDENT_MAX": 0},  # every pass re-reads the row (before session 26)
    {"BLOCK": 2048, "num_warps": 8, "DIGIT_BITS": 8},  # the default before session 27 (5 since)
    {"BLOCK": 2048, "num_warps": 8, "DIGIT_BITS": 4},
    {"BLOCK": 2048, "num_warps": 8, "DIGIT_BITS": 6},
    {"BLOCK": 1024, "num_warps": 4},
    {"BLOCK": 2048, "num_warps": 8, "CHUNK": 8192},
    {"BLOCK": 1024, "num_warps": 4, "CHUNK": 8192},
    {"BLOCK": 1024, "num_warps": 4, "CHUNK": 4096, "CHUNK_PER_K": 4},
    {"BLOCK": 1024, "num_warps": 4, "CHUNK": 32768},
]


def indexer_config_case(label: str, name: str, cfg: dict, run, check, nbytes: float, flops: float) -> None:
    """Time one tiling of an indexer kernel (`name`: its config dict in the module) and check
    its result."""
    from dsv4.ops.triton import indexer

    default = getattr(indexer, name)
    setattr(indexer, name, dict(default, **cfg))
    try:
        ok, err = check(run())
        t_k = median_time(run, reps=10)
    finally:
        setattr(indexer, name, default)
    record("indexer_config", f"{label} " + " ".join(f"{k}={v}" for k, v in cfg.items()), "triton", ok=ok, err=err, **perf(t_k, nbytes, flops, "bf16"))


def indexer_configs(label: str, args: list, key_bytes: float, ref: torch.Tensor, k: int) -> None:
    """Alternative tilings of index_scores (against the reference) and of topk_ascending over
    its scores (exactly)."""
    from dsv4.ops import indexer as ref_ops
    from dsv4.ops.triton import indexer

    nbytes, flops = scores_cost(args, key_bytes)
    run = lambda: indexer.index_scores(*args)
    check = lambda y: (lambda e: (e <= 1e-5, e))(scores_err(y, ref, args[6]))
    for cfg in IDX_SCORES_CONFIGS:
        guarded("indexer_config", f"{label} {cfg}", indexer_config_case, f"scores {label}", "SCORES_CONFIG", cfg, run, check, nbytes, flops)
    lengths = args[6]
    picks = ref_ops.topk_ascending_reference(ref, lengths, k)
    run = lambda: indexer.topk_ascending(ref, lengths, k)
    check = lambda y: (lambda same: (same, 0.0 if same else 1.0))(torch.equal(y, picks))
    nbytes = int(lengths.long().sum()) * 4 + ref.shape[0] * k * 4
    for cfg in IDX_TOPK_CONFIGS:
        guarded("indexer_config", f"{label} {cfg}", indexer_config_case, f"topk k={k} {label}", "TOPK_CONFIG", cfg, run, check, nbytes, 0)


def indexer_select_case(label: str, scores: torch.Tensor, lengths: torch.Tensor, k: int, block: int = 0) -> None:
    """topk_ascending (k columns of the scores, or with `block` of their block maxima, after
    block_max) against the references, exactly, and timed. Floor: the input read once."""
    from dsv4.ops import indexer as ref_ops
    from dsv4.ops.triton import indexer

    t = scores.shape[0]
    if block:
        nb = -(-lengths.long() // block)
        have = torch.arange(-(-scores.shape[1] // block), device="cuda") < nb.unsqueeze(1)
        bm = indexer.block_max(scores, lengths, block)
        exact = torch.equal(bm[have], ref_ops.block_max_reference(scores, lengths, block)[have])
        t_k = median_time(lambda: indexer.block_max(scores, lengths, block), reps=10)
        nbytes = int(lengths.long().sum()) * 4 + int(nb.sum()) * 4
        record("block_max", f"{label} block={block}", "triton", ok=exact, err=0.0 if exact else 1.0, **perf(t_k, nbytes, 0, "bf16"))
        scores, lengths = bm, nb.int()
    chunks = indexer.topk_plan(t, scores.shape[1], k, scores.device)[1]
    case = f"{label} {'blocks ' if block else ''}k={k} chunks={chunks}"
    exact = torch.equal(indexer.topk_ascending(scores, lengths, k), ref_ops.topk_ascending_reference(scores, lengths, k))
    t_k = median_time(lambda: indexer.topk_ascending(scores, lengths, k), reps=10)
    nbytes = int(lengths.long().sum()) * 4 + t * k * 4
    record("topk_ascending", case, "triton", ok=exact, err=0.0 if exact else 1.0, **perf(t_k, nbytes, 0, "bf16"))
    t_r = median_time(lambda: ref_ops.topk_ascending_reference(scores, lengths, k), reps=3, warmup=1)
    record("topk_ascending", case, "torch", **perf(t_r, nbytes, 0, "bf16"))


def indexer_decode_case(cache: IndexerCache, t: int, n: int, configs: bool) -> None:
    arange = torch.arange(t, device="cuda")
    args = cache.args(t, n, arange, torch.full((t,), n, device="cuda"), n)
    label = f"decode T={t} len={n}"
    scores, ref = indexer_scores_case(label, args, t * n * IDX_KEY_BYTES)
    indexer_select_case(label, scores, args[6], 512)
    indexer_select_case(label, scores, args[6], 2048, block=8)
    if configs:
        indexer_configs(label, args, t * n * IDX_KEY_BYTES, ref, 512)


def indexer_prefill_case(cache: IndexerCache) -> None:
    visible = (28672 + torch.arange(4096, device="cuda") + 1) // 2
    args = cache.args(1, 16384, torch.zeros(4096, device="cuda"), visible, 16384)
    label = "prefill T=4096 len<=16K"
    scores, ref = indexer_scores_case(label, args, 16384 * IDX_KEY_BYTES)
    indexer_select_case(label, scores, args[6], 512)
    indexer_select_case(label, scores, args[6], 2048, block=8)
    indexer_configs(label, args, 16384 * IDX_KEY_BYTES, ref, 512)


def indexer_reindex_case(cache: IndexerCache, t: int, visible: torch.Tensor, n_req: int) -> None:
    """Reindex scoring of a 16384-entry candidate pool per row, then its top 512."""
    from dsv4.ops import indexer as ref_ops
    from dsv4.ops.triton import indexer

    blocks, entries = indexer_candidates(visible, -(-int(visible.max()) // 8), cache.g)
    # the pool as the model builds it (one kernel), the same entries
    record("pool_entries", f"reindex T={t}", "triton", ok=torch.equal(indexer.pool_entries(blocks, visible, 8), entries),
           **perf(median_time(lambda: indexer.pool_entries(blocks, visible, 8), reps=10), blocks.numel() * 8 + entries.numel() * 4, 0, "bf16"))
    width = entries.shape[1]
    row_req = torch.arange(t, device="cuda") if n_req > 1 else torch.zeros(t, device="cuda")
    args = cache.args(n_req, int(visible.max()), row_req, torch.full((t,), width, device="cuda"), width, entries)
    real = entries >= 0
    distinct = int(torch.unique((entries.long() + row_req.long().unsqueeze(1) * (1 << 32))[real]).numel())
    label = f"reindex T={t} pool={width} of len<={int(visible.max())}"
    scores, _ = indexer_scores_case(label, args, distinct * IDX_KEY_BYTES)
    indexer_select_case(label, scores, args[6], 512)
    same = torch.equal(indexer.topk_ascending(scores, args[6], 512, labels=entries), ref_ops.topk_ascending_reference(scores, args[6], 512, labels=entries))
    record("topk_ascending", f"{label} labels=pool", "triton", ok=same, err=0.0 if same else 1.0)


def indexer_invariance(cache: IndexerCache) -> None:
    """Row 0 alone vs in a batch: decode T=64 at 64K (split over fewer programs in the batch)
    and a prefill chunk (one program per row in the batch), all three ops."""
    from dsv4.ops.triton import indexer

    for label, t, n in (("decode T=64 len=64K", 64, 65536), ("prefill T=4096 len<=16K", 4096, 16384)):
        if t == 64:
            args = cache.args(t, n, torch.arange(t, device="cuda"), torch.full((t,), n, device="cuda"), n)
        else:
            args = cache.args(1, n, torch.zeros(t, device="cuda"), (28672 + torch.arange(t, device="cuda") + 1) // 2, n)
        one = [a[:1] if i in (0, 1, 5, 6) else a for i, a in enumerate(args)]
        m = int(args[6][0])
        batch, alone = indexer.index_scores(*args), indexer.index_scores(*one)
        same = torch.equal(alone[0, :m], batch[0, :m])
        record("indexer_invariance", f"index_scores {label}: row 0 alone vs in batch", "triton", ok=same)
        nb = -(-m // 8)
        same = torch.equal(indexer.block_max(batch[:1], args[6][:1], 8)[0, :nb], indexer.block_max(batch, args[6], 8)[0, :nb])
        record("indexer_invariance", f"block_max {label}: row 0 alone vs in batch", "triton", ok=same)
        same = torch.equal(indexer.topk_ascending(batch[:1], args[6][:1], 512)[0], indexer.topk_ascending(batch, args[6], 512)[0])
        record("indexer_invariance", f"topk_ascending {label}: row 0 alone ({indexer.topk_plan(1, n, 512, batch.device)[1]} chunks) vs in batch", "triton", ok=same)


def section_indexer() -> None:
    cache = IndexerCache(64 * 524288 // IDX_PER_BLOCK)  # the largest case's keys: 2.3 GB
    for t, n in IDX_DECODE:  # alternative tilings timed at five decode shapes and the prefill
        guarded("index_scores", f"decode T={t} len={n}", indexer_decode_case, cache, t, n, (t, n) in ((1, 4096), (1, 16384), (1, 524288), (64, 16384), (64, 65536)))
    guarded("index_scores", "prefill", indexer_prefill_case, cache)
    for t in (1, 64):  # decode at 1M context (ratio 2: 512K entries)
        guarded("index_scores", f"reindex T={t}", indexer_reindex_case, cache, t, torch.full((t,), 524288, device="cuda"), t)
    prefill_visible = (61440 + torch.arange(4096, device="cuda") + 1) // 2  # a 4096-row chunk up to 64K tokens
    guarded("index_scores", "reindex prefill", indexer_reindex_case, cache, 4096, prefill_visible, 1)
    guarded("indexer_invariance", "indexer", indexer_invariance, cache)
    # scale bytes far from 127 (above 128: the keys' second exact multiply), decode and prefill rows
    wide = IndexerCache(2 * 16384 // IDX_PER_BLOCK, seed=1, scale_bytes=(20, 231))
    for label, t, n_req, n in (("decode T=8 len=2048", 8, 8, 2048), ("prefill T=256 len=16K", 256, 1, 16384)):
        row_req = torch.arange(t, device="cuda") if n_req > 1 else torch.zeros(t, device="cuda")
        args = wide.args(n_req, n, row_req, torch.full((t,), n, device="cuda"), n)
        guarded("index_scores", label, indexer_scores_case, f"scale bytes 20..230 {label}", args, n_req * n * IDX_KEY_BYTES)


# V4-Flash's indexer: 64 heads x 128, bf16 keys (no scales), ratio 4 (64 entries per 256-token
# block). Decode: T requests of one row at 8K / 32K / 128K tokens; prefill: one request's
# 4096-row chunk at positions 28672..32767 (lengths 7168..8192).
IDX_V4_HEADS, IDX_V4_PER_BLOCK = 64, 64


def indexer_v4_args(g: torch.Generator, n_req: int, entries: int, row_req: torch.Tensor, lengths: torch.Tensor, width: int) -> list:
    """index_scores arguments over bf16 keys: n_req requests of `entries` keys each in their
    own blocks, bf16 queries and per-head weights for each row."""
    per_req = -(-entries // IDX_V4_PER_BLOCK)
    keys = torch.randn(n_req * per_req, IDX_V4_PER_BLOCK, IDX_DIM, device="cuda", generator=g).bfloat16()
    blocks = torch.randperm(keys.shape[0], device="cuda", generator=g).view(n_req, per_req).int()
    t = row_req.numel()
    q = torch.randn(t, IDX_V4_HEADS, IDX_DIM, device="cuda", generator=g).bfloat16()
    weights = torch.randn(t, IDX_V4_HEADS, device="cuda", generator=g) * IDX_V4_HEADS**-0.5
    return [q, weights, keys, None, blocks, row_req.int(), lengths.int(), IDX_V4_PER_BLOCK, width, None]


def section_indexer_v4() -> None:
    from dsv4.ops.triton import indexer

    g = torch.Generator(device="cuda").manual_seed(4)
    key_bytes = IDX_DIM * 2
    for tokens in (8192, 32768, 131072):
        n = tokens // 4
        for t in (1, 8, 64):
            arange = torch.arange(t, device="cuda")
            args = indexer_v4_args(g, t, n, arange, torch.full((t,), n, device="cuda"), n)
            label = f"v4 decode T={t} len={n}"
            scores, _ = indexer_scores_case(label, args, t * n * key_bytes)
            guarded("topk_ascending", label, indexer_select_case, label, scores, args[6], 512)
            if t == 64 and tokens == 32768:  # a row alone has the bits it has in the batch
                one = [a[:1] if i in (0, 1, 5, 6) else a for i, a in enumerate(args)]
                same = torch.equal(indexer.index_scores(*one)[0], scores[0])
                record("indexer_invariance", f"index_scores {label}: row 0 alone vs in batch", "triton", ok=same)
    visible = (28672 + torch.arange(4096, device="cuda") + 1) // 4
    args = indexer_v4_args(g, 1, 8192, torch.zeros(4096, device="cuda"), visible, 8192)
    label = "v4 prefill T=4096 len<=8K"
    scores, ref = indexer_scores_case(label, args, 8192 * key_bytes)
    indexer_select_case(label, scores, args[6], 512)
    m = int(args[6][0])
    one = [a[:1] if i in (0, 1, 5, 6) else a for i, a in enumerate(args)]
    record("indexer_invariance", f"index_scores {label}: row 0 alone vs in batch", "triton",
           ok=torch.equal(indexer.index_scores(*one)[0, :m], scores[0, :m]))
    for cfg in ({"ROWS": 4, "MAX_STACKED_N": 256}, {"ROWS": 1}):
        check = lambda y: (lambda e: (e <= 1e-5, e))(scores_err(y, ref, args[6]))
        guarded("indexer_config", f"{label} {cfg}", indexer_config_case, f"scores {label}", "SCORES_CONFIG", cfg,
                lambda: indexer.index_scores(*args), check, *scores_cost(args, 8192 * key_bytes))


# ------------------------------------------------------------------------------ kv store

KV_KINDS = {"window": ("fp8", 512), "ckv": ("fp4_e4m3", 512), "idx": ("fp4_ue8m0", 128)}
KV_ROWS = (1, 64, 256, 4096, 8192)
# Largest block magnitude 2**e of the test rows. The compressed KV's E4M3 scale is amax / 6 cast
# to float8_e4m3fn: torch < 2.12 casts finite values above 464 to NaN (2.12 made the cast
# saturate, as the kernel does), so its rows stay below amax 6 * 448; the model's RMS-normed,
# RoPE'd latents (|x| < ~100) are far below either. tests/ops covers the saturation on CPU.
KV_MAX_EXP = {"window": 20, "ckv": 8, "idx": 20}


def kv_rows(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(i0, i1, mask, S) for a cache of S x 128 entries: 90% of the rows valid, at distinct
    targets; the masked rows carry garbage indices (far out of range, or a valid row's target)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s, r = t // 64 + 2, 128
    mask = torch.rand(t, device="cuda", generator=g) < 0.9
    mask[0] = True
    flat = torch.randperm(s * r, device="cuda", generator=g)[:t]
    i0, i1 = flat // r, flat % r
    i0 = torch.where(mask, i0, torch.where(torch.rand(t, device="cuda", generator=g) < 0.5, 2**40, i0[0]))
    i1 = torch.where(mask, i1, i1[0])
    return i0, i1, mask, s


def kv_store_x(t: int, d: int, block: int, seed: int, max_exp: int) -> torch.Tensor:
    """bf16 rows with per-block magnitudes 2**-20 .. 2**max_exp, some zero and -0 blocks, and
    blocks on e2m1 rounding ties (amax 6 * 2**k, the rest ties * 2**k)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = d // block
    mag = torch.exp2(torch.randint(-20, max_exp + 1, (t, nb, 1), device="cuda", generator=g).float())
    x = torch.randn(t, nb, block, device="cuda", generator=g) * mag
    style = torch.randint(0, 8, (t, nb, 1), device="cuda", generator=g)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device="cuda")
    tie = ties[torch.randint(0, 8, (t, nb, block), device="cuda", generator=g)] * mag
    tie[..., 0] = 6.0 * mag[..., 0]
    x = torch.where(style == 0, 0.0, torch.where(style == 1, -0.0, torch.where(style == 2, tie, x)))
    return x.flatten(1).bfloat16()


def kv_store_case(kind: str, t: int) -> None:
    """store_rows against the reference `kv.store` of the valid rows (bytes equal); time both.
    Bytes: the valid rows' x and stored entries, the masks and indices of every row."""
    from dsv4.cache.storage import _alloc
    from dsv4.ops import kv as kvops
    from dsv4.ops.triton import kv as triton_kv

    quant_kind, d = KV_KINDS[kind]
    i0, i1, mask, s = kv_rows(t, seed=t)
    block = {"window": 32, "ckv": 16, "idx": 32}[kind]
    x = kv_store_x(t, d, block, seed=t + 1, max_exp=KV_MAX_EXP[kind])
    got = _alloc((s, 128), d, quant_kind, torch.bfloat16, "cuda")
    ref = _alloc((s, 128), d, quant_kind, torch.bfloat16, "cuda")
    triton_kv.store_rows(got, kind, x, (i0, i1), mask)
    kvops.store(ref, (i0[mask], i1[mask]), x[mask], kind)
    exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((got.codes, ref.codes), (got.scales, ref.scales)))
    valid = int(mask.sum())
    entry = (d if kind == "window" else d // 2) + d // block
    nbytes = valid * (2 * d + entry) + t * 17
    case = f"{kind} T={t} D={d}"
    t_k = median_time(lambda: triton_kv.store_rows(got, kind, x, (i0, i1), mask))
    record("kv_store", case, "triton", ok=exact, err=0.0 if exact else 1.0, **perf(t_k, nbytes, 0, "bf16"))
    t_r = median_time(lambda: kvops.store(ref, (i0[mask], i1[mask]), x[mask], kind))
    record("kv_store", case, "torch", **perf(t_r, nbytes, 0, "bf16"))


def kv_plain_case(t: int) -> None:
    """store_plain of fp32 compressor-tail rows (width 512) against index_put."""
    from dsv4.ops.triton import kv as triton_kv

    i0, i1, mask, s = kv_rows(t, seed=t + 2)
    x = torch.randn(t, 512, device="cuda")
    got = torch.zeros(s, 128, 512, device="cuda")
    ref = got.clone()
    triton_kv.store_plain(got, (i0, i1), x, mask)
    ref[i0[mask], i1[mask]] = x[mask]
    nbytes = int(mask.sum()) * 512 * 8 + t * 17
    t_k = median_time(lambda: triton_kv.store_plain(got, (i0, i1), x, mask))
    record("kv_store", f"plain fp32 T={t} D=512", "triton", ok=torch.equal(got, ref), **perf(t_k, nbytes, 0, "bf16"))


def compressor_case(t: int) -> None:
    """`compress_entries` at V4.1's widths (ratio 2, 512 channels, 32 RoPE pairs): the kernel
    against the torch reference (dsv4.ops.compressor) on T rows: decode rows at random odd and
    even positions (half of them read the tail) up to T = 64, else requests of 2048 rows from
    odd starts. Entries within 2 bf16 ulps (the norm's sum order can move the fp32 rstd by an
    ulp, the normalised value's bf16 by one, its product with the weight by two: S5-2 saw 2 at
    T = 8192, with the same cache bytes), the same emit flags and
    locations, cache bytes compared; time both. Bytes: the fp32 kv / gate rows and tails read,
    the bf16 entries and FP4 entries written."""
    from dsv4.cache.storage import _alloc
    from dsv4.ops import compressor, torch_only
    from dsv4.ops.triton import compressor as tcompressor

    w, r, block_size = 512, 2, 256
    g = torch.Generator(device="cuda").manual_seed(t)
    per = 1 if t <= 64 else 2048
    b = t // per
    starts = torch.randint(0, 60000, (b,), device="cuda", generator=g) | (1 if per > 1 else 0)
    counts = torch.full((b,), per, device="cuda")
    req = torch.arange(t, device="cuda") // per
    row0 = (torch.arange(b, device="cuda") * per).int()
    positions = starts[req] + torch.arange(t, device="cuda") % per
    n_blocks = b * 256
    tables = torch.randperm(n_blocks, device="cuda", generator=g).view(b, 256).int()
    both = torch.randn(t, 2 * w, device="cuda", generator=g) * 2
    tails = [torch.randn(b, r, w, device="cuda", generator=g) for _ in range(2)]
    angles = torch.randn(t, 32, device="cuda", generator=g) * 3
    args = [both[:, :w], both[:, w:], *tails, req.int(), positions, starts, row0, torch.ones(t, dtype=torch.bool, device="cuda"),
            torch.arange(b, device="cuda"), torch.zeros(b, dtype=torch.long, device="cuda"), tables,
            (torch.rand(w, device="cuda", generator=g) + 0.5).bfloat16(), 1e-6, angles.cos().bfloat16(), angles.sin().bfloat16()]
    got, ref = (_alloc((n_blocks, block_size // r), w, "fp4_e4m3", torch.bfloat16, "cuda") for _ in range(2))
    latent, where, emit = tcompressor.compress_entries(*args, got, r, block_size, torch.bfloat16)
    with torch_only():
        ref_latent, ref_where, ref_emit = compressor.compress_entries(*args, ref, r, block_size, torch.bfloat16)
    ordered = lambda a: torch.where(a.view(torch.int16) < 0, -32768 - a.view(torch.int16).int(), a.view(torch.int16).int())
    ulps = (ordered(latent) - ordered(ref_latent)).abs().max().item()
    same_rows = torch.equal(emit, ref_emit) and torch.equal(where[1], ref_where[1]) and torch.equal(where[0][emit], ref_where[0][emit])
    differing = int((got.codes != ref.codes).sum()) + int((got.scales.view(torch.uint8) != ref.scales.view(torch.uint8)).sum())
    n_emit = int(ref_emit.sum())
    nbytes = t * 2 * w * 4 * 2 + t * w * 2 + n_emit * (w // 2 + w // 16)
    case = f"ratio 2 W={w} T={t}"
    t_k = median_time(lambda: tcompressor.compress_entries(*args, got, r, block_size, torch.bfloat16))
    record("compressor", case, "triton", ok=ulps <= 2 and same_rows, ulps=ulps, differing_cache_bytes=differing, **perf(t_k, nbytes, 0, "bf16"))
    with torch_only():
        t_r = median_time(lambda: compressor.compress_entries(*args, ref, r, block_size, torch.bfloat16))
    record("compressor", case, "torch", **perf(t_r, nbytes, 0, "bf16"))


def kv_round_trip_case(kind: str, t: int) -> None:
    """round_trip (the window KV / indexer query fake quantisation) against the torch
    decode(encode(x)): the same bits; time both. Indexer queries are [T, 32, 128]."""
    from dsv4.cache.storage import _alloc
    from dsv4.ops import kv as kvops
    from dsv4.ops.triton import kv as triton_kv

    quant_kind, d = KV_KINDS[kind]
    block = {"window": 32, "ckv": 16, "idx": 32}[kind]
    heads = 32 if kind == "idx" else 1
    x = kv_store_x(t * heads, d, block, seed=t + 3, max_exp=KV_MAX_EXP[kind]).view(t, heads, d).squeeze(1)
    q = _alloc((1, 1), d, quant_kind, torch.bfloat16, "cuda")

    def torch_path() -> torch.Tensor:
        return kvops.decode(q, *kvops.encode(q, x, kind), kind, x.dtype)

    got, ref = triton_kv.round_trip(kind, x), torch_path()
    exact = torch.equal(got.view(torch.int16), ref.view(torch.int16))
    nbytes = 2 * x.numel() * 2
    case = f"round_trip {kind} {list(x.shape)}"
    record("kv_store", case, "triton", ok=exact, err=0.0 if exact else 1.0, **perf(median_time(lambda: triton_kv.round_trip(kind, x)), nbytes, 0, "bf16"))
    record("kv_store", case, "torch", **perf(median_time(torch_path), nbytes, 0, "bf16"))


def section_kv_store() -> None:
    """Round trips first: the stores hand the kernels garbage indices (masked rows), and a fault
    there would poison the process for every later case."""
    for kind in KV_KINDS:
        for t in KV_ROWS:
            guarded("kv_store", f"round_trip {kind} T={t}", kv_round_trip_case, kind, t)
    for kind in KV_KINDS:
        for t in KV_ROWS:
            guarded("kv_store", f"{kind} T={t}", kv_store_case, kind, t)
    for t in (1, 4096):
        guarded("kv_store", f"plain T={t}", kv_plain_case, t)
    for t in (1, 64, 8192):
        guarded("compressor", f"T={t}", compressor_case, t)


# ------------------------------------------------------------------------------ engram

ENGRAM_ROWS = (1, 8, 64, 256, 4096, 8192)
ENGRAM_TABLE_ROWS = 16 << 20  # 4 GiB of FP8 rows: ids past 2**23 need int64 offsets (the released tables: 384M rows)


def engram_setup() -> dict:
    """The released V4.1-Flash engram shapes (D 5120, hc 4, 24 columns of 256): the hasher of
    both engram layers on a random token map, one Engram layer with a random FP8 table of
    ENGRAM_TABLE_ROWS rows (no NaN codes, scale bytes 100 .. 140) and a random FP8 wkv."""
    from dsv4.cache.reference_configs import released_v41_config
    from dsv4.config import parse_config
    from dsv4.model.layers.engram import Engram, EngramHasher

    cfg = parse_config(released_v41_config())
    g = torch.Generator(device="cuda").manual_seed(0)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), device="cuda", generator=g)
    hasher = EngramHasher(cfg, token_map, "cuda")
    d, hc, dim = cfg.hidden_size, cfg.hc_mult, cfg.engram_head_dim
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    codes = torch.randint(0, 256, (ENGRAM_TABLE_ROWS, dim), device="cuda", generator=g, dtype=torch.uint8)
    codes.sub_(((codes & 0x7F) == 0x7F).to(torch.uint8))  # no NaN codes (a checkpoint holds none)
    scale = torch.randint(100, 141, (ENGRAM_TABLE_ROWS, dim // 32), device="cuda", generator=g, dtype=torch.uint8)
    wkv, wkv_s = fp8_weight((hc + 1) * d, cols * dim, cfg.weight_block_size, seed=1)
    w = {
        "embed.weight": codes.view(torch.float8_e4m3fn), "embed.scale": scale, "wkv.weight": wkv, "wkv.scale": wkv_s,
        "q_weight": (1 + 0.3 * torch.randn(hc, d, device="cuda", generator=g)).bfloat16(),
        "k_weight": (1 + 0.3 * torch.randn(hc, d, device="cuda", generator=g)).bfloat16(),
    }
    return {"cfg": cfg, "hasher": hasher, "engram": Engram(w, "", cfg), "cols": cols}


def engram_batch(cfg, t: int, seed: int) -> tuple:
    """(ids, req int32, local, positions, prev_tokens) of T rows: decode rows (one per request)
    up to T = 64, else requests of 512 rows; random starts, so look-backs cross prev_tokens and
    a few requests start at 0 (blocked)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = 1 if t <= 64 else 512
    rows = torch.arange(t, device="cuda")
    req, local = rows // per, rows % per
    b = int(req[-1]) + 1
    start = torch.randint(0, 6000, (b,), device="cuda", generator=g)
    start[::5] = 0
    positions = start[req] + local
    prev = torch.randint(0, cfg.vocab_size, (b, cfg.engram_max_ngram_size - 1), device="cuda", generator=g)
    prev = torch.where(torch.arange(prev.shape[1], device="cuda") < start[:, None], prev, -1)
    ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=g)
    return ids, req.int(), local, positions, prev


def engram_streams(cfg, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 streams [T, 4, D] and a wkv output [T, 5 D] with per-row magnitudes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d, hc = cfg.hidden_size, cfg.hc_mult
    mag = torch.exp2(torch.randint(-8, 9, (t, 1, 1), device="cuda", generator=g).float())
    streams = (torch.randn(t, hc, d, device="cuda", generator=g) * mag).bfloat16()
    kv = (torch.randn(t, (hc + 1) * d, device="cuda", generator=g) * mag[:, 0]).bfloat16()
    return streams, kv


def bf16_ulps(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Max |y - ref| in bf16 ulps of ref, elementwise; with `scale`, ulps of max(|ref|, |scale|)."""
    size = ref.float().abs() if scale is None else torch.maximum(ref.float().abs(), scale.float().abs())
    ulp = torch.exp2(torch.floor(torch.log2(size.clamp_min(1e-30))) - 7)
    return ((y.float() - ref.float()).abs() / ulp).max().item()


def engram_compute_case(s: dict, t: int) -> None:
    """Hashes (both layers): the same integers as the torch path; gate: within one bf16 ulp of
    the torch path on the GPU, counted at the scale of the update's operands (max(|out|, |h|)):
    out = h + g * value cancels where h ~ -g * value, and there the fp32-level difference of g
    (its sums run in another order) is many ulps of the small result: the first H200 run saw
    16 .. 128 per-element ulps at 0.003% of the elements (recorded as element_ulps), the class
    the CPU interpreter reproduces at D = 5120 (tests/ops: 8 per-element ulps, 1 at the
    operands' scale). Time each against its torch path."""
    from dsv4.ops.triton import engram as triton_engram

    cfg, hasher, eng = s["cfg"], s["hasher"], s["engram"]
    batch = engram_batch(cfg, t, seed=t)
    n_layers = len(cfg.engram_layer_ids)
    hashes = hasher(*batch)
    exact = torch.equal(hashes, hasher.reference(*batch))
    nbytes = t * (8 * 4 + 8 * cfg.engram_max_ngram_size + 8 * n_layers * s["cols"])
    record("engram_hash", f"T={t} L={n_layers}", "triton", ok=exact, err=0.0 if exact else 1.0, **perf(median_time(lambda: hasher(*batch)), nbytes, 0, "bf16"))
    record("engram_hash", f"T={t} L={n_layers}", "torch", **perf(median_time(lambda: hasher.reference(*batch)), nbytes, 0, "bf16"))

    streams, kv = engram_streams(cfg, t, seed=t + 2)
    eps = cfg.rms_norm_eps
    got, ref = triton_engram.gate(streams, kv, eng.gate_weight, eps), eng.gate_reference(streams, kv)
    err = bf16_ulps(got, ref, streams)
    nbytes = t * (streams[0].numel() * 4 + kv[0].numel() * 2) + eng.gate_weight.numel() * 4
    record("engram_gate", f"T={t}", "triton", ok=err <= 1.0, err=err, exact_frac=(got == ref).float().mean().item(), element_ulps=bf16_ulps(got, ref),
           **perf(median_time(lambda: triton_engram.gate(streams, kv, eng.gate_weight, eps)), nbytes, 0, "bf16"))
    record("engram_gate", f"T={t}", "torch", **perf(median_time(lambda: eng.gate_reference(streams, kv)), nbytes, 0, "bf16"))


def engram_table_ids(s: dict, t: int) -> torch.Tensor:
    """Random ids [T, 24] of the table (strided: one layer of the hasher's [T, L, 24] layout),
    column 0 among the table's last rows (offsets past 2**32 bytes)."""
    g = torch.Generator(device="cuda").manual_seed(t + 1)
    ids = torch.randint(0, ENGRAM_TABLE_ROWS, (t, len(s["cfg"].engram_layer_ids), s["cols"]), device="cuda", generator=g)
    ids[:, :, 0] = ENGRAM_TABLE_ROWS - 1 - ids[:, :, 0] % 1024
    return ids[:, 0]


def engram_table_case(s: dict, t: int) -> None:
    """Lookup: the same bits as the torch path; the whole layer (lookup, w8a16 wkv, gate) within
    one bf16 ulp at the operands' scale (the gate's measure: both paths run the same wkv GEMM on
    the same rows). Time each against its torch path."""
    from dsv4.ops.triton import engram as triton_engram

    cfg, eng = s["cfg"], s["engram"]
    ids = engram_table_ids(s, t)
    table, scale = eng.table, eng.table_scale
    rows = triton_engram.lookup(table, scale, ids, torch.bfloat16)
    exact = torch.equal(rows.view(torch.int16), eng.lookup_reference(ids, torch.bfloat16).view(torch.int16))
    lookup_bytes = t * s["cols"] * (cfg.engram_head_dim * 3 + cfg.engram_head_dim // 32 + 8)
    record("engram_lookup", f"T={t}", "triton", ok=exact, err=0.0 if exact else 1.0, **perf(median_time(lambda: triton_engram.lookup(table, scale, ids, torch.bfloat16)), lookup_bytes, 0, "bf16"))
    record("engram_lookup", f"T={t}", "torch", **perf(median_time(lambda: eng.lookup_reference(ids, torch.bfloat16)), lookup_bytes, 0, "bf16"))

    streams, _ = engram_streams(cfg, t, seed=t + 2)

    def torch_layer() -> torch.Tensor:  # the same wkv GEMM around the torch lookup and gate
        return eng.gate_reference(streams, eng.wkv(eng.lookup_reference(ids, streams.dtype)))

    layer_err = bf16_ulps(eng(streams, ids), torch_layer(), streams)
    k = s["cols"] * cfg.engram_head_dim
    flops = 2 * t * eng.wkv.out_features * k
    gate_bytes = t * (streams[0].numel() * 4 + eng.wkv.out_features * 2) + eng.gate_weight.numel() * 4
    nbytes = gate_bytes + lookup_bytes + eng.wkv.out_features * k + 2 * t * eng.wkv.out_features
    record("engram_layer", f"T={t}", "triton", ok=layer_err <= 1.0, err=layer_err, **perf(median_time(lambda: eng(streams, ids)), nbytes, flops, "bf16"))
    record("engram_layer", f"T={t}", "torch", **perf(median_time(torch_layer), nbytes, flops, "bf16"))


def engram_invariance(s: dict) -> None:
    """The gate of row 0 alone / in T = 1 .. 4096 rows has the bits it has in 8192 rows."""
    from dsv4.ops.triton import engram as triton_engram

    cfg, eng = s["cfg"], s["engram"]
    streams, kv = engram_streams(cfg, 8192, seed=5)
    whole = triton_engram.gate(streams, kv, eng.gate_weight, cfg.rms_norm_eps)
    same = all(torch.equal(triton_engram.gate(streams[:t], kv[:t], eng.gate_weight, cfg.rms_norm_eps)[:1], whole[:1]) for t in (1, 7, 64, 4096))
    record("invariance", "engram gate: row 0 of T=1..4096 vs T=8192", "triton", ok=bool(same))


def section_engram() -> None:
    """Hashes and gates first, the table reads (ids up to the 4 GiB table's end) last: a fault
    there poisons the process for every later case."""
    s = engram_setup()
    for t in ENGRAM_ROWS:
        guarded("engram", f"hash + gate T={t}", engram_compute_case, s, t)
    guarded("invariance", "engram", engram_invariance, s)
    for t in ENGRAM_ROWS:
        guarded("engram", f"lookup + layer T={t}", engram_table_case, s, t)


# ------------------------------------------------------------------------------ mHC

MHC_ROWS = (1, 8, 64, 256, 4096, 8192)
MHC_HC, MHC_D, MHC_ITERS, MHC_EPS = 4, 5120, 20, 1e-6
# Alternative GEMM tilings timed against the default at decode (split) and prefill sizes (a
# different BLOCK_K changes the bits). Each one compiles the GEMM anew (seconds on a cold cache;
# an early section ran past a 30 s limit with four variants at three sizes; with a 200 s budget
# for this section and dequant_sweep, these three at three sizes fit, S20-2): half the K steps
# (each step then waits for its MMAs before the fp32 add), the prefill's split programs at the
# decode height, a deeper pipeline.
MHC_CONFIGS = [{"BLOCK_K": 128, "num_stages": 2}, {"MANY_BLOCK_T": 64}, {"num_stages": 4}]
MHC_CONFIG_ROWS = (1, 256, 8192)


def mhc_data(t: int, seed: int = 0) -> dict:
    """Streams with per-row magnitudes, mix weights giving mixes of order 1, V4.1 shapes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, k = (2 + MHC_HC) * MHC_HC, MHC_HC * MHC_D
    x = torch.randn(t, MHC_HC, MHC_D, device="cuda", generator=g) * torch.exp(torch.randn(t, 1, 1, device="cuda", generator=g))
    return {
        "x": x.bfloat16(),
        "fn": torch.randn(n, k, device="cuda", generator=g) * k**-0.5,
        "base": torch.randn(n, device="cuda", generator=g) * 0.5,
        "scale": torch.tensor([0.7, 1.3, 2.5], device="cuda"),
        "pre": torch.rand(t, MHC_HC, device="cuda", generator=g) + 0.1,
        "post": 2 * torch.rand(t, MHC_HC, device="cuda", generator=g),
        "comb": torch.softmax(torch.randn(t, MHC_HC, MHC_HC, device="cuda", generator=g), dim=-1),
        "y": torch.randn(t, MHC_D, device="cuda", generator=g).bfloat16(),
        "weight": torch.randn(MHC_D, device="cuda", generator=g).bfloat16(),
    }


def mixes_fp64(a: dict) -> tuple:
    """hc_mixes' math in fp64 (`ops.mhc.hc_mixes_fp64`): the yardstick for the kernel and the
    fp32 torch reference."""
    from dsv4.ops import mhc as mhc_ops

    return mhc_ops.hc_mixes_fp64(*mhc_mixes_args(a))


def max_rel(outs: tuple, refs: tuple) -> float:
    return max(((o.double() - r.double()).abs() / r.double().abs()).max().item() for o, r in zip(outs, refs))


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """V4.1's RMSNorm in torch ops (`ops.norm.rms_norm` itself runs a Triton kernel on CUDA)."""
    h = x.float()
    return w.to(x.dtype) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mhc_mixes_args(a: dict) -> tuple:
    return (a["x"], a["fn"], a["base"], a["scale"], MHC_HC, MHC_ITERS, MHC_EPS, MHC_EPS)


def mhc_case(t: int) -> None:
    """mixes (vs fp64: within 2x the fp32 reference's error), collapse + norm, collapse and
    expand (vs the torch reference: within a bf16 ulp, collapse + norm within two); kernel and
    torch times."""
    from dsv4.ops import mhc
    from dsv4.ops.norm import rms_norm
    from dsv4.ops.triton import mhc as triton_mhc

    a = mhc_data(t, seed=t)
    x, pre, w = a["x"], a["pre"], a["weight"]
    stream_bytes = t * MHC_HC * MHC_D * 2
    row_bytes = t * MHC_D * 2
    args = mhc_mixes_args(a)
    exact = mixes_fp64(a)
    mixes = triton_mhc.hc_mixes(*args)
    err_k = max_rel(mixes, exact)
    err_r = max_rel(mhc.hc_mixes_reference(*args), exact)
    nbytes = stream_bytes + a["fn"].numel() * 4 + t * 24 * 4
    t_k = median_time(lambda: triton_mhc.hc_mixes(*args))
    record("mhc_mixes", f"T={t}", "triton", ok=err_k <= max(2e-6, 2 * err_r), err=err_k, **perf(t_k, nbytes, 0, "bf16"))
    if t >= 4096:  # prefill sizes: one program per row tile over all chunks (no split) must give the same bits
        from unittest import mock

        with mock.patch.object(triton_mhc, "SPLIT_MAX_BYTES", 0):
            same = all(torch.equal(p, q) for p, q in zip(triton_mhc.hc_mixes(*args), mixes))
            t_u = median_time(lambda: triton_mhc.hc_mixes(*args))
        record("mhc_mixes", f"T={t}", "triton unsplit", ok=same, same_bits=same, **perf(t_u, nbytes, 0, "bf16"))
    t_r = median_time(lambda: mhc.hc_mixes_reference(*args))
    record("mhc_mixes", f"T={t}", "torch", err=err_r, **perf(t_r, nbytes, 0, "bf16"))

    ulp = 2**-7  # one bf16 ulp, relative
    # name -> (kernel, torch, extra bytes, error, tolerance). V4.1's norm rounds twice:
    # bf16(w * bf16(normed)); its rstd differs from torch's at fp32 level (sum order), which can
    # flip bf16(normed) by one ulp, and times w that is up to two ulps of the result (the first
    # H200 run: 8.0e-3 relative at T=256, 2 ulps of an element with mantissa 1.95), so it is
    # counted in ulps of each element.
    collapses = {
        "mhc_collapse": (lambda: triton_mhc.hc_collapse(x, pre), lambda: mhc.hc_collapse_reference(x, pre), 0, lambda y, r: rel_err(y, r, floor=1e-3), ulp),
        "mhc_collapse_norm": (
            lambda: triton_mhc.hc_collapse_norm(x, pre, w, MHC_EPS, False),
            lambda: rms_norm_torch(mhc.hc_collapse_reference(x, pre), w, MHC_EPS),
            MHC_D * 2,
            bf16_ulps,
            2.0,
        ),
    }
    for name, (fn_k, fn_r, extra, measure, tol) in collapses.items():
        y, ref = fn_k(), fn_r()
        err = measure(y, ref)
        nbytes = stream_bytes + row_bytes + t * MHC_HC * 4 + extra
        t_k = median_time(fn_k)
        record(name, f"T={t}", "triton", ok=err <= tol, err=err, exact_frac=(y == ref).float().mean().item(), **perf(t_k, nbytes, 0, "bf16"))
        record(name, f"T={t}", "torch", **perf(median_time(fn_r), nbytes, 0, "bf16"))

    def two_kernels() -> torch.Tensor:  # unfused, through the dispatchers: collapse, then ops.norm's kernel
        return rms_norm(mhc.hc_collapse(x, pre), w, MHC_EPS, False)

    fused_bytes = stream_bytes + row_bytes + t * MHC_HC * 4 + MHC_D * 2  # the fused kernel's floor
    record("mhc_collapse_norm", f"T={t}", "two_kernels", **perf(median_time(two_kernels), fused_bytes, 0, "bf16"))

    exp_args = (a["y"], x, a["post"], a["comb"])
    ref = mhc.hc_expand_reference(*exp_args, fp32=True)
    y = triton_mhc.hc_expand(*exp_args, True)
    err = rel_err(y, ref, floor=1e-3)
    nbytes = row_bytes + 2 * stream_bytes + t * MHC_HC * (MHC_HC + 1) * 4
    t_k = median_time(lambda: triton_mhc.hc_expand(*exp_args, True))
    record("mhc_expand", f"T={t}", "triton", ok=err <= ulp, err=err, exact_frac=(y == ref).float().mean().item(), **perf(t_k, nbytes, 0, "bf16"))
    record("mhc_expand", f"T={t}", "torch", **perf(median_time(lambda: mhc.hc_expand_reference(*exp_args, fp32=True)), nbytes, 0, "bf16"))


def mhc_invariance() -> None:
    """Row 0 alone and in batches of 8..4096 (split over K chunks) has its bits of an 8192-row
    batch (not split), for mixes, collapse + norm and expand."""
    from dsv4.ops.triton import mhc as triton_mhc

    a = mhc_data(8192, seed=1)
    whole = triton_mhc.hc_mixes(*mhc_mixes_args(a))
    cn = triton_mhc.hc_collapse_norm(a["x"], a["pre"], a["weight"], MHC_EPS, False)
    ex = triton_mhc.hc_expand(a["y"], a["x"], a["post"], a["comb"], True)
    same = True
    for m in (1, 8, 256, 4096):
        part = {k: v[:m] if k in ("x", "pre", "post", "comb", "y") else v for k, v in a.items()}
        same &= all(torch.equal(p[:1], q[:1]) for p, q in zip(triton_mhc.hc_mixes(*mhc_mixes_args(part)), whole))
        same &= torch.equal(triton_mhc.hc_collapse_norm(part["x"], part["pre"], a["weight"], MHC_EPS, False)[:1], cn[:1])
        same &= torch.equal(triton_mhc.hc_expand(part["y"], part["x"], part["post"], part["comb"], True)[:1], ex[:1])
    record("invariance", "mhc mixes / collapse_norm / expand: row 0 of T=1..4096 vs T=8192", "triton", ok=bool(same))


def mhc_config_case(t: int, a: dict, cfg: dict) -> None:
    from dsv4.ops.triton import mhc as triton_mhc

    default = dict(triton_mhc.CONFIG)
    args = mhc_mixes_args(a)
    base = triton_mhc.hc_mixes(*args)
    triton_mhc.CONFIG.update(cfg)
    try:
        got = triton_mhc.hc_mixes(*args)
        err = max_rel(got, mixes_fp64(a))
        same = all(torch.equal(g, b) for g, b in zip(got, base))
        t_k = median_time(lambda: triton_mhc.hc_mixes(*args))
    finally:
        triton_mhc.CONFIG.clear()
        triton_mhc.CONFIG.update(default)
    t_0 = median_time(lambda: triton_mhc.hc_mixes(*args))
    nbytes = a["x"].numel() * 2 + a["fn"].numel() * 4 + t * 24 * 4
    record("mhc_config", f"T={t} " + " ".join(f"{k}={v}" for k, v in cfg.items()), f"triton (default {t_0 * 1e3:.4f} ms, same bits: {same})",
           err=err, same_bits=same, **perf(t_k, nbytes, 0, "bf16"))


def rope_case(t: int, kind: str) -> None:
    """The RoPE tables' kernel against their torch code on the GPU: the same bits (both call
    libdevice's cosf / sinf), V4.1-Flash's frequencies, positions to 1M."""
    from dsv4.cache.reference_configs import released_v41_config
    from dsv4.config import parse_config
    from dsv4.ops import rope
    from dsv4.ops.triton import rowwise

    inv = rope.inv_freq(parse_config(released_v41_config()), kind).cuda()
    positions = torch.randint(0, 1 << 20, (t,), device="cuda")
    got, ref = rowwise.rope_tables(positions, inv, torch.bfloat16), rope.cos_sin(positions, inv, torch.bfloat16)
    exact = all(torch.equal(a, b) for a, b in zip(got, ref))
    nbytes = t * 8 + 2 * got[0].numel() * 2
    record("rope_tables", f"T={t} {kind}", "triton", ok=exact, err=0.0 if exact else 1.0,
           **perf(median_time(lambda: rowwise.rope_tables(positions, inv, torch.bfloat16)), nbytes, 0, "bf16"))
    record("rope_tables", f"T={t} {kind}", "torch", **perf(median_time(lambda: rope.cos_sin(positions, inv, torch.bfloat16)), nbytes, 0, "bf16"))


def section_rope() -> None:
    for t in (1, 64, 8192, 131072):
        for kind in ("main", "compress"):
            guarded("rope_tables", f"T={t} {kind}", rope_case, t, kind)


def section_mhc() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    for t in MHC_ROWS:
        guarded("mhc", f"T={t}", mhc_case, t)
    guarded("invariance", "mhc", mhc_invariance)
    for t in MHC_CONFIG_ROWS:
        a = mhc_data(t, seed=t)
        for cfg in MHC_CONFIGS:
            guarded("mhc_config", f"T={t} {cfg}", mhc_config_case, t, a, cfg)


# ------------------------------------------------------------------------------ batch invariance


INVARIANCE_ROWS = (1, 16, 17, 32, 33, 64, 256)  # both sides of every row-class boundary
INVARIANCE_TOKENS = (1, 8, 64, 1024, 2048)  # MoE row tiles: pair tiles, 16, 16, 32, 64 (T=4096: 128)


def invariance_fp8_linear(name: str, n: int, k: int, block: int) -> None:
    """Row 0 alone and in batches of every row class (row tiles 16 .. 128, split-K and not)
    against the same row in 4096 rows; the record counts the differing outputs per M."""
    from dsv4.ops.triton import fp8_gemm

    w, s = fp8_weight(n, k, block, seed=1)
    x = torch.randn(4096, k, device="cuda").bfloat16()
    batch = fp8_gemm.fp8_linear_w8a16(x, w, s, block)  # row tile 128, one program per tile over all chunks
    differ = {m: int((fp8_gemm.fp8_linear_w8a16(x[:m], w, s, block)[0] != batch[0]).sum()) for m in INVARIANCE_ROWS}
    rows = ",".join(map(str, INVARIANCE_ROWS))
    record("invariance", f"fp8_linear_w8a16 {name}: row 0 of M={rows} vs M=4096", "triton", ok=not any(differ.values()), differing=differ)


def invariance_moe() -> None:
    from dsv4.ops.triton import moe

    x, ids, weights, w13, s13, w2, s2 = moe_data(4096, seed=1)
    batch = moe.moe_experts(x, ids, weights, w13, s13, w2, s2, 10.0, True)
    differ = {t: int((moe.moe_experts(x[:t], ids[:t], weights[:t], w13, s13, w2, s2, 10.0, True)[0] != batch[0]).sum()) for t in INVARIANCE_TOKENS}
    pairs = [t * ids.shape[1] for t in INVARIANCE_TOKENS]
    tiles = ",".join("pairs" if p <= moe.MOE["PAIR_TILES_MAX_PAIRS"] else str(moe.moe_config(p, w13.shape[0])["BLOCK_T"]) for p in pairs)
    label = f"moe_experts: token 0 of T={','.join(map(str, INVARIANCE_TOKENS))} (row tiles {tiles}) vs T=4096"
    record("invariance", label, "triton", ok=not any(differ.values()), differing=differ)


def invariance_attention() -> None:
    """Token 0 alone (spread over more programs and 16-head logits blocks by "auto") and in a
    64-token decode batch, and the batch under every fixed spread (PV channel slices, logits
    tiles per program, logits head blocks): the same bits, which also checks on the hardware
    that a wgmma's N does not change its results."""
    from dsv4.ops.triton import attention

    args = attention_data(64, True, seed=1)
    alone = dict(args, **{k: args[k][:1] for k in ("q", "kv_new", "topk", "token_req", "positions")})
    batch = attention.sparse_attention(**args)
    same = torch.equal(attention.sparse_attention(**alone)[0], batch[0])
    record("invariance", "sparse_attention: token 0 alone vs in T=64 (default spread)", "triton", ok=same)
    spreads = [{"DSPLIT": d, "TILES_PER_PROGRAM": n} for d in attention.DSPLITS for n in (1, 5)]
    for spread in spreads + [{"LOGIT_BLOCK_H": b} for b in attention.LOGIT_BLOCK_HS[1:]]:
        same = torch.equal(attention.sparse_attention(**args, config=spread), batch)
        record("invariance", f"sparse_attention T=64 {attention_label(spread)} vs default", "triton", ok=same)
    # the decode batch's keys from the dense copy under every channel split (wgmma operands
    # from shared memory instead of registers)
    for d in attention.DSPLITS:
        spread = {"DENSE_CKV": True, "DSPLIT": d}
        same = torch.equal(attention.sparse_attention(**args, config=spread), batch)
        record("invariance", f"sparse_attention T=64 {attention_label(spread)} vs default", "triton", ok=same)
    chunk = attention_data(1024, False, seed=2)  # "auto": the dense copy
    same = torch.equal(attention.sparse_attention(**chunk), attention.sparse_attention(**chunk, config={"DENSE_CKV": False}))
    record("invariance", "sparse_attention: 1024-token chunk, dense copy vs cache keys", "triton", ok=same,
           dense=attention_plan(1024, chunk["q"].device, attention.CONFIG)["DENSE_CKV"])


def invariance_fp32_gemm() -> None:
    """`mhc.fp32_gemm` at the V4.1 compressor's (1024 columns) and router's (385 columns, padded
    to 512) shapes: row 0 alone (K chunks split over programs) against its row in 4096
    (unsplit), and the 4096 rows with 32-column blocks instead of the unsplit calls' 64 (a
    column's bits must not depend on the block width: the split calls take 32)."""
    from unittest import mock

    from dsv4.ops.triton import fp8_gemm, mhc

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4096, 5120, device="cuda", generator=g).bfloat16()
    for label, n in (("compressor", 1024), ("router", 385)):
        w = torch.randn(n, 5120, device="cuda", generator=g) * 0.02
        batch = mhc.fp32_gemm(x, w)
        alone = mhc.fp32_gemm(x[:1], w)
        record("invariance", f"fp32_gemm {label} N={n}: row 0 alone (split) vs in T=4096", "triton", ok=torch.equal(alone[0], batch[0]))
        with mock.patch.object(mhc, "WIDE_BLOCK_N", mhc.SPLIT_BLOCK_N):
            narrow = mhc.fp32_gemm(x, w)
        record("invariance", f"fp32_gemm {label} N={n}: {mhc.SPLIT_BLOCK_N}- vs {mhc.WIDE_BLOCK_N}-column blocks at T=4096", "triton",
               ok=torch.equal(narrow, batch), differing=int((narrow != batch).sum()))


def invariance_router() -> None:
    """`router.route_scores` at V4.1's shapes (5120 inputs; 64 and 384 experts, top-6 + the
    shared one): a 16-token call (the gate GEMM one program per K step, `STEP_PARTS_MAX_ROWS`)
    against the same rows in 4096 tokens (the chunk partials): the same experts and weights,
    bit for bit."""
    from dsv4.ops.triton import router

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4096, 5120, device="cuda", generator=g).bfloat16()
    for e in (64, 384):
        gate = torch.randn(e, 5120, device="cuda", generator=g) * 0.04
        bias = torch.randn(e, device="cuda", generator=g) * 0.1
        args = (gate, bias, 6, 1.5, 2.5, True, e)
        w, ids = router.route_scores(x, *args)
        w16, ids16 = router.route_scores(x[:16], *args)
        record("invariance", f"route_scores E={e}: rows of T=16 (step parts) vs in T=4096", "triton",
               ok=torch.equal(w16, w[:16]) and torch.equal(ids16, ids[:16]), differing=int((w16 != w[:16]).sum()))


def section_invariance() -> None:
    """A row computed alone must have the bits it has inside a batch."""
    for name, n, k, block in (p for p in PROJECTIONS if p[0] in ("wq_a+wkv", "wq_b", "wo_b")):  # 14, 1, 6 chunks
        guarded("invariance", f"fp8_linear_w8a16 {name}", invariance_fp8_linear, name, n, k, block)
    guarded("invariance", "moe_experts", invariance_moe)
    guarded("invariance", "sparse_attention", invariance_attention)
    guarded("invariance", "fp32_gemm", invariance_fp32_gemm)
    guarded("invariance", "route_scores", invariance_router)


# ------------------------------------------------------------------------------ sm_90 compile


def compile_targets() -> list[tuple]:
    """(label, kernel, argument types, constexprs, options[, the MMA the variant must compile
    to]) of every kernel variant the wrappers launch at the real shapes (index tensors int64, as
    the tests pass them)."""
    from dsv4.ops.triton import attention, fp8_gemm, moe

    i, f = "i32", "fp32"
    out = []
    a = "i32:16"  # sizes and strides that are multiples of 16 at the real shapes
    w8a16 = {
        "x_ptr": "*bf16:16", "xs_ptr": "*bf16:16", "w_ptr": "*fp8e4nv:16", "s_ptr": "*u8:16", "out_ptr": "*bf16:16", "part_ptr": "*fp32:16",
        "count_ptr": "*i32:16", "M": i, "N": a, "K": a, "CHUNK_K": a, "GROUP_ROWS": a, "stride_xm": a, "stride_xsm": i, "stride_wn": a,
        "stride_sn": a, "stride_om": a,
    }
    w8a8_decode = dict(w8a16, x_ptr="*fp8e4nv:16", xs_ptr="*u8")  # A8: FP8 activations (x_scale)
    classes = [(c, False) for c in fp8_gemm.W8A16["rows"]] + [(c, True) for c in fp8_gemm.W8A16["fp8_rows"]]
    for (max_rows, cfg), fp8_inputs in classes:
        for block in (32, 128):
            # both weight reads, or FP8 inputs (bytes only)
            variants = [(sp, False, True) for sp in (False, True)] if fp8_inputs else [(sp, wo, False) for sp in (False, True) for wo in (False, True)]
            for split, words, a8 in variants:
                tiles = {k: cfg[k] for k in ("BLOCK_T", "BLOCK_N", "BLOCK_K", "GROUP_T")}
                fragment = fp8_gemm.w8a16_fragment(a8, block, 5120, cfg["BLOCK_K"])  # (K in whole 128s, as V4.1's are)
                consts = dict(tiles, QBLOCK=block, PIECE=min(block, 32), SPLIT=split, EVEN_K=True, PTX=True, WORDS=words,
                              LOADS=fp8_gemm.REDUCE_LOADS, ROWS=fp8_gemm.REDUCE_ROWS,
                              TICKET=split and cfg["BLOCK_T"] <= fp8_gemm.W8A16["TICKET_MAX_T"], A8=a8,
                              STEP=words and fp8_gemm.W8A16["STEP"] and 128 % cfg["BLOCK_K"] == 0, FRAGMENT=fragment,
                              XREG=fragment and cfg["BLOCK_T"] <= fp8_gemm.W8A16["XREG_MAX_T"], WARPS=cfg["num_warps"])
                label = (f"w8a16 rows<={max_rows} BT={cfg['BLOCK_T']} BN={cfg['BLOCK_N']} BK={cfg['BLOCK_K']} b={block} split={split} "
                         f"{'fp8 inputs' if a8 else 'words' if words else 'bytes'}{' fragment' if fragment else ''}")
                # every row class on wgmma: the batch-invariance contract (fp8_gemm.W8A16)
                out.append((label, fp8_gemm._w8a16_kernel, w8a8_decode if a8 else w8a16, consts,
                            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}, "wgmma"))
    act = {"x_ptr": "*bf16:16", "q_ptr": "*fp8e4nv:16", "s_ptr": "*u8:16", "M": i, "K": a, "stride_xm": a, "stride_qm": a, "stride_sm": a}
    act_fake = dict(act, q_ptr="*bf16:16", s_ptr="*u8", stride_sm=i)  # the round trip to bf16 (fp8_act_fake_quant)
    for block in (32, 128):
        out.append((f"act quant b={block}", fp8_gemm._act_quant_kernel, act, {"QBLOCK": block, "BLOCK_R": min(64, 4096 // block), "FAKE": False}, {"num_warps": 4}))
    out.append(("act fake quant b=32", fp8_gemm._act_quant_kernel, act_fake, {"QBLOCK": 32, "BLOCK_R": 64, "FAKE": True}, {"num_warps": 4}))
    frag = {"x_ptr": "*bf16:16", "out_ptr": "*bf16:16", "t": i, "blocks": i, "stride_x": a}
    out.append(("fragment order copy", fp8_gemm._fragment_order_kernel, frag, {"ROWS": fp8_gemm.FRAGMENT_ROWS, "BLOCKS": fp8_gemm.FRAGMENT_BLOCKS}, {"num_warps": 4}))
    w8a8 = {
        "a_ptr": "*fp8e4nv:16", "as_ptr": "*u8:16", "w_ptr": "*fp8e4nv:16", "ws_ptr": "*u8:16", "out_ptr": "*bf16:16",
        "M": i, "N": a, "K": a, "ROW_CLASS": i, "stride_am": a, "stride_asm": a, "stride_wn": a, "stride_wsn": a, "stride_om": a,
    }
    for cfg in fp8_gemm.w8a8_configs(gpu=True):
        for block in (32, 128):
            consts = dict(cfg.kwargs, QBLOCK=block, BLOCK_K=32)
            out.append((f"w8a8 {cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']} b={block}", fp8_gemm._w8a8_kernel.fn, w8a8, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}))
    common = {
        "w_ptr": "*fp8e4nv:16", "s_ptr": "*u8:16", "rows_ptr": "*i32:16", "tile_expert_ptr": "*i32:16", "rw_ptr": "*fp32:16",
        # stride_we: 2 * 2304 * 5120 elements per expert fits int32, so the launch passes i32
        # (an i64 here described a variant that never ran, and hid the kernels' int32 overflow)
        "n_pairs": i, "n_experts": i, "D": a, "I": a, "stride_we": a, "stride_wn": a, "stride_se": a, "stride_sn": a,
    }
    gate_up = dict(common, x_ptr="*bf16:16", act_ptr="*bf16:16", stride_x=a, stride_act=a, limit=f)
    down = dict(common, act_ptr="*bf16:16", y_ptr="*bf16:16", stride_act=a, stride_y=a)
    # every row class with the default dequantisation (words where the K step allows), and the
    # first (decode) class also with byte reads and with pair tiles (the sweep times both)
    first = moe.MOE["rows"][0][0]
    for max_mean, cfg in moe.MOE["rows"]:
        for before in (True, False):
            for name, kernel, types, part in (("gate_up", moe._gate_up_kernel, gate_up, cfg["gate_up"]), ("down", moe._down_kernel, down, cfg["down"])):
                words = moe.MOE["DEQUANT"] == "words" and 128 % part["BLOCK_K"] == 0
                # FP8 stacks (the FP8-activation loads' and the V4.1 shared expert's: LAST_SLOT) and
                # compact FP4 stacks (the default), as the launches combine them
                fp8 = {"FP4": False, "LAST_SLOT": 0}
                for variant in ({"WORDS": words, "PAIR_TILES": False, **fp8}, {"WORDS": not words, "PAIR_TILES": False, **fp8},
                                {"WORDS": words, "PAIR_TILES": True, **fp8}, {"WORDS": words, "PAIR_TILES": False, "FP4": False, "LAST_SLOT": 7},
                                {"WORDS": words, "PAIR_TILES": False, "FP4": True, "LAST_SLOT": 0},
                                {"WORDS": words, "PAIR_TILES": True, "FP4": True, "LAST_SLOT": 0}):
                    if max_mean != first and (variant["WORDS"] != words or variant["PAIR_TILES"]):
                        continue
                    if variant["WORDS"] and 128 % part["BLOCK_K"]:
                        continue
                    # the real shapes' D and I are multiples of 64: fragment order
                    # (FP4 stacks of whole 128s: slot order, whole 128-input steps, as `moe_experts` runs them)
                    consts = {"WEIGHT_BEFORE_DOWN": before, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_N": part["BLOCK_N"],
                              "BLOCK_K": 128 if variant["FP4"] else part["BLOCK_K"], "EVEN_K": True, "PTX": True,
                              "FRAGMENT": True, "WARPS": part["num_warps"], "SLOTS": variant["FP4"], "EVEN_N": True, **variant}
                    if name == "gate_up":
                        consts.update(TOPK=7, HAS_LIMIT=True, STACK=part.get("STACK", False), ACT_FRAGMENT=True,
                                      XREG=cfg["BLOCK_T"] <= moe.MOE["XREG_MAX_T"])
                    dequant = ("fp4 " if variant["FP4"] else "") + ("words" if variant["WORDS"] else "bytes")
                    label = (f"moe {name} mean<={max_mean} BT={cfg['BLOCK_T']} BN={part['BLOCK_N']} BK={consts['BLOCK_K']} before={before} {dequant}"
                             f"{' pair-tiles' if variant['PAIR_TILES'] else ''}{' last-slot' if variant['LAST_SLOT'] else ''}")
                    out.append((label, kernel, dict(types, w_ptr="*u8:16") if variant["FP4"] else types, consts,
                                fp8_gemm.launch_options(part), "wgmma"))
    # the dense prefill path's FP4 dequantisation (rows of whole 128s: words read from their slots)
    dq4 = {"w_ptr": "*u8:16", "s_ptr": "*u8", "out_ptr": "*bf16:16", "N": i, "K": a, "stride_wn": a, "stride_sn": i, "stride_on": a}
    for slots in (False, True):
        out.append((f"dequant_fp4 slots={slots}", fp8_gemm._dequant_fp4_kernel, dq4, {"BLOCK_R": 32, "BLOCK_C": 256, "PTX": True, "SLOTS": slots},
                    {"num_warps": 8}))
    # gate_up with its rows stacked (gate over up in one accumulator), at the decode tile
    cfg = moe.MOE["rows"][0][1]
    part = cfg["gate_up"]
    for pair_tiles in (False, True):
        consts = {"WEIGHT_BEFORE_DOWN": True, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_N": part["BLOCK_N"], "BLOCK_K": part["BLOCK_K"], "EVEN_K": True, "PTX": True,
                  "WORDS": 128 % part["BLOCK_K"] == 0, "PAIR_TILES": pair_tiles, "TOPK": 7, "HAS_LIMIT": True, "STACK": True, "FP4": False, "LAST_SLOT": 0,
                  "FRAGMENT": True, "ACT_FRAGMENT": True, "WARPS": part["num_warps"], "SLOTS": False, "XREG": cfg["BLOCK_T"] <= moe.MOE["XREG_MAX_T"],
                  "EVEN_N": True}
        label = f"moe gate_up BT={cfg['BLOCK_T']} BN={part['BLOCK_N']} BK={part['BLOCK_K']} stacked{' pair-tiles' if pair_tiles else ''}"
        out.append((label, moe._gate_up_kernel, gate_up, consts, fp8_gemm.launch_options(part), "wgmma"))
    # the FP8-activation kernels (fp8_act), every row class
    fp8_common = {k: v for k, v in common.items()}
    gate_up8 = dict(fp8_common, xq_ptr="*fp8e4nv:16", xs_ptr="*u8:16", aq_ptr="*fp8e4nv:16", as_ptr="*u8", stride_xq=a, stride_xs=i,
                    stride_aq=a, stride_as=i, limit=f)
    down8 = dict(fp8_common, aq_ptr="*fp8e4nv:16", as_ptr="*u8", y_ptr="*bf16:16", stride_aq=a, stride_as=i, stride_y=a)
    for max_mean, cfg in moe.MOE["fp8_rows"]:
        for pair_tiles in ((False, True) if max_mean == first else (False,)):
            for name, kernel, types, part in (("gate_up", moe._gate_up_fp8_kernel, gate_up8, cfg["gate_up"]), ("down", moe._down_fp8_kernel, down8, cfg["down"])):
                consts = {"WEIGHT_BEFORE_DOWN": True, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_N": part["BLOCK_N"], "BLOCK_K": part["BLOCK_K"], "EVEN_K": True,
                          "PAIR_TILES": pair_tiles}
                if name == "gate_up":
                    stack = part.get("STACK", False)
                    consts.update(TOPK=7, HAS_LIMIT=True, STACK=stack, CH=part["BLOCK_N"] // 2 if stack else part["BLOCK_N"])
                label = f"moe fp8-act {name} mean<={max_mean} BT={cfg['BLOCK_T']} BN={part['BLOCK_N']} BK={part['BLOCK_K']}{' pair-tiles' if pair_tiles else ''}"
                out.append((label, kernel, types, consts, fp8_gemm.launch_options(part), "wgmma"))
    align = {"ids_ptr": "*i64:16", "rows_ptr": "*i32:16", "tile_expert_ptr": "*i32:16", "n_pairs": i, "n_experts": i, "n_tiles": i}
    for e_block in (128, 512):
        bt = moe.MOE["rows"][0][1]["BLOCK_T"]
        consts = {"BLOCK_T": bt, "E_BLOCK": e_block, "P_BLOCK": moe.ALIGN_P_BLOCK, "FILL": 256}
        out.append((f"moe align E<{e_block}", moe._align_kernel, align, consts, {"num_warps": 4}))
    # bf16: the layer output (V4: the shared expert added after rounding)
    for gather, out_type, after in ((False, "fp32", False), (False, "bf16", False), (True, "bf16", False), (False, "bf16", True), (True, "bf16", True)):
        out.append((f"moe slot sum{' gathered' if gather else ''} -> {out_type}{' shared after rounding' if after else ''}", moe._sum_slots_kernel,
                    {"y_ptr": "*bf16:16", "ids_ptr": "*i64:16", "row_ptr": "*i64:16", "out_ptr": f"*{out_type}:16", "D": a},
                    {"TOPK": 7, "K_BLOCK": 8, "BLOCK": 1024, "GATHER": gather, "LAST_AFTER_ROUNDING": after}, {"num_warps": 4}))
    import triton

    from dsv4.ops.triton import mhc, router

    route = {"part_ptr": "*fp32:16", "bias_ptr": "*fp32:16", "weights_ptr": "*fp32:16", "ids_ptr": "*i64:16", "E": "i32", "stride_part": "i32", "stride_l": "i32",
             "temp": f, "scale": f, "extra_id": "i32"}
    per, chunks_5120 = mhc.fp32_chunks(5120)
    for e, chunks, steps in ((64, 1, 1), (384, chunks_5120, 1), (64, chunks_5120, per), (384, chunks_5120, per)):  # (steps: step parts)
        out.append((f"router E={e} chunks={chunks} steps={steps}", router._route_kernel, route,
                    {"CHUNKS": chunks, "STEPS": steps, "TOP_K": 6, "NORMALIZE": True, "EXTRA": True, "E_BLOCK": triton.next_power_of_2(e), "K_BLOCK": 8},
                    {"num_warps": 4 if e > 256 else 1}))
    route_v4 = {"logit_ptr": "*bf16:16", "bias_ptr": "*fp32:16", "fixed_ptr": "*i64:16", "weights_ptr": "*fp32:16", "ids_ptr": "*i64:16", "E": "i32",
                "stride_l": "i32", "stride_fixed": "i32", "scale": f, "extra_id": "i32"}
    for fixed in (False, True):  # V4: learned and hash-routed layers, 256 experts
        out.append((f"router V4 E=256{' hash' if fixed else ''}", router._route_v4_kernel, route_v4,
                    {"TOP_K": 6, "NORMALIZE": True, "FIXED": fixed, "EXTRA": True, "E_BLOCK": 256, "K_BLOCK": 8}, {"num_warps": 1}))
    dequant = {"w_ptr": "*fp8e4nv:16", "s_ptr": "*u8:16", "out_ptr": "*bf16:16", "N": a, "K": a, "stride_wn": a, "stride_sn": a, "stride_on": a}
    for qrows, qcols in ((32, 32), (1, 32)):
        block_r, block_c, warps = fp8_gemm.dequant_tile(qcols)
        out.append((f"dequant fp8 scales {qrows}x{qcols}", fp8_gemm._dequant_kernel, dequant,
                    {"QROWS": qrows, "QCOLS": qcols, "BLOCK_R": block_r, "BLOCK_C": block_c, "PTX": True}, {"num_warps": warps}))
    from dsv4.ops.triton import rowwise

    norm = {"x_ptr": "*bf16:16", "w_ptr": "*bf16:16", "out_ptr": "*bf16:16", "stride_x": a, "stride_o": a, "N": a, "eps": f}
    for width in (512, 1280, 5120):
        out.append((f"rms_norm D={width}", rowwise._rms_norm_kernel, norm, {"WEIGHT_IN_FP32": False, "BLOCK": triton_next_pow2(width), "WEIGHTED": True},
                    {"num_warps": 4 if width <= 2048 else 8}))
    out.append(("head_norm D=512 (V4's q heads)", rowwise._rms_norm_kernel, norm, {"WEIGHT_IN_FP32": False, "BLOCK": 512, "WEIGHTED": False}, {"num_warps": 4}))
    rope = {"x_ptr": "*bf16:16", "cos_ptr": "*bf16:16", "sin_ptr": "*bf16:16", "V": i, "M": i, "lead": a,
            "stride_xt": a, "stride_xm": a, "stride_c": a}
    for inverse in (False, True):
        out.append((f"rope D=512 inverse={inverse}", rowwise._rope_kernel, rope, {"HALF": 32, "INVERSE": inverse, "BLOCK_V": rowwise.ROPE_BLOCK_V},
                    {"num_warps": 4, "enable_fp_fusion": False}))
    latent = {"x_ptr": "*bf16:16", "qw_ptr": "*bf16:16", "kvw_ptr": "*bf16:16", "q_ptr": "*bf16:16", "kv_ptr": "*bf16:16", "cos_ptr": "*bf16:16",
              "sin_ptr": "*bf16:16", "stride_x": a, "stride_q": a, "stride_kv": a, "stride_c": a, "QN": a, "eps": f}
    out.append(("latent_inputs q 1280 kv 512 (V4.1)", rowwise._latent_inputs_kernel, latent,
                {"WEIGHT_IN_FP32": False, "Q_BLOCK": 2048, "KVN": 512, "HALF": 32, "FP8": True}, {"num_warps": 4, "enable_fp_fusion": False}))
    queries = {"q_ptr": "*bf16:16", "cos_ptr": "*bf16:16", "sin_ptr": "*bf16:16", "i_ptr": "*bf16:16", "icos_ptr": "*bf16:16", "isin_ptr": "*bf16:16",
               "VQ": i, "H": i, "VI": i, "IH": i, "stride_qt": a, "stride_qh": a, "stride_it": a, "stride_ih": a, "stride_c": a, "stride_ic": a, "q_lead": a}
    for fp4 in (True, False):
        out.append((f"rope_queries 64 x 512 + indexer 32 x 128 fp4={fp4}", rowwise._query_rope_kernel, queries,
                    {"HALF": 32, "ID": 128, "IHALF": 32, "FP4": fp4, "BLOCK_V": rowwise.ROPE_BLOCK_V}, {"num_warps": 4, "enable_fp_fusion": False}))
    tables = {"pos_ptr": "*i64:16", "inv_ptr": "*fp32:16", "cos_ptr": "*bf16:16", "sin_ptr": "*bf16:16", "T": i}
    out.append(("rope_tables HALF=32", rowwise._rope_tables_kernel, tables, {"HALF": 32, "BLOCK_T": rowwise.ROPE_TABLE_BLOCK_T},
                {"num_warps": 4, "enable_fp_fusion": False}))
    out.extend(attention_compile_targets())
    out.extend(kv_store_compile_targets())
    out.extend(engram_compile_targets())
    out.extend(mhc_compile_targets())
    out.extend(indexer_compile_targets())
    return [with_pdl(t) for t in out]


def with_pdl(target: tuple) -> tuple:
    """A compile target as the launches run it on the device: PDL on and the launch attribute
    set (every kernel takes PDL, `dsv4.ops.triton.pdl`)."""
    label, kernel, types, consts, options, *mma = target
    return (label, kernel, types, {**consts, "PDL": True}, {**options, "launch_pdl": True}, *mma)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


V41_FORMATS = {"RING_RAW": False, "CKV_RAW": False, "SKIP_EMPTY": False}  # the attention kernels' V4.1 cache formats, full top-k tiles


def attention_compile_targets() -> list[tuple]:
    """Both sparse-attention kernels at V4.1's shapes (64 heads x 512, window 128, top-k 512,
    ratio-2 blocks): the default configuration with every PV channel split the "auto" policy
    picks, and the alternatives `attention_sweep` times (each must compile without spills)."""
    from dsv4.ops.triton import attention

    a = "i32:16"  # sizes and strides that are multiples of 16 at the real shapes
    idx = {n: "*i64:16" for n in ("topk_ptr", "token_req_ptr", "pos_ptr", "start_ptr", "row_ptr", "slot_ptr", "floor_ptr", "block_table_ptr")}
    caches = dict(idx, kv_new_ptr="*bf16:16", ring_ptr="*fp8e4nv:16", ring_scale_ptr="*u8:16", ckv_ptr="*u8:16", ckv_scale_ptr="*fp8e4nv:16", s_ptr="*bf16:16", stat_ptr="*fp32:16")
    logits = dict(caches, q_ptr="*bf16:16", dense_ptr="*bf16:16", H=a, n_top=a, n_keys=a, n_tiles="i32", tiles_per_program="i32", sm_scale="fp32",
                  dense_rows=a, stride_qt=a, stride_qh=a, stride_kv=a, stride_top=a, stride_bt=a)
    pv = dict(caches, sink_ptr="*fp32:16", dense_ptr="*bf16:16", cos_ptr="*bf16:16", sin_ptr="*bf16:16", out_ptr="*bf16:16", out_exp_ptr="*u8:16",
              H=a, n_top=a, n_keys=a, dense_rows=a, stride_kv=a, stride_top=a, stride_bt=a, stride_rope=a, stride_ot=a, stride_oh=a, stride_oe=a)
    pv_fp8 = dict(pv, out_ptr="*fp8e4nv:16")  # FP8_OUT: the output quantised for wo_a (FP8 activations)
    shape = {"WINDOW": ATTN_SHAPE["window"], "PER_BLOCK": ATTN_SHAPE["per_block"], "DIM": ATTN_SHAPE["dim"]}
    out = []
    # wgmma only: that a head block or a channel slice (the MMA's N) leaves every element's
    # bits alone, which batch invariance rests on, holds within one MMA family. The default's
    # variants also with the dense copy's keys (any batch size may take it; the
    # attention_prefill alternatives compile on the device only: a cold sm_90 compile of each
    # takes seconds, and this runs in CI).
    def default(cfg: dict, keys: tuple) -> bool:
        return all(cfg[k] == attention.CONFIG[k] for k in keys if k not in ("LOGIT_BLOCK_H", "DSPLIT", "PV_BLOCK_N"))

    for cfg in attention_logit_variants():
        c = {**attention.CONFIG, **cfg}
        for dense, stages in [(False, c["dense_stages"])] + ([(True, c["dense_stages"])] if default(c, ATTN_LOGIT_KEYS) else []):
            consts = dict(shape, BLOCK_H=c["LOGIT_BLOCK_H"], BLOCK_N=c["LOGIT_BLOCK_N"], PIECE=c["PIECE"], DENSE=dense, DENSE_STAGES=stages, PTX=True, **V41_FORMATS)
            label = (f"attention logits BH={c['LOGIT_BLOCK_H']} BN={c['LOGIT_BLOCK_N']} piece={c['PIECE']} w={c['logit_warps']} s={c['logit_stages']}"
                     + (f" dense s={stages} maxnreg={c['dense_logit_maxnreg']}" if dense else ""))
            options = {"num_warps": c["logit_warps"], "num_stages": c["logit_stages"]}
            if dense and c["dense_logit_maxnreg"]:
                options["maxnreg"] = c["dense_logit_maxnreg"]
            out.append((label, attention._logits_kernel, logits, consts, options, "wgmma"))
    for cfg in attention_pv_variants():
        c = {**attention.CONFIG, **cfg}
        n_tiles = -(-ATTN_SHAPE["window"] // c["LOGIT_BLOCK_N"]) + -(-ATTN_SHAPE["top"] // c["LOGIT_BLOCK_N"])
        # the default's variants also with the dense copy's values, and (decode, the cache's) with the output in FP8
        forms = [(False, False)] + ([(True, False), (False, True)] if default(c, ATTN_PV_KEYS) else [])
        for dense, fp8_out in forms:
            consts = dict(shape, N_TILES=n_tiles, BLOCK_H=c["BLOCK_H"], BLOCK_N=c["PV_BLOCK_N"], DSPLIT=c["DSPLIT"], DENSE=dense, PIECE=c["PIECE"], PTX=True,
                          ROPE_HALF=ATTN_SHAPE["rope_half"], FP8_OUT=fp8_out, **V41_FORMATS)
            label = (f"attention pv DSPLIT={c['DSPLIT']} BN={c['PV_BLOCK_N']} w={c['pv_warps']} s={c['pv_stages']} tiles={n_tiles}"
                     f"{' dense' if dense else ''}{' fp8 out' if fp8_out else ''}")
            out.append((label, attention._pv_kernel, pv_fp8 if fp8_out else pv, consts, {"num_warps": c["pv_warps"], "num_stages": c["pv_stages"]}, "wgmma"))
    # V4-Flash: bf16 ring and compressed KV (the wrapper passes the values in the scale slots),
    # never the dense copy; CSA (top-512, ratio 4: 64 entries a block) and HCA (every visible
    # entry, ratio 128: 2 a block; 8192 of them at a 1M-token capacity, empty tiles skipped)
    raw = {n: "*bf16:16" for n in ("ring_ptr", "ring_scale_ptr", "ckv_ptr", "ckv_scale_ptr")}
    c = attention.CONFIG
    for per_block, top in ((64, 512), (2, 8192)):
        formats = dict(RING_RAW=True, CKV_RAW=True, SKIP_EMPTY=top > attention.SKIP_EMPTY_MIN_ENTRIES, PTX=True)
        for bh in attention.LOGIT_BLOCK_HS:
            consts = dict(shape, PER_BLOCK=per_block, BLOCK_H=bh, BLOCK_N=c["LOGIT_BLOCK_N"], PIECE=c["PIECE"], DENSE=False,
                          DENSE_STAGES=c["dense_stages"], **formats)
            out.append((f"attention logits v4 BH={bh} per_block={per_block} top={top}", attention._logits_kernel, dict(logits, **raw), consts,
                        {"num_warps": c["logit_warps"], "num_stages": c["logit_stages"]}, "wgmma"))
        n_tiles = -(-ATTN_SHAPE["window"] // c["LOGIT_BLOCK_N"]) + -(-top // c["LOGIT_BLOCK_N"])
        for dsplit in (*attention.AUTO_DSPLITS, *attention.WIDE_DSPLITS):  # the splits "auto" picks
            consts = dict(shape, PER_BLOCK=per_block, N_TILES=n_tiles, BLOCK_H=c["BLOCK_H"], BLOCK_N=attention.pv_block_n(dsplit, c),
                          DSPLIT=dsplit, DENSE=False, PIECE=c["PIECE"], ROPE_HALF=ATTN_SHAPE["rope_half"], FP8_OUT=False, **formats)
            out.append((f"attention pv v4 DSPLIT={dsplit} per_block={per_block} tiles={n_tiles}", attention._pv_kernel, dict(pv, **raw), consts,
                        {"num_warps": c["pv_warps"], "num_stages": c["pv_stages"]}, "wgmma"))
    copy = {"ckv_ptr": "*u8:16", "ckv_scale_ptr": "*fp8e4nv:16", "block_table_ptr": "*i64:16", "dense_ptr": "*bf16:16", "n_blocks": "i32", "entries": a, "stride_bt": a}
    out.append(("attention dense copy", attention._dense_ckv_kernel, copy,
                {"PER_BLOCK": ATTN_SHAPE["per_block"], "DIM": ATTN_SHAPE["dim"], "PIECE": attention.CONFIG["PIECE"], "ROWS": attention.DENSE_ROWS, "PTX": True},
                {"num_warps": 4}))
    return out


def kv_store_compile_targets() -> list[tuple]:
    """The masked cache stores at V4.1's widths (window / compressed KV 512, indexer keys 128)."""
    from dsv4.ops.triton import kv

    i = "i32"
    rows = {"mask_ptr": "*u8", "i0_ptr": "*i64", "i1_ptr": "*i64", "T": i, "S": i, "R": i}
    quant = dict(rows, codes_ptr="*u8", scales_ptr="*u8", NB=i, stride_x=i, stride_c0=i, stride_c1=i, stride_s0=i, stride_s1=i)
    out = [("kv store window fp8", kv._store_fp8_kernel, dict(quant, x_ptr="*bf16", codes_ptr="*fp8e4nv"), {"BLOCK": 32, "NB_P": 16, "BLOCK_T": kv._rows_per_program(512)}, {"num_warps": 4})]
    for kind, block, d, e4m3 in (("ckv", 16, 512, True), ("idx", 32, 128, False)):
        types = dict(quant, x_ptr="*bf16", scales_ptr="*fp8e4nv" if e4m3 else "*u8")
        consts = {"E4M3_SCALE": e4m3, "BLOCK": block, "NB_P": d // block, "BLOCK_T": kv._rows_per_program(d)}
        out.append((f"kv store {kind} fp4", kv._store_fp4_kernel, types, consts, {"num_warps": 4}))
    plain = dict(rows, D=i, stride_x=i, stride_d0=i, stride_d1=i)
    for src, dst in (("fp32", "fp32"), ("bf16", "bf16")):
        consts = {"BLOCK_T": kv._rows_per_program(512), "BLOCK_D": 512}
        out.append((f"kv store plain {src}->{dst}", kv._store_plain_kernel, dict(plain, x_ptr=f"*{src}", dst_ptr=f"*{dst}"), consts, {"num_warps": 4}))
    trip = {"x_ptr": "*bf16:16", "out_ptr": "*bf16:16", "M": i, "NB": i, "stride_x": "i32:16", "stride_o": "i32:16"}
    for kind, block, d in (("window", 32, 512), ("ckv", 16, 512), ("idx", 32, 128)):
        consts = {"FP8": kind == "window", "E4M3_SCALE": kind == "ckv", "BLOCK": block, "NB_P": d // block, "BLOCK_T": kv._rows_per_program(d)}
        out.append((f"kv round_trip {kind}", kv._round_trip_kernel, trip, consts, {"num_warps": 4}))
    from dsv4.ops.triton import compressor

    comp = {n: "*i64" for n in ("pos_ptr", "start_ptr", "slot_ptr", "emit_from_ptr", "block_out_ptr", "offset_out_ptr")}
    comp.update(kv_ptr="*fp32", gate_ptr="*fp32", tail_kv_ptr="*fp32", tail_gate_ptr="*fp32", req_ptr="*i32", row0_ptr="*i32", write_ptr="*u8",
                block_table_ptr="*i32", norm_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", cache_ptr="*u8", scales_ptr="*fp8e4nv", out_ptr="*bf16",
                emit_out_ptr="*i8", eps="fp32", ape_ptr="*bf16", prev_kv_ptr="*fp32", prev_gate_ptr="*fp32", pooled_ptr="*bf16",
                **{n: i for n in ("R", "n_cols", "S", "stride_kv", "stride_tail_s", "stride_tail_j", "stride_bt", "stride_cos", "stride_c0",
                                  "stride_c1", "stride_s0", "stride_s1", "stride_prev_s", "stride_prev_j", "stride_ape")})
    options = {"enable_fp_fusion": False}
    for ratio in (2, 1):  # V4.1 (FP4 cache); its ape / overlap-state pointers are the launch's unread stand-ins
        bf16 = {n: "*bf16" for n in ("kv_ptr", "gate_ptr", "tail_kv_ptr", "tail_gate_ptr", "prev_kv_ptr", "prev_gate_ptr")}
        types = comp if ratio > 1 else dict(comp, **bf16)
        consts = {"RATIO": ratio, "W": 512, "ROPE_PAIRS": 32, "PER_BLOCK": 256 // ratio, "BLOCK_T": compressor.BLOCK_T,
                  "V4": False, "OVERLAP": False, "FP4": True, "POOLED": False}
        out.append((f"compressor ratio {ratio}", compressor._compress_kernel, types, consts, dict(options, num_warps=compressor.NUM_WARPS)))
    v4 = dict(comp, kv_ptr="*bf16", gate_ptr="*bf16", ape_ptr="*fp32", cache_ptr="*bf16", scales_ptr="*bf16")
    for label, ratio, width, overlap in (("CSA", 4, 512, True), ("CSA indexer keys", 4, 128, True), ("HCA", 128, 512, False)):
        n_slots = 2 * ratio if overlap else ratio
        apart = n_slots > compressor.FUSED_MAX_SLOTS  # (the wrapper's rule)
        consts = {"RATIO": ratio, "W": width, "ROPE_PAIRS": 32, "PER_BLOCK": 256 // ratio, "BLOCK_T": compressor.V4_BLOCK_T,
                  "V4": True, "OVERLAP": overlap, "FP4": False, "POOLED": apart}
        out.append((f"compressor V4 {label} ratio {ratio} W={width}", compressor._compress_kernel, v4, consts, dict(options, num_warps=compressor.V4_NUM_WARPS)))
        if apart:
            pool = {n: v4[n] for n in ("kv_ptr", "gate_ptr", "tail_kv_ptr", "tail_gate_ptr", "req_ptr", "pos_ptr", "start_ptr", "row0_ptr", "slot_ptr",
                                       "pooled_ptr", "R", "stride_kv", "stride_tail_s", "stride_tail_j", "ape_ptr", "prev_kv_ptr", "prev_gate_ptr",
                                       "stride_prev_s", "stride_prev_j", "stride_ape")}
            consts = {"RATIO": ratio, "W": width, "PAIRS": min(compressor.APART_TILE // n_slots, width // 2),
                      "V4": True, "OVERLAP": overlap}
            out.append((f"compressor V4 {label} pooling apart", compressor._pool_kernel, pool, consts, dict(options, num_warps=4)))
    state = {n: "*i64" for n in ("start_ptr", "count_ptr", "slot_ptr")}
    state.update(kv_ptr="*bf16", gate_ptr="*bf16", tail_kv_ptr="*fp32", tail_gate_ptr="*fp32", ape_ptr="*fp32", row0_ptr="*i32", write_ptr="*u8",
                 prev_kv_ptr="*fp32", prev_gate_ptr="*fp32", **{n: i for n in ("R", "stride_kv", "stride_tail_s", "stride_tail_j", "stride_prev_s",
                                                                               "stride_prev_j", "stride_ape")})
    for half in (512, 128):  # V4 CSA's compressed KV and indexer keys
        out.append((f"compressor V4 overlap state half={half}", compressor._overlap_state_kernel, state, {"RATIO": 4, "BLOCK_C": min(half, 256)},
                    {"num_warps": 4}))
    return out


def engram_compile_targets() -> list[tuple]:
    """The engram kernels at V4.1's shapes: 2 layers x 24 columns (4-grams, 8 heads), rows of
    256 with 8 scales, D 5120 with 4 streams."""
    from dsv4.ops.triton import engram

    i, f = "i32", "fp32"
    hashing = {n: "*i64" for n in ("ids_ptr", "local_ptr", "pos_ptr", "prev_ptr", "map_ptr", "mult_ptr", "primes_ptr", "offsets_ptr", "out_ptr")}
    hashing.update(req_ptr="*i32", T=i, P=i, V=i, L=i, C=i, pad=i, stride_prev=i)
    out = [("engram hash L=2 N=4 heads=8", engram._hash_kernel, hashing, {"N": 4, "HEADS": 8, "L_P": 2, "C_P": 32, "BLOCK_T": engram.HASH_TILE // 64}, {"num_warps": 4})]
    lookup = {"hash_ptr": "*i64", "table_ptr": "*fp8e4nv:16", "scale_ptr": "*u8:16", "out_ptr": "*bf16:16", "C": i, "R": i, "stride_ht": i, "stride_hc": i, "stride_table": "i32:16", "stride_scale": i, "stride_o": "i32:16"}
    out.append(("engram lookup dim=256", engram._lookup_kernel, lookup, {"NB": 8, "SB": 32, "NB_P": 8, "BLOCK_C": engram.LOOKUP_COLS}, {"num_warps": 4}))
    a = "i32:16"
    gate = {"s_ptr": "*bf16:16", "kv_ptr": "*bf16:16", "w_ptr": "*fp32:16", "out_ptr": "*bf16:16", "D": a, "stride_st": a, "stride_sh": a, "stride_kv": a, "stride_ot": a, "stride_oh": a, "d_float": f, "inv_sqrt_d": f, "eps": f}
    out.append(("engram gate D=5120 hc=4", engram._gate_kernel, gate, {"HC": 4, "BLOCK_D": 8192}, {"num_warps": 8, "enable_fp_fusion": False}))
    return out


def mhc_compile_targets() -> list[tuple]:
    """mHC at hc = 4, D = 5120 (V4's 4096 for the fp32-weight norm)."""
    from dsv4.ops.triton import fp8_gemm, mhc

    i, f, a = "i32", "fp32", "i32:16"  # a: sizes and strides that are multiples of 16 at the real shapes
    cfg = mhc.CONFIG
    gemm = {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "T": i, "N": i, "K": i, "stride_x": i, "stride_w": i, "stride_part": i, "stride_row": i,
            "K_STEPS": i, "CHUNK_STEPS": i, "CHUNKS_PER_PROGRAM": i}
    out = [(f"fp32 gemm {label}", mhc._fp32_gemm_kernel, gemm,
            {"SUMSQ": sumsq, "STEP_PARTS": steps, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_N": n, "BLOCK_K": cfg["BLOCK_K"]},
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
           for label, sumsq, n, steps in (("mhc mixes", True, 32, False), ("router split", False, mhc.SPLIT_BLOCK_N, False),
                                          ("router step parts", False, mhc.SPLIT_BLOCK_N, True), ("wide", False, mhc.WIDE_BLOCK_N, False))]
    out += [(f"fp32 gemm {label} many rows", mhc._fp32_gemm_kernel, gemm,
             {"SUMSQ": sumsq, "STEP_PARTS": False, "BLOCK_T": cfg["MANY_BLOCK_T"], "BLOCK_N": mhc.SPLIT_BLOCK_N, "BLOCK_K": cfg["BLOCK_K"]},
             {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}) for label, sumsq in (("mhc mixes", True), ("router split", False))]
    for label, dst, chunks in (("fp32 gemm", "*fp32", mhc.fp32_chunks(5120)[1]), ("w8a16 bf16", "*bf16", 20)):
        out.append((f"{label} chunk sum", fp8_gemm._sum_chunks_kernel, {"part_ptr": "*fp32", "out_ptr": dst, "T": i, "N": i, "stride_part": i, "stride_row": i, "stride_out": i},
                    {"CHUNKS": chunks, "BLOCK_T": fp8_gemm.SUM_BLOCK_T, "BLOCK_N": 256}, {"num_warps": 4}))
    epi = {n: "*fp32" for n in ("part_ptr", "base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr")}
    epi.update(T=i, K=i, stride_part=i, iters=i, norm_eps=f, hc_eps=f)
    for chunks in (1, mhc.fp32_chunks(4 * 5120)[1]):
        out.append((f"mhc mixes epilogue chunks={chunks}", mhc._mixes_epilogue_kernel, epi, {"CHUNKS": chunks, "HC": 4, "NP": 32, "BLOCK_T": cfg["EPI_BLOCK_T"]}, {"num_warps": 1, "enable_fp_fusion": False}))
    col = {"x_ptr": "*bf16:16", "pre_ptr": "*fp32:16", "out_ptr": "*bf16:16", "part_ptr": "*fp32:16", "D": a, "stride_xt": a, "stride_xh": a,
           "stride_ot": a}
    for norm in (False, True):
        out.append((f"mhc collapse norm={norm}", mhc._collapse_kernel, col, {"HC": 4, "NORM": norm, "BLOCK_D": mhc.COLLAPSE_BLOCK_D},
                    {"num_warps": 4, "enable_fp_fusion": False}))
    slices = {"h_ptr": "*bf16:16", "part_ptr": "*fp32:16", "D": a, "stride_ht": a, "eps": f}
    for fp32_w, d in ((False, 5120), (True, 4096)):
        out.append((f"mhc norm slices fp32_weight={fp32_w} D={d}", mhc._norm_slices_kernel, dict(slices, w_ptr="*fp32:16" if fp32_w else "*bf16:16"),
                    {"SLICES": mhc._slices(d)[1], "WEIGHT_IN_FP32": fp32_w, "BLOCK_D": mhc.COLLAPSE_BLOCK_D}, {"num_warps": 4, "enable_fp_fusion": False}))
    expand = {"y_ptr": "*bf16", "res_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16", "D": i, "stride_yt": i, "stride_rt": i, "stride_rh": i}
    for fp32 in (True, False):  # V4.1's rounding, V4's
        out.append((f"mhc expand fp32={fp32}", mhc._expand_kernel, expand, {"HC": 4, "BLOCK_D": mhc.EXPAND_BLOCK_D, "FP32": fp32},
                    {"num_warps": 4, "enable_fp_fusion": False}))
    fused = {"y_ptr": "*bf16:16", "res_ptr": "*bf16:16", "post_ptr": "*fp32:16", "comb_ptr": "*fp32:16", "pre_ptr": "*fp32:16", "out_ptr": "*bf16:16",
             "h_ptr": "*bf16:16", "part_ptr": "*fp32:16", "D": a, "stride_yt": a, "stride_rt": a, "stride_rh": a, "stride_ht": a}
    out.append(("mhc expand + collapse D=5120 (V4.1)", mhc._expand_collapse_kernel, fused, {"HC": 4, "BLOCK_D": mhc.COLLAPSE_BLOCK_D},
                {"num_warps": 4, "enable_fp_fusion": False}))
    return out


def indexer_compile_targets() -> list[tuple]:
    """The indexer kernels at V4.1's shapes: 32 heads x 128, ratio 2 / 1 (128 / 256 entries per
    block), with and without entry lists; candidate blocks of 8; the three top-k stages."""
    from dsv4.ops.triton import indexer

    i, a = "i32", "i32:16"  # a: multiples of 16 at the real shapes (torch's pointers are 16-byte aligned)
    idx = {n: "*i32:16" for n in ("block_table_ptr", "row_req_ptr", "lengths_ptr", "entries_ptr")}
    scores = dict(
        idx, q_ptr="*bf16:16", w_ptr="*fp32:16", codes_ptr="*u8:16", scales_ptr="*u8:16", out_ptr="*fp32:16", T=i, H=a, width=i, scale="fp32",
        stride_qt=a, stride_qh=a, stride_wt=a, stride_bt=i, stride_et=i, stride_ot=i,
    )
    cfg = indexer.SCORES_CONFIG
    out = []
    for per_block in (128, 256):
        for entries, rows in ((False, 1), (False, cfg["ROWS"]), (True, 1)):
            consts = {"ROWS": rows, "PER_BLOCK": per_block, "DK": 128, "BLOCK_H": 32, "BLOCK_N": cfg["BLOCK_N"],
                      "HAS_ENTRIES": entries, "CONTIGUOUS": not entries, "RAW_KEYS": False, "PTX": True, "FRAGMENT": True,
                      "WARPS": cfg["num_warps"], "INTERPRETED": False}
            label = f"index_scores per_block={per_block} entries={entries} rows={rows}"
            out.append((label, indexer._index_scores_kernel, scores, consts, {"num_warps": cfg["num_warps"]}))
    # V4-Flash: bf16 keys, 64 heads (2 rows stack to N = 128), ratio 4 (64 entries per block: gathered keys)
    raw = dict(scores, codes_ptr="*bf16:16", scales_ptr="*bf16:16")
    for rows in (1, indexer.scores_rows(cfg["ROWS_MIN_T"], 64, False)):
        consts = {"ROWS": rows, "PER_BLOCK": 64, "DK": 128, "BLOCK_H": 64, "BLOCK_N": cfg["BLOCK_N"], "HAS_ENTRIES": False,
                  "CONTIGUOUS": False, "RAW_KEYS": True, "PTX": True, "FRAGMENT": False, "WARPS": cfg["num_warps"], "INTERPRETED": False}
        out.append((f"index_scores v4 bf16 heads=64 per_block=64 rows={rows}", indexer._index_scores_kernel, raw, consts,
                    {"num_warps": cfg["num_warps"]}))
    block_max = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "out_ptr": "*fp32", "width": i, "stride_st": i, "stride_ot": i}
    bcfg = indexer.BLOCK_MAX_CONFIG
    out.append(("block_max block=8", indexer._block_max_kernel, block_max, {"BLOCK": 8, "TILE_BLOCKS": bcfg["TILE_BLOCKS"]}, {"num_warps": bcfg["num_warps"]}))
    topk = {"v_ptr": "*fp32", "col_ptr": "*i32", "lengths_ptr": "*i32", "out_ptr": "*i32", "out_v_ptr": "*fp32", "labels_ptr": "*i32",
            "width": i, "k": i, "chunk": i, "stride_v": i, "stride_c": i, "stride_l": i}
    for stage in (0, 1, 2):
        for labels in (False, True) if stage != 1 else (False,):
            for columns in (2048, 8192, 1 << 20):  # resident tiles up to RESIDENT_MAX (8192), then streamed ones
                tiles = indexer.topk_tiles(columns, columns <= indexer.TOPK_CONFIG["RESIDENT_MAX"])
                out.append((f"topk_ascending stage={stage} labels={labels} columns={columns}", indexer._topk_kernel, topk,
                            {"STAGE": stage, "LABELS": labels, "BITS": indexer.TOPK_CONFIG["DIGIT_BITS"],
                             **{k: v for k, v in tiles.items() if k != "num_warps"}},
                            {"num_warps": tiles["num_warps"]}))
    pool = {"cand_ptr": "*i32:16", "visible_ptr": "*i64:16", "out_ptr": "*i32:16", "n": i, "stride_ct": i, "stride_ot": i}
    out.append(("pool_entries block=8", indexer._pool_entries_kernel, pool, {"BLOCK": 8, "TILE": indexer.POOL_TILE}, {"num_warps": 4}))
    return out


def compile_case(label: str, kernel, types: dict, consts: dict, options: dict, mma_required: str | None = None) -> None:
    """Compile for sm_90 with the wheel's ptxas (no GPU needed); registers, spill stack and
    shared memory per thread block from cuobjdump. A type written "*bf16:16" or "i32:16" marks
    an argument the launch specialises as a multiple of 16 (torch's pointers; sizes and strides
    at the real shapes): without it loads are not vectorised and not pipelined, and the report
    would describe a kernel the launch never runs. `mma_required` ("wgmma"): the variant fails
    unless every MMA it issues is of that family (what the GEMMs' bits contract rests on)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "constexpr").split(":")[0] for name in kernel.arg_names}
    aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t.endswith(":16")}
    start = time.time()
    compiled = triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32), options=options)
    usage = {}
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=False).stdout
            sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=False).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
        if found:
            usage = {"registers": int(found[1]), "spill_stack_bytes": int(found[2])}
        # static SASS counts: the MoE and GEMM kernels are bound by the L1/TEX unit (shared
        # memory; ncu, docs/PERF.md eighth session), so shared-memory stores and loads per
        # variant are the offline proxy to compare tiles and dequantisations by
        ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
        if ops:
            usage.update(sass_instructions=len(ops), shared_stores=ops.count("STS"), shared_loads=ops.count("LDS") + ops.count("LDSM"))
    mma = "wgmma" if "wgmma" in compiled.asm["ptx"] else "mma.sync" if "mma.sync" in compiled.asm["ptx"] else "none"
    families = {"wgmma": "wgmma.mma_async", "mma.sync": "mma.sync"}
    if mma_required and (families[mma_required] not in compiled.asm["ptx"] or any(f in compiled.asm["ptx"] for k, f in families.items() if k != mma_required)):
        raise RuntimeError(f"{label}: must compile to {mma_required} only, got {mma} (a row's bits would then depend on its row class)")
    record("compile_sm90", label, "triton", ok=True, seconds=time.time() - start, shared_bytes=compiled.metadata.shared, mma=mma, **usage)


def _compile_share(index: int, count: int) -> list[dict]:
    """Compile every count-th of `compile_targets()` from index; its records."""
    for target in compile_targets()[index::count]:
        guarded("compile_sm90", target[0], compile_case, *target)
    return RECORDS


def compile_all(jobs: int) -> None:
    """Compile every target over `jobs` processes: each compile is one CPU-bound thread
    (Triton's passes, then ptxas), so on CI's two cores two workers halve the suite's longest
    test. Forked workers (no CUDA is touched); the records come back in target order within
    each share."""
    if jobs <= 1:
        _compile_share(0, 1)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for share in pool.map(_compile_share, range(jobs), [jobs] * jobs):
            RECORDS.extend(share)


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
            if "sass_instructions" in r:
                item += f", {r['sass_instructions']} SASS ({r['shared_stores']} STS, {r['shared_loads']} LDS)"
            if "same_bits" in r:
                item += f" same bits: {r['same_bits']}"
            item += {True: " ok", False: " FAIL"}.get(r.get("ok"), "")
            parts.append(item)
        lines.append(" ".join(parts))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(s for s in SECTIONS if s not in ON_REQUEST),
                        help=f"comma-separated subset of {list(SECTIONS)} (default: all but {list(ON_REQUEST)})")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all sections together")
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_90 here (no GPU needed) and report registers / spills")
    parser.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))),
                        help="--compile-only: compiling processes (default: one per CPU this process may use, at most 8: each holds its own torch and Triton)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        return run_section(args.section, args.json)
    if args.compile_only:
        compile_all(args.jobs)
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

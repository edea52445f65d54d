#!/usr/bin/env python3
"""Device experiment: how the dequantised FP8 weight tile reaches the wgmma register operand.

The decode GEMMs (`moe._gate_up_kernel` / `_down_kernel`, `fp8_gemm._w8a16_kernel`) load FP8
words into a blocked layout, dequantise them in registers and hand the bf16 tile to the
wgmma as its register operand (weight rows as M). That layout and the operand's differ in
their warps and lanes, so Triton moves the tile through shared memory (STS + LDSM and barriers)
— the round trip docs/PERF.md (eighth session) named as the MoE kernels' likely bound.
This script times one weight-streaming GEMM y = x @ W^T (W FP8 [N, K] with an E8M0 scale per
32 inputs, x bf16 [T, K], T padded to the row tile) in these forms, each against the torch
reference of the dequantised weight (the `err` column; the two K64 forms were timed in the
twelfth session and are no longer run):

* `current`: the kernels' form (128-input K steps, the tile through shared memory);
* `natural K64`: the same with 64-input K steps;
* `fragment K64`: tile row i loads weight row pi(i) (pi swaps the row bits Triton's load gives
  the warps with the ones the operand gives them) and the dot's K runs, inside every block of
  64 inputs, in the order sigma that puts each lane's dequantised pairs where the operand
  wants them; the tile then reaches the operand by register renaming alone (no STS, no LDSM
  in the sm_90 SASS). x must come in the same order: here it is permuted in memory first,
  which in the model would be its producer's job (the gate_up kernel for the down GEMM);
* `fragment K128`: the same in 128-input steps loaded as two 64-input halves;
* `fragment K128 xreg`: the same with x read in natural order and put in sigma order in
  registers (reshape + permute before it goes to shared memory as the wgmma's other operand),
  which would spare the model the permuted copy of x.

Not used by the engine; it decides the next kernel design (results: docs/PERF.md, twelfth
and fourteenth sessions). Run on the device: `python scripts/weight_path_experiment.py` (writes
$OUT/weight_path.json)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsv4.ops.triton.fp8_gemm import dequant_word_step  # noqa: E402

@triton.jit
def _sigma(kappa):
    """Natural input of dot position kappa inside its 64-block: bit 0 stays, bits 1-2 go to
    4-5 (the lane's pair), bits 3, 4, 5 to 1, 2, 3."""
    return (kappa & ~63) | (kappa & 1) | (((kappa >> 3) & 7) << 1) | (((kappa >> 1) & 3) << 4)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, K, stride_x, stride_wn, stride_sn, stride_y,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr,
                 XREG: tl.constexpr):
    """y [BLOCK_T, N] = x @ W^T, one program per BLOCK_N weight rows (4 warps), no masks (the
    driver's shapes are whole tiles)."""
    pid_n = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    if FRAGMENT:  # tile row i: bits 0-2 lanes, 3-4 warps, 5+ registers -> warps on weight-row bits 4-5
        i = (i & 7) | (((i >> 5) & 1) << 3) | (((i >> 3) & 3) << 4) | ((i >> 6) << 6)
    rows = pid_n * BLOCK_N + i
    x_rows = x_ptr + tl.arange(0, BLOCK_T)[:, None] * stride_x
    w_words = (w_ptr + rows[:, None] * stride_wn).to(tl.pointer_type(tl.int32), bitcast=True)
    s_words = (s_ptr + rows * stride_sn).to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s_word = tl.load(s_words + k0 // 128)
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :])
        if XREG:  # natural inputs n0 + 2 n1 + 4 n2 + 8 n3 + 16 n45 -> dot position kappa (sigma)
            x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_T, BLOCK_K // 64, 4, 2, 2, 2, 2)), (0, 1, 3, 4, 5, 2, 6)), (BLOCK_T, BLOCK_K))
        if FRAGMENT and BLOCK_K == 128:  # two 64-input halves as the slowest dim (registers)
            kw = k0 // 4 + 16 * tl.arange(0, 2)[:, None, None] + tl.arange(0, 16)[None, None, :]
            w0, w1 = tl.split(tl.permute(tl.load(w_words[None, :, :] + kw), (1, 2, 0)))
            w = tl.join(dequant_word_step(w0, s_word, k0, 64), dequant_word_step(w1, s_word, k0 + 64, 64))
            w = tl.reshape(tl.permute(w, (0, 2, 1)), (BLOCK_N, BLOCK_K))
        else:
            w = dequant_word_step(tl.load(w_words + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :]), s_word, k0, BLOCK_K)
        if FRAGMENT:
            # [tile row i, natural input] -> [weight row m, dot position kappa]: i = r3 + 8 w2 +
            # 32 r1 + 64 hi holds m = r3 + 8 r1 + 16 w2 + 64 hi; input n0 + 2 n1 + 4 n2 + 8 n3 +
            # 16 n45 sits at kappa = n0 + 2 n45 + 8 n1 + 16 n2 + 32 n3 (sigma)
            w = tl.reshape(w, (BLOCK_N // 64, 2, 4, 8, BLOCK_K // 64, 4, 2, 2, 2, 2))
            w = tl.reshape(tl.permute(w, (0, 2, 1, 3, 4, 6, 7, 8, 5, 9)), (BLOCK_N, BLOCK_K))
        acc = tl.dot(w, tl.trans(x), acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + tl.arange(0, BLOCK_T)[None, :] * stride_y + cols[:, None], acc.to(tl.bfloat16))


def sigma_order(k: int, device) -> torch.Tensor:
    """The natural input of every dot position (`_sigma` on the host): x[:, sigma_order] is x
    in the fragment form's order."""
    kappa = torch.arange(k, device=device)
    return (kappa & ~63) | (kappa & 1) | (((kappa >> 3) & 7) << 1) | (((kappa >> 1) & 3) << 4)


def main() -> int:
    torch.manual_seed(0)
    records = []
    # (N, K): the down projection's K over 8 experts' rows, gate_up's K at two grid sizes (320
    # and 160 programs of 64 rows: how the grid's balance over 132 SMs shows)
    for n, k in ((40960, 2304), (20480, 5120), (10240, 5120)):
        w = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (n, k // 32), device="cuda", dtype=torch.uint8)
        dense = (w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, 1)).bfloat16().float()
        for t in (1, 16, 64):
            bt = max(16, t)
            x = torch.zeros(bt, k, device="cuda", dtype=torch.bfloat16)
            x[:t] = torch.randn(t, k, device="cuda").bfloat16()
            ref = x[:t].float() @ dense.T
            forms = [(name, fragment, bk, bn, st, xreg) for bn in (64, 128) for st in (3, 4)
                     for name, fragment, bk, xreg in (("current", False, 128, False), ("fragment K128", True, 128, False),
                                                      ("fragment K128 xreg", True, 128, True))]
            for name, fragment, bk, bn, st, xreg in forms:
                xin = x[:, sigma_order(k, x.device)].contiguous() if fragment and not xreg else x
                y = torch.empty(bt, n, device="cuda", dtype=torch.bfloat16)

                def call():
                    _gemm_kernel[(n // bn,)](xin, w, s, y, k, xin.stride(0), w.stride(0), s.stride(0), y.stride(0),
                                             BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, FRAGMENT=fragment, XREG=xreg,
                                             num_warps=4, num_stages=st)
                rec = dict(N=n, K=k, T=t, form=name, BLOCK_N=bn, stages=st)
                try:
                    call()
                    torch.cuda.synchronize()
                    rec["err"] = float((y[:t].float() - ref).abs().max() / ref.abs().max())
                    rec["ms"] = triton.testing.do_bench_cudagraph(call, rep=50)
                    rec["tb_s"] = n * k * (1 + 1 / 32) / rec["ms"] / 1e9
                except Exception as exc:  # noqa: BLE001 - a form that fails to compile or run is a result
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(rec), flush=True)
                records.append(rec)
    best = {}
    for r in records:
        key = (r["N"], r["K"], r["T"], r["form"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    for (n, k, t, name), r in sorted(best.items()):
        print(f"N={n} K={k} T={t:3d} {name:<14} {r['ms'] * 1e3:7.1f} us {r['tb_s']:5.2f} TB/s (BLOCK_N {r['BLOCK_N']}, {r['stages']} stages) err {r['err']:.1e}")
    Path(os.environ.get("OUT", "."), "weight_path.json").write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

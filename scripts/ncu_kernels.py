#!/usr/bin/env python3
"""The decode- and prefill-regime kernels that bound the forward step, run at V4.1-Flash's real
shapes for Nsight Compute, which says what limits each one (issue slots, memory latency,
occupancy, DRAM bandwidth) where check_kernels.py only gives times:

    ncu --kernel-name regex:'_gate_up|_down_kernel|_w8a16|_logits|_pv' --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python scripts/ncu_kernels.py [--cases moe_t1,moe_t64,...]

Each case runs its kernel twice (compile and warm-up, then the profiled launch) on the data
check_kernels.py builds; scripts/device_run.sh's `ncu` step runs it and keeps the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_kernels as ck  # noqa: E402  (the device data builders)


def moe(t: int, fp4: bool = False) -> None:
    """Routed experts of the 64-expert benchmark layer plus the shared one, top-6 + 1 (pair
    tiles at T=1, the counting-sort layout above); `fp4`: the routed ones as compact FP4
    (`--fp4-experts`), the shared one as its own FP8 stack."""
    from dsv4.ops.triton import moe

    x, _, _, w13, s13, w2, s2 = ck.moe_data(t, e=65)
    ids, weights = ck.moe_routings(t, 65, seed=t, shared=True)[0]
    stacks, shared = (w13, s13, w2, s2), None
    if fp4:
        stacks = (ck.fp4_stack(w13[:64]), s13[:64], ck.fp4_stack(w2[:64]), s2[:64])
        shared = (w13[64:], s13[64:], w2[64:], s2[64:])
    for _ in range(2):
        moe.moe_experts(x[:t], ids, weights, *stacks, 10.0, True, shared=shared)


def moe_capped(t: int, maxnreg: int | None) -> None:
    """`moe(t)` with the prefill class's gate_up under another register cap (None: uncapped;
    `moe.launch_options`)."""
    from dsv4.ops.triton import moe as moe_kernels

    gate_up = moe_kernels.MOE["rows"][-1][1]["gate_up"]
    default = gate_up.get("maxnreg")
    gate_up["maxnreg"] = maxnreg
    try:
        moe(t)
    finally:
        gate_up["maxnreg"] = default


def w8a16(name: str, m: int = 1) -> None:
    from dsv4.ops.triton import fp8_gemm

    _, n, k, block = next(p for p in ck.PROJECTIONS if p[0] == name)
    w, s = ck.fp8_weight(n, k, block, seed=0)
    x = torch.randn(m, k, device="cuda").bfloat16()
    for _ in range(2):
        fp8_gemm.fp8_linear_w8a16(x, w, s, block)


def attention(t: int) -> None:
    from dsv4.ops.triton import attention

    args = ck.attention_data(t, decode=t <= 256)
    for _ in range(2):
        attention.sparse_attention(**args)


CASES = {
    "moe_t1": lambda: moe(1),
    "moe_t64": lambda: moe(64),
    "moe_fp4_t64": lambda: moe(64, fp4=True),
    # the prefill class (hit=1024@100000's encoder layers: 1152 rows, ~124 pairs per expert)
    "moe_t1152": lambda: moe(1152),
    "moe_t1152_uncapped": lambda: moe_capped(1152, None),
    "wq_b_m1": lambda: w8a16("wq_b"),
    "wo_b_m1": lambda: w8a16("wo_b"),
    "wq_b_m64": lambda: w8a16("wq_b", 64),
    "wo_b_m64": lambda: w8a16("wo_b", 64),
    "wq_b_m256": lambda: w8a16("wq_b", 256),
    "attn_t1": lambda: attention(1),
    "attn_t64": lambda: attention(64),
    "attn_t4096": lambda: attention(4096),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    args = parser.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    for name in names:
        torch.cuda.nvtx.range_push(name)
        CASES[name]()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

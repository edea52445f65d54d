#!/usr/bin/env python3
"""The decode- and prefill-regime kernels that bound the forward step, run at V4.1-Flash's real
shapes for Nsight Compute, which says what limits each one (issue slots, memory latency,
occupancy, DRAM bandwidth) where check_kernels.py only gives times:

    ncu --kernel-name regex:'_gate_up|_down_kernel|_w8a16|_logits|_pv' --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python scripts/ncu_kernels.py [--cases moe_t1,moe_t64,...]

Each case runs its kernel twice (compile and warm-up, then the profiled launch) on the data
check_kernels.py builds; scripts/device_run.sh's `ncu` step runs it and keeps the report.

Where inside a kernel the time goes: its `ncu_source` step profiles with SourceCounters, writes
ncu's source page (SASS) as CSV and prints `--summarize-source CSV`: per kernel the warp-stall
samples and the excess shared-memory wavefronts (bank conflicts) by opcode, and the
instructions with the most of each.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import Counter
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
    """`moe(t)` with the gate_up of the row class it takes under a register cap (None:
    uncapped; `fp8_gemm.launch_options`)."""
    from dsv4.ops.triton import moe as moe_kernels

    gate_up = moe_kernels.moe_config(7 * t, 65)["gate_up"]  # top-6 + the shared expert over 65
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
    # a prefill class (hit=1024@100000's encoder layers: 1152 rows, ~124 pairs per expert)
    "moe_t1152": lambda: moe(1152),
    "moe_t1152_capped": lambda: moe_capped(1152, 128),
    "wq_b_m1": lambda: w8a16("wq_b"),
    "wo_b_m1": lambda: w8a16("wo_b"),
    "wq_b_m64": lambda: w8a16("wq_b", 64),
    "wo_b_m64": lambda: w8a16("wo_b", 64),
    "wq_b_m256": lambda: w8a16("wq_b", 256),
    "attn_t1": lambda: attention(1),
    "attn_t64": lambda: attention(64),
    "attn_t256": lambda: attention(256),
    "attn_t4096": lambda: attention(4096),
}


STALLS = "Warp Stall Sampling (All Samples)"
EXCESS = "L1 Wavefronts Shared Excessive"
INSTRUCTIONS = "Instructions Executed"  # warp-level; with the stall reasons (stall_*) below, read when present


def _count(text: str) -> float:
    """A CSV cell of ncu's (thousands separators, empty for none) as a number."""
    text = text.replace(",", "").strip()
    return float(text) if text else 0.0


def _opcode(sass: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers ("@P1 LDGSTS.E.128 ..." -> "LDGSTS")."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def source_summary(text: str, top: int = 8) -> dict[str, dict]:
    """ncu's source page as CSV (`--page source --csv --print-source sass`; one block per kernel,
    each opened by a "Kernel Name" line) -> per kernel: the warp-stall samples and the excess
    shared wavefronts as shares by opcode, and the `top` instructions of each; where the page
    has them, the executed warp instructions by opcode and the stall samples by reason (its
    `stall_*` columns, all samples)."""
    out = {}
    for block in text.split('"Kernel Name",')[1:]:
        name, body = block.split("\n", 1)
        rows = list(csv.DictReader(io.StringIO(body)))
        kernel = name.strip().strip(",").strip('"')
        missing = {STALLS, EXCESS, "Source"} - set(rows[0] if rows else ())
        if missing:
            raise ValueError(f"source page of {kernel}: no column(s) {sorted(missing)} (profile with --section SourceCounters)")
        entry = {}
        for key, column in (("stalls", STALLS), ("excess_shared", EXCESS)):
            by_op = Counter()
            for row in rows:
                by_op[_opcode(row["Source"])] += _count(row[column])
            total = sum(by_op.values())
            ranked = sorted(rows, key=lambda r: -_count(r[column]))[:top]
            entry[key] = {
                "total": total,
                "by_opcode": {op: n / total for op, n in by_op.most_common() if n} if total else {},
                "top": [(row["Address"], row["Source"].strip(), _count(row[column])) for row in ranked if _count(row[column])],
            }
        if INSTRUCTIONS in rows[0]:
            by_op = Counter()
            for row in rows:
                by_op[_opcode(row["Source"])] += _count(row[INSTRUCTIONS])
            total = sum(by_op.values())
            entry["instructions"] = {"total": total, "by_opcode": {op: n / total for op, n in by_op.most_common() if n} if total else {}}
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        if reasons:
            sums = {c.removeprefix("stall_"): sum(_count(row[c]) for row in rows) for c in reasons}
            total = sum(sums.values())
            entry["stall_reasons"] = {r: n / total for r, n in sorted(sums.items(), key=lambda kv: -kv[1]) if n} if total else {}
        out[kernel] = entry
    return out


def print_source_summary(path: str) -> None:
    for kernel, entry in source_summary(Path(path).read_text()).items():
        for key, title in (("stalls", "warp-stall samples"), ("excess_shared", "excess shared wavefronts")):
            part = entry[key]
            shares = ", ".join(f"{op} {share:.1%}" for op, share in list(part["by_opcode"].items())[:8])
            print(f"{kernel}: {title} {part['total']:.0f}: {shares}")
            for address, sass, n in part["top"]:
                print(f"    {n:12.0f}  {address}  {sass[:90]}")
        if "instructions" in entry:
            shares = ", ".join(f"{op} {share:.1%}" for op, share in list(entry["instructions"]["by_opcode"].items())[:12])
            print(f"{kernel}: warp instructions {entry['instructions']['total']:.0f}: {shares}")
        if entry.get("stall_reasons"):
            print(f"{kernel}: stall reasons: " + ", ".join(f"{r} {share:.1%}" for r, share in list(entry["stall_reasons"].items())[:10]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--summarize-source", metavar="CSV", help="print the summary of ncu's source page (no GPU needed) and exit")
    args = parser.parse_args()
    if args.summarize_source:
        print_source_summary(args.summarize_source)
        return 0
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

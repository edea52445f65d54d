#!/usr/bin/env python3
"""Per-kernel table of forward steps as the benchmark runs them (device script).

`dsv4 bench forward` says which component a step's time goes to; this says which kernels:
for each case (the bench's grammar) it builds the same model (`--config v41 --num-layers 8
--num-experts 64` by default, random weights), captures the step's CUDA graphs the way the
bench does, replays them under torch.profiler and sums the GPU time of every kernel name per
step, with its launch count, its share of the step and the GPU's idle time between kernels.

    python scripts/profile_step.py d1_8k=1*1@8192 d64_32k=64*1@32768 p8k=8192 --json out.json

`--eager`: also profiles the eager step (`Model.forward` on the unpadded batch, as the bench's
"eager ms"), kernel by kernel beside the graphs' table: where a graph replay loses to it.

`--torch-ops`: also runs one eager step under a torch dispatch mode and lists the aten ops it
issues outside the Triton kernels by the dsv4 source line that issued them (the profiler of
the device's torch records no Python callers): where a step's small torch launches come from.

The kernels are launched without programmatic dependent launch (`dsv4.ops.triton.pdl`), so
that each kernel's time is its own: with PDL a kernel starts while its predecessor runs and
its time would include the wait. `--pdl` profiles them as the bench runs them.

`--timeline`: also stores (in the --json file) one replay's kernels in start order with their
streams, durations and the idle gaps between them (the step's critical chain), and prints its
totals (`timeline_summary`: span, durations, the part that ran beside other kernels, gaps).

`--copies`: also lists an eager step's copy ops (copy_, clone, _to_copy, contiguous; a copy
counts under each op it passes through) by input shapes with the GPU time of their kernels:
which tensors the graphs' `direct_copy_kernel` launches move (the nineteenth session's: the
fragment-order copies of the wider GEMM tiles' activations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsv4.bench import forward as bench  # noqa: E402
from dsv4.bench.roofline import case_floor, parse_cases, plan_case  # noqa: E402
from dsv4.model.model import Model  # noqa: E402
from dsv4.model.random_weights import random_weights  # noqa: E402


def kernel_table(step, steps: int) -> dict:
    """Replay `step` `steps` times under the profiler -> per kernel name: calls and us per step;
    plus the step's GPU span and the sum of its kernels' times (the rest is idle GPU)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        entry = per_name[e.name]
        entry[0] += 1
        entry[1] += e.device_time
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    busy = sum(v[1] for v in per_name.values())
    rows = sorted(((n, c / steps, us / steps) for n, (c, us) in per_name.items()), key=lambda r: -r[2])
    return {"span_us": (end - start) / steps, "kernel_us": busy / steps, "kernels": [{"name": n, "calls": c, "us": us} for n, c, us in rows]}


def timeline(step) -> list[dict]:
    """One replay of `step` under the profiler, kernel by kernel in start order: name, stream,
    start (us from the first kernel's), duration and the idle gap since the latest end before
    it on any stream (negative: it overlapped its predecessor)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    t0, last_end, out = kernels[0].time_range.start, kernels[0].time_range.start, []
    for e in kernels:
        out.append({"name": e.name, "stream": getattr(e, "device_resource_id", None), "start_us": e.time_range.start - t0,
                    "us": e.device_time, "gap_us": e.time_range.start - last_end})
        last_end = max(last_end, e.time_range.end)
    return out


def timeline_summary(entries: list[dict]) -> dict:
    """A `timeline`'s totals from its first kernel on (leading copies, the step's metadata
    upload, are not counted): kernels, span_us (first kernel's start to the last end), busy_us
    (their durations summed), gaps_us (idle time between them, summed), beside_us (busy time
    that ran beside other kernels: busy - (span - gaps)), lead_us (from the first entry to the
    first kernel)."""
    first = next((i for i, e in enumerate(entries) if not e["name"].startswith("Memcpy")), None)
    if first is None:
        raise ValueError("the timeline has no kernel")
    kernels = entries[first:]
    start = kernels[0]["start_us"]
    span = max(e["start_us"] + e["us"] for e in kernels) - start
    busy = sum(e["us"] for e in kernels)
    gaps = sum(max(0.0, e["gap_us"]) for e in kernels[1:])
    return {"kernels": len(kernels), "span_us": span, "busy_us": busy, "gaps_us": gaps, "beside_us": busy - (span - gaps),
            "lead_us": start - entries[0]["start_us"]}


def per_call(entries: list[dict]) -> dict[str, list[float]]:
    """A `timeline`'s durations by kernel name, call by call in start order: one layer's call
    next to the others' (on the H200, S28-6: every d1_8k logits call ~14 us, window and CSA
    layers alike, PV 5.5 us on window layers and 12 on CSA ones), which the totals hide."""
    calls: dict[str, list[float]] = {}
    for e in entries:
        calls.setdefault(e["name"], []).append(e["us"])
    return calls


# aten ops that only make views or read metadata: no kernel
_NO_KERNEL = {"detach", "view", "_unsafe_view", "t", "expand", "slice", "select", "unsqueeze", "squeeze", "split",
              "split_with_sizes", "alias", "transpose", "unbind", "reshape", "permute", "as_strided", "lift_fresh",
              "_record_function_enter_new", "_record_function_exit", "empty", "empty_like", "empty_strided"}


class _CountOps(TorchDispatchMode):
    """Counts the kernel-launching aten ops by (op, innermost dsv4 source line)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _NO_KERNEL:
            where = next((f"{f.filename.split('dsv4/', 1)[-1]}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-1])
                          if "/dsv4/" in f.filename), "?")
            self.counts[(func.overloadpacket.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


def eager_step(model: Model, batch, cache):
    """The bench's eager step (`Model.forward` on the unpadded batch, then the logits)."""
    with torch.inference_mode():
        return model.logits(model.forward(batch, cache))


def torch_op_table(model: Model, batch, cache) -> list[dict]:
    """The aten ops of one eager step, per (op, source line), most frequent first."""
    eager_step(model, batch, cache)  # warm: lazily built tensors are not counted
    mode = _CountOps()
    with mode:
        eager_step(model, batch, cache)
    return [{"op": op, "where": where, "calls": n} for (op, where), n in mode.counts.most_common()]


def copy_table(model: Model, batch, cache) -> list[dict]:
    """The copy ops of one eager step (copy_, clone, _to_copy, contiguous) by input shapes,
    with the GPU time of the kernels they launched, most first."""
    eager_step(model, batch, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        eager_step(model, batch, cache)
        torch.cuda.synchronize()
    rows = [{"op": e.key, "shapes": str(e.input_shapes), "calls": e.count, "us": e.device_time_total}
            for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::contiguous")]
    return sorted(rows, key=lambda r: -r["us"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+")
    p.add_argument("--config", default="v41")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="replays profiled per case")
    p.add_argument("--top", type=int, default=30, help="kernels printed per case")
    p.add_argument("--eager", action="store_true", help="also profile the eager step (Model.forward, no padding)")
    p.add_argument("--torch-ops", action="store_true", help="also list an eager step's aten ops by source line")
    p.add_argument("--copies", action="store_true", help="also list an eager step's copy ops by input shape, with their GPU time")
    p.add_argument("--pdl", action="store_true", help="launch with PDL, as the bench does (kernel times then include their waits)")
    p.add_argument("--timeline", action="store_true", help="also store one replay's kernels in start order (with --json)")
    p.add_argument("--json")
    args = p.parse_args()
    from dsv4.ops.triton import pdl  # (here: importing the kernels at module level would fix them as compiled, and the CPU tests import this module)

    pdl.PDL = args.pdl  # before any capture: the graphs keep the launch attributes they were captured with
    dtype, device = torch.bfloat16, torch.device("cuda")
    cfg = bench.bench_config(args.config, num_layers=args.num_layers, num_experts=args.num_experts, engram_rows=bench.DEFAULT_ENGRAM_ROWS)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=torch.Generator().manual_seed(0))
    model = Model(cfg, random_weights(cfg, dtype=dtype, device=device, compact=True, seed=0), dtype=dtype, device=device, token_map=token_map)
    doc = {}
    for case in parse_cases(args.cases):
        cache, batch = bench.build_case(cfg, plan_case(cfg, case), block_size=256, dtype=dtype, device=device, seed=0, batch_device=torch.device("cpu"))
        blocks = batch.block_tables.shape[1]
        runner = bench.DecodeGraphs(model, cache, max_blocks=blocks, sizes=(batch.num_requests,), rows=max(batch.num_tokens))
        if runner.fits(batch):
            runner.capture()
        else:
            runner = bench.PiecewiseGraphs(model, cache, max_blocks=blocks)
            runner.capture(batch)
        times = bench.time_step(lambda: runner.run(batch), device, 2, 5)
        table = kernel_table(lambda: runner.run(batch), args.steps)
        floor = case_floor(cfg, case, dtype)["floor_ms"]
        doc[case.name] = {"case": case.text, "step_ms": statistics.median(times), "floor_ms": floor, **table}
        if args.timeline:
            doc[case.name]["timeline"] = timeline(lambda: runner.run(batch))
            summary = doc[case.name]["timeline_summary"] = timeline_summary(doc[case.name]["timeline"])
        print(f"\n== {case.text}{' (PDL)' if args.pdl else ' (no PDL)'}: step {doc[case.name]['step_ms']:.3f} ms (floor {floor:.3f}), GPU span {table['span_us'] / 1e3:.3f} ms, "
              f"kernels {table['kernel_us'] / 1e3:.3f} ms, {sum(k['calls'] for k in table['kernels']):.0f} launches")
        calls = per_call(doc[case.name]["timeline"]) if args.timeline else {}
        for k in table["kernels"][: args.top]:
            print(f"  {k['us']:9.1f} us {100 * k['us'] / table['kernel_us']:5.1f}% {k['calls']:6.1f}x  {k['name'][:110]}")
            if len(calls.get(k["name"], ())) > 1:  # the replay's calls, in order
                print("               calls: " + " ".join(f"{us:.1f}" for us in calls[k["name"]][:40]))
        if args.timeline:
            print(f"  one replay: {summary['kernels']} kernels over {summary['span_us']:.1f} us from the first, their durations "
                  f"{summary['busy_us']:.1f} us ({summary['beside_us']:.1f} beside other kernels), idle gaps {summary['gaps_us']:.1f} us; "
                  f"{summary['lead_us']:.1f} us before the first kernel")
        if args.eager:
            eager = lambda: eager_step(model, batch, cache)  # noqa: E731
            eager_times = bench.time_step(eager, device, 2, 5)
            eager_table = doc[case.name]["eager"] = {"step_ms": statistics.median(eager_times), **kernel_table(eager, args.steps)}
            graph_us = {k["name"]: k["us"] for k in table["kernels"]}
            print(f"  eager: step {eager_table['step_ms']:.3f} ms, GPU span {eager_table['span_us'] / 1e3:.3f} ms, kernels "
                  f"{eager_table['kernel_us'] / 1e3:.3f} ms; kernels by |graph - eager| (us per step):")
            eager_us = {k["name"]: k["us"] for k in eager_table["kernels"]}
            gaps = sorted(set(graph_us) | set(eager_us), key=lambda n: -abs(graph_us.get(n, 0.0) - eager_us.get(n, 0.0)))
            for name in gaps[: args.top]:
                print(f"  {graph_us.get(name, 0.0):9.1f} graph {eager_us.get(name, 0.0):9.1f} eager  {name[:100]}")
        if args.torch_ops:
            ops = doc[case.name]["torch_ops"] = torch_op_table(model, batch, cache)
            by_line = Counter()
            for o in ops:
                by_line[o["where"]] += o["calls"]
            print(f"  {sum(o['calls'] for o in ops)} aten ops outside the Triton kernels in an eager step; by source line:")
            for where, n in by_line.most_common():
                names = ", ".join(f"{o['op']} x{o['calls']}" for o in ops if o["where"] == where)
                print(f"  {n:5d}  {where}  ({names})")
        if args.copies:
            print("  an eager step's copies by input shapes (GPU us):")
            for row in doc[case.name].setdefault("copies", copy_table(model, batch, cache)):
                print(f"  {row['us']:9.1f} us {row['calls']:4d}x  {row['op']}  {row['shapes'][:150]}")
        del runner, cache, batch
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

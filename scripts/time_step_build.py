#!/usr/bin/env python3
"""Host time of a graph step's metadata (CPU only, no GPU needed).

A CUDA-graph decode step first builds its `Step` on the host (`model.step.build_step`) and
packs it into the captured step's buffer (`StepBuffer.load`); the benchmark counts that time
inside the step (`graph_host_ms`). This times both for the benchmark's cases (its grammar and
config, the batch it builds), as the graph runners call them, and prints the best of a few
repeats in ms.

    python scripts/time_step_build.py d1_8k=1*1@8192 d256_8k=256*1@8192
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dsv4.bench import forward as bench  # noqa: E402
from dsv4.bench.roofline import parse_cases, plan_case  # noqa: E402
from dsv4.model.step import StepBuffer, build_step  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+")
    p.add_argument("--config", default="v41")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--calls", type=int, default=200, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = bench.bench_config(args.config, num_layers=args.num_layers, num_experts=8)
    for case in parse_cases(args.cases):
        cache, batch = bench.build_case(cfg, plan_case(cfg, case), block_size=256, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
        blocks = batch.block_tables.shape[1]
        rows = max(batch.num_tokens)

        def build():
            return build_step(batch, cfg, cache.block_size, "cpu", pad_rows=rows, max_blocks=blocks)

        buffer = StepBuffer(build())
        timings = {}
        for label, fn in (("build_step", build), ("build_step + load", lambda: buffer.load(build()))):
            for _ in range(20):
                fn()
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                best = min(best, (time.perf_counter() - start) / args.calls * 1e3)
            timings[label] = best
        print(f"{case.text}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items()))
        del cache, batch
    return 0


if __name__ == "__main__":
    sys.exit(main())

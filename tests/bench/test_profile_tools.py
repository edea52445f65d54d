"""The device profiling tools' CPU-runnable parts: `profile_step.torch_op_table` (an eager
step's aten ops by source line) and `time_step_build.py` (the host's share of a graph step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import profile_step  # noqa: E402

from dsv4.bench import forward as bench  # noqa: E402
from dsv4.bench.roofline import parse_cases, plan_case  # noqa: E402
from dsv4.model.model import Model  # noqa: E402
from dsv4.model.random_weights import random_weights  # noqa: E402


def test_torch_op_table_attributes_ops_to_model_lines():
    cfg = bench.bench_config("tiny-v41")
    model = Model(cfg, random_weights(cfg, dtype=torch.bfloat16, device="cpu", compact=False, seed=0), dtype=torch.bfloat16,
                  device="cpu", token_map=torch.zeros(cfg.vocab_size, dtype=torch.long), fast_path=True)
    case = parse_cases(["d=2*1@300"])[0]
    cache, batch = bench.build_case(cfg, plan_case(cfg, case), block_size=256, dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
    table = profile_step.torch_op_table(model, batch, cache)
    assert table and all(row["calls"] > 0 for row in table)
    assert [row["calls"] for row in table] == sorted((row["calls"] for row in table), reverse=True)
    # every op is placed at a dsv4 source line; views and metadata ops are not counted
    assert all(row["where"].endswith(tuple("0123456789")) and ".py:" in row["where"] for row in table)
    assert not {row["op"] for row in table} & profile_step._NO_KERNEL
    # the CPU fast path runs its ops' torch code: the compressor's reference is among them
    assert any(row["where"].startswith("ops/compressor.py:") for row in table)


def test_time_step_build_prints_both_timings():
    out = subprocess.run([sys.executable, str(REPO / "scripts/time_step_build.py"), "a=2*1@300", "--num-layers", "4", "--calls", "3", "--repeats", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a=2*1@300: build_step " in out.stdout and "build_step + load " in out.stdout

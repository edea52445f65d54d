"""The whole fast path on the Triton kernels (in Triton's interpreter on CPU): every kernel call
the model makes is repeated on the torch code with the same arguments and must agree
(scripts/check_fast_path.py). Catches wiring faults (arguments, strides, dtypes, layouts)
that kernel tests on random inputs cannot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(os.environ.get("DSV4_SHARED", REPO / ".." / "shared")) / "golden" / "v41-tiny-a"


def test_every_kernel_agrees_with_its_reference_inside_the_model():
    pytest.importorskip("triton", reason="triton is not installed")
    if not GOLDEN.is_dir():
        pytest.skip(f"golden set {GOLDEN} not found (set DSV4_SHARED)")
    cmd = [sys.executable, str(REPO / "scripts/check_fast_path.py"), str(GOLDEN), "--prompts", "1", "--steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    calls = [line for line in proc.stdout.splitlines() if " calls " in line]
    assert len(calls) >= 15, proc.stdout  # every kernel of the fast path was exercised
    assert any(line.split()[0] == "compress_entries" for line in calls), proc.stdout  # the fused compressor (its own wrapper)

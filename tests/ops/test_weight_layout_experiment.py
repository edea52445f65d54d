"""scripts/weight_layout_experiment.py's two streaming forms, in the interpreter: each reads
every word of the weight exactly once, so the XOR of its programs' results is the weight's."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import weight_layout_experiment as experiment  # noqa: E402


def _xor_all(t: torch.Tensor) -> int:
    return functools.reduce(lambda a, b: a ^ b, t.flatten().tolist(), 0)


@pytest.mark.parametrize("layout", ["rows", "tiled"])
@pytest.mark.parametrize("block_n,step_bytes,split", [(16, 64, 1), (16, 64, 2), (32, 128, 1)])
def test_each_form_reads_every_word_once(layout, block_n, step_bytes, split):
    w = torch.randint(-2**31, 2**31 - 1, (64, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(block_n + split))
    out = experiment.stream(w, layout, block_n, step_bytes, 2, split)
    assert out.numel() == (64 // block_n) * split
    assert _xor_all(out) == _xor_all(w)


def test_stream_rejects_partial_tiles_and_unknown_layouts():
    w = torch.zeros(64, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="whole 48-row tiles"):
        experiment.stream(w, "rows", 48, 64, 2, 1)
    with pytest.raises(ValueError, match="whole 16-row tiles of 3 chunks"):
        experiment.stream(w, "rows", 16, 64, 2, 3)
    with pytest.raises(ValueError, match="layout must be"):
        experiment.stream(w, "columns", 16, 64, 2, 1)

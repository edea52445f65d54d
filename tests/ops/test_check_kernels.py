"""scripts/check_kernels.py's section `defaults` (kernel A/Bs of two trees): every sweep it
runs keeps only its default candidate. Here, under tests/ops/conftest.py, so that the kernel
modules the candidate lists import are the interpreter's."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import check_kernels as ck  # noqa: E402


def test_defaults_section_keeps_each_sweeps_default_only(monkeypatch):
    import torch

    from dsv4.ops.triton import fp8_gemm, moe

    monkeypatch.delenv(ck.DEFAULTS_ONLY_ENV, raising=False)
    monkeypatch.setitem(fp8_gemm._SMS, torch.device("cuda"), 132)  # (the chunking asks for the GPU's SM count)
    for m in ck.SWEEP_ROWS:
        full = ck.w8a16_candidates(m, 5120, 8192, 32)
        assert len(full) > 1 and full[0] == {"tile": fp8_gemm.w8a16_config(m)}
        monkeypatch.setenv(ck.DEFAULTS_ONLY_ENV, "1")
        assert ck.w8a16_candidates(m, 5120, 8192, 32) == full[:1]
        monkeypatch.delenv(ck.DEFAULTS_ONLY_ENV)
    for pairs in (7, 448, 1792):
        full = ck.moe_candidates(pairs, 65)
        assert len(full) > 1 and full[0] == {"cfg": moe.moe_config(pairs, 65, ck.SWEEP_FP8), "knobs": {}}
        monkeypatch.setenv(ck.DEFAULTS_ONLY_ENV, "1")
        assert ck.moe_candidates(pairs, 65) == full[:1]
        monkeypatch.delenv(ck.DEFAULTS_ONLY_ENV)
    assert len(ck.swept(ck.ATTN_SWEEP)) > 1
    monkeypatch.setenv(ck.DEFAULTS_ONLY_ENV, "1")
    assert ck.swept(ck.ATTN_SWEEP) == [{}]  # the attention default: no overrides of attention.CONFIG
    assert ck.swept(ck.MOE_PREFILL_TILES) == ck.MOE_PREFILL_TILES[:1]
    assert "defaults" in ck.SECTIONS and "defaults" in ck.ON_REQUEST

"""The MoE layer on the GPU's weight form (compact FP8 experts stacked for the grouped kernel,
V4.1's shared expert folded in as one more expert of weight 1) against the same layer on
dequantised weights (the per-expert torch path), with the kernels in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

import dsv4.ops
from dsv4.model import quant
from dsv4.model.layers.moe import MoE
from dsv4.ops.triton import moe as moe_kernels
from dsv4.ops.triton.moe import moe_experts_dense as dense_experts
from dsv4.model.make_tiny import tiny_config
from dsv4.config import parse_config

pytest.importorskip("triton", reason="triton is not installed")


def _weights(cfg, g: torch.Generator) -> tuple[dict, dict]:
    """One layer's FFN tensors: (compact, dequantised to bf16) with the same values."""
    d, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    compact, dense = {}, {}
    p = "ffn."
    compact[p + "gate.weight"] = dense[p + "gate.weight"] = (torch.randn(e, d, generator=g) * d**-0.5).bfloat16()
    compact[p + "gate.bias"] = dense[p + "gate.bias"] = torch.randn(e, generator=g) * 0.1
    for i in range(e):
        for name, (rows, cols) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            w = (torch.randn(rows, cols, generator=g) * 8).to(torch.float8_e4m3fn)
            s = torch.randint(120, 124, (rows, cols // 32), generator=g, dtype=torch.uint8)
            compact[f"{p}experts.{i}.{name}.weight"], compact[f"{p}experts.{i}.{name}.scale"] = w, s
            dense[f"{p}experts.{i}.{name}.weight"] = quant.dequant_fp8_rows(w, s).bfloat16()
    b = cfg.weight_block_size
    for name, (rows, cols) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        w = (torch.randn(rows, cols, generator=g) * 8).to(torch.float8_e4m3fn)
        s = torch.randint(120, 124, (-(-rows // b), -(-cols // b)), generator=g, dtype=torch.uint8)
        compact[f"{p}shared_experts.{name}.weight"], compact[f"{p}shared_experts.{name}.scale"] = w, s
        dense[f"{p}shared_experts.{name}.weight"] = quant.dequant_fp8_block(w, s, b).bfloat16()
    return compact, dense


def test_grouped_moe_with_the_shared_expert_folded_in_matches_the_reference(monkeypatch):
    cfg = parse_config(tiny_config("v41"))
    g = torch.Generator().manual_seed(7)
    compact, dense = _weights(cfg, g)
    x = (torch.randn(9, cfg.hidden_size, generator=g) * 2).bfloat16()
    ids = torch.zeros(9, dtype=torch.long)
    reference = MoE(dense, "ffn.", cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, False)
    assert reference.grouped is None
    want = reference(x, ids)
    monkeypatch.setattr(dsv4.ops, "TRITON_ON_CPU", True)
    fast = MoE(compact, "ffn.", cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, False)
    assert fast.grouped is not None and fast.shared_in_grouped
    assert fast.grouped[0].shape[0] == cfg.n_routed_experts + 1
    got = fast(x, ids)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 2**-7 * scale  # a couple of bf16 roundings
    # the dense (prefill) path on the same stacked weights, shared expert included
    monkeypatch.setattr("dsv4.model.layers.moe.DENSE_EXPERT_PAIRS", 0)
    calls = []
    monkeypatch.setattr("dsv4.ops.triton.moe_experts_dense", lambda *a, **kw: calls.append("dense") or dense_experts(*a, **kw))
    dense_path = fast(x, ids)
    assert calls == ["dense"]
    assert (dense_path.float() - want.float()).abs().max() <= 2**-7 * scale
    # experts over the bf16 budget take the grouped kernels at any load
    monkeypatch.setitem(moe_kernels.MOE, "DENSE_TEMP_BYTES", 1)
    small = MoE(compact, "ffn.", cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, False)
    assert not small.dense_fits
    assert torch.equal(small(x, ids), got) and calls == ["dense"]


def test_compact_fp4_experts_give_the_fp8_stacks_bits(monkeypatch):
    """The loader's default GPU form: FP4 experts in the kernels' layout, the FP8 shared expert
    as a separate stack of one. Same values as the FP8 conversion, so the same bits through
    the grouped and the dense paths; the per-expert torch path (non-bf16 activations) agrees
    with the reference too."""
    cfg = parse_config(tiny_config("v41"))
    g = torch.Generator().manual_seed(11)
    fp8_compact, dense = _weights(cfg, g)
    fp4_compact = dict(fp8_compact)
    for i in range(cfg.n_routed_experts):
        for name in ("w1", "w2", "w3"):
            key = f"ffn.experts.{i}.{name}"
            rows, cols = fp8_compact[key + ".weight"].shape
            packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
            fp4_compact[key + ".weight"] = quant.fp4_kernel_layout(packed)
            fp8_compact[key + ".weight"] = quant.fp4_expert_to_fp8(packed, fp8_compact[key + ".scale"])[0]
            dense[key + ".weight"] = quant.dequant_fp4_expert(packed, fp8_compact[key + ".scale"]).bfloat16()
    x = (torch.randn(9, cfg.hidden_size, generator=g) * 2).bfloat16()
    ids = torch.zeros(9, dtype=torch.long)
    want = MoE(dense, "ffn.", cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, False)(x, ids)
    monkeypatch.setattr(dsv4.ops, "TRITON_ON_CPU", True)
    make = lambda w: MoE(w, "ffn.", cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, False)
    fp8, fp4 = make(fp8_compact), make(fp4_compact)
    assert fp4.grouped[0].dtype == torch.uint8 and fp4.grouped[0].shape[0] == cfg.n_routed_experts
    assert fp4.shared_grouped[0].dtype == torch.float8_e4m3fn and fp4.shared_id == cfg.n_routed_experts
    got = fp4(x, ids)
    assert torch.equal(got, fp8(x, ids))
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    monkeypatch.setattr("dsv4.model.layers.moe.DENSE_EXPERT_PAIRS", 0)
    assert torch.equal(fp4(x, ids), fp8(x, ids))
    per_expert = fp4(x.float(), ids)  # fp32 activations: the torch loop over the dequantised experts
    assert (per_expert.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()

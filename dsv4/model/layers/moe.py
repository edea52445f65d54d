"""The MoE feed-forward of a layer: router (fp32 with gate_temp on V4.1, activation dtype on
V4; hash-routed on V4's first layers), routed experts and the shared expert."""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.ops import moe as moe_ops
from dsv4.ops.linear import Linear, linear


class MoE:
    def __init__(self, w: dict, prefix: str, cfg: ModelConfig, n_experts: int, top_k: int, hash_moe: bool):
        self.cfg, self.top_k, self.v41 = cfg, top_k, cfg.arch == "v41"
        b = cfg.weight_block_size
        self.gate = w[prefix + "gate.weight"]
        self.bias = w.get(prefix + "gate.bias")
        self.tid2eid = w[prefix + "gate.tid2eid"].long() if hash_moe else None

        def lin(name, row_scales=False):
            return Linear(w[name + ".weight"], w.get(name + ".scale"), b, row_scales)

        # routed experts arrive FP4-converted-to-FP8 with a scale per 32 inputs when compact
        self.w1 = [lin(f"{prefix}experts.{e}.w1", True) for e in range(n_experts)]
        self.w2 = [lin(f"{prefix}experts.{e}.w2", True) for e in range(n_experts)]
        self.w3 = [lin(f"{prefix}experts.{e}.w3", True) for e in range(n_experts)]
        self.s1, self.s2, self.s3 = (lin(f"{prefix}shared_experts.{n}") for n in ("w1", "w2", "w3"))

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, trace: dict | None = None, tag: str = "") -> torch.Tensor:
        cfg = self.cfg
        if self.v41:
            scores = moe_ops.sqrtsoftplus(linear(x.float(), self.gate.float()) / cfg.gate_temp)
        else:
            scores = moe_ops.sqrtsoftplus(linear(x, self.gate.to(x.dtype)))
        fixed = self.tid2eid[input_ids] if self.tid2eid is not None else None
        weights, indices = moe_ops.route(scores, self.bias, self.top_k, fixed, cfg.routed_scaling_factor, cfg.norm_topk_prob)
        if trace is not None and fixed is None:
            trace.setdefault(f"{tag}.experts", []).append(indices.sort(dim=-1).values)
        routed = moe_ops.experts_forward(x, weights, indices, self.w1, self.w2, self.w3, cfg.swiglu_limit, self.v41)
        shared = self.s2(moe_ops.swiglu(self.s1(x), self.s3(x), cfg.swiglu_limit).to(x.dtype))
        if self.v41:
            return (routed + shared.float()).to(x.dtype)
        return routed + shared

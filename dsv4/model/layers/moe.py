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
        self.grouped = None
        if self.w1[0].scale is not None and self.w1[0].weight.is_cuda:
            # compact FP8 experts on the GPU: stacked once for the grouped Triton kernels
            self.grouped = (
                torch.stack([torch.cat([a.weight, c.weight]) for a, c in zip(self.w1, self.w3)]),
                torch.stack([torch.cat([a.scale, c.scale]) for a, c in zip(self.w1, self.w3)]),
                torch.stack([d.weight for d in self.w2]),
                torch.stack([d.scale for d in self.w2]),
            )
            self.w1 = self.w2 = self.w3 = None  # the stacked copies replace them

    def _unstacked(self, which: int) -> list:
        """Per-expert views of the stacked GPU weights (fp32 runs on the GPU take the torch path)."""
        w13, s13, w2, s2 = self.grouped
        if which == 2:
            return [Linear(w2[e], s2[e], 0, True) for e in range(w2.shape[0])]
        inter = w13.shape[1] // 2
        part = slice(0, inter) if which == 0 else slice(inter, 2 * inter)
        return [Linear(w13[e, part], s13[e, part], 0, True) for e in range(w13.shape[0])]

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
        if self.grouped is not None and x.dtype == torch.bfloat16:
            from dsv4.ops.triton import moe_experts

            routed = moe_experts(x, indices, weights.float(), *self.grouped, cfg.swiglu_limit, self.v41)
            if not self.v41:
                routed = routed.to(x.dtype)
        else:
            routed = moe_ops.experts_forward(x, weights, indices, self.w1 or self._unstacked(0), self.w2 or self._unstacked(2), self.w3 or self._unstacked(1), cfg.swiglu_limit, self.v41)
        shared = self.s2(moe_ops.swiglu(self.s1(x), self.s3(x), cfg.swiglu_limit).to(x.dtype))
        if self.v41:
            return (routed + shared.float()).to(x.dtype)
        return routed + shared

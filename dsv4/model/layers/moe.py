"""The MoE feed-forward of a layer: router (fp32 with gate_temp on V4.1, activation dtype on
V4; hash-routed on V4's first layers), routed experts and the shared expert.

On the GPU (compact weights) the routed experts are stacked for the grouped Triton kernels —
converted to FP8, or FP4 as the checkpoint holds them (`ModelConfig.fp4_experts`) — and the shared expert
joins them as one more expert that every token takes with weight 1 (FP8: the last expert of
an FP8 stack, or a stack of one beside an FP4 stack, run by the same kernels over the same
buffers): the kernels then compute it as the reference does (bf16 gate/up, clamped SwiGLU in
fp32, bf16 activation, bf16 output added last: V4.1 to the fp32 sum of the routed ones, V4 to
that sum rounded to bf16, in bf16), instead of two more projections and the SwiGLU's
elementwise ops."""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.ops import moe as moe_ops
from dsv4.ops import on_triton
from dsv4.ops.linear import Linear, linear, stack_rows

# From this many (token, expert) pairs per expert on average, the experts are compute bound:
# the layer's FP8 experts are dequantised to bf16 (exact) for grouped bf16 GEMMs
# (`moe_experts_dense`), faster there than the weight-only kernels (`moe_experts`), which read
# one byte per weight but re-read and re-dequantise it for every tile of pairs.
DENSE_EXPERT_PAIRS = 256


def _row_scales(lin: Linear) -> torch.Tensor:
    """A dense projection's E8M0 tile scales (one per block x block) as one per 32 inputs of
    each row, the routed experts' layout (the same values, repeated)."""
    b = lin.block
    rows, cols = lin.weight.shape
    return lin.scale.repeat_interleave(b, 0)[:rows].repeat_interleave(b // 32, 1)[:, : cols // 32]


class MoE:
    def __init__(self, w: dict, prefix: str, cfg: ModelConfig, n_experts: int, top_k: int, hash_moe: bool):
        self.cfg, self.top_k, self.v41 = cfg, top_k, cfg.arch == "v41"
        b = cfg.weight_block_size
        self.gate = w[prefix + "gate.weight"]
        if self.v41:  # the router runs in fp32: convert once, not per call
            self.gate = self.gate.float()
        self.bias = w.get(prefix + "gate.bias")
        if hash_moe and self.v41:
            raise ValueError(f"{prefix}: V4.1 has no hash-routed MoE layers (num_hash_layers must be 0)")
        self.tid2eid = w[prefix + "gate.tid2eid"].long() if hash_moe else None

        def lin(name, row_scales=False):
            return Linear(w[name + ".weight"], w.get(name + ".scale"), b, row_scales, quant_input=cfg.fp8_activations)

        # compact routed experts: FP8 converted from FP4 (FP4 in the kernels' layout with fp4_experts), a scale per 32 inputs
        w1 = [lin(f"{prefix}experts.{e}.w1", True) for e in range(n_experts)]
        w2 = [lin(f"{prefix}experts.{e}.w2", True) for e in range(n_experts)]
        w3 = [lin(f"{prefix}experts.{e}.w3", True) for e in range(n_experts)]
        self.s1, self.s2, self.s3 = (lin(f"{prefix}shared_experts.{n}") for n in ("w1", "w2", "w3"))
        self.experts = (w1, w2, w3)
        self.grouped = None
        self.shared_grouped = None  # compact FP4 stacks: the FP8 shared expert as a stack of one
        self.shared_in_grouped = False
        self.shared_id = None  # the expert id the kernels give the shared expert (every token's last slot)
        if w1[0].scale is not None and on_triton(w1[0].weight):
            # compact experts on the GPU (FP8, or FP4 with fp4_experts): stacked once for
            # the grouped Triton kernels (the stacked copies replace the per-expert tensors)
            fp4 = w1[0].weight.dtype == torch.uint8
            if self.s1.scale is not None and self.s1.weight.shape == (w1[0].weight.shape[0], cfg.hidden_size) and b % 32 == 0:
                shared = [Linear(lin.weight, _row_scales(lin), 0, True) for lin in (self.s1, self.s3, self.s2)]
                self.shared_in_grouped, self.shared_id = True, n_experts
                self.s1 = self.s2 = self.s3 = None
                if fp4:  # FP8 weights cannot join an FP4 stack: the kernels take them as `shared`
                    self.shared_grouped = (torch.cat([shared[0].weight, shared[1].weight])[None], torch.cat([shared[0].scale, shared[1].scale])[None],
                                           shared[2].weight[None], shared[2].scale[None])
                else:
                    w1, w3, w2 = w1 + shared[:1], w3 + shared[1:2], w2 + shared[2:]
            self.grouped = (
                torch.stack([torch.cat([a.weight, c.weight]) for a, c in zip(w1, w3)]),
                torch.stack([torch.cat([a.scale, c.scale]) for a, c in zip(w1, w3)]),
                torch.stack([d.weight for d in w2]),
                torch.stack([d.scale for d in w2]),
            )
            self.experts = None
            from dsv4.ops.triton.moe import dense_fits

            self.dense_fits = dense_fits(self.grouped[0])
        if self.s1 is not None:  # a shared expert apart from the routed ones: w1 and w3 (one input) as one GEMM, they are views of it
            self.s13, (self.s1, self.s3) = stack_rows([self.s1, self.s3])

    def _unstacked(self) -> tuple[list, list, list]:
        """Per-expert views (w1, w2, w3) of the stacked GPU weights, the shared expert last when
        the kernels take it (the per-expert torch path, for activations other than bf16)."""
        if self.experts is not None:
            return self.experts
        rows = lambda w, s: [Linear(w[e], s[e], 0, True, quant_input=self.cfg.fp8_activations) for e in range(w.shape[0])]
        w1, w2, w3 = [], [], []
        for w13, s13, wd, sd in [self.grouped] + ([self.shared_grouped] if self.shared_grouped is not None else []):
            inter = w13.shape[1] // 2
            w1 += rows(w13[:, :inter], s13[:, :inter])
            w2 += rows(wd, sd)
            w3 += rows(w13[:, inter:], s13[:, inter:])
        return w1, w2, w3

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, trace: dict | None = None, tag: str = "") -> torch.Tensor:
        cfg = self.cfg
        # the shared expert joins as every token's last slot when it is in the stack
        if self.v41:  # learned routing only
            weights, indices = moe_ops.route_scores(x, self.gate, self.bias, self.top_k, cfg.gate_temp,
                                                    cfg.routed_scaling_factor, cfg.norm_topk_prob, self.shared_id)
        else:
            fixed = self.tid2eid[input_ids] if self.tid2eid is not None else None
            weights, indices = moe_ops.route_logits(linear(x, self.gate.to(x.dtype)), self.bias, self.top_k, cfg.routed_scaling_factor,
                                                    cfg.norm_topk_prob, fixed, self.shared_id)
        if trace is not None and self.tid2eid is None:
            trace.setdefault(f"{tag}.experts", []).append(indices[:, : self.top_k].sort(dim=-1).values)
        experts = self.grouped[0].shape[0] + (self.shared_grouped is not None) if self.grouped is not None else len(self.experts[0])
        if self.grouped is not None and x.dtype == torch.bfloat16:
            from dsv4.ops.triton import moe_experts, moe_experts_dense

            dense = indices.numel() >= DENSE_EXPERT_PAIRS * experts and self.dense_fits
            grouped = moe_experts_dense if dense else moe_experts
            # with the shared expert in the stack the sum is the layer's output: rounded to the
            # activation dtype in the kernel (V4: the routed sum rounded, then the shared expert added)
            out_dtype = x.dtype if self.shared_in_grouped else torch.float32
            routed = grouped(x, indices, weights, *self.grouped, cfg.swiglu_limit, self.v41, out_dtype, fp8_act=cfg.fp8_activations,
                             shared=self.shared_grouped, shared_after_rounding=self.shared_in_grouped and not self.v41)
        else:
            routed = moe_ops.experts_forward(x, weights, indices, *self._unstacked(), cfg.swiglu_limit, self.v41)
        if self.shared_in_grouped:
            return routed.to(x.dtype)  # already in it on the kernels
        gate, up = self.s13(x).split([self.s1.out_features, self.s3.out_features], dim=-1)
        shared = self.s2(moe_ops.swiglu(gate, up, cfg.swiglu_limit).to(x.dtype))
        if self.v41:
            return (routed + shared.float()).to(x.dtype)
        return routed.to(x.dtype) + shared

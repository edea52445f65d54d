"""Triton kernels of the H200 fast path. Each has the signature of a torch reference and is
checked against it: on CPU at small shapes with TRITON_INTERPRET=1
(tests/ops/test_triton_kernels.py), on the GPU at the real shapes (scripts/check_kernels.py).

* `fp8_linear` (`fp8_gemm`): FP8 block-scaled projection, weight-only (decode) or FP8 x FP8
  with activation quantisation (prefill); reference `ops.linear.Linear`.
* `moe_experts` (`moe`): routed experts as two grouped FP4- or FP8-weight GEMMs with the clamped SwiGLU
  fused (decode), and `moe_experts_dense`: grouped bf16 GEMMs over the experts dequantised in
  one pass (prefill); reference `ops.moe.experts_forward`.
* `sparse_attention` (`attention`): sparse MQA over the FP8 window ring and the FP4 paged
  compressed KV with sinks; reference `dsv4.ops.attention.sparse_attention_reference`
  (`Attention._attend`'s math).

Importing this package needs `triton`; set TRITON_INTERPRET=1 before the import to run the
kernels on CPU tensors.
"""

from dsv4.ops.triton.attention import sparse_attention
from dsv4.ops.triton.fp8_gemm import (
    fp8_act_quant,
    fp8_linear,
    fp8_linear_w8a8,
    fp8_linear_w8a16,
)
from dsv4.ops.triton.moe import moe_experts, moe_experts_dense

__all__ = [
    "fp8_act_quant",
    "fp8_linear",
    "fp8_linear_w8a8",
    "fp8_linear_w8a16",
    "moe_experts",
    "moe_experts_dense",
    "sparse_attention",
]

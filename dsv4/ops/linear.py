"""Dense projections. On CPU the loader dequantises FP8 weights to the compute dtype, so this
is a plain matmul; compact FP8 weights (GPU) carry their E8M0 tile scales."""

import torch
import torch.nn.functional as F

from dsv4.model import quant
from dsv4.ops import on_triton

# BLAS picks different kernels (with different rounding) for matrices of only a few rows;
# from this many rows on, every row's result is the same whatever the row count.
MIN_GEMM_ROWS = 16
# From this many rows a projection is compute bound: its FP8 weight is dequantised to bf16
# (exact, and a few % of the product's time) for cuBLAS's tensor-core GEMM, which runs at
# 2-3x the weight-only kernel's rate there (docs/PERF.md). Below, the weight-only kernel reads
# one byte per weight.
DENSE_GEMM_ROWS = 1024


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w^T` whose rows do not depend on how many rows the call has.

    Calls with fewer than MIN_GEMM_ROWS rows are padded with zero rows, so a request's results
    are bitwise the same alone or batched, chunked or not (exact-mode prefix hits and
    batch-invariant greedy decoding rely on it)."""
    if x.dim() == 2 and x.shape[0] < MIN_GEMM_ROWS:
        return F.linear(torch.cat([x, _zero_rows(x)[: MIN_GEMM_ROWS - x.shape[0]]]), w)[: x.shape[0]]
    return F.linear(x, w)


_ZERO_ROWS: dict[tuple, torch.Tensor] = {}


def _zero_rows(x: torch.Tensor) -> torch.Tensor:
    """MIN_GEMM_ROWS zero rows like x's, made once per (device, dtype, width): the padding is
    then one launch (the cat), not two, at every decode-sized call. Never kept from inside a
    CUDA-graph capture, whose kernels do not run then (the rows would stay unwritten outside
    the graph)."""
    key = (x.device, x.dtype, x.shape[1])
    zeros = _ZERO_ROWS.get(key)
    if zeros is None:
        zeros = x.new_zeros(MIN_GEMM_ROWS, x.shape[1])
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ZERO_ROWS[key] = zeros
    return zeros


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w^T` in fp32 for an fp32 weight (V4.1's compressor pooling projections). bf16 x [R,
    K] on the Triton path: bf16 tensor cores at fp32 accuracy, K in chunks fixed by the
    shapes (`triton.mhc.fp32_gemm`), where cuBLAS's fp32 kernel, and with it the rounding,
    followed the row count."""
    if on_triton(x) and x.dtype == torch.bfloat16 and x.dim() == 2:
        from dsv4.ops.triton.mhc import fp32_gemm

        return fp32_gemm(x if x.stride(-1) == 1 else x.contiguous(), w.contiguous())
    return linear(x.float(), w)


def quantise_input(x: torch.Tensor) -> torch.Tensor:
    """A GEMM input under FP8 activations (`ModelConfig.fp8_activations`): its FP8 round trip
    per `quant.ACT_BLOCK` columns (`quant.fake_quant_act`; one Triton launch for bf16 on the
    GPU). A bf16 GEMM of the round trip is the FP8 x FP8 product up to the order of the sums."""
    if on_triton(x) and x.dtype == torch.bfloat16:
        from dsv4.ops.triton import fp8_gemm

        return fp8_gemm.fp8_act_fake_quant(x, quant.ACT_BLOCK)
    return quant.fake_quant_act(x, quant.ACT_BLOCK)


class Linear:
    """One projection `y = x @ W^T`, W either in the compute dtype or FP8 with E8M0 scales:
    one per `block` x `block` tile (dense projections), or with `row_scales=True` one per 32
    inputs of a row (routed experts: FP8 converted exactly from FP4, or compact FP4 itself,
    uint8 [out, in/2] in `quant.fp4_kernel_layout`). `quant_input`: the weight is
    FP8/FP4 in the checkpoint and the model runs FP8 activations, so x is quantised first
    (`quantise_input`; the loader may have dequantised the weight itself)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, block: int = 0, row_scales: bool = False,
                 quant_input: bool = False):
        self.weight, self.scale, self.block, self.row_scales, self.quant_input = weight, scale, block, row_scales, quant_input

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (dequantised exactly; the loader validated the scales, so no
        check and no host synchronisation here)."""
        if self.scale is None:
            return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)
        if self.weight.dtype == torch.uint8:  # compact FP4 expert rows
            return quant.dequant_fp4_kernel_layout(self.weight, self.scale).to(dtype)
        if self.weight.is_cuda and dtype == torch.bfloat16:  # one kernel, no fp32 temporaries
            from dsv4.ops.triton import fp8_gemm

            return fp8_gemm.dequant_fp8(self.weight, self.scale, self.block, self.row_scales)
        if self.row_scales:
            return quant.dequant_fp8_rows(self.weight, self.scale, 32, validate=False).to(dtype)
        return quant.dequant_fp8_block(self.weight, self.scale, self.block, validate=False).to(dtype)

    def split_rows(self, rows: list[int]) -> list["Linear"]:
        """The projection's consecutive row ranges as projections of their own. Compact FP8
        ranges that are whole scale tiles are views with their tiles' scales; otherwise (tiny
        test shapes) the weight is dequantised once here rather than at every call."""
        if self.row_scales:
            raise ValueError("split_rows: for projections with tile scales (a routed expert's row scales are not split)")
        if self.scale is None or all(r % self.block == 0 for r in rows):
            scales = [None] * len(rows) if self.scale is None else self.scale.split([r // self.block for r in rows])
            return [Linear(w, s, self.block, quant_input=self.quant_input) for w, s in zip(self.weight.split(rows), scales)]
        return [Linear(w, quant_input=self.quant_input) for w in self.dense(torch.float32).split(rows)]

    def weight_only(self, x: torch.Tensor) -> bool:
        """Whether `x @ W^T` runs the FP8 weight-only Triton kernel: compact FP8 tiles, bf16 x on
        the GPU, fewer than DENSE_GEMM_ROWS rows (Hopper decode)."""
        return (self.scale is not None and not self.row_scales and x.is_cuda and x.dtype == torch.bfloat16
                and x.numel() < DENSE_GEMM_ROWS * x.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_input and self.weight_only(x):  # FP8 x FP8 in the kernel, from x's FP8 codes
            from dsv4.ops.triton import fp8_gemm

            codes, exps = fp8_gemm.fp8_act_quant(x.reshape(-1, x.shape[-1]), quant.ACT_BLOCK)
            y = fp8_gemm.fp8_linear_w8a16(codes, self.weight, self.scale, self.block, x_scale=exps)
            return y.view(*x.shape[:-1], -1)
        return self.matmul(quantise_input(x) if self.quant_input else x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W^T` of x as given (already quantised where `quant_input` asks for it)."""
        if self.weight_only(x):  # Hopper, few rows: the weight stays FP8
            from dsv4.ops.triton import fp8_linear_w8a16

            return fp8_linear_w8a16(x, self.weight, self.scale, self.block)
        if self.scale is not None and not self.row_scales and x.is_cuda and x.dtype == torch.bfloat16:
            return F.linear(x, self.dense(x.dtype))  # many rows: compute bound, cuBLAS on the dequantised weight
        return linear(x, self.dense(x.dtype))


def stack_rows(parts: list[Linear]) -> tuple[Linear, list[Linear]]:
    """Projections of the same input as one projection of their stacked rows (one GEMM, one
    launch at decode, where each launch costs a few us beyond its bytes) and the parts again as
    its `split_rows`, so the weights are held once. Compact FP8 parts stack their tile scales
    when every part's rows are whole scale tiles; otherwise (tiny test shapes) they are
    dequantised once here. The stacked GEMM splits K by its own shape
    (`fp8_gemm.w8a16_chunk_k`): its bits may differ from the parts' at the last place, never
    with the batch."""
    first = parts[0]
    if any(p.block != first.block or p.row_scales or p.quant_input != first.quant_input or (p.scale is None) != (first.scale is None)
           or p.weight.dtype != first.weight.dtype for p in parts):
        raise ValueError("stack_rows: the parts must share weight dtype, block, scale kind and input quantisation")
    rows = [p.out_features for p in parts]
    if first.scale is not None and all(r % first.block == 0 for r in rows):
        whole = Linear(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), first.block, quant_input=first.quant_input)
    else:
        whole = Linear(torch.cat([p.dense(p.weight.dtype if p.scale is None else torch.float32) for p in parts]), quant_input=first.quant_input)
    return whole, whole.split_rows(rows)


def _grouped_kernel(whole: Linear, groups: int, rows: int, k: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """How `grouped_linear` runs an input [rows, groups, k] of `dtype` on `device` through one
    launch of the weight-only kernel: "fp8" (FP8 x FP8 from the input's codes: FP8
    activations, whole 32-input blocks, each group's its own), "bf16", or None (compact FP8 on
    the GPU, decode-sized and fitting the kernel's tiles only; otherwise a projection per group)."""
    if whole.scale is None or whole.row_scales or device.type != "cuda" or dtype != torch.bfloat16 or rows >= DENSE_GEMM_ROWS:
        return None
    from dsv4.ops.triton import fp8_gemm

    fp8_inputs = whole.quant_input and k % quant.ACT_BLOCK == 0
    if not fp8_gemm.grouped_fits(whole.out_features // groups, rows, fp8_inputs):
        return None
    return "fp8" if fp8_inputs else "bf16"


def grouped_takes_codes(whole: Linear, groups: int, rows: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `grouped_linear` multiplies the FP8 codes of its input [rows, groups, k]
    (`fp8_act_quant`'s), so that the input's producer may hand them over instead (the
    attention quantises its output in its epilogue)."""
    return _grouped_kernel(whole, groups, rows, k, dtype, device) == "fp8"


def grouped_linear(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], whole: Linear, parts: list[Linear]) -> torch.Tensor:
    """A block-diagonal projection: x [R, G, K] (G groups of K inputs) -> [R, G * N_g], group g
    through `parts[g]` (rows g*N_g .. of `whole`). Compact FP8 on the GPU, decode-sized: one
    launch of the weight-only kernel for all groups; otherwise one projection per group.
    Where `grouped_takes_codes` holds, x may come as its FP8 codes [R, G, K] and exponent bytes
    [R, G * K / ACT_BLOCK] (`fp8_act_quant` of x.view(R, -1))."""
    groups = len(parts)
    kind = "codes" if isinstance(x, tuple) else _grouped_kernel(whole, groups, x.shape[0], x.shape[-1], x.dtype, x.device)
    if kind is None:
        if whole.quant_input:  # per block of a group's inputs (K), as each part would
            x = quantise_input(x)
        return torch.cat([w.matmul(x[:, g]) for g, w in enumerate(parts)], dim=-1)
    from dsv4.ops.triton import fp8_gemm

    if kind == "bf16":
        return fp8_gemm.fp8_linear_w8a16((quantise_input(x) if whole.quant_input else x).reshape(x.shape[0], -1),
                                         whole.weight, whole.scale, whole.block, groups=groups)
    codes, exps = x if kind == "codes" else fp8_gemm.fp8_act_quant(x.reshape(x.shape[0], -1), quant.ACT_BLOCK)
    return fp8_gemm.fp8_linear_w8a16(codes.reshape(codes.shape[0], -1), whole.weight, whole.scale, whole.block, groups=groups, x_scale=exps)

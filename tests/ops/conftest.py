"""Kernel tests run the Triton kernels on CPU tensors in Triton's interpreter when there is no
GPU: TRITON_INTERPRET=1 must be set before any kernel module is imported, so it is set here
(conftest files load before the test modules), with fixes for the interpreter's defects."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter() -> None:
    """Work around five defects of Triton's interpreter (seen in 3.6 and 3.9) so that it
    computes what the GPU computes: (1) scalars are 1-element arrays and `int()` of them fails
    with numpy 2.4 (loop bounds derived from program ids); (2) `tl.dot` of bf16 operands
    multiplies their raw uint16 bit patterns; (3) fp32 -> bf16 casts truncate instead of
    rounding to nearest even; (4) libdevice's functions are not interpreted at all: `exp`
    (the compressor's, CUDA's expf on the GPU) becomes the interpreter's `tl.exp`, numpy's, and
    so do `cos` / `sin` (the RoPE tables') and `log1p` (V4's router); (5) inline PTX is
    refused: `ptx_emulator` runs the kernels' PTX blocks (used where a test asks for the
    compiled path, `ptx_in_interpreter`)."""
    import numpy as np
    import triton.language as tl
    from ptx_emulator import emulate_inline_asm  # (after triton: the ImportError caught below means no triton)
    from triton.language.extra import libdevice
    from triton.runtime import interpreter as interp

    if getattr(interp, "_dsv4_patched", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_fp32(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    create_dot = interp.InterpreterBuilder.create_dot

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    cast_impl = interp.InterpreterBuilder.cast_impl

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            return interp.TensorHandle(rounded, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    libdevice.exp = lambda x: tl.exp(x)
    libdevice.log1p = lambda x: tl.tensor(interp.interpreter_builder.unary_op(x.handle, np.log1p), x.type)  # (V4's router)
    libdevice.cos = lambda x: tl.cos(x)
    libdevice.sin = lambda x: tl.sin(x)
    interp._patch_lang_tensor = patched_tensor
    interp.InterpreterBuilder.create_dot = patched_dot
    interp.InterpreterBuilder.cast_impl = patched_cast
    interp.InterpreterBuilder.create_inline_asm = emulate_inline_asm
    interp._dsv4_patched = True


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _patch_interpreter()
    except ImportError:  # no triton: the kernel tests skip themselves
        pass


@pytest.fixture
def ptx_in_interpreter(monkeypatch):
    """Kernels take their compiled path (`PTX` True: int32 word loads, the PTX dequantisers)
    in the interpreter, their inline PTX run by `ptx_emulator`. (bf16 elementwise arithmetic
    stays the interpreter's, on raw bit patterns: tests use the paths that do theirs in PTX.)"""
    from dsv4.ops.triton import attention, fp8_gemm, indexer, moe

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's emulation of the compiled path (on a GPU the kernels run compiled)")
    for module in (fp8_gemm, moe, attention, indexer):
        monkeypatch.setattr(module, "ptx_convert", lambda device: True)

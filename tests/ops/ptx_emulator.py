"""The kernels' inline PTX, run by Triton's interpreter (which refuses inline assembly).

On the GPU the weight kernels dequantise through a few lines of inline PTX (`fp8_gemm`'s
e4m3 / e2m1 permutes, the bf16 pair split, attention's FP4 decoding, `rowwise.mul_rn`); the
interpreter cannot run them, so CPU tests took the kernels' other form (`PTX` False) and never
ran the code around the PTX: the int32 word loads, the scale words, the word kernels' K steps.
`emulate_inline_asm` executes those PTX blocks instruction by instruction on numpy registers,
bit-exactly, so that tests can run the compiled path's kernel code (`ptx_in_interpreter` in
conftest.py). What it knows: `.reg` declarations, `mov.b32` (an immediate, or a split into two
16-bit halves), `prmt.b32` (default mode), `shl.b32`, `shr.u32`, `and.b32`, `or.b32`,
`mul.rn.bf16x2` and `mul.rn.f32`; anything else raises.

Packing follows the compiled kernels: an instance takes `pack` consecutive elements (row-major)
of each operand, narrower elements filling a 32-bit register from its low bits, and each
output element comes from the same position of the instance's inputs. The PTX above is
elementwise, so which elements share an instance does not change its results.
"""

from __future__ import annotations

import re

import numpy as np
from triton.runtime.interpreter import TensorHandle

_MASK32 = np.uint64(0xFFFFFFFF)


class _Results:
    """What `create_inline_asm` returns to `tl.inline_asm_elementwise`: one handle per output."""

    def __init__(self, handles: list[TensorHandle]):
        self.handles = handles

    def get_result(self, i: int) -> TensorHandle:
        return self.handles[i]


def _bits(data: np.ndarray) -> tuple[np.ndarray, int]:
    """An operand's elements as unsigned integers of their width, and the width in bits."""
    width = data.dtype.itemsize * 8
    return data.view(np.dtype(f"uint{width}")).astype(np.uint64), width


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 values (products of two bf16, so exact) rounded to the nearest bf16, ties to
    even, subnormals included -> their bf16 bits (uint64)."""
    mant, exp = np.frexp(x)  # x = mant * 2**exp, |mant| in [0.5, 1)
    normal = np.ldexp(np.round(np.ldexp(mant, 8)), exp - 8)  # 8 significant bits
    sub = np.round(np.ldexp(x, 133)) * 2.0**-133  # below 2**-126: multiples of 2**-133
    rounded = np.where(np.abs(x) < 2.0**-126, sub, normal).astype(np.float32)  # exact in fp32
    return (rounded.view(np.uint32).astype(np.uint64) >> np.uint64(16)) & np.uint64(0xFFFF)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): byte i of the result is byte n & 7 of {b, a} (a: bytes
    0..3), or with n & 8 that byte's sign bit copied through all 8 bits; n = selector nibble i."""
    source = a | (b << np.uint64(32))
    out = np.zeros_like(a)
    for i in range(4):
        n = (selector >> (4 * i)) & 0xF
        byte = (source >> np.uint64(8 * (n & 7))) & np.uint64(0xFF)
        if n & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * i)
    return out


def _run(asm: str, regs: dict[str, np.ndarray], size: int) -> None:
    """Execute the PTX block on `regs` ($n operands and named registers, uint64 arrays holding
    32- or 16-bit values), in place."""
    def value(operand: str) -> np.ndarray:
        operand = operand.strip()
        if operand in regs:
            return regs[operand]
        return np.full(size, int(operand, 0) & 0xFFFFFFFF, dtype=np.uint64)

    lines = [part.strip() for line in asm.splitlines() for part in line.split(";")]
    for line in lines:
        if line in ("", "{", "}") or line.startswith(".reg"):  # (a block's braces stand on lines of their own)
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # {lo, hi}, src: the two 16-bit halves
            halves, src = rest[1:].split("}")
            lo, hi = (h.strip() for h in halves.split(","))
            word = value(src.strip(" ,"))
            regs[lo], regs[hi] = word & np.uint64(0xFFFF), word >> np.uint64(16)
            continue
        dst, *args = (a.strip() for a in re.split(r",", rest))
        if op == "mov.b32":
            regs[dst] = value(args[0])
        elif op == "prmt.b32":
            regs[dst] = _prmt(value(args[0]), value(args[1]), int(args[2], 0))
        elif op == "shl.b32":
            regs[dst] = (value(args[0]) << np.uint64(int(args[1], 0))) & _MASK32
        elif op == "shr.u32":
            regs[dst] = value(args[0]) >> np.uint64(int(args[1], 0))
        elif op == "and.b32":
            regs[dst] = value(args[0]) & value(args[1])
        elif op == "or.b32":
            regs[dst] = value(args[0]) | value(args[1])
        elif op == "mul.rn.bf16x2":
            a, b = value(args[0]), value(args[1])
            halves = [_bf16_round(_bf16_values((a >> np.uint64(s)) & np.uint64(0xFFFF)) * _bf16_values((b >> np.uint64(s)) & np.uint64(0xFFFF)))
                      for s in (0, 16)]
            regs[dst] = halves[0] | (halves[1] << np.uint64(16))
        elif op == "mul.rn.f32":
            a, b = (value(x).astype(np.uint32).view(np.float32) for x in args)
            regs[dst] = (a * b).view(np.uint32).astype(np.uint64)
        else:
            raise NotImplementedError(f"ptx_emulator: no emulation of {op!r} (in {line!r})")


def emulate_inline_asm(builder, asm, constraints, values, types, is_pure, pack):
    """`InterpreterBuilder.create_inline_asm`: run `asm` on the operands' elements, `pack` at a
    time. `values` are the (broadcast) operand handles, `types` the outputs' block types."""
    asm = getattr(asm, "value", asm)
    letters = [c.strip() for c in constraints.split(",")]
    shape = values[0].data.shape
    count = int(np.prod(shape))
    if count % pack:
        raise ValueError(f"ptx_emulator: {count} elements do not split into packs of {pack}")
    size = count // pack
    regs: dict[str, np.ndarray] = {}
    n_out = sum(1 for c in letters if c.startswith("="))
    reg = n_out  # the inputs' registers follow the outputs'
    for handle in values:
        bits, width = _bits(np.ascontiguousarray(handle.data).reshape(size, pack))
        per_reg = max(1, (16 if letters[reg] == "h" else 32) // width)
        for r in range(max(1, pack // per_reg)):
            word = np.zeros(size, dtype=np.uint64)
            for j in range(per_reg):
                word |= bits[:, r * per_reg + j] << np.uint64(j * width)
            regs[f"${reg}"] = word
            reg += 1
    _run(asm, regs, size)
    outputs, reg = [], 0
    for ty in types:
        dtype = ty.element_ty if hasattr(ty, "element_ty") else ty
        width = dtype.primitive_bitwidth
        per_reg = max(1, (16 if letters[reg] == "=h" else 32) // width)
        elements = np.zeros((size, pack), dtype=np.uint64)
        for r in range(max(1, pack // per_reg)):
            for j in range(per_reg):
                elements[:, r * per_reg + j] = (regs[f"${reg}"] >> np.uint64(j * width)) & np.uint64((1 << width) - 1)
            reg += 1
        store = np.dtype(f"uint{width}")
        data = elements.astype(store).reshape(shape)
        if dtype.is_floating() and width == 32:
            data = data.view(np.float32)
        elif dtype.is_int_signed():
            data = data.view(np.dtype(f"int{width}"))
        outputs.append(TensorHandle(data, dtype))
    return _Results(outputs)

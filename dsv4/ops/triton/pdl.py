"""Programmatic Dependent Launch (PDL) for every kernel of the fast path (Hopper).

A decode step replays ~380 small kernels from a CUDA graph, and the GPU idles ~1-1.5 us
between two of them (0.5 ms of a 3.8 ms step at batch 1): the next grid is only scheduled
once the previous one has drained. With PDL a kernel is launched with programmatic stream
serialisation (Triton's `launch_pdl`): its programs may be scheduled as soon as every program
of the running kernel has executed `griddepcontrol.launch_dependents` (or exited), and they
then block in `griddepcontrol.wait` until that kernel has completed and its memory is
visible. Launch and ramp-up overlap the predecessor's tail; stream capture keeps the
programmatic edges in the graph.

Correctness rule for every kernel launched with PDL: EVERY program calls `pdl_start` (the
wait) before its first global load or store, on every path, early exits included. The wait
orders a kernel after its immediate predecessor only; the chain reaches further back
because each kernel completes only after its own wait returned, i.e. after its predecessor
completed. A program that returned without waiting could let its grid complete before the
predecessor, and the next kernel's wait would then no longer cover the predecessor's writes.
`launch_dependents` right after the wait is safe: a dependent's own wait still waits for this
grid's full completion; signalling early only lets its programs become resident and wait.
So `pdl_start` is the first statement of every `*_kernel` (tests/ops/test_pdl.py checks it
statically, and that every launch passes `launch_args`). Kernels of torch or cuBLAS between
two of ours keep their own launches (a plain one starts once our kernel has completed), and
the next of ours waits for them in its `pdl_start`.

The one exception is `prefetch_l2` before the wait (`fp8_gemm._w8a16_kernel`, whose addresses
come from program ids alone): an L2 prefetch of model weights, which no kernel of a step
writes. It is a hint without any effect on values (L2 is where the SMs' memory accesses
meet, so no later load can see stale data through it); it lets the weight stream start
during the predecessor's tail (not measured yet, hence off by default).

Knobs, read at every launch (a device A/B script flips them as module attributes, e.g.
KNOBS="dsv4.ops.triton.pdl:PDL.enabled=False"; a captured CUDA graph keeps the launches it
recorded):
* PDL["enabled"]: launch with PDL (the environment's DSV4_PDL=0 turns it off as well);
* PDL["prefetch"]: the weight prefetches before the wait (off until a device A/B shows them
  worth it).
PDL is only used where the kernel is compiled for CUDA on sm_90 or newer (`griddepcontrol`
needs sm_90); in the interpreter (TRITON_INTERPRET=1, the CPU tests) it is off: its inline
PTX does not run there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PDL = {"enabled": True, "prefetch": False}

_CAPABILITY: dict[torch.device, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, cached (every launch asks)."""
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device]


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: the knob on, DSV4_PDL not 0, and compiled
    CUDA (not the interpreter) on sm_90 or newer."""
    return (
        PDL["enabled"]
        and os.environ.get("DSV4_PDL", "1") != "0"
        and device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and _capability(device) >= (9, 0)
    )


def launch_args(device: torch.device) -> dict:
    """The keyword arguments every launch of a fast-path kernel on `device` passes: the
    kernel's PDL constexpr and, when it is true, Triton's `launch_pdl` launch option (the two
    always together: a PDL launch of a kernel without the wait would break the chain)."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def prefetch(device: torch.device) -> bool:
    """Whether the weight-streaming kernels prefetch their first weight lines before the wait
    (only useful, and only done, under PDL)."""
    return PDL["prefetch"] and enabled(device)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """The first statement of every fast-path kernel: under PDL wait for the predecessor
    grid (complete, memory visible), then let the next grid be scheduled; nothing otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# 128-byte lines: the unit L2 and HBM move (4 x 32-byte sectors).
PREFETCH_LINE = tl.constexpr(128)


@triton.jit
def prefetch_l2(ptrs):
    """`prefetch.global.L2` of the line holding each address of `ptrs` (any shape). No effect on
    values; the dummy output only satisfies inline asm's need for one, and the asm is not
    pure, so the compiler keeps it although nothing reads the result."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\nprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)

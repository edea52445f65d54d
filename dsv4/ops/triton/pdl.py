"""Programmatic dependent launch (PDL, sm_90+) for the fast path's kernels.

A decode step is a chain of ~280 kernels, most of them a few microseconds long, each waiting
for the one before it. Launched with PDL, a kernel is started while its predecessor in the
stream still runs: its programs become resident, then wait (`griddepcontrol.wait`) until the
predecessor has finished and its writes are visible. The predecessor lets it start as soon as
each of its own programs has begun (`griddepcontrol.launch_dependents`); until then nothing
of it is launched, so a successor never takes an SM slot one of its predecessor's programs
still needs. What this hides is each kernel's launch and ramp (docs/PERF.md, twenty-third
session: batch-1 decode 2.956 -> 2.784 ms on the H100).

The rule every kernel keeps: `begin(PDL)` is its first statement, so nothing is read or
written before the wait (tests/ops/test_pdl.py checks every kernel for it). The wait is
transitive (a predecessor finishes only after its own wait), so a PDL kernel after one without
PDL (torch's, cuBLAS's) is ordered as without PDL. Graph capture records the launches as
programmatic edges. Off (`PDL` False, the CPU, the interpreter, before sm_90): the same
kernels without the two instructions, launched as before.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL = True  # knob: launch the fast path's kernels with programmatic dependent launch
_CAPABLE: dict[torch.device, bool] = {}


def compiled(device: torch.device) -> bool:
    """Whether kernels on `device` run compiled for CUDA (not in Triton's interpreter): what
    PDL and the kernels' inline PTX need."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel on `device`: its PDL constexpr, and the launch
    attribute where the device supports it (sm_90+, compiled)."""
    if not PDL or not compiled(device):
        return {"PDL": False}
    if device not in _CAPABLE:
        _CAPABLE[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _CAPABLE[device] else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """A kernel's first statement: let the next kernel in the stream launch, then wait until
    the previous one has finished and its writes are visible (nothing without PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

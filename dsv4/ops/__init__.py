"""Hot operations, one function each. Every function here is the torch reference; on CUDA the
same signature is served by a Triton kernel where one exists (see docs/architecture.md)."""

import os
from contextlib import contextmanager

import torch

# Run the Triton kernels on CPU tensors too (with TRITON_INTERPRET=1 they run in Triton's
# interpreter): lets a test run the whole model on the kernels without a GPU.
TRITON_ON_CPU = os.environ.get("DSV4_TRITON_ON_CPU") == "1"
# Every op runs its torch code, on CUDA too (`torch_only`: the benchmark's reference path).
TORCH_ONLY = False


def on_triton(x: torch.Tensor) -> bool:
    """Whether the ops serve `x` with their Triton kernel: CUDA tensors (and CPU tensors
    under DSV4_TRITON_ON_CPU=1), unless inside `torch_only()`."""
    return not TORCH_ONLY and (x.is_cuda or TRITON_ON_CPU)


@contextmanager
def torch_only():
    """Run every op on its torch code inside this block (an HF-style baseline)."""
    global TORCH_ONLY
    before, TORCH_ONLY = TORCH_ONLY, True
    try:
        yield
    finally:
        TORCH_ONLY = before

"""Optional Triton: kernels are defined either way; they run compiled on CUDA
and, on the CPU, only through Triton's interpreter (TRITON_INTERPRET=1, tests)."""
from __future__ import annotations

import os

import torch

triton = tl = None  # not installed, or nothing here can run it: Triton plugins register nothing
# Imported only where its kernels can run: on CUDA, or interpreted. On a machine
# without a GPU the import would cost every process 0.3 s of its start.
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:
        pass


def triton_usable(device) -> bool:
    return triton is not None and (
        torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def kernel(fn):
    """``triton.jit`` when Triton is installed; the plain function otherwise."""
    return triton.jit(fn) if triton is not None else fn

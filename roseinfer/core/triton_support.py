"""Optional Triton: kernels are defined either way; they run compiled on CUDA
and, on the CPU, only through Triton's interpreter (TRITON_INTERPRET=1, tests)."""
from __future__ import annotations

import functools
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


PDL_MAX_ROWS = 16  # rows (tokens) of a launch up to which dependent launches pay


def dependent_launch(device: torch.device, rows: int) -> bool:
    """Whether a kernel over ``rows`` tokens on ``device`` launches as a programmatic
    dependent (Hopper and later): the GPU starts it while the kernel before it drains,
    and it waits in ``wait_for_inputs`` before touching memory. At decode batch sizes a
    kernel takes a few microseconds, and launching and draining each was a large part
    of a layer's time: batch 1 ran 3-8 % faster. From 128 rows up it cost GPT-2's
    decode 3 % (docs/kernels.md, "Dependent launches"), so only launches of at most
    PDL_MAX_ROWS rows use it. ``ROSEINFER_PDL=0`` turns it off."""
    return rows <= PDL_MAX_ROWS and _pdl_device(device)


def rope_in_append() -> bool:
    """Whether RoPE is left to the KV append's launch (``RotaryEmbedding.deferred``): on
    unless ``ROSEINFER_ROPE_IN_APPEND=0``. One launch fewer a layer took the H100's batch-1
    step from 1.218 to 1.200 ms on the Llama-3.2 1B shape and 5.648 to 5.630 on the 8B
    (docs/kernels.md, "Folded ops")."""
    return os.environ.get("ROSEINFER_ROPE_IN_APPEND") != "0"


@functools.lru_cache
def _pdl_device(device: torch.device) -> bool:
    return (triton is not None and device.type == "cuda" and os.environ.get("ROSEINFER_PDL") != "0"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@kernel
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL (a kernel launched with ``launch_pdl=dependent_launch(device, rows)``): wait
    until the kernel before has finished and its writes are visible, then let the next
    one start. Every program calls it before it reads anything an earlier kernel wrote,
    and before it writes anything: so a kernel's end still implies its predecessors'."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

"""Arrival counters: the last program of a group to finish runs the group's epilogue (an
MoE token's sum over its experts) in the same launch, where a second kernel would add a
launch, and its wait for the whole grid, to every layer. Where the epilogue reads much
(a split decode's merge of 32 splits) a merge kernel a head is faster: docs/kernels.md.

A group's programs each add one to the group's int32 counter once their results are
stored; the one that reads ``expected - 1`` back is the last, reads the others' results
and puts the counter back to zero, so the next launch finds every counter zeroed without
a memset. The counters live in one buffer per device, allocated zeroed outside CUDA graph
capture (the engine runs each step once eagerly before capturing it); a launch that finds
no buffer, or too few counters, runs its separate epilogue kernel instead. Split launches
(a skinny linear's K over several programs) leave their partial sums in a second buffer
of the same kind.

Launches that count must not overlap on a device: the engine's steps run them in order on
one stream, and a dependent launch counts only after ``wait_for_inputs``.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import torch

from roseinfer.core.triton_support import kernel as _kernel, tl

CAPACITY = 1 << 16  # counters a device holds: 256 KiB
PARTIALS = 1 << 20  # float32 partial sums a device holds for split launches: 4 MiB
_buffers: dict[torch.device, torch.Tensor] = {}
_partials: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed counters where they hold ``needed``; None where a separate
    epilogue must run (too many groups, or first asked for inside a graph capture, where a
    zeroing could be recorded but not run)."""
    buf = _held(_buffers, device, lambda: torch.zeros(CAPACITY, dtype=torch.int32,
                                                      device=device))
    return buf if buf is not None and needed <= buf.numel() else None


def partials(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's float32 scratch for the partial results a split launch's programs
    leave to the last of their group (a split-K linear's sums), where it holds ``needed``;
    None where it does not or is first asked for inside a graph capture (as ``counters``).
    One launch at a time uses it, as the counters."""
    buf = _held(_partials, device, lambda: torch.empty(PARTIALS, dtype=torch.float32,
                                                       device=device))
    return buf if buf is not None and needed <= buf.numel() else None


def _held(buffers: dict, device: torch.device, make) -> torch.Tensor | None:
    """``buffers``' tensor for ``device``, made now if none is and no capture runs."""
    buf = buffers.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = buffers[device] = make()
    return buf


@_kernel
def last_to_arrive(counter_ptr, expected):
    """Whether this program is the last of the ``expected`` at its group's counter (it
    then zeroes the counter). Called once the program's results are stored: the barrier
    orders every thread's stores before the arrival, which one thread makes with release
    semantics at GPU scope, and its acquire orders the last program's loads after the
    others' stores (CUTLASS's split-K semaphore does the same). The last program reads
    those results with ``cache_modifier=".cg"``, from L2, not its SM's L1."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == expected - 1
    if last:
        tl.store(counter_ptr, 0)
    return last

"""A one-shot all-reduce for decode-sized messages between the GPUs of one host, with
the residual add and RMSNorm that follow a row-parallel layer in the same kernel (the
Lamport design of TensorRT-LLM's and FlashInfer's fused all-reduce).

Every rank holds a buffer its peers map over CUDA IPC: 3 slots, each a region per
source rank. A call stores this rank's rows straight into its region of the current
slot in every rank's buffer, then reads the regions of its own buffer until each
holds data. No flag is set or waited for: the buffers start filled with negative
zero's bits, which no stored value carries (a -0.0 is sent as +0.0, the same in a
sum), so the data is the flag. A call clears the slot the call before it used, which
peers next write two calls later, after this rank's next call has reached them.
The call count lives on the GPU (the last program of a call advances it), so CUDA
graphs replay the kernel as it was captured.

Each rank adds the regions in rank order, rounding each sum to the activations'
dtype as an all-reduce in that dtype does: every rank gets the same bits, and at two
ranks NCCL's. Messages above ``MAX_BYTES`` go to NCCL (docs/kernels.md, "One-shot
all-reduce"). ``ROSEINFER_ONE_SHOT=0`` sends every message to NCCL.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import logging
import os

import torch

from roseinfer.core.triton_support import dependent_launch, kernel, tl, triton, \
    wait_for_inputs

log = logging.getLogger(__name__)
MAX_BYTES = 512 << 10      # a rank's message: 64 rows of 4,096 bf16 values
MARKER = -32768            # int16 bits of bf16 / fp16 -0.0
SLOTS = 3


@kernel
def _one_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, peers_ptr, buf_ptr,
                     count_ptr, s_x, s_res, s_out, s_res_out, n_cols, region, eps,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, MARK: tl.constexpr,
                     PDL: tl.constexpr):
    """One program a row: send it, clear a share of the last call's slot, sum the
    ranks' rows as they arrive; then (NORM) add the residual and RMS-normalise as
    layers/fused.py's add-norm does, or store the sum."""
    wait_for_inputs(PDL)  # every kernel before, the last call's included, has finished
    row = tl.program_id(0)
    rows = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    call = tl.load(count_ptr, volatile=True)
    slot = call % 3
    # the slot the last call used, as far as it wrote: peers write it again two calls on
    last_elems = tl.load(count_ptr + 2, volatile=True)
    last = ((call + 2) % 3) * WORLD * region
    for start in range(row * BLOCK, last_elems, rows * BLOCK):
        for src in tl.static_range(WORLD):
            at = start + cols
            tl.store(buf_ptr + last + src * region + at, MARK, mask=at < last_elems)
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    bits = x.to(tl.int16, bitcast=True)
    bits = tl.where(bits == MARK, 0, bits)
    here = (slot * WORLD + RANK) * region + row * n_cols + cols
    for peer in tl.static_range(WORLD):
        base = tl.load(peers_ptr + peer).to(tl.pointer_type(tl.int16))
        tl.store(base + here, bits, mask=mask)
    h = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        at = buf_ptr + (slot * WORLD + src) * region + row * n_cols + cols
        got = tl.load(at, mask=mask, other=0, volatile=True)
        while tl.max((got == MARK).to(tl.int32), axis=0) > 0:
            got = tl.load(at, mask=mask, other=0, volatile=True)
        h = (h + got.to(x.dtype, bitcast=True).to(tl.float32)).to(x.dtype).to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * s_res + cols, mask=mask, other=0.0).to(tl.float32)
            h = (h + r).to(x.dtype)
            tl.store(res_out_ptr + row * s_res_out + cols, h, mask=mask)
            h = h.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        h = (h * rstd).to(x.dtype).to(tl.float32) * w  # LlamaRMSNorm's rounding
    tl.store(out_ptr + row * s_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)
    # the last program of the call moves the count on (the next call is a later launch)
    if tl.atomic_add(count_ptr + 1, 1) == rows - 1:
        tl.store(count_ptr + 1, 0)
        tl.store(count_ptr + 2, rows * n_cols)
        tl.store(count_ptr, call + 1)


class OneShot:
    """This rank's buffer and its peers' (``peers``: their addresses, this rank's own
    among them), and the call count: ``[calls, programs done, last call's elements]``."""

    def __init__(self, rank: int, world: int, buf: torch.Tensor, peers: list[int]):
        self.rank, self.world, self.buf = rank, world, buf
        self.region = buf.shape[-1]
        self.peers = torch.tensor(peers, dtype=torch.int64, device=buf.device)
        self.count = torch.zeros(3, dtype=torch.int32, device=buf.device)
        self.warps = None  # by the row's width (a bench may set it)

    @staticmethod
    def buffer(world: int, device) -> torch.Tensor:
        return torch.full((SLOTS, world, MAX_BYTES // 2), MARKER, dtype=torch.int16,
                          device=device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float16) and x.numel() <= self.region and \
            x.shape[-1] <= 8192 and x.stride(-1) == 1

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 0.0):
        """The sum over ranks of ``x`` [rows, cols]; with ``weight``, (rms_norm(sum +
        residual), sum + residual) as layers/fused.py's ``add_rms_norm`` gives them."""
        rows = x.reshape(-1, x.shape[-1])
        n, cols = rows.shape
        out = torch.empty_like(rows)
        norm, has_res = weight is not None, residual is not None
        res = residual.reshape(-1, cols) if has_res else rows
        res_out = torch.empty_like(rows) if has_res else out
        block = triton.next_power_of_2(cols)
        pdl = dependent_launch(x.device, n)
        _one_shot_kernel[(n,)](
            rows, res, weight if norm else rows, out, res_out, self.peers, self.buf,
            self.count, rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            cols, self.region, eps, RANK=self.rank, WORLD=self.world, BLOCK=block,
            NORM=norm, HAS_RESIDUAL=has_res, MARK=MARKER, PDL=pdl,
            num_warps=self.warps or min(max(block // 256, 1), 16), launch_pdl=pdl)
        if not norm:
            return out.view(x.shape)
        return out.view(x.shape), (res_out if has_res else rows).view(x.shape)


def connect(rank: int, world: int, device: torch.device) -> OneShot | None:
    """Map every rank's buffer into this one (a collective: every rank calls it). None
    where the path is off, the GPUs cannot reach each other's memory, or Triton is
    missing."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    usable = triton is not None and device.type == "cuda" and \
        os.environ.get("ROSEINFER_ONE_SHOT") != "0" and all(
            torch.cuda.can_device_access_peer(device, d) for d in range(torch.cuda.device_count())
            if d != device.index)
    agreed = torch.tensor([int(usable)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if not agreed.item():
        log.info("one-shot all-reduce off: every all-reduce goes through NCCL")
        return None
    buf = OneShot.buffer(world, device)
    handles = [None] * world
    dist.all_gather_object(handles, reduce_tensor(buf)[1])
    mapped = [buf if r == rank else _open(handles[r], device) for r in range(world)]
    torch.cuda.synchronize(device)
    dist.barrier()
    one = OneShot(rank, world, buf, [t.data_ptr() for t in mapped])
    one.mapped = mapped  # kept: the peers' mappings live as long as these tensors
    return one


def _open(handle: tuple, device: torch.device) -> torch.Tensor:
    """A peer's buffer, from the arguments torch's IPC pickling gave for it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    args = list(handle)
    # opened from this rank's device, so its kernels may reach it (peer access is
    # enabled for the device that opens a handle); the tensor claims that device
    args[6] = device.index
    return rebuild_cuda_tensor(*args)

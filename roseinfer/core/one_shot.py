"""A one-shot all-reduce for decode-sized messages between the GPUs of one host, with
the residual add and RMSNorm that follow a row-parallel layer in the same kernel (the
Lamport design of TensorRT-LLM's and FlashInfer's fused all-reduce).

Every rank holds a buffer its peers map over CUDA IPC: 3 slots, each a region per
source rank, each a place per row. A call stores this rank's rows straight into its
region of the current slot in every rank's buffer, then reads the regions of its own
buffer until each holds data. No flag is set or waited for: the buffers start filled
with negative zero's bits, which no stored value carries (a -0.0 is sent as +0.0, the
same in a sum), so the data is the flag. Each row clears where the row was written by
the last call that had it, which peers next write two such calls later, after this
rank's next one has reached them. Each row's call count lives on the GPU, so CUDA
graphs replay the kernel as it was captured, and no program waits for another.

Each rank adds the regions in rank order, rounding each sum to the activations'
dtype as an all-reduce in that dtype does: every rank gets the same bits, and at two
ranks NCCL's. Messages of more than MAX_ROWS rows, or rows wider than ROW, go to NCCL
(docs/kernels.md, "One-shot all-reduce"). ``ROSEINFER_ONE_SHOT=0`` sends every message to NCCL.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import ctypes
import functools
import logging
import os

import torch

from roseinfer.core.triton_support import dependent_launch, kernel, tl, triton, \
    wait_for_inputs
from roseinfer.layers.fused import add_residual, rms_norm_row

log = logging.getLogger(__name__)
MAX_ROWS = 64              # rows a message may have
ROW = 8192                 # the widest row (a row's place in a region is fixed)
MARKER = -32768            # int16 bits of bf16 / fp16 -0.0
SLOTS = 3


@kernel
def _one_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, peers_ptr, buf_ptr,
                     count_ptr, s_x, s_res, s_out, s_res_out, n_cols, eps,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, MARK: tl.constexpr,
                     ROW: tl.constexpr, REGION: tl.constexpr, PDL: tl.constexpr):
    """One program a row: clear the row where the last call that had it wrote it, send
    it, sum the ranks' rows as they arrive; then (NORM) add the residual and
    RMS-normalise as layers/fused.py's add-norm does, or store the sum."""
    wait_for_inputs(PDL)  # every kernel before, the last call's included, has finished
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # This row's calls and its last width: a row counts only the calls that had it, the
    # same on every rank, so its slots rotate alike everywhere with no sync between rows.
    call = tl.load(count_ptr + 2 * row)
    slot = call % 3
    width = tl.load(count_ptr + 2 * row + 1)
    at_row = row * ROW + cols
    last = ((call + 2) % 3) * WORLD * REGION + at_row  # peers write it again two calls on
    for start in range(0, width, BLOCK):
        for src in tl.static_range(WORLD):
            tl.store(buf_ptr + last + src * REGION + start, MARK, mask=start + cols < width)
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    bits = x.to(tl.int16, bitcast=True)
    bits = tl.where(bits == MARK, 0, bits)
    here = (slot * WORLD + RANK) * REGION + at_row
    for peer in tl.static_range(WORLD):
        base = tl.load(peers_ptr + peer).to(tl.pointer_type(tl.int16))
        tl.store(base + here, bits, mask=mask)
    h = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        at = buf_ptr + (slot * WORLD + src) * REGION + at_row
        got = tl.load(at, mask=mask, other=0, volatile=True)
        while tl.max((got == MARK).to(tl.int32), axis=0) > 0:
            got = tl.load(at, mask=mask, other=0, volatile=True)
        h = (h + got.to(x.dtype, bitcast=True).to(tl.float32)).to(x.dtype).to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            h = add_residual(h, res_ptr + row * s_res, res_out_ptr + row * s_res_out, cols,
                             mask).to(tl.float32)
        h = rms_norm_row(h, w_ptr, out_ptr, cols, mask, n_cols, eps, False)
    tl.store(out_ptr + row * s_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(count_ptr + 2 * row, call + 1)
    tl.store(count_ptr + 2 * row + 1, n_cols)


class OneShot:
    """This rank's buffer and its peers' (``peers``: their addresses, this rank's own
    among them), and each row's call count and last width (``count`` [MAX_ROWS, 2])."""

    def __init__(self, rank: int, world: int, buf: torch.Tensor, peers: list[int]):
        self.rank, self.world, self.buf = rank, world, buf
        self.peers = torch.tensor(peers, dtype=torch.int64, device=buf.device)
        self.count = torch.zeros(MAX_ROWS, 2, dtype=torch.int32, device=buf.device)
        self.warps = None  # by the row's width (a bench may set it)
        self.opened: list[int] = []  # the peers' allocations mapped here (``disconnect``)

    @staticmethod
    def buffer(world: int, device) -> torch.Tensor:
        return torch.full((SLOTS, world, MAX_ROWS * ROW), MARKER, dtype=torch.int16,
                          device=device)

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        return x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] <= ROW and \
            x.numel() <= MAX_ROWS * x.shape[-1] and x.stride(-1) == 1

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
            cols, eps, RANK=self.rank, WORLD=self.world, BLOCK=block,
            NORM=norm, HAS_RESIDUAL=has_res, MARK=MARKER, ROW=ROW, REGION=MAX_ROWS * ROW,
            PDL=pdl,
            num_warps=self.warps or min(max(block // 256, 1), 16), launch_pdl=pdl)
        if not norm:
            return out.view(x.shape)
        return out.view(x.shape), (res_out if has_res else rows).view(x.shape)


def connect(rank: int, world: int, device: torch.device) -> OneShot | None:
    """Map every rank's buffer into this one (a collective: every rank calls it). None
    where the path is off, the GPUs cannot reach each other's memory, or Triton is
    missing."""
    import torch.distributed as dist

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
    dist.all_gather_object(handles, _export(buf))
    opened = [None if r == rank else _open(*handles[r]) for r in range(world)]
    dist.barrier()
    one = OneShot(rank, world, buf, [buf.data_ptr() if b is None else b + off
                                     for b, (_, off) in zip(opened, handles)])
    one.opened = [b for b in opened if b is not None]
    return one


def disconnect(one: OneShot) -> None:
    """Unmap the peers' buffers (this rank's own is freed with ``one``)."""
    lib = _driver()
    for base in one.opened:
        lib.cuIpcCloseMemHandle(ctypes.c_uint64(base))
    one.opened = []


# CUDA IPC through the driver itself: torch's own sharing of CUDA tensors counts
# references across processes, and a rank that outlived its peers crashed at exit.

class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle,
                                          ctypes.c_uint]
    return lib


def _check(rc: int, call: str) -> None:
    if rc:
        raise RuntimeError(f"{call} failed with CUDA driver error {rc}; set "
                           f"ROSEINFER_ONE_SHOT=0 to sum every message through NCCL")


def _export(t: torch.Tensor) -> tuple[bytes, int]:
    """(the IPC handle of the allocation holding ``t``, ``t``'s offset in it)."""
    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                       ctypes.c_uint64(t.data_ptr())), "cuMemGetAddressRange")
    handle = _IpcHandle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return bytes(handle), t.data_ptr() - base.value


def _open(handle: bytes, offset: int) -> int:
    """A peer's allocation mapped here, from this rank's device (peer access is enabled
    for the device that opens it): its base address."""
    base = ctypes.c_uint64()
    _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(base),
                                           _IpcHandle.from_buffer_copy(handle), 1),
           "cuIpcOpenMemHandle")  # 1: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return base.value

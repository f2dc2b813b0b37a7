"""The sum over the ranks fused with the residual add and RMSNorm, for a decode step's
few rows on the GPUs of one host.

A Llama layer sums its row-parallel outputs twice (after o_proj and down_proj), and
each sum is followed by the residual add and RMSNorm. NCCL took 8-11 µs per 8 KB sum on
two H100s (docs/benchmarks.md), most of it protocol. Here one kernel per sum does all
of it: each rank copies its rows into a buffer that its peers have mapped (CUDA IPC,
over NVLink), meets them at a barrier, reads every rank's rows, adds them in rank
order (so every rank holds the same bits), adds the residual and normalises. A second
barrier lets the buffer be written again. The barriers are flags on signal pads that
each crossing resets to zero, so the kernel replays in CUDA graphs; it needs no NVLink
multicast (NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 stay set).

Rows past the buffer (prefill) take NCCL and the plain fused norm. The buffers come from
cudaMalloc through the CUDA runtime that torch loaded, so that an IPC handle names the
allocation's start; torch's own IPC opens a handle on the owner's device index,
which would give this process a context on its peer's GPU.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs

log = logging.getLogger(__name__)
# Sums of at most this many bytes per rank take the fused kernel; 0 turns it off (the
# NCCL baseline of docs/bench/tensor_parallel.sh). 1 MiB holds 128 rows of the 8B shape.
MAX_BYTES = int(os.environ.get("ROSEINFER_TP_PEER_SUM_MAX_BYTES", 1 << 20))
MAX_PROGRAMS = 64  # programs per launch: each owns a pair of flags per rank on the pads
_PAD_BYTES = MAX_PROGRAMS * 64 * 4  # room for 64 ranks' int32 flags per program

_peers: "Peers | None" = None


# ---------------------------------------------------------------- the kernel

@_kernel
def _meet(pads_ptr, program, rank, WORLD: tl.constexpr):
    """Wait until this program's twin on every rank has got here. Everything the block
    wrote before is visible to the twins after (release, then acquire, at system scope)."""
    tl.debug_barrier()  # the block's writes come before the release of one thread
    flags = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32)) + program * WORLD
    for peer in tl.static_range(WORLD):
        theirs = tl.load(pads_ptr + peer).to(tl.pointer_type(tl.int32)) + program * WORLD
        while tl.atomic_cas(theirs + rank, 0, 1, sem="release", scope="sys") != 0:
            pass  # its flag from the last crossing not taken yet
    for peer in tl.static_range(WORLD):
        while tl.atomic_cas(flags + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@_kernel
def _sum_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bufs_ptr, pads_ptr,
    n_rows, n_cols, s_x, s_res, eps, rank,
    WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    program, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    mine = tl.load(bufs_ptr + rank).to(tl.pointer_type(dtype))
    for row in range(program, n_rows, programs):
        part = tl.load(x_ptr + row * s_x + cols, mask=mask)
        tl.store(mine + row * n_cols + cols, part, mask=mask)
    _meet(pads_ptr, program, rank, WORLD)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(program, n_rows, programs):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # rank order: the same bits on every rank
            theirs = tl.load(bufs_ptr + peer).to(tl.pointer_type(dtype))
            # volatile: the peer rewrites these rows every call; no stale cached line
            total += tl.load(theirs + row * n_cols + cols, mask=mask, other=0.0,
                             volatile=True).to(tl.float32)
        h = total.to(dtype)  # what an all-reduce would have left in x
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * s_res + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * n_cols + cols, h, mask=mask)
        h = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        y = (h * rstd).to(dtype).to(tl.float32) * w  # LlamaRMSNorm's rounding (fused.py)
        tl.store(out_ptr + row * n_cols + cols, y.to(dtype), mask=mask)
    _meet(pads_ptr, program, rank, WORLD)  # every peer has read this rank's rows


def sum_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, peers: "Peers | None" = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rms_norm(h), h)`` for ``h`` = the sum of ``x`` [rows, cols] over the ranks, plus
    ``residual``; None where this path does not serve (no buffers, too many rows): the
    caller sums through NCCL instead. Every rank must call it with the same shapes.
    ``peers``: this process's (tests pass their own)."""
    peers = peers or _peers
    if peers is None or x.dim() != 2 or x.stride(1) != 1 or \
            x.numel() * x.element_size() > peers.nbytes:
        return None
    n_rows, n_cols = x.shape
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    block = triton.next_power_of_2(n_cols)
    pdl = dependent_launch(x.device, n_rows)
    res = residual if residual is not None else x
    _sum_add_rms_norm_kernel[(min(n_rows, MAX_PROGRAMS),)](
        x, res, weight, out, res_out, peers.bufs, peers.pads,
        n_rows, n_cols, x.stride(0), res.stride(0), eps, peers.rank,
        WORLD=peers.world, HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl,
        num_warps=min(max(block // 256, 1), 16), launch_pdl=pdl)
    return out, res_out


# ---------------------------------------------------------------- the buffers

class Peers:
    """This rank's buffer and signal pads, and its peers' mapped into this process."""

    def __init__(self, rank: int, world: int, device: torch.device, nbytes: int):
        import torch.distributed as dist

        self.rank, self.world, self.nbytes = rank, world, nbytes
        self.cuda = _runtime()
        self.own = self.cuda.malloc(_PAD_BYTES + nbytes)  # pads first: zeroed, 16-aligned
        handles = [None] * world
        dist.all_gather_object(handles, self.cuda.ipc_handle(self.own))
        self.opened = [self.cuda.ipc_open(h) for i, h in enumerate(handles) if i != rank]
        bases = self.opened[:rank] + [self.own] + self.opened[rank:]
        self.pads = torch.tensor(bases, dtype=torch.int64, device=device)
        self.bufs = self.pads + _PAD_BYTES

    def close(self) -> None:
        for ptr in self.opened:
            self.cuda.ipc_close(ptr)
        self.cuda.free(self.own)
        self.opened, self.own = [], None


def open_peers(rank: int, world: int, device: torch.device) -> None:
    """Map the ranks' buffers (a collective: every rank calls it), then check the kernel's
    sums against NCCL's; every rank agrees to use the path, or none does."""
    global _peers
    if MAX_BYTES <= 0 or world > 64:
        return
    peers = None
    try:
        peers = Peers(rank, world, device, MAX_BYTES)
    except Exception as e:  # no CUDA runtime to load, no P2P between these GPUs
        log.warning("event=tp_peer_sum_off error=%r", e)
    if not _agreed(peers is not None, device):
        _peers = None
    else:
        _peers = peers
        if not _agreed(_sums_like_nccl(device), device):
            log.warning("event=tp_peer_sum_off error='its sum differed from NCCL's'")
            _peers = None
    if peers is not None and _peers is None:
        peers.close()


def close_peers(free: bool = True) -> None:
    """Stop using the buffers; ``free``: unmap and free them (this rank's device work is
    done; not when a peer is gone and a kernel may still wait for it)."""
    global _peers
    peers, _peers = _peers, None
    if peers is not None and free:
        peers.close()


def _agreed(ok: bool, device: torch.device) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _sums_like_nccl(device: torch.device) -> bool:
    """Whether the kernel's sum of rank-valued rows equals NCCL's on this rank."""
    import torch.distributed as dist

    rank = torch.distributed.get_rank()
    rows = (torch.arange(3 * 4096, device=device) % 7 * (rank + 1)).to(torch.bfloat16)
    rows = rows.view(3, 4096)
    want = rows.clone()
    dist.all_reduce(want)
    got = sum_add_rms_norm(rows, None, torch.ones(4096, dtype=rows.dtype, device=device), 1e-5)
    return got is not None and torch.equal(got[1], want)


# ---------------------------------------------------------------- the CUDA runtime

class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]


class _Runtime:
    """The few CUDA runtime calls torch does not wrap: device memory whose IPC handle
    names its own start, and opening a peer's handle on this process's device."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self.lib = lib
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle,
                                             ctypes.c_uint]

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            self.lib.cudaGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{call}: {self.lib.cudaGetErrorString(status).decode()}")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cudaMalloc")
        self._check(self.lib.cudaMemset(ptr, 0, ctypes.c_size_t(nbytes)), "cudaMemset")
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def ipc_handle(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)),
                    "cudaIpcGetMemHandle")
        return bytes(handle)

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        lazy_peer_access = 1  # cudaIpcMemLazyEnablePeerAccess
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcHandle.from_buffer_copy(
            handle), lazy_peer_access), "cudaIpcOpenMemHandle")
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def _runtime() -> _Runtime:
    """The libcudart that torch loaded (its current device is the one torch set)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    if not paths:
        raise RuntimeError("torch has no shared CUDA runtime loaded")
    return _Runtime(sorted(paths)[0])

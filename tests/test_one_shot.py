"""The one-shot all-reduce (core/one_shot.py).

Off CUDA its kernel runs interpreted, the ranks played in turn by one process: each
rank's buffer gets the rows of the ranks that have not run yet as their stores would
leave them, so a rank's wait ends as it would on GPUs. On a host with several GPUs it
runs as it serves, one process a GPU, against NCCL's sums, in CUDA graphs too.
"""
import os
import socket

import pytest
import torch

from roseinfer.core.one_shot import MARKER, OneShot
from roseinfer.core.triton_support import triton_usable
from roseinfer.layers.fused import add_rms_norm

interpreted = pytest.mark.skipif(not triton_usable("cpu"),
                                 reason="the ranks in one process need TRITON_INTERPRET=1")
EPS = 1e-5


def ranks_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order, rounded to the dtype after each add."""
    total = parts[0]
    for p in parts[1:]:
        total = (total.float() + p.float()).to(p.dtype)
    return total


@interpreted
@pytest.mark.parametrize("world", [2, 3])
def test_sums_and_norms_over_calls_of_every_size(world):
    gen = torch.Generator().manual_seed(world)
    region = 96
    bufs = [OneShot.buffer(world, "cpu")[:, :, :region].contiguous() for _ in range(world)]
    ranks = [OneShot(r, world, bufs[r], [b.data_ptr() for b in bufs]) for r in range(world)]
    weight = torch.rand(16, generator=gen).half()
    # more rows, then fewer: a call must clear all that the one before it wrote
    for call, (rows, norm) in enumerate([(5, True), (1, False), (6, True), (2, True),
                                         (4, False)]):
        slot = call % 3
        parts = [torch.randn(rows, 16, generator=gen).half() for _ in range(world)]
        parts[0][0, 0] = -0.0  # sent as +0.0: the marker never travels
        residual = torch.randn(rows, 16, generator=gen).half()
        got = []
        for r in range(world):
            for later in range(r + 1, world):
                bits = parts[later].view(torch.int16).reshape(-1).clone()
                bits[bits == MARKER] = 0
                bufs[r][slot, later, :bits.numel()] = bits
            got.append(ranks[r](parts[r], residual, weight, EPS) if norm else ranks[r](parts[r]))
        total = ranks_sum(parts)
        for r in range(world):
            if norm:
                want = add_rms_norm(total, residual, weight, EPS, use_triton=False)
                assert torch.equal(got[r][0], want[0]) and torch.equal(got[r][1], want[1])
            else:
                assert torch.equal(got[r], total)
            # what this call stored, on every rank; the last call's slot cleared
            for src in range(world):
                bits = parts[src].view(torch.int16).reshape(-1)
                assert torch.equal(bufs[r][slot, src, :rows * 16],
                                   torch.where(bits == MARKER, 0, bits))
            assert bufs[r][(call + 2) % 3].eq(MARKER).all()


def test_fits_only_half_types_within_the_region():
    one = OneShot(0, 2, OneShot.buffer(2, "cpu")[:, :, :64].contiguous(), [0, 0])
    assert one.fits(torch.zeros(4, 16, dtype=torch.bfloat16))
    assert not one.fits(torch.zeros(5, 16, dtype=torch.bfloat16))  # past the region
    assert not one.fits(torch.zeros(2, 16))                          # float32: NCCL
    assert not one.fits(torch.zeros(16, 4, dtype=torch.float16).t())


# ---------------------------------------------------------------- several GPUs


def _rank(rank: int, world: int, port: int, errors):
    import torch.distributed as dist

    from roseinfer.core import tp
    try:
        device = torch.device("cuda", rank)
        tp.init(rank, world, port, device)
        assert tp._one_shot is not None, "the one-shot path did not connect"
        gen = torch.Generator(device).manual_seed(rank)
        weight = torch.rand(4096, device=device, generator=gen).bfloat16()
        for rows in (1, 7, 64):
            part = torch.randn(rows, 4096, device=device, generator=gen).bfloat16()
            residual = torch.full_like(part, 0.5)
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part)
            want = ranks_sum(parts)
            nccl = part.clone()
            dist.all_reduce(nccl)
            got = tp.all_reduce(part.clone())
            assert torch.equal(got, want), rows
            if world == 2:
                assert torch.equal(got, nccl), rows
            normed = tp.all_reduce_rms_norm(part, residual, weight, EPS)
            assert all(torch.equal(a, b) for a, b in
                       zip(normed, add_rms_norm(want, residual, weight, EPS))), rows
            # replayed in a CUDA graph, as a decode step is
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                tp.all_reduce(part)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                out = tp.all_reduce(part)
            for _ in range(5):
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, want), rows
        tp.destroy()
    except BaseException as e:  # reported by the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        os._exit(1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs or more")
def test_against_nccl_on_gpus():
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

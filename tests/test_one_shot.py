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

from roseinfer.core.one_shot import MARKER, MAX_ROWS, ROW, OneShot
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
    """Each call's results against the sum in rank order, and every rank's whole buffer
    against what the design says it holds after the call: each row of each source in
    the row's current slot, its last slot cleared."""
    gen = torch.Generator().manual_seed(world)
    bufs = [OneShot.buffer(world, "cpu") for _ in range(world)]
    ranks = [OneShot(r, world, bufs[r], [b.data_ptr() for b in bufs]) for r in range(world)]
    expected = OneShot.buffer(world, "cpu").view(3, world, MAX_ROWS, ROW)
    calls, widths = [0] * MAX_ROWS, [0] * MAX_ROWS  # per row, as the kernel counts
    # more rows, then fewer; a wider row, then narrower: each row clears what it wrote
    for rows, cols, norm in [(5, 16, True), (1, 32, False), (6, 16, True), (2, 16, True),
                             (4, 32, False), (6, 16, True)]:
        weight = torch.rand(cols, generator=gen).half()
        parts = [torch.randn(rows, cols, generator=gen).half() for _ in range(world)]
        parts[0][0, 0] = -0.0  # sent as +0.0: the marker never travels
        sent = [p.view(torch.int16).masked_fill(p.view(torch.int16) == MARKER, 0)
                for p in parts]
        residual = torch.randn(rows, cols, generator=gen).half()
        for i in range(rows):
            expected[(calls[i] + 2) % 3, :, i, :widths[i]] = MARKER
            for src in range(world):
                expected[calls[i] % 3, src, i, :cols] = sent[src][i]
        got = []
        for r in range(world):
            # the ranks that run after this one: their stores, as they will land
            view = bufs[r].view(3, world, MAX_ROWS, ROW)
            for later in range(r + 1, world):
                for i in range(rows):
                    view[calls[i] % 3, later, i, :cols] = sent[later][i]
            got.append(ranks[r](parts[r], residual, weight, EPS) if norm else ranks[r](parts[r]))
        for i in range(rows):
            calls[i], widths[i] = calls[i] + 1, cols
        total = ranks_sum(parts)
        for r in range(world):
            if norm:
                want = add_rms_norm(total, residual, weight, EPS, use_triton=False)
                assert torch.equal(got[r][0], want[0]) and torch.equal(got[r][1], want[1])
            else:
                assert torch.equal(got[r], total)
            assert torch.equal(bufs[r].view_as(expected), expected)


def test_fits_half_types_of_at_most_max_rows_and_row_wide():
    half = torch.bfloat16
    assert OneShot.fits(torch.zeros(MAX_ROWS, ROW, dtype=half))
    assert not OneShot.fits(torch.zeros(MAX_ROWS + 1, 16, dtype=half))
    assert not OneShot.fits(torch.zeros(1, ROW + 1, dtype=half))
    assert not OneShot.fits(torch.zeros(2, 16))                        # float32: NCCL
    assert not OneShot.fits(torch.zeros(16, 4, dtype=torch.float16).t())


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

"""The fused sum over the ranks + residual add + RMSNorm (core/peer_sum.py), against
NCCL's all-reduce followed by the plain fused norm.

On the CPU its kernel runs interpreted as a group of one (its barrier meets only
itself); on a host with two GPUs two processes sum real peers' rows over CUDA IPC,
eagerly and replayed in a CUDA graph."""
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from roseinfer.core import peer_sum, tp
from roseinfer.models.fused import add_rms_norm

TWO_GPUS = torch.cuda.device_count() >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
def test_one_rank_equals_the_plain_norm(dtype, with_residual):
    if torch.cuda.is_available():
        pytest.skip("the group of one runs interpreted, off CUDA")
    gen = torch.Generator().manual_seed(3)
    rows, cols = 5, 72
    buf = torch.zeros(rows * cols, dtype=dtype)
    pads = torch.zeros(peer_sum.MAX_PROGRAMS * 64, dtype=torch.int32)
    peers = SimpleNamespace(rank=0, world=1, nbytes=buf.numel() * buf.element_size(),
                            bufs=torch.tensor([buf.data_ptr()]),
                            pads=torch.tensor([pads.data_ptr()]))
    x, r = (torch.randn(rows, cols, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.2 * torch.randn(cols, generator=gen)).to(dtype)
    residual = r if with_residual else None
    normed, summed = peer_sum.sum_add_rms_norm(x, residual, w, 1e-5, peers=peers)
    want_normed, want_summed = add_rms_norm(x, residual, w, 1e-5, use_triton=True)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)
    assert not pads.any(), "each crossing of the barrier leaves its flags at zero"
    too_many = torch.zeros(rows + 1, cols, dtype=dtype)
    assert peer_sum.sum_add_rms_norm(too_many, None, w, 1e-5, peers=peers) is None


def _rank(rank: int, port: int, results) -> None:
    device = torch.device("cuda", rank)
    tp.init(rank, 2, port, device)
    try:
        assert peer_sum._peers is not None, "the peer path did not open on two GPUs"
        gen = torch.Generator(device=device).manual_seed(rank)
        w = torch.full((4096,), 1.1, device=device, dtype=torch.bfloat16)
        checks = []
        for rows in (1, 7, 64, 128):
            x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16, generator=gen)
            res = torch.full_like(x, 0.5)  # the residual stream: the same on every rank
            want = add_rms_norm(tp.all_reduce(x.clone()), res, w, 1e-5)
            got = peer_sum.sum_add_rms_norm(x, res, w, 1e-5)
            checks.append((rows, torch.equal(got[1], want[1]),
                           (got[0].float() - want[0].float()).abs().max().item()))
        # Captured once, replayed with new rows in place: the flags must reset each time.
        x = torch.zeros(3, 4096, device=device, dtype=torch.bfloat16)
        peer_sum.sum_add_rms_norm(x, None, w, 1e-5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = peer_sum.sum_add_rms_norm(x, None, w, 1e-5)
        for step in range(20):
            x.copy_(torch.full_like(x, step + rank))
            graph.replay()
            checks.append(("graph", torch.equal(out[1], torch.full_like(x, 2 * step + 1)), 0.0))
        results.put((rank, checks, peer_sum.sum_add_rms_norm(
            torch.zeros(1024, 4096, device=device, dtype=torch.bfloat16), None, w, 1e-5)))
    finally:
        torch.cuda.synchronize(device)
        tp.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
def test_two_gpus_sum_as_nccl_does():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, checks, past_buffer in got:
        for what, summed_equal, normed_diff in checks:
            assert summed_equal, f"rank {rank}, {what}: the sum differs from NCCL's"
            assert normed_diff <= 0.02, f"rank {rank}, {what}: normed off by {normed_diff}"
        assert past_buffer is None, "rows past the buffer must go to NCCL"

"""All-reduce latency on the GPUs of one host: NCCL against the symmetric-memory
one-shot path of roseinfer.core.tp, each call captured 50 times in a CUDA graph
(as a decode step captures them), for messages of 8 KB to 8 MB of bf16.
Checks each path's sum against the exact one. Usage: python3 docs/bench/all_reduce.py [N]"""
import os
import socket
import statistics
import sys

import torch
import torch.multiprocessing as mp

CALLS = 50
SIZES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20,
         2 << 20, 4 << 20, 8 << 20]


def replay_us(graph) -> float:
    """Median microseconds per call over 10 timed replays."""
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times[3:])


def captured(fn, x):
    x0 = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.copy_(x0)
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn(x)
    return g


def rank_main(rank, size, port):
    import torch.distributed as dist

    from roseinfer.core import tp
    tp.SYMMETRIC_MAX_BYTES = max(SIZES)
    device = torch.device("cuda", rank)
    tp.init(rank, size, port, device)
    rows = []
    for nbytes in SIZES:
        n = nbytes // 2
        data = (torch.arange(n, device=device) % 5 + rank).to(torch.bfloat16)
        exact = sum((torch.arange(n, device=device) % 5 + r) for r in range(size)).to(torch.bfloat16)
        result = []
        for name, fn in (("nccl", dist.all_reduce), ("symmetric", tp._symmetric_all_reduce)):
            x = data.clone()
            fn(x)  # once, outside a graph: the sum it gives
            ok = torch.equal(x, exact)
            x = data.clone()
            us = replay_us(captured(fn, x))
            result += [us, ok]
        rows.append((nbytes, *result))
    if rank == 0:
        print(f"all-reduce over {size} GPUs ({torch.cuda.get_device_name(0)}), us per call "
              f"(median of 10 graph replays of {CALLS} calls)")
        print(f"{'bytes':>9} {'nccl':>8} {'symm':>8} {'nccl/symm':>9}  sums exact (nccl, symm)")
        for nbytes, nccl, nok, symm, sok in rows:
            print(f"{nbytes:9d} {nccl:8.2f} {symm:8.2f} {nccl / symm:9.2f}  {nok}, {sok}")
    tp.destroy()


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(size, port), nprocs=size)

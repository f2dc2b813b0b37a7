"""Does a process group leave cleanly while CUDA graphs that captured its collectives
are alive? Two ranks each capture NCCL and symmetric-memory all-reduces in a graph,
replay it, then leave the group (roseinfer.core.tp.destroy) with the graph kept or
released first. A rank that has not left within 30 s prints its stack and exits 3.
Usage: python3 docs/bench/tp_teardown.py"""
import faulthandler
import gc
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


def rank_main(rank, port, keep_graph):
    import torch.distributed as dist

    from roseinfer.core import tp
    device = torch.device("cuda", rank)
    tp.init(rank, 2, port, device)
    x = torch.ones(4096, dtype=torch.bfloat16, device=device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_reduce(x)
        tp.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x)
        tp.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    if not keep_graph:
        del graph
        gc.collect()
    faulthandler.dump_traceback_later(30, exit=True)
    t = time.perf_counter()
    tp.destroy()
    faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: left in {time.perf_counter() - t:.2f} s "
          f"({'graph alive' if keep_graph else 'graph released'})", flush=True)


def run(keep_graph):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(rank_main, args=(port, keep_graph), nprocs=2)
        return "left"
    except Exception as e:
        return f"failed: {str(e).splitlines()[0][:120]}"


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    for keep in (False, True):
        print(f"graph {'alive' if keep else 'released'}: {run(keep)}", flush=True)
    sys.exit(0)

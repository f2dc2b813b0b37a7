"""All-reduce latency on the GPUs of one host: NCCL against torch's symmetric-memory
one-shot all-reduce (with the copy into its buffer that a layer's output needs), each
call captured 50 times in a CUDA graph, as a decode step captures them, for messages
of 8 KB to 8 MB of bf16. Checks each sum against the exact one. The one-shot path
needs no NVLink multicast, which stays off. Usage: python3 docs/bench/all_reduce.py [N]"""
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
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn(x)
    return g


def rank_main(rank, size, port):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, device_id=device)
    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(max(SIZES) // 2, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, name)

    def one_shot(x):
        staged = buf[:x.numel()]
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", name, out=x)

    rows = []
    for nbytes in SIZES:
        n = nbytes // 2
        data = (torch.arange(n, device=device) % 5 + rank).to(torch.bfloat16)
        exact = sum(torch.arange(n, device=device) % 5 + r for r in range(size)).to(torch.bfloat16)
        result = []
        for fn in (dist.all_reduce, one_shot):
            x = data.clone()
            fn(x)  # once, outside a graph: the sum it gives
            ok = torch.equal(x, exact)
            result += [replay_us(captured(fn, data.clone())), ok]
        rows.append((nbytes, *result))
    if rank == 0:
        print(f"all-reduce over {size} GPUs ({torch.cuda.get_device_name(0)}), us per call "
              f"(median of 10 graph replays of {CALLS} calls)")
        print(f"{'bytes':>9} {'nccl':>8} {'symm':>8} {'nccl/symm':>9}  sums exact (nccl, symm)")
        for nbytes, nccl, nok, symm, sok in rows:
            print(f"{nbytes:9d} {nccl:8.2f} {symm:8.2f} {nccl / symm:9.2f}  {nok}, {sok}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(size, port), nprocs=size)

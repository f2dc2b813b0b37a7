"""All-reduce latency on the GPUs of one host, for messages of 1 to 64 rows of 4,096
bf16 values (8 KB to 512 KB) and beyond: NCCL against core/one_shot.py's one-shot
kernel, alone and with the residual add and RMSNorm that follow a row-parallel layer
(NCCL then layers/fused.py's add-norm, against the one fused kernel). Each call is
captured 50 times in a CUDA graph, as a decode step captures them; each result is
checked against the sum in rank order first (and NCCL's, bit for bit, at two ranks).
NVLink multicast stays off. Usage: python3 docs/bench/all_reduce.py [N] [--json F]"""
import json
import os
import socket
import statistics
import sys

import torch
import torch.multiprocessing as mp

CALLS = 50
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
HIDDEN = 4096
EPS = 1e-5
WARPS = [int(w) for w in os.environ.get("WARPS", "").split(",") if w]


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


def captured(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    return g


def rank_main(rank, size, port, out):
    import torch.distributed as dist

    from roseinfer.core import tp
    from roseinfer.layers.fused import add_rms_norm

    device = torch.device("cuda", rank)
    tp.init(rank, size, port, device)
    one = tp._one_shot
    gen = torch.Generator(device).manual_seed(rank)
    weight = torch.rand(HIDDEN, device=device, generator=gen).bfloat16()
    rows_out = []
    for rows in ROWS:
        part = torch.randn(rows, HIDDEN, device=device, generator=gen).bfloat16()
        residual = torch.randn(rows, HIDDEN, device=device, generator=gen).bfloat16()
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part)
        want = parts[0]
        for p in parts[1:]:
            want = (want.float() + p.float()).bfloat16()
        nccl = part.clone()
        dist.all_reduce(nccl)

        def nccl_norm():
            x = part.clone()
            dist.all_reduce(x)
            return add_rms_norm(x, residual, weight, EPS)

        row = {"rows": rows, "bytes": part.numel() * 2,
               "nccl_us": replay_us(captured(lambda: dist.all_reduce(part.clone()))),
               "nccl_norm_us": replay_us(captured(nccl_norm))}
        if one.fits(part):
            row["one_shot_exact"] = torch.equal(one(part), want) and (
                size > 2 or torch.equal(one(part), nccl))
            row["fused_exact"] = all(torch.equal(a, b) for a, b in zip(
                one(part, residual, weight, EPS), add_rms_norm(want, residual, weight, EPS)))
            row["one_shot_us"] = replay_us(captured(lambda: one(part)))
            row["fused_us"] = replay_us(captured(lambda: one(part, residual, weight, EPS)))
            for warps in WARPS:  # the launch's warps against the default's
                one.warps = warps
                row[f"fused_w{warps}_us"] = replay_us(
                    captured(lambda: one(part, residual, weight, EPS)))
            one.warps = None
        rows_out.append(row)
    if rank == 0:
        print(f"all-reduce over {size} GPUs ({torch.cuda.get_device_name(0)}), us per call "
              f"(median of 10 graph replays of {CALLS} calls); rows of {HIDDEN} bf16")
        print(f"{'rows':>5} {'bytes':>8} {'nccl':>7} {'one-shot':>8} {'nccl+norm':>9} "
              f"{'fused':>7}  exact (one-shot, fused)")
        for r in rows_out:
            print(f"{r['rows']:5d} {r['bytes']:8d} {r['nccl_us']:7.2f} "
                  f"{r.get('one_shot_us', float('nan')):8.2f} {r['nccl_norm_us']:9.2f} "
                  f"{r.get('fused_us', float('nan')):7.2f}  {r.get('one_shot_exact')}, "
                  f"{r.get('fused_exact')}")
        if out:
            with open(out, "w") as f:
                json.dump({"gpus": size, "device": torch.cuda.get_device_name(0),
                           "rows": rows_out}, f, indent=1)
    del one  # its peers' mappings close while the peers are alive
    dist.barrier()
    tp.destroy()


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[args.index("--json") + 1] if "--json" in args else None
    size = int(args[0]) if args and args[0] != "--json" else torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(size, port, out), nprocs=size)

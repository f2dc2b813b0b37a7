"""Skinny kernel launch settings per shape: BLOCK_N 16/32/64, stages, warps; rows 1, 4 and 16;
each as a CUDA graph over 400 MB of copies of the shape's weight, with cuBLAS alongside."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from roseinfer.layers import skinny_linear as sk
from roseinfer.layers.skinny_linear import graph_time, launch_config

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
SHAPES = [("8b qkv", 6144, 4096), ("8b o", 4096, 4096), ("8b gate_up", 28672, 4096), ("8b down", 4096, 14336),
          ("8b head", 128256, 4096), ("1b qkv", 3072, 2048), ("1b o", 2048, 2048), ("1b gate_up", 16384, 2048),
          ("1b down", 2048, 8192), ("1b head", 128256, 2048)]
out = open(os.environ.get("OUT", ".") + "/bn.txt", "w")
def say(*a):
    print(*a, flush=True); print(*a, file=out, flush=True)
t0 = time.time()
for name, n, k in SHAPES:
    copies = max(2, (400 << 20) // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
    default = launch_config(k, 2)
    configs = sorted({default} | {(bn, default[1], w, s) for bn in (16, 32, 64) for w in (4, 8) for s in (3, 4, 5)})
    for rows in (1, 4, 16):
        x = torch.randn(rows, k, device=dev, dtype=dt)
        cublas = graph_time(lambda: [F.linear(x, w) for w in ws], 5) / copies * 1e3
        res = []
        for c in configs:
            try:
                res.append((graph_time(lambda: [sk.skinny_linear(x, w, None, c) for w in ws], 5) / copies * 1e3, c))
            except Exception as e:
                res.append((float("inf"), c))
        d = dict((c, t) for t, c in res)[default]
        res.sort()
        floor = n * k * 2 / 3.0e12 * 1e6
        say(f"{name:10s} rows {rows:2d}: floor {floor:7.2f} cublas {cublas:7.2f} default{default} {d:7.2f} | best {res[0][0]:7.2f} {res[0][1]} | "
            + " ".join(f"{t:.2f}{c}" for t, c in res[1:4]))
    del ws
    torch.cuda.empty_cache()
say(f"{time.time() - t0:.0f} s")

"""Fused prologues (rms_norm, silu) in the skinny kernel vs the unfused pair, in CUDA graphs
over enough weight copies that they stream from HBM."""
import importlib.util, itertools, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from roseinfer.layers import skinny_linear as sk
from roseinfer.layers.fused import add_rms_norm, silu_and_mul
from roseinfer.layers.skinny_linear import graph_time
spec = importlib.util.spec_from_file_location("old_sk", "scratch/old/skinny_linear.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
SHAPES = [("8b qkv", 6144, 4096, "rms_norm"), ("8b gate_up", 28672, 4096, "rms_norm"),
          ("8b down", 4096, 14336, "silu"), ("1b qkv", 3072, 2048, "rms_norm"),
          ("1b gate_up", 16384, 2048, "rms_norm"), ("1b down", 2048, 8192, "silu")]
CONFIGS = [(32, bk, w, s) for bk in (64, 128, 256, 512) for w in (4, 8) for s in (3, 4, 6)]
quick = len(sys.argv) > 1
out = open(os.environ.get("OUT", ".") + "/sweep.txt", "w")
def say(*a):
    print(*a, flush=True); print(*a, file=out, flush=True)
t0 = time.time()
for name, n, k, kind in SHAPES:
    copies = max(2, (400 << 20) // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
    g = torch.randn(k, device=dev, dtype=dt) * 0.1 + 1
    for rows in (1, 16):
        x = torch.randn(rows, (2 if kind == "silu" else 1) * k, device=dev, dtype=dt)
        r = torch.randn(rows, k, device=dev, dtype=dt)
        if kind == "silu":
            pair = lambda: [sk.skinny_linear(silu_and_mul(x), w) for w in ws]
            plain_old = lambda: [old.skinny_linear(silu_and_mul(x), w) for w in ws]
            fused = lambda c: (lambda: [sk._launch(x, w, None, c, inputs="silu") for w in ws])
        else:
            pair = lambda: [sk.skinny_linear(add_rms_norm(x, r, g, 1e-5)[0], w) for w in ws]
            plain_old = lambda: [old.skinny_linear(add_rms_norm(x, r, g, 1e-5)[0], w) for w in ws]
            fused = lambda c: (lambda: [sk._launch(x, w, None, c, inputs="rms_norm", residual=r,
                                                   norm_weight=g, eps=1e-5) for w in ws])
        base, base_old = graph_time(pair, 5) / copies * 1e3, graph_time(plain_old, 5) / copies * 1e3
        floor = n * k * 2 / 3.0e12 * 1e6
        res = []
        for c in ([sk.launch_config(k, 2)] if quick else CONFIGS):
            try:
                res.append((graph_time(fused(c), 5) / copies * 1e3, c))
            except Exception as e:  # out of shared memory etc.
                res.append((float("inf"), c))
        res.sort()
        say(f"{name:10s} rows {rows:2d}: pair (new plain) {base:7.2f} us, pair (old plain) {base_old:7.2f} us, "
            f"floor {floor:6.2f} us | fused best {res[0][0]:7.2f} us {res[0][1]} | "
            + " ".join(f"{t:.1f}{c[1:]}" for t, c in res[1:6]))
    del ws
    torch.cuda.empty_cache()
say(f"{time.time() - t0:.0f} s")

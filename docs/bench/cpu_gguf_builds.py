"""The GGUF block kernels of each build (this CPU's, AVX2 without AVX-512, portable C++) on
the default model's shapes, 1, 4 and 16 rows, two threads.

Usage: python3 docs/bench/cpu_gguf_builds.py
"""
import time, torch, numpy as np, gguf
from roseinfer.layers import gguf_linear
torch.set_num_threads(2)
B = {"native": (gguf_linear.NATIVE, "roseinfer_gguf"),
     "avx2": (("-O3", "-march=x86-64-v3", *gguf_linear.OPENMP), "roseinfer_gguf_avx2"),
     "portable": (("-O3", "-march=x86-64-v2", *gguf_linear.OPENMP), "roseinfer_gguf_portable")}
Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)
shapes = [("gate_up 3072x576 Q4_1", 3072, 576, Q.Q4_1, 3), ("down 576x1536 Q4_1", 576, 1536, Q.Q4_1, 3),
          ("head 49152x576 Q8_0", 49152, 576, Q.Q8_0, 8)]
data = {}
for name, n, k, q, kind in shapes:
    w = rng.standard_normal((n, k)).astype(np.float32)
    data[name] = (torch.from_numpy(gguf.quants.quantize(w, q).view(np.uint8).reshape(n, -1).copy()), kind, k)
for b, (flags, ns) in B.items():
    gguf_linear.build(flags, ns)
    mm = getattr(torch.ops, ns).mm
    for name, (blocks, kind, k) in data.items():
        for rows in (1, 4, 16):
            x = torch.randn(rows, k)
            for _ in range(5): mm(x, blocks, kind)
            t = time.perf_counter(); r = 0
            while time.perf_counter() - t < 0.3: mm(x, blocks, kind); r += 1
            print(f"{b:9s} {name:24s} rows {rows:2d}: {(time.perf_counter()-t)/r*1e6:9.1f} us", flush=True)

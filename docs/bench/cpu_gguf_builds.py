"""The GGUF block kernels of each build (this CPU's, AVX2 without AVX-512, portable C++) on
the default model's shapes, 1, 4 and 16 rows of x, two threads, the weights hot in cache:
Q4_1, the Q8_0 head, Q4_0 and a Q4_K tensor repacked (kind 100) as stored and over
sixteen interleaved rows (kinds 102-105).

Usage: python3 docs/bench/cpu_gguf_builds.py [--builds native,avx2,portable]
"""
import argparse
import time

import gguf
import numpy as np
import torch

from roseinfer.layers import gguf_linear, gguf_repack

BUILDS = {"native": (gguf_linear.NATIVE, "roseinfer_gguf"),
          "avx2": (("-O3", "-march=x86-64-v3", *gguf_linear.OPENMP), "roseinfer_gguf_avx2"),
          "portable": (("-O3", "-march=x86-64-v2", *gguf_linear.OPENMP),
                       "roseinfer_gguf_portable")}
Q = gguf.GGMLQuantizationType
SHAPES = [("ffn gate_up 3072 x 576", 3072, 576, Q.Q4_1), ("ffn down 576 x 1536", 576, 1536, Q.Q4_1),
          ("attn q 576 x 576", 576, 576, Q.Q4_1), ("head 49152 x 576", 49152, 576, Q.Q8_0),
          ("ffn gate_up 3072 x 576", 3072, 576, Q.Q4_0),
          ("ffn gate_up 3072 x 768", 3072, 768, Q.Q4_K)]  # Q4_K: random, repacked (kind 100)


def stored(kind, n, k, rng):
    """Rows of ``kind`` blocks for an n x k weight, and the kind the kernels read them as."""
    if kind == Q.Q4_K:  # the gguf package cannot quantize to it: random blocks, small d
        raw = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
        raw[:, :4] = rng.uniform(1e-3, 1e-2, (len(raw), 2)).astype(np.float16).view(np.uint8)
        kind, raw = gguf_repack.repack(int(Q.Q4_K), raw.reshape(n, -1))
        return torch.from_numpy(raw), kind
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, kind).view(np.uint8).reshape(n, -1)
    return torch.from_numpy(raw.copy()), int(kind)


def timed(fn, seconds=0.3):
    for _ in range(5):
        fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--builds", default=",".join(BUILDS))
    args = p.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    weights = []
    for name, n, k, kind in SHAPES:
        blocks, read = stored(kind, n, k, rng)
        forms = [(f"{kind.name}", read, blocks),
                 ("x16", gguf_linear.INTERLEAVED[read], gguf_linear.interleave(read, blocks))]
        weights.append((name, k, forms))
    for build in args.builds.split(","):
        ops = gguf_linear.build(*BUILDS[build])
        for name, k, forms in weights:
            for rows in (1, 4, 16):
                x = torch.randn(rows, k)
                cells = [f"{label} {timed(lambda: ops.mm(x, b, kind)):8.1f} us"
                         for label, kind, b in forms]
                print(f"{build:8s} {name:24s} {forms[0][0]:5s} rows {rows:2d}: "
                      + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()

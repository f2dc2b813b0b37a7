"""The interleaved Q4_1 kernel (kind 102) at one row of x, two threads, its weights streamed
through 200 MB of copies, built with each prefetch distance given (bytes ahead; the
source's default is 2048; each distance is its own build, -DGGUF_PREFETCH=N).

Usage: python3 docs/bench/cpu_gguf_prefetch.py 1024 2048 4096
"""
import sys
import time

import gguf
import numpy as np
import torch

from roseinfer.layers import gguf_linear

Q = gguf.GGMLQuantizationType
SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # qkv, gate_up, down of the default model


def streamed_us(ops, n: int, k: int) -> float:
    """µs a one-row call of the interleaved Q4_1 kernel, each call over the next of 200 MB
    of copies of one random n x k weight."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, Q.Q4_1).view(np.uint8).reshape(n, -1)
    blocks = gguf_linear.interleave(gguf_linear.Q4_1, torch.from_numpy(raw.copy()))
    copies = [blocks.clone() for _ in range(max(1, (200 << 20) // blocks.numel()))]
    x, kind = torch.randn(1, k), gguf_linear.INTERLEAVED[gguf_linear.Q4_1]
    for c in copies[:5]:
        ops.mm(x, c, kind)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.5:
        ops.mm(x, copies[calls % len(copies)], kind)
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main():
    torch.set_num_threads(2)
    for ahead in sys.argv[1:]:
        ops = gguf_linear.build((*gguf_linear.NATIVE, f"-DGGUF_PREFETCH={ahead}"),
                                f"roseinfer_gguf_prefetch{ahead}")
        for n, k in SHAPES:
            us = streamed_us(ops, n, k)
            print(f"{ahead} bytes ahead, {n} x {k}: {us:.1f} us streamed, "
                  f"{n * k * 20 / 32 / us / 1e3:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()

"""bfloat16 weights times one and four rows on the CPU: the GEMV of docs/bench/cpu_bf16_gemv.cpp
(built here by torch's cpp_extension, -O3 -march=native, OpenMP) against oneDNN's packed
bfloat16 linear (what cpu_weight_dtype="bfloat16" runs) and F.linear on the plain layout,
on the default model's linear shapes
(SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, the head 49152x576),
each weight streamed from memory (copies up to 256 MB, taken in turn), 2 threads; µs a call
and GB/s of weights, then a 512-row prompt's GEMM on the plain and the packed layout.

    python3 docs/bench/cpu_bf16_gemv.py [--reps 100]
"""
import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from roseinfer.layers.extensions import build_library
from roseinfer.layers.gguf_linear import NATIVE, _cpu

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ROWS = (1, 4, 16, 32)
STREAM_BYTES = 256e6


def seconds(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def in_turn(op, x, weights):
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(weights)
        return op(x, weights[i[0]])
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ops = build_library(Path(__file__).with_name("cpu_bf16_gemv.cpp"), "roseinfer_bf16",
                        NATIVE, _cpu(), "the bfloat16 GEMV")
    print(f"AVX512-BF16 path: {ops.vectorized()}; {torch.get_num_threads()} threads")
    onednn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    for n, k in SHAPES:
        weights = [torch.randn(n, k).bfloat16() for _ in range(max(1, int(STREAM_BYTES // (n * k * 2))))]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
        row = []
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            want = x.float() @ weights[0].float().T
            err = ((ops.mm(x, weights[0]) - want).abs().max() / want.abs().max()).item()
            own = seconds(in_turn(ops.mm, x, weights), args.reps)
            theirs = seconds(in_turn(onednn, x, packed), args.reps)
            plain = seconds(in_turn(F.linear, x, weights), args.reps)
            row.append(f"{m} row(s): own {own * 1e6:7.1f} us ({n * k * 2 / own / 1e9:4.1f} GB/s), "
                       f"oneDNN {theirs * 1e6:7.1f} us ({n * k * 2 / theirs / 1e9:4.1f}), "
                       f"F.linear plain {plain * 1e6:7.1f}, rel. error {err:.0e}")
        print(f"{n:6d} x {k:4d} | " + " | ".join(row), flush=True)
    x, w = torch.randn(512, 576).bfloat16(), torch.randn(3072, 576).bfloat16()
    p = torch.ops.mkldnn._reorder_linear_weight(w, 512)
    print("512 rows x 3072x576: F.linear on the plain layout %.0f us, packed %.0f us" % (
        seconds(lambda: F.linear(x, w), 20) * 1e6, seconds(lambda: onednn(x, p), 20) * 1e6))


if __name__ == "__main__":
    main()

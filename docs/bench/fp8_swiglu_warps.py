"""SwiGLU rounding its rows to e4m3 (one program a whole row, layers/fused.py ``fp8=True``)
per warp count, against the unfused pair (SwiGLU, then ``quantize_rows``), on
Llama-3-8B's down input (14,336 columns): µs per call over 8 calls in one CUDA graph.

Usage: python3 docs/bench/fp8_swiglu_warps.py
"""
import torch

from roseinfer.core.triton_support import triton
from roseinfer.layers.fp8_linear import quantize_rows
from roseinfer.layers.fused import _silu_and_mul_kernel, silu_and_mul
from roseinfer.layers.skinny_linear import graph_time

COLS = 14336


def fused(x, out, scales, warps):
    block = triton.next_power_of_2(COLS)
    _silu_and_mul_kernel[(x.shape[0], 1)](x, out, scales, x.stride(0), out.stride(0), COLS,
                                           BLOCK=block, PDL=False, FP8=True, num_warps=warps)


for rows in (1, 16, 64):
    xs = [torch.randn(rows, 2 * COLS, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    out = torch.empty(rows, COLS, device="cuda", dtype=torch.float8_e4m3fn)
    scales = torch.empty(rows, 1, device="cuda", dtype=torch.float32)
    line = [f"rows {rows}:"]
    pair = graph_time(lambda: [quantize_rows(silu_and_mul(x)) for x in xs]) / 8
    line.append(f"pair {pair * 1e3:.2f}")
    for warps in (4, 8, 16, 32):
        t = graph_time(lambda: [fused(x, out, scales, warps) for x in xs]) / 8
        line.append(f"w{warps} {t * 1e3:.2f}")
    print("  ".join(line), flush=True)

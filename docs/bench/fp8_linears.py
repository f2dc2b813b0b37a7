"""FP8 linears against bf16 on the Llama-3-8B shapes (one H100): each timed as a CUDA
graph over 8 copies of the weight (so weights come from memory, as in a decode step);
ms per linear and the weight bytes' rate. Rows 1 and 16 (the skinny kernel, several
launch settings), the row quantization alone, and rows 64 (torch._scaled_mm).

Usage: python docs/bench/fp8_linears.py [--output-json F]
"""
import torch
import torch.nn.functional as F

from linear_shapes import COPIES, per_call, run
from roseinfer.layers.fp8_linear import fp8_gemm, fp8_skinny_linear, quantize_rows
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale
from roseinfer.layers.skinny_linear import skinny_linear

CONFIGS = [(32, 1024, 4, 4), (32, 512, 4, 4), (64, 512, 4, 4), (16, 1024, 4, 4),
           (32, 1024, 4, 3), (64, 1024, 8, 4), (32, 2048, 4, 3)]


def measure(n, k):
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
           for _ in range(COPIES)]
    scales = [absmax_scale(w.float()).view(-1) for w in w16]
    w8 = [(w.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
          for w, s in zip(w16, scales)]
    row = {}
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row[f"bf16_skinny_m{m}"] = per_call(lambda i: skinny_linear(x, w16[i]))
        row[f"bf16_cublas_m{m}"] = per_call(lambda i: F.linear(x, w16[i]))
        row[f"quantize_m{m}"] = per_call(lambda i: quantize_rows(x))
        for c in CONFIGS:
            try:
                row[f"fp8_m{m}_{c}"] = per_call(lambda i: fp8_skinny_linear(x, w8[i], scales[i],
                                                                           config=c))
            except Exception as e:  # a setting that does not fit the shared memory
                row[f"fp8_m{m}_{c}"] = repr(e)[:80]
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    row["bf16_cublas_m64"] = per_call(lambda i: F.linear(x, w16[i]))
    row["fp8_scaled_mm_m64"] = per_call(lambda i: fp8_gemm(x, w8[i], scales[i]))
    row["fp8_floor_ms"] = n * k / 3.0e9  # 3.0 TB/s
    row["bf16_floor_ms"] = 2 * n * k / 3.0e9
    return row


if __name__ == "__main__":
    run(measure)

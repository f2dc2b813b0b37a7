"""FP8 linears against bf16 on the Llama-3-8B shapes (one H100): each timed as a CUDA
graph over 8 copies of the weight (so weights come from memory, as in a decode step);
ms per linear and the weight bytes' rate. Rows 1 and 16 (the skinny kernel, several
launch settings), the row quantization alone, and rows 64 (torch._scaled_mm).

Usage: python docs/bench/fp8_linears.py [--output-json F]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from roseinfer.models.fp8_linear import fp8_gemm, fp8_skinny_linear, quantize_rows
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale
from roseinfer.models.skinny_linear import graph_time, skinny_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
CONFIGS = [(32, 1024, 4, 4), (32, 512, 4, 4), (64, 512, 4, 4), (16, 1024, 4, 4),
           (32, 1024, 4, 3), (64, 1024, 8, 4), (32, 2048, 4, 3)]
COPIES = 8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    args = p.parse_args()
    out = {}
    for name, (n, k) in SHAPES.items():
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(COPIES)]
        scales = [absmax_scale(w.float()).view(-1) for w in w16]
        w8 = [(w.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
              for w, s in zip(w16, scales)]
        row = {}

        def per(fn):
            return graph_time(lambda: [fn(i) for i in range(COPIES)]) / COPIES

        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row[f"bf16_skinny_m{m}"] = per(lambda i: skinny_linear(x, w16[i]))
            row[f"bf16_cublas_m{m}"] = per(lambda i: F.linear(x, w16[i]))
            row[f"quantize_m{m}"] = per(lambda i: quantize_rows(x))
            for c in CONFIGS:
                try:
                    row[f"fp8_m{m}_{c}"] = per(lambda i: fp8_skinny_linear(x, w8[i], scales[i],
                                                                          config=c))
                except Exception as e:  # a setting that does not fit the shared memory
                    row[f"fp8_m{m}_{c}"] = repr(e)[:80]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        row["bf16_cublas_m64"] = per(lambda i: F.linear(x, w16[i]))
        row["fp8_scaled_mm_m64"] = per(lambda i: fp8_gemm(x, w8[i], scales[i]))
        row["fp8_floor_ms"] = n * k / 3.0e9  # 3.0 TB/s
        row["bf16_floor_ms"] = 2 * n * k / 3.0e9
        out[name] = row
        print(name, json.dumps({a: (round(b, 4) if isinstance(b, float) else b)
                                for a, b in row.items()}), flush=True)
        w16 = w8 = None  # free them before the next shape
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

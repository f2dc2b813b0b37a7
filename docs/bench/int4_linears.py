"""INT4 (W4A16, groups of 128) linears against bf16 on the Llama-3-8B shapes (one H100):
each timed as a CUDA graph over 8 copies of the weight (so weights come from memory, as
in a decode step); ms per linear, against the packed bytes' floor. Rows 1 and 16 (the
skinny kernel, several launch settings), and rows 64 (de-quantize, then cuBLAS).

Usage: python docs/bench/int4_linears.py [--output-json F]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from roseinfer.models.int4_linear import dequantize_weight, int4_skinny_linear, pack, quantize
from roseinfer.models.skinny_linear import graph_time, skinny_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# BLOCK_N, groups of 128 per K step, warps, stages
CONFIGS = [(32, 4, 4, 4), (16, 4, 4, 4), (16, 8, 4, 3), (32, 2, 4, 4), (32, 4, 4, 3),
           (32, 8, 8, 3), (64, 2, 4, 4), (64, 4, 8, 3), (16, 2, 4, 6), (32, 2, 4, 6)]
COPIES = 8
PEAK = 3.0e12


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    args = p.parse_args()
    out = {}
    for name, (n, k) in SHAPES.items():
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(COPIES)]
        packed = [(pack(lv), s.half()) for lv, s in (quantize(w, 128) for w in w16)]
        row = {"int4_floor_ms": (n * k / 2 + n * k / 128 * 2) / PEAK * 1e3,
               "bf16_floor_ms": 2 * n * k / PEAK * 1e3}

        def per(fn):
            return graph_time(lambda: [fn(i) for i in range(COPIES)]) / COPIES

        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row[f"bf16_skinny_m{m}"] = per(lambda i: skinny_linear(x, w16[i]))
            row[f"bf16_cublas_m{m}"] = per(lambda i: F.linear(x, w16[i]))
            for c in CONFIGS:
                try:
                    row[f"int4_m{m}_{c}"] = per(lambda i: int4_skinny_linear(x, *packed[i],
                                                                            config=c))
                except Exception as e:  # a setting that does not fit the shared memory
                    row[f"int4_m{m}_{c}"] = repr(e)[:80]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        row["bf16_cublas_m64"] = per(lambda i: F.linear(x, w16[i]))
        row["int4_dequant_cublas_m64"] = per(
            lambda i: F.linear(x, dequantize_weight(*packed[i], torch.bfloat16)))
        out[name] = row
        print(name, json.dumps({a: (round(b, 4) if isinstance(b, float) else b)
                                for a, b in row.items()}), flush=True)
        w16 = packed = None  # free them before the next shape
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

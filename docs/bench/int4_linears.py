"""INT4 (W4A16, groups of 128) linears against bf16 on the Llama-3-8B shapes (one H100):
each timed as a CUDA graph over 8 copies of the weight (so weights come from memory, as
in a decode step); ms per linear, against the packed bytes' floor. Rows 1 and 16 (three
kernels, several launch settings), and rows 64 (de-quantize, then cuBLAS).

Usage: python docs/bench/int4_linears.py [--output-json F]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from roseinfer.models.int4_linear import dequantize_weight, int4_skinny_linear, pack, quantize, \
    unpack
from roseinfer.models.skinny_linear import graph_time, skinny_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# (variant, (BLOCK_N, groups of 128 per K step, warps, stages)); gemv serves one row
CONFIGS = [("split", c) for c in [(32, 2, 4, 4), (16, 2, 4, 6)]] + \
    [("dot", (bn, 1, 4, st)) for bn in (32, 64) for st in (2, 4)] + \
    [("gemv", (bn, g, w, st)) for bn in (16, 64) for g in (1, 2) for w in (4, 8)
     for st in (2, 4)]
COPIES = 8
PEAK = 3.0e12


def tinygemm_operands(w, inner_k_tiles):
    """torch's own int4 kernel (tinygemm): levels two to a byte, then its packing, and
    [K / 128, N, 2] (scale, zero) with w = (q - 8) * scale + zero."""
    levels, scale = quantize(w, 128)
    as_bytes = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(as_bytes, inner_k_tiles)
    scale = scale.to(torch.bfloat16)
    qsz = torch.stack([scale, torch.zeros_like(scale)], -1).transpose(0, 1).contiguous()
    return packed, qsz


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    args = p.parse_args()
    out = {}
    for name, (n, k) in SHAPES.items():
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(COPIES)]
        packed = [(pack(lv), s.t().contiguous().half())
                  for lv, s in (quantize(w, 128) for w in w16)]
        row = {"int4_floor_ms": (n * k / 2 + n * k / 128 * 2) / PEAK * 1e3,
               "bf16_floor_ms": 2 * n * k / PEAK * 1e3}

        def per(fn):
            return graph_time(lambda: [fn(i) for i in range(COPIES)]) / COPIES

        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row[f"bf16_skinny_m{m}"] = per(lambda i: skinny_linear(x, w16[i]))
            row[f"bf16_cublas_m{m}"] = per(lambda i: F.linear(x, w16[i]))
            for variant, c in CONFIGS:
                if variant == "gemv" and m > 1:
                    continue
                key = f"int4_m{m}_{variant}_{'_'.join(map(str, c))}"
                try:
                    row[key] = per(lambda i: int4_skinny_linear(x, *packed[i], config=c,
                                                                variant=variant))
                except Exception as e:  # a setting that does not fit the shared memory
                    row[key] = repr(e)[:80]
            for tiles in (2, 4, 8):
                key = f"int4_m{m}_tinygemm_{tiles}"
                try:
                    tg = [tinygemm_operands(w, tiles) for w in w16[:2]]
                    ref = x.float() @ (unpack(packed[0][0]).float() - 8).mul(
                        packed[0][1].float().t().repeat_interleave(128, 1)).t()
                    got = torch._weight_int4pack_mm(x, tg[0][0], 128, tg[0][1]).float()
                    row[f"{key}_error"] = float((got - ref).norm() / ref.norm())
                    tg = tg + [tinygemm_operands(w, tiles) for w in w16[2:]]
                    row[key] = per(lambda i: torch._weight_int4pack_mm(x, tg[i][0], 128, tg[i][1]))
                except Exception as e:  # not in this torch, or not on this GPU
                    row[key] = repr(e)[:120]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        row["bf16_cublas_m64"] = per(lambda i: F.linear(x, w16[i]))
        row["int4_dequant_cublas_m64"] = per(
            lambda i: F.linear(x, dequantize_weight(*packed[i], torch.bfloat16)))
        out[name] = row
        times = {a: b for a, b in row.items() if isinstance(b, float)}
        for m in (1, 16):
            best = min((a for a in times if a.startswith(f"int4_m{m}_") and
                        not a.endswith("_error")), key=times.get)
            print(name, m, {a: times[a] for a in times if "tinygemm" in a and f"m{m}_" in a})
            print(f"{name} m{m}: bf16 {min(times[f'bf16_skinny_m{m}'], times[f'bf16_cublas_m{m}']):.4f}"
                  f" best {best} {times[best]:.4f} ms, floor {row['int4_floor_ms']:.4f}", flush=True)
        w16 = packed = None  # free them before the next shape
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

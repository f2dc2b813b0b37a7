"""W4A16 linear candidates on the Llama-3-8B shapes (one GPU), per row count, ms per
call over 8 copies of the weight in one CUDA graph (weights from memory, as in a decode
step), groups of 128 with a zero point each (as AWQ's):

- bf16: cuBLAS, and the skinny kernel up to 16 rows (the unquantized baseline);
- ``w4a16``: layers/int4_linear.py's kernel, every launch setting of the sweep;
- torch's int4 kernel (tinygemm, ``torch._weight_int4pack_mm``);
- GemLite's kernels (its H100-tuned configs): GEMV_REVSPLITK up to 4 rows,
  GEMM_SPLITK up to 64, GEMM from 16;
- ``unpack`` then cuBLAS: the weight de-quantized into a bf16 buffer, then multiplied.

Usage: python docs/bench/int4_linears.py [--output-json F] [--no-gemlite]
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton

from linear_shapes import COPIES, per_call, run
from roseinfer.layers.int4_linear import dequantize, pack, quantize, unpack, w4a16
from roseinfer.layers.skinny_linear import skinny_linear

GROUP = 128
ROWS = (1, 2, 4, 8, 16, 32, 64, 512, 2048)
SWEPT_ROWS = (1, 16, 64)
CONFIGS = [(bn, tiles, 4, stages) for bn in (32, 64) for tiles in (1, 2) for stages in (3, 4)] \
    + [(128, 1, 8, 3), (16, 2, 4, 3)]  # (BLOCK_N, TILES, warps, stages)
GEMLITE = "--no-gemlite" not in sys.argv


def tinygemm_pack(levels, scales, zeros):
    """tinygemm's packing (inner K tiles 8) and (scale, zero) table: it computes
    (level - 8) * scale + zero."""
    two_a_byte = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(two_a_byte, 8)
    table = torch.stack([scales, (8 - zeros) * scales], -1).bfloat16()
    return packed, table.transpose(0, 1).contiguous()


def gemlite_layer(levels, scales, zeros):
    from gemlite.core import DType, GemLiteLinearTriton
    n, k = levels.shape
    layer = GemLiteLinearTriton(4, group_size=GROUP, in_features=k, out_features=n,
                                input_dtype=DType.BF16, output_dtype=DType.BF16)
    return layer.pack(levels.to(torch.uint8), scales.bfloat16(), zeros.bfloat16(),
                      fma_mode=True)


def measure(n, k):
    gen = torch.Generator("cuda").manual_seed(n + k)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
           for _ in range(COPIES)]
    quants = [quantize(w, GROUP) for w in w16]
    zeros = [torch.randint(4, 12, s.shape, device="cuda", generator=gen).float()
             for _, s in quants]
    ours = [(pack(lv), s.t().bfloat16().contiguous(),
             (-z * s).t().bfloat16().contiguous()) for (lv, s), z in zip(quants, zeros)]
    tiny = [tinygemm_pack(lv, s, z) for (lv, s), z in zip(quants, zeros)]
    lite = [gemlite_layer(lv, s, z) for (lv, s), z in zip(quants, zeros)] if GEMLITE else []
    ref = dequantize(quants[0][0], quants[0][1], zeros[0]).double()
    row = {"int4_floor_ms": (n * k / 2 + 2 * n * k / GROUP * 2) / 3.0e9,
           "bf16_floor_ms": 2 * n * k / 3.0e9,
           "unpack_max_err": (unpack(*ours[0]).double().t() - ref).abs().max().item()}
    buf = torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = x.double() @ ref.t()
        row[f"bf16_cublas_m{m}"] = per_call(lambda i: F.linear(x, w16[i]))
        if m <= 16:
            row[f"bf16_skinny_m{m}"] = per_call(lambda i: skinny_linear(x, w16[i]))
        if m <= 64:
            got = w4a16(x, *ours[0]).double()
            row[f"w4a16_rel_err_m{m}"] = ((got - want).norm() / want.norm()).item()
            row[f"w4a16_default_m{m}"] = per_call(lambda i: w4a16(x, *ours[i]))
        if m in SWEPT_ROWS:
            bm = 16 if m <= 16 else m
            for c in CONFIGS:
                try:
                    row[f"w4a16_{'_'.join(map(str, c))}_m{m}"] = per_call(
                        lambda i: w4a16(x, *ours[i], config=(bm, *c)))
                except triton.runtime.errors.OutOfResources:  # stages x tile too large
                    pass
        if m <= 64:
            row[f"tinygemm_m{m}"] = per_call(
                lambda i: torch._weight_int4pack_mm(x, tiny[i][0], GROUP, tiny[i][1]))
        types = (("GEMV_REVSPLITK",) if m <= 4 else ()) + \
            (("GEMM_SPLITK",) if m <= 64 else ()) + (("GEMM",) if m >= 16 else ())
        for t in types if GEMLITE else ():
            row[f"gemlite_{t}_m{m}"] = per_call(lambda i: lite[i].forward_manual(x, t))
        if m >= 64:
            row[f"unpack_cublas_m{m}"] = per_call(lambda i: x @ unpack(*ours[i], buf))
    row["unpack_only"] = per_call(lambda i: unpack(*ours[i], buf))
    return row


if __name__ == "__main__":
    if GEMLITE:
        import gemlite
        from gemlite.core import GemLiteLinearTriton
        # Hopper's 132 SMs either way: the H100's tuned configs serve the H200 too
        GemLiteLinearTriton.load_config(os.path.join(os.path.dirname(gemlite.__file__),
                                                     "configs", "h100.json"))
    sys.argv = [a for a in sys.argv if a != "--no-gemlite"]
    run(measure)

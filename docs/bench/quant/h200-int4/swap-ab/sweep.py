"""The launch settings of the W4A16 kernels of kernel.py (beside this file), swept on the
Llama-3-8B linear shapes per row count (ms per call over 8 copies of the weight in one
CUDA graph, as linear_shapes.py times), beside bf16 (the faster of cuBLAS and the
skinny kernel) and the INT4 layer as it runs. Each setting's output is checked against
the float64 product of the de-quantized weight first; one that is off by more than 1 %
is recorded as such and not timed.

Usage (from the repository root): python docs/bench/quant/h200-int4/swap-ab/sweep.py [--output-json F] [--rows 1,2,4,...]
"""
import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, "docs/bench")
from int4_linears import GROUP, weights
from linear_shapes import SHAPES, per_call
from kernel import pack, w4a16
from roseinfer.layers.int4_linear import to_int4
from roseinfer.layers.skinny_linear import skinny_linear


def settings(block_n, warps, stages, splits, magic, xdot=(False,), gemv=False):
    return [dict(block_n=b, warps=w, stages=s, split=sp, magic=mg,
                 **({"gemv": True} if gemv else {"xdot": xd}))
            for b, w, s, sp, mg, xd in itertools.product(block_n, warps, stages, splits, magic,
                                                         xdot)]


def name(cfg: dict) -> str:
    return ("gemv" if cfg.get("gemv") else "mma") + "_n{block_n}_w{warps}_s{stages}_k{split}" \
        .format(**cfg) + ("_magic" if cfg["magic"] else "") + ("_xdot" if cfg.get("xdot") else "")


def measure(n, k, rows, gemm, gemv):
    gen, w16, quants, zeros = weights(n, k)
    own = [(pack(lv), s.bfloat16(), (-z * s).bfloat16()) for (lv, s), z in zip(quants, zeros)]
    lv0, s0 = quants[0]
    ref_w = (lv0.double() - zeros[0].double().repeat_interleave(GROUP, 1)) * \
        s0.double().repeat_interleave(GROUP, 1)
    layers = []
    for (lv, s), z in zip(quants, zeros):
        layers.append(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        to_int4(layers[-1], lv, s, z)
    del quants
    out = {"int4_floor_ms": (n * k / 2 + 2 * n * k / GROUP * 2) / 3.0e9,
           "bf16_floor_ms": 2 * n * k / 3.0e9}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = x.double() @ ref_w.T
        row = out[m] = {}
        row["bf16"] = per_call(lambda i: F.linear(x, w16[i]))
        if m <= 16:
            row["bf16"] = min(row["bf16"], per_call(lambda i: skinny_linear(x, w16[i])))
        row["layer"] = per_call(lambda i: layers[i](x))
        for cfg in gemm + (gemv if m == 1 else []):
            key = name(cfg)
            try:
                err = ((w4a16(x, *own[0], **cfg).double() - ref).abs().max()
                       / ref.abs().max()).item()
                row[key] = per_call(lambda i: w4a16(x, *own[i], **cfg)) if err < 0.01 \
                    else f"off by {err:.3g}"
            except Exception as e:  # a setting that does not compile (shared memory, ...)
                row[key] = f"{type(e).__name__}: {str(e)[:80]}"
        timed = {a: b for a, b in row.items() if isinstance(b, float) and a not in ("bf16", "layer")}
        best = sorted(timed, key=timed.get)[:3]
        print(f"n={n} k={k} m={m} bf16 {row['bf16'] * 1e3:.1f} us  layer {row['layer'] * 1e3:.1f}"
              f"  best " + "  ".join(f"{b} {timed[b] * 1e3:.1f}" for b in best), flush=True)
        bad = {a: b for a, b in row.items() if isinstance(b, str)}
        if bad:
            print("  not timed:", len(bad), next(iter(bad.items())), flush=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--gemv-block-n", default="32,64,128")
    p.add_argument("--warps", default="2,4")
    p.add_argument("--stages", default="3,4")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--magic", default="0,1")
    p.add_argument("--xdot", default="0,1")
    args = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    rows = ints(args.rows)
    common = ints(args.warps), ints(args.stages), ints(args.splits), \
        [bool(v) for v in ints(args.magic)]
    gemm = settings(ints(args.block_n), *common, [bool(v) for v in ints(args.xdot)])
    gemv = settings(ints(args.gemv_block_n), *common, gemv=True)
    result = {}
    for shape in args.shapes.split(","):
        result[shape] = measure(*SHAPES[shape], rows, gemm, gemv)
        torch.cuda.empty_cache()
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

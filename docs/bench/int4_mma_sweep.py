"""The project's W4A16 tensor-core kernel (layers/int4_mma.py) on the Llama-3-8B shapes,
every block config and split, and the one its tuning at load picks, against bf16 and
GemLite's kernels (the INT4 layer's before) in the same process: ms per call over 8 copies of the weight in one CUDA graph (linear_shapes.py).

First every config is checked against the float64 product of the de-quantized weight, at
groups of 32, 64 and 128 and at row counts on both sides of each batch tile; a config off
by more than bf16's rounding stops the run. The floor of a call is its packed bytes
(levels, scales and shifts) at the copy rate measured first.

Usage: python docs/bench/int4_mma_sweep.py [--shapes qkv,o] [--output-json F]
"""
import time

import torch
import torch.nn.functional as F

from bandwidth import copy_rate
from linear_shapes import COPIES, per_call, run
from roseinfer.layers import int4_mma
from roseinfer.layers.int4_linear import dequantize, gemlite_linear, quantize
from roseinfer.layers.skinny_linear import skinny_linear

ROWS = (1, 2, 4, 8, 16, 32, 64)
SPLITS = (1, 2, 4, 7, 8, 14, 16)
CHECK_ROWS = (1, 3, 8, 9, 16, 17, 33, 64)


def packed(n, k, group, gen):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    levels, scales = quantize(w, group)
    zeros = torch.randint(4, 12, scales.shape, device="cuda", generator=gen).float()
    s = scales.bfloat16()
    shifts = (-zeros * s.float()).bfloat16()
    return (levels, scales, zeros), (int4_mma.pack(levels), int4_mma.panels(s.t()),
                                     int4_mma.panels(shifts.t()))


def check(gen) -> dict:
    """Each config's largest error over the float64 product, relative to its largest
    value, beside a bf16 product of the same weight rounded to bf16."""
    errs = {}
    for n, k in ((256, 1024), (384, 2048)):
        for group in int4_mma.GROUPS:
            (levels, scales, zeros), (words, s, z) = packed(n, k, group, gen)
            w = dequantize(levels, scales.bfloat16().float(), zeros)
            # the kernel's weights: level * scale + shift, rounded once to bf16
            shift = (-zeros * scales.bfloat16().float()).bfloat16().float()
            w16 = (levels.float() * scales.bfloat16().float().repeat_interleave(group, 1)
                   + shift.repeat_interleave(group, 1)).bfloat16()
            for m in CHECK_ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                ref = x.double() @ w.double().t()
                scale = ref.abs().max().item()
                base = ((x.double() @ w16.double().t()).float().bfloat16().double()
                        - ref).abs().max().item() / scale
                for config in int4_mma.CONFIGS:
                    for splits in (1, 2, 8):
                        if not int4_mma.fits(config, splits, n, k):
                            continue
                        y = int4_mma.mm(x, words, s, z, config, splits)
                        err = (y.double() - ref).abs().max().item() / scale
                        errs[f"{n}x{k}/g{group}/m{m}/c{config}/s{splits}"] = err
                        if not err <= 2 * base + 4e-3:
                            raise SystemExit(f"config {config} splits {splits} m {m} group "
                                             f"{group} {n}x{k}: error {err:.4g}, bf16's {base:.4g}")
                        # a second call: the counters left at zero, the same sums
                        if not torch.equal(y, int4_mma.mm(x, words, s, z, config, splits)):
                            raise SystemExit(f"config {config} splits {splits}: not repeatable")
    return {"max_err": max(errs.values()), "checked": len(errs)}


def measure_shape(rate):
    def measure(n, k):
        gen = torch.Generator("cuda").manual_seed(n + k)
        ours, w16, lite = [], [], []
        for _ in range(COPIES):
            (levels, scales, zeros), p = packed(n, k, 128, gen)
            ours.append(p)
            w16.append(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen))
            s = scales.bfloat16()
            lite.append(gemlite_linear(levels, s, (-zeros * s.float()).bfloat16()))
        start = time.time()
        int4_mma.tune(*ours[0])
        row_tune_s = time.time() - start
        floor = (n * k / 2 + 2 * 2 * n * k / 128) / rate * 1e3
        row = {"int4_floor_ms": floor, "bf16_floor_ms": 2 * n * k / rate * 1e3,
               "tune_s": row_tune_s}
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            bf16 = per_call(lambda i: F.linear(x, w16[i]))
            if m <= 16:
                bf16 = min(bf16, per_call(lambda i: skinny_linear(x, w16[i])))
            row[f"bf16_m{m}"] = bf16
            kind = "GEMV_REVSPLITK" if m == 1 else "GEMM_SPLITK"
            row[f"gemlite_m{m}"] = per_call(lambda i: lite[i].forward_manual(x, kind))
            best = None
            for config in int4_mma.CONFIGS:
                for splits in SPLITS:
                    if splits * m * n > int4_mma.PARTIALS or \
                            not int4_mma.fits(config, splits, n, k):
                        continue
                    t = per_call(lambda i: int4_mma.mm(x, *ours[i], config, splits))
                    row[f"mma_c{config}_s{splits}_m{m}"] = t
                    if best is None or t < best[0]:
                        best = (t, config, splits)
            row[f"mma_best_m{m}"] = best
            row[f"mma_tuned_m{m}"] = per_call(lambda i: int4_mma.mm(x, *ours[i]))
            print(f"  {n}x{k} m{m}: bf16 {bf16 * 1e3:.1f} us, GemLite "
                  f"{row[f'gemlite_m{m}'] * 1e3:.1f}, mma best {best[0] * 1e3:.1f} "
                  f"(c{best[1]} s{best[2]}), tuned {row[f'mma_tuned_m{m}'] * 1e3:.1f} "
                  f"{int4_mma.choose(m, n, k, x.device)}, floor {floor * 1e3:.1f}", flush=True)
        return row
    return measure


if __name__ == "__main__":
    start = time.time()
    int4_mma.ops(torch.cuda.get_device_capability())
    print(f"built in {time.time() - start:.0f} s", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    print("check:", check(gen), flush=True)
    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    run(measure_shape(rate))

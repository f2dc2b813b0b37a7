"""Latent attention (DeepSeek's absorbed MLA: one KV head of 64 + 512, values are keys)
through triton_paged, per launch setting.

Decode: one query row a sequence, 16 heads (V2-Lite, Moonlight) or 128 (V3, Kimi K2 at one
GPU's share of none), each call over its own random blocks of a cache larger than the L2,
10 calls a CUDA graph; the rows' bytes (576 x 2 a key, read once) over the copy rate
measured first. Prefill: one 4,096-token prompt, its FLOPs (scores over 576 dims, the
output over 576) over the time.

One JSON line per row to OUT/latent_attention.jsonl; prints the best setting per shape.

    python3 docs/bench/latent_attention.py [--quick]
"""
import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_sweep import time_graph  # noqa: E402
from long_context_attention import copy_rate, metadata  # noqa: E402

from roseinfer.core.attention import AttnMetadata  # noqa: E402
from roseinfer.plugins.attention import triton_latent, triton_paged  # noqa: E402

BLOCK, WIDTH, CALLS = 16, 576, 10
DECODE = [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (128, 1024)]


def decode_settings(heads: int, quick: bool):
    if quick:
        yield dict(triton_latent.LATENT_TUNING["decode"])
        return
    for block_h, block_n, warps, stages, ppsm, most in itertools.product(
            [16, 32, 64] if heads > 16 else [16], [32, 64], [4, 8], [2, 3], [2, 4], [64, 128]):
        yield {"block_h": block_h, "block_n": block_n, "num_warps": warps,
               "num_stages": stages, "programs_per_sm": ppsm, "max_splits": most}


def prefill_settings(quick: bool):
    if quick:
        yield dict(triton_latent.LATENT_TUNING["prefill"])
        return
    for block_m, block_n, warps, stages in itertools.product([32, 64], [32, 64], [4, 8], [1, 2]):
        yield {"block_m": block_m, "block_h": 16, "block_n": block_n, "num_warps": warps,
               "num_stages": stages}


def run(calls, kind, setting):
    shipped = dict(triton_latent.LATENT_TUNING[kind])
    triton_latent.LATENT_TUNING[kind] = setting
    try:
        return time_graph(calls), calls[0]().float()
    finally:
        triton_latent.LATENT_TUNING[kind] = shipped


def decode_rows(heads, quick, peak, out):
    need = max(b * c for b, c in DECODE) // BLOCK + 1
    cache = torch.randn(need, 1, BLOCK, WIDTH, device="cuda", dtype=torch.bfloat16)
    backend = triton_paged.TritonPagedAttention()
    for batch, ctx in DECODE:
        attns = metadata(batch, ctx, need, ctx)
        q = torch.randn(batch, heads, WIDTH, device="cuda", dtype=torch.bfloat16)
        calls = [functools.partial(backend.forward, q, cache, cache, a, 192 ** -0.5)
                 for a in attns]
        kv_bytes = batch * ctx * WIDTH * 2
        best, ref = None, None
        for s in decode_settings(heads, quick):
            try:
                t, got = run(calls, "decode", s)
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses
                print(f"skip decode {heads} {s}: {type(e).__name__}", flush=True)
                continue
            ref = got if ref is None else ref
            row = {"kind": "decode", "heads": heads, "batch": batch, "context": ctx,
                   "us": t * 1e6, "fraction": kv_bytes / peak / t,
                   "max_diff": (got - ref).abs().max().item(), **s}
            out.write(json.dumps(row) + "\n")
            best = row if best is None or row["us"] < best["us"] else best
        print(f"decode h{heads} {batch}x{ctx}: best {best['us']:.1f} us, "
              f"{best['fraction']:.1%} of the copy rate, {best}", flush=True)
    del cache
    torch.cuda.empty_cache()


def prefill_rows(heads, quick, out, length=4096):
    cache = torch.randn(length // BLOCK + 1, 1, BLOCK, WIDTH, device="cuda", dtype=torch.bfloat16)
    attn = AttnMetadata(torch.arange(1, length // BLOCK + 1, device="cuda").int().view(1, -1),
                        torch.tensor([length], dtype=torch.int32, device="cuda"),
                        torch.tensor([0, length], dtype=torch.int32, device="cuda"),
                        length, length)
    q = torch.randn(length, heads, WIDTH, device="cuda", dtype=torch.bfloat16)
    backend = triton_paged.TritonPagedAttention()
    calls = [functools.partial(backend.forward, q, cache, cache, attn, 192 ** -0.5)] * 2
    flops = 2 * 2 * heads * WIDTH * length * (length + 1) / 2  # causal: half the square
    best = None
    for s in prefill_settings(quick):
        try:
            t, _ = run(calls, "prefill", s)
        except Exception as e:  # noqa: BLE001
            print(f"skip prefill {heads} {s}: {type(e).__name__}", flush=True)
            continue
        row = {"kind": "prefill", "heads": heads, "length": length, "us": t * 1e6,
               "tflops": flops / t / 1e12, **s}
        out.write(json.dumps(row) + "\n")
        best = row if best is None or row["us"] < best["us"] else best
    print(f"prefill h{heads} {length}: best {best['us']:.0f} us, {best['tflops']:.0f} TFLOP/s,"
          f" {best}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the shipped tuning only")
    ap.add_argument("--heads", default="16,128", help="query heads, comma-separated")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    peak = copy_rate()
    print(f"copy rate {peak / 1e12:.2f} TB/s", flush=True)
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "latent_attention.jsonl"), "a") as out:
        for heads in map(int, args.heads.split(",")):
            decode_rows(heads, args.quick, peak, out)
            if not args.no_prefill:
                prefill_rows(heads, args.quick, out)


if __name__ == "__main__":
    main()

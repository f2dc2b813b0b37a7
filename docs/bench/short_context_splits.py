"""Decode attention at short contexts under every split count: what a graph captured for a
long context bound (the engine's max_model_len) costs a short context.

The split count follows the bound, not the context (triton_paged.num_splits): at batch 1
a 40k bound gives the most splits, and at a 512-token context most of them find no keys
and the merge reads them all. For each model's attention shape and (batch, context): the
time of one decode attention call (kernel and merge) inside a CUDA graph, with the
shipped rule at ``--bound`` and with each split count forced, and the K/V floor.

    python3 docs/bench/short_context_splits.py [--bound 40960]
"""
import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_sweep import time_graph  # noqa: E402
from long_context_attention import copy_rate, metadata  # noqa: E402

from roseinfer.plugins.attention import triton_paged  # noqa: E402

BLOCK = 16
# (name, query heads, KV heads, head dim)
CLASSES = [("qwen3-30b-a3b", 32, 4, 128), ("llama3-8b", 32, 8, 128),
           ("llama3.2-1b", 32, 8, 64), ("gpt-oss-20b", 64, 8, 64)]
SHAPES = [(1, 128), (1, 512), (1, 2048), (1, 8192), (8, 512), (8, 2048)]
SPLITS = [1, 2, 4, 8, 16, 32, 64]


def timed(calls, splits=None) -> float:
    """Seconds per call; ``splits`` forces the split count."""
    rule = triton_paged.num_splits
    if splits is not None:
        triton_paged.num_splits = lambda *a, **k: splits
    try:
        return time_graph(calls)
    finally:
        triton_paged.num_splits = rule


def sweep(cls, bound, peak, out):
    name, heads, kv_heads, head_dim = cls
    need = max(b * c for b, c in SHAPES) // BLOCK + 1
    k_cache = torch.randn(need, kv_heads, BLOCK, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    backend = triton_paged.TritonPagedAttention()
    tune = triton_paged.decode_tuning(head_dim, heads // kv_heads)
    for batch, ctx in SHAPES:
        attns = metadata(batch, ctx, need, bound)
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        calls = [functools.partial(backend.forward, q, k_cache, v_cache, a, head_dim ** -0.5)
                 for a in attns]
        shipped = triton_paged.num_splits(attns[0], kv_heads, triton_paged._num_sms(q.device),
                                          tune)
        kv_bytes = batch * ctx * kv_heads * head_dim * 4
        row = {"class": name, "batch": batch, "context": ctx, "bound": bound,
               "floor_us": kv_bytes / peak * 1e6, "shipped_splits": shipped,
               "shipped_us": timed(calls) * 1e6,
               "forced_us": {s: timed(calls, s) * 1e6 for s in SPLITS}}
        best = min(row["forced_us"], key=row["forced_us"].get)
        out.write(json.dumps(row) + "\n")
        out.flush()
        forced = " ".join(f"{s}:{t:.2f}" for s, t in row["forced_us"].items())
        print(f"{name:14s} {batch:3d} x {ctx:5d}: shipped ({shipped} splits) "
              f"{row['shipped_us']:.2f} us | best {best} splits {row['forced_us'][best]:.2f} us "
              f"| floor {row['floor_us']:.2f} | {forced}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bound", type=int, default=40960)
    args = p.parse_args()
    peak = copy_rate()
    print(f"copy rate {peak / 1e12:.2f} TB/s, bound {args.bound}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "short_context_splits.jsonl"), "w") as out:
        for cls in CLASSES:
            sweep(cls, args.bound, peak, out)


if __name__ == "__main__":
    main()

"""Sweep triton_paged's decode launch settings over real model shapes.

For each (head dim, query heads per KV head) class and each (batch, context)
shape: the time of one decode attention call inside a CUDA graph (10 calls
per replay), the bytes floor (K/V read at 3.0 TB/s) and the fraction of it,
per setting. The graph is captured as the engine captures it: with the
context bound (--bound) as max_context_len, so splits follow the bound.

Writes one JSON line per (shape, setting) to OUT/decode_sweep.jsonl and
prints, per class, the setting with the best geometric-mean fraction over
shapes with >= 8 MB of K/V, and every shape's figure under it.

    python docs/bench/decode_attention_sweep.py --out DIR [--cache-dtype fp8]
"""
import argparse
import functools
import itertools
import json
import math
import os

import torch

from roseinfer.core.attention import AttnMetadata
from roseinfer.plugins.attention import triton_paged

PEAK = 3.0e12
HEADS = 32
BLOCK = 16
CLASSES = [(64, 1), (64, 4), (64, 8), (128, 1), (128, 4), (128, 8)]
BATCHES = [1, 16, 64, 256]
CONTEXTS = [128, 512, 2048, 8192]
MAX_BYTES = 8 << 30
CALLS = 10


def settings(dot_only: bool):
    for bn, w, st in itertools.product([16, 32], [1, 2, 4], [1, 2]):
        if not dot_only:
            yield {"dot": False, "block_n": bn, "num_warps": w, "num_stages": st}
    for bn, st in itertools.product([32, 64, 128], [2, 3, 4]):
        yield {"dot": True, "block_n": bn, "num_warps": 4, "num_stages": st}


def time_graph(fns, replays=5) -> float:
    """Seconds per call of the ``fns`` captured back to back in one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (len(fns) * replays)


def shapes(head_dim, group, itemsize=2):
    kv_heads = HEADS // group
    for batch, ctx in itertools.product(BATCHES, CONTEXTS):
        kv_bytes = batch * ctx * kv_heads * head_dim * 2 * itemsize
        if kv_bytes <= MAX_BYTES:
            yield batch, ctx, kv_bytes


def sweep_class(head_dim, group, bound, dot_only, out, cache_dtype=torch.bfloat16):
    kv_heads = HEADS // group
    need = max(b * c for b, c, _ in shapes(head_dim, group)) // BLOCK + 1
    k_cache = torch.randn(need, kv_heads, BLOCK, head_dim, device="cuda").to(cache_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.bfloat16).to(cache_dtype)
    backend = triton_paged.TritonPagedAttention()
    results = []
    for batch, ctx, kv_bytes in shapes(head_dim, group, cache_dtype.itemsize):
        # Each of the graph's calls reads its own random blocks of the whole cache, so
        # that K/V small enough for the L2 cache (50 MB) is not read from it, as in a
        # model, where the other layers' K/V and weights pass between two reads.
        blocks = ctx // BLOCK
        attns = [AttnMetadata(
            (torch.randperm(need - 1, device="cuda")[:batch * blocks].int() + 1).view(batch, blocks),
            torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
            torch.arange(batch + 1, dtype=torch.int32, device="cuda"), 1, max(bound, ctx))
            for _ in range(CALLS)]
        q = torch.randn(batch, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
        calls = [functools.partial(backend.forward, q, k_cache, v_cache, attn, head_dim ** -0.5)
                 for attn in attns]
        floor = kv_bytes / PEAK
        for s, ppsm in itertools.product(settings(dot_only), [4, 8] if dot_only else [4, 8, 16]):
            triton_paged.DECODE_TUNING.clear()
            triton_paged.TUNING["decode"] = dict(s, programs_per_sm=ppsm)
            try:
                t = time_graph(calls)
            except Exception as e:  # a setting the compiler refuses (e.g. out of shared memory)
                print(f"skip {head_dim}/{group} {s} {ppsm}: {type(e).__name__}", flush=True)
                continue
            row = dict(head_dim=head_dim, group=group, batch=batch, context=ctx,
                       cache=str(cache_dtype).removeprefix("torch."),
                       kv_mb=kv_bytes / 2**20, us=t * 1e6, floor_us=floor * 1e6,
                       fraction=floor / t, programs_per_sm=ppsm, **s)
            results.append(row)
            out.write(json.dumps(row) + "\n")
        out.flush()
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return results


def best(results):
    """The setting with the best geometric-mean fraction over shapes >= 8 MB."""
    def key(r):
        return tuple(r[k] for k in ("dot", "block_n", "num_warps", "num_stages", "programs_per_sm"))
    by_setting = {}
    for r in results:
        by_setting.setdefault(key(r), []).append(r)
    def score(rows):
        big = [r["fraction"] for r in rows if r["kv_mb"] >= 8]
        return math.exp(sum(map(math.log, big)) / len(big)) if big else 0
    return max(by_setting.items(), key=lambda kv: score(kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--bound", type=int, default=8192, help="max_context_len the graphs capture with")
    ap.add_argument("--classes", default=",".join(f"{d}x{g}" for d, g in CLASSES))
    ap.add_argument("--dot-only", action="store_true", help="only the tensor-core tile")
    ap.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "fp8"])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    with open(os.path.join(args.out, f"decode_sweep_{args.cache_dtype}.jsonl"), "w") as out:
        for cls in args.classes.split(","):
            head_dim, group = map(int, cls.split("x"))
            cache = torch.float8_e4m3fn if args.cache_dtype == "fp8" else torch.bfloat16
            (setting, rows) = best(sweep_class(head_dim, group, args.bound, args.dot_only, out,
                                               cache))
            print(f"head_dim {head_dim} group {group}: best {setting}", flush=True)
            for r in rows:
                print(f"  batch {r['batch']:4d} ctx {r['context']:5d} {r['kv_mb']:9.1f} MB "
                      f"{r['us']:8.1f} us floor {r['floor_us']:8.1f} us {100 * r['fraction']:5.1f} %",
                      flush=True)


if __name__ == "__main__":
    main()

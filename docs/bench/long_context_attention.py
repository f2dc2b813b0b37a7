"""Decode attention at long contexts: triton_paged's split rule against torch's SDPA.

For each attention shape (Llama-3-8B: 32 heads over 8 KV heads of 128; Gemma-3-12B's
global layers: 16 over 8 of 256; Qwen3-Next's: 16 over 2 of 256), cache dtype and (batch, context): the time of one
decode attention call inside a CUDA graph (10 calls a replay, each over its own random
blocks of a cache larger than the L2), its K/V bytes over the copy rate measured first
(the floor), and the fraction of it, for each split rule (most splits, programs per SM)
and tile (keys a tile, pipeline stages). Graphs are captured with ``--bound`` as
max_context_len, as an engine with that max_model_len captures them. Beside them, for
bfloat16: torch's scaled_dot_product_attention over K/V already contiguous (the floor of
effort: no paging) and with the gather from the paged cache counted.

One JSON line per row to OUT/long_context_attention.jsonl; prints per class the best
setting per shape and the setting with the best geometric mean over shapes.

    python3 docs/bench/long_context_attention.py [--bound 131072] [--mode grid|quick|compare|fp8]
"""
import argparse
import functools
import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_attention_sweep import time_graph  # noqa: E402

from roseinfer.core.attention import AttnMetadata  # noqa: E402
from roseinfer.plugins.attention import triton_paged  # noqa: E402

BLOCK = 16
CALLS = 10
# (name, query heads, KV heads, head dim)
CLASSES = [("llama3-8b", 32, 8, 128), ("gemma3-12b-global", 16, 8, 256),
           ("qwen3-next", 16, 2, 256)]
SHAPES = [(1, 512), (1, 2048), (1, 8192), (1, 32768), (1, 131072), (4, 32768), (16, 8192),
          (64, 2048), (256, 1024)]


def copy_rate() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (median of 20)."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * x.element_size() / sorted(times)[len(times) // 2]


# The tuning before the split rule followed long contexts (at most 16 splits; Gemma's
# 32-key tile; FP8 caches with their class's stages): the baseline of --compare.
BEFORE = {(128, 4): {"block_n": 64, "num_stages": 2, "max_splits": 16, "programs_per_sm": 4},
          (256, 2): {"block_n": 32, "num_stages": 2, "max_splits": 16, "programs_per_sm": 4}}


def before_num_splits(attn, num_kv_heads, num_sms, tune, window=triton_paged.NO_WINDOW):
    """The split count before: as now, without rounding down to a power of two."""
    if not attn.is_decode:
        return 1
    wanted = -(-tune["programs_per_sm"] * num_sms // (attn.num_seqs * num_kv_heads))
    keys = min(attn.max_context_len, window)
    return max(1, min(wanted, keys // triton_paged.MIN_SPLIT_LEN, tune.get("max_splits", 64)))


def settings(mode: str, head_dim: int, group: int, fp8: bool):
    """(label, tile settings) to time: the grid, or the shipped tuning and the one before;
    ``fp8``: the FP8 cache's tiles x warps."""
    shipped = triton_paged.decode_tuning(head_dim, group, fp8)
    if mode == "compare":
        before = dict(BEFORE[(head_dim, group)], **({"block_n": 128} if fp8 else {}))
        yield "shipped", {k: shipped.get(k, triton_paged.MAX_SPLITS) for k in before}
        yield "before", before
        return
    if mode == "fp8":
        most = shipped.get("max_splits", triton_paged.MAX_SPLITS)
        for (block_n, stages), warps in itertools.product([(64, 2), (128, 2), (128, 3), (256, 2)],
                                                          [4, 8]):
            yield "grid", {"block_n": block_n, "num_stages": stages, "max_splits": most,
                           "programs_per_sm": 4, "num_warps": warps}
        return
    yield "shipped", shipped
    splits = [16, 32, 64, 128]
    ppsm = [2, 4, 8]
    tiles = [(64, 3)] if mode == "quick" else [(32, 3), (64, 2), (64, 3), (64, 4), (128, 2),
                                               (128, 3)]
    for (block_n, stages), s, p in itertools.product(tiles, splits, ppsm):
        yield "grid", {"block_n": block_n, "num_stages": stages, "max_splits": s,
                       "programs_per_sm": p}


def apply(setting: dict, head_dim: int, group: int) -> dict:
    """The class's tuning set to ``setting`` (the FP8 tile too); returns it."""
    tune = {"num_warps": 4, "dot": True, **setting}
    triton_paged.FP8_TILE = {k: setting[k] for k in ("block_n", "num_stages", "programs_per_sm",
                                                     "num_warps") if k in setting}
    triton_paged.DECODE_TUNING[(head_dim, group)] = tune
    return tune


def metadata(batch: int, ctx: int, need: int, bound: int) -> list[AttnMetadata]:
    blocks = ctx // BLOCK
    return [AttnMetadata(
        (torch.randperm(need - 1, device="cuda")[:batch * blocks].int() + 1).view(batch, blocks),
        torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        torch.arange(batch + 1, dtype=torch.int32, device="cuda"), 1, max(bound, ctx))
        for _ in range(CALLS)]


def sdpa_rows(q, k_cache, v_cache, attns, scale):
    """(contiguous, gathered) seconds per call of torch's SDPA, GQA, one query row."""
    import torch.nn.functional as F
    batch, heads, head_dim = q.shape
    q4 = q.view(batch, heads, 1, head_dim)

    def gather(cache, table):
        x = cache[table.long()]                       # [B, blocks, Hkv, BLOCK, D]
        return x.permute(0, 2, 1, 3, 4).reshape(batch, cache.shape[1], -1, head_dim)

    ks = [gather(k_cache, a.block_tables) for a in attns[:2]]
    vs = [gather(v_cache, a.block_tables) for a in attns[:2]]
    contiguous = [functools.partial(F.scaled_dot_product_attention, q4, ks[i % 2], vs[i % 2],
                                    scale=scale, enable_gqa=True) for i in range(CALLS)]
    gathered = [functools.partial(lambda a: F.scaled_dot_product_attention(
        q4, gather(k_cache, a.block_tables), gather(v_cache, a.block_tables), scale=scale,
        enable_gqa=True), a) for a in attns]
    out = []
    for calls in (contiguous, gathered):
        try:
            out.append(time_graph(calls))
        except Exception as e:  # noqa: BLE001 - a backend torch has not for this shape
            print(f"sdpa: {type(e).__name__}: {str(e)[:120]}", flush=True)
            out.append(None)
    return out


def sweep(cls, cache_dtype, bound, mode, peak, out):
    name, heads, kv_heads, head_dim = cls
    group = heads // kv_heads
    itemsize = torch.finfo(cache_dtype).bits // 8
    most = max(b * c for b, c in SHAPES)
    need = most // BLOCK + 1
    k_cache = torch.randn(need, kv_heads, BLOCK, head_dim, device="cuda").to(cache_dtype)
    v_cache = torch.randn(need, kv_heads, BLOCK, head_dim, device="cuda").to(cache_dtype)
    backend = triton_paged.TritonPagedAttention()
    rows = []
    for batch, ctx in SHAPES:
        kv_bytes = batch * ctx * kv_heads * head_dim * 2 * itemsize
        attns = metadata(batch, ctx, need, bound)
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        ref = None
        calls = [functools.partial(backend.forward, q, k_cache, v_cache, a, head_dim ** -0.5)
                 for a in attns]
        base = {"class": name, "cache": str(cache_dtype).removeprefix("torch."), "batch": batch,
                "context": ctx, "bound": bound, "kv_mb": kv_bytes / 2**20,
                "floor_us": kv_bytes / peak * 1e6}
        fp8 = cache_dtype != torch.bfloat16
        shipped = (dict(triton_paged.DECODE_TUNING), dict(triton_paged.FP8_TILE))
        rule = triton_paged.num_splits
        for label, s in settings(mode, head_dim, group, fp8):
            tune = apply(s, head_dim, group)
            if label == "before":
                triton_paged.num_splits = before_num_splits
            try:
                t = time_graph(calls)
                got = calls[0]().float()
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses
                print(f"skip {name} {s}: {type(e).__name__}", flush=True)
                continue
            finally:
                triton_paged.DECODE_TUNING, triton_paged.FP8_TILE = map(dict, shipped)
                splits = triton_paged.num_splits(attns[0], kv_heads,
                                                 triton_paged._num_sms(q.device), tune)
                triton_paged.num_splits = rule
            ref = got if ref is None else ref
            row = dict(base, kernel="triton_paged", label=label, us=t * 1e6,
                       fraction=kv_bytes / peak / t, splits=splits,
                       max_err=(got - ref).abs().max().item(), **s)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
        if cache_dtype == torch.bfloat16:
            for kernel, t in zip(("sdpa_contiguous", "sdpa_gathered"),
                                 sdpa_rows(q, k_cache, v_cache, attns, head_dim ** -0.5)):
                if t is not None:
                    row = dict(base, kernel=kernel, us=t * 1e6, fraction=kv_bytes / peak / t)
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
        out.flush()
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return rows


def seconds(fn, reps: int = 3) -> float:
    """Median seconds of ``fn()`` after one warm-up, timed with events."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


PREFILL_GRID = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
                for m, n, w, st in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])]


def prefill_batch(length: int, seqs: int, chunk: int, kv_heads: int, head_dim: int):
    """(caches, q, the step's AttnMetadata per chunk): ``seqs`` prompts of ``length`` tokens
    in chunks of ``chunk`` queries (several prompts' chunks share a step)."""
    blocks = length // BLOCK
    k_cache = torch.randn(seqs * blocks + 1, kv_heads, BLOCK, head_dim, device="cuda",
                          dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(seqs * blocks, device="cuda").int() + 1).view(seqs, blocks)
    per = max(1, chunk // length)  # whole short prompts a step
    steps = []
    for first in range(0, seqs, per):
        rows = list(range(first, min(seqs, first + per)))
        for end in range(min(chunk, length), length + 1, min(chunk, length)):
            q_len = min(chunk, length)
            steps.append(AttnMetadata(
                table[rows], torch.full((len(rows),), end, dtype=torch.int32, device="cuda"),
                torch.arange(len(rows) + 1, dtype=torch.int32, device="cuda") * q_len,
                q_len, end))
    return k_cache, v_cache, steps


def prefill_grid(cls, chunk: int, out) -> None:
    """Every prefill tile of PREFILL_GRID over long prompts in chunks and many short
    prompts a step: ms for all the steps, per tile; prints the best for each shape and
    the current tile's."""
    name, heads, kv_heads, head_dim = cls
    backend = triton_paged.TritonPagedAttention()
    shipped = dict(triton_paged.TUNING["prefill"])
    for length, seqs in ((32768, 1), (8192, 1), (512, 16), (128, 32)):
        k_cache, v_cache, steps = prefill_batch(length, seqs, chunk, kv_heads, head_dim)
        qs = [torch.randn(int(a.query_start[-1]), heads, head_dim, device="cuda",
                          dtype=torch.bfloat16) for a in steps]
        flops = 2 * heads * head_dim * length ** 2 * seqs
        rows = []
        for tile in [shipped] + PREFILL_GRID:
            triton_paged.TUNING["prefill"] = tile
            try:
                t = seconds(lambda: [backend.forward(q, k_cache, v_cache, a, head_dim ** -0.5)
                                     for q, a in zip(qs, steps)])
            except Exception as e:  # noqa: BLE001 - a tile out of shared memory
                print(f"skip {tile}: {type(e).__name__}", flush=True)
                continue
            finally:
                triton_paged.TUNING["prefill"] = shipped
            rows.append(dict(tile, ms=t * 1e3, tflops=flops / t / 1e12))
            out.write(json.dumps({"class": name, "kernel": "prefill_grid", "prompt": length,
                                  "seqs": seqs, "chunk": chunk, **rows[-1]}) + "\n")
        best = min(rows[1:], key=lambda r: r["ms"])
        print(f"  prefill tiles {name} {seqs} x {length}: shipped {rows[0]['ms']:.3f} ms "
              f"({rows[0]['tflops']:.0f} TFLOP/s) | best {best['ms']:.3f} ms "
              f"({best['tflops']:.0f}) {[best[k] for k in shipped]}", flush=True)


def prefill(cls, chunk: int, out) -> None:
    """A whole prompt's attention, causal: triton_paged as the engine runs it (chunks of
    ``chunk`` queries, each over the cache before it) against torch's SDPA over the whole
    contiguous prompt at once, in TFLOP/s (2 * heads * head_dim * L^2 for causal)."""
    import torch.nn.functional as F
    name, heads, kv_heads, head_dim = cls
    backend = triton_paged.TritonPagedAttention()
    for length in (8192, 32768, 131072):
        blocks = length // BLOCK
        k_cache = torch.randn(blocks + 1, kv_heads, BLOCK, head_dim, device="cuda",
                              dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = (torch.randperm(blocks, device="cuda").int() + 1).view(1, blocks)
        q = torch.randn(length, heads, head_dim, device="cuda", dtype=torch.bfloat16)

        def chunked():
            for end in range(chunk, length + 1, chunk):
                attn = AttnMetadata(table, torch.tensor([end], dtype=torch.int32, device="cuda"),
                                    torch.tensor([0, chunk], dtype=torch.int32, device="cuda"),
                                    chunk, end)
                backend.forward(q[end - chunk:end], k_cache, v_cache, attn, head_dim ** -0.5)

        k = k_cache[1:].permute(1, 0, 2, 3).reshape(1, kv_heads, length, head_dim)
        v = v_cache[1:].permute(1, 0, 2, 3).reshape(1, kv_heads, length, head_dim)
        q4 = q.transpose(0, 1).unsqueeze(0)
        whole = functools.partial(F.scaled_dot_product_attention, q4, k, v, is_causal=True,
                                  scale=head_dim ** -0.5, enable_gqa=True)
        flops = 2 * heads * head_dim * length ** 2
        for kernel, fn in (("triton_paged_chunked", chunked), ("sdpa_causal_whole", whole)):
            t = seconds(fn)
            row = {"class": name, "kernel": kernel, "prompt": length, "chunk": chunk,
                   "ms": t * 1e3, "tflops": flops / t / 1e12}
            out.write(json.dumps(row) + "\n")
            print(f"  prefill {name} {length:6d} tokens {kernel:>22}: {t * 1e3:9.2f} ms "
                  f"{flops / t / 1e12:6.1f} TFLOP/s", flush=True)


def report_compare(rows):
    for batch, ctx in SHAPES:
        shape = {r.get("label", r["kernel"]): r for r in rows
                 if (r["batch"], r["context"]) == (batch, ctx)}
        new, old = shape["shipped"], shape["before"]
        others = " ".join(f"{k} {r['us']:.1f} us ({r['fraction']:.0%})" for k, r in shape.items()
                          if r["kernel"] != "triton_paged")
        print(f"  {batch:4d} x {ctx:6d}: floor {new['floor_us']:8.1f} us | before "
              f"{old['us']:8.1f} us ({old['fraction']:.0%}, {old['splits']} splits) | shipped "
              f"{new['us']:8.1f} us ({new['fraction']:.0%}, {new['splits']} splits): "
              f"{old['us'] / new['us']:.2f}x | {others}", flush=True)


def report(rows, shipped_class):
    """The best setting per shape and overall; ``shipped_class``: (head dim, group, fp8)."""
    tri = [r for r in rows if r["kernel"] == "triton_paged"]
    key = lambda r: (r["block_n"], r["num_stages"],  # noqa: E731
                     r.get("max_splits", triton_paged.MAX_SPLITS), r["programs_per_sm"],
                     r.get("num_warps", 4), r.get("dot", True))
    by_setting = {}
    for r in tri:
        by_setting.setdefault(key(r), []).append(r)
    geo = {k: math.exp(sum(math.log(r["fraction"]) for r in v) / len(v))
           for k, v in by_setting.items() if len(v) == len(SHAPES)}
    if not geo:
        print("no setting ran at every shape")
        return
    best = max(geo, key=geo.get)
    current = key(dict({"max_splits": triton_paged.MAX_SPLITS},
                       **triton_paged.decode_tuning(*shipped_class)))
    print(f"best overall (block_n, stages, max_splits, programs/SM, warps) {best}: geomean "
          f"{geo[best]:.1%}; current {current}: {geo.get(current, float('nan')):.1%}")
    for batch, ctx in SHAPES:
        shape = [r for r in rows if (r["batch"], r["context"]) == (batch, ctx)]
        top = max((r for r in shape if r["kernel"] == "triton_paged"), key=lambda r: r["fraction"])
        pick = next(r for r in by_setting[best] if (r["batch"], r["context"]) == (batch, ctx))
        cur = next((r for r in by_setting.get(current, [])
                    if (r["batch"], r["context"]) == (batch, ctx)), None)
        others = " ".join(f"{r['kernel']} {r['us']:.1f} us ({r['fraction']:.0%})"
                          for r in shape if r["kernel"] != "triton_paged")
        print(f"  {batch:4d} x {ctx:6d}: floor {pick['floor_us']:8.1f} us | current "
              f"{cur['us'] if cur else float('nan'):8.1f} us ({cur['fraction'] if cur else 0:.0%}) "
              f"| best-overall {pick['us']:8.1f} us ({pick['fraction']:.0%}, {pick['splits']} splits) "
              f"| best here {top['us']:8.1f} us ({top['fraction']:.0%}) {key(top)} | {others}",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--bound", type=int, default=131072)
    ap.add_argument("--mode", default="grid", choices=["grid", "quick", "compare", "fp8", "prefill"],
                    help="grid: tiles x split rules; quick: one tile; compare: the shipped "
                         "tuning against the one before; fp8: the FP8 cache's tiles x warps; "
                         "prefill: the prefill tiles")
    ap.add_argument("--classes", default=",".join(c[0] for c in CLASSES))
    ap.add_argument("--caches", default="bfloat16,float8_e4m3fn")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="also time whole prompts' attention in chunks of this many queries")
    args = ap.parse_args()
    peak = copy_rate()
    print(f"{torch.cuda.get_device_name()}: copy {peak / 1e12:.2f} TB/s", flush=True)
    with open(os.path.join(args.out, "long_context_attention.jsonl"), "w") as out:
        for cls in CLASSES:
            if cls[0] not in args.classes.split(","):
                continue
            if args.mode == "prefill":  # the prefill tiles only
                prefill_grid(cls, args.prefill_chunk or 4096, out)
                continue
            for cache in args.caches.split(","):
                print(f"== {cls[0]} cache {cache}", flush=True)
                rows = sweep(cls, getattr(torch, cache), args.bound, args.mode, peak, out)
                if args.mode == "compare":
                    report_compare(rows)
                else:
                    report(rows, (cls[3], cls[1] // cls[2], cache != "bfloat16"))
            if args.prefill_chunk:
                prefill(cls, args.prefill_chunk, out)


if __name__ == "__main__":
    main()

"""Prefill attention of this tree against the tree in .base (`git archive REV roseinfer |
tar -x -C .base`), in one process on one GPU: the kernel level (long prompts in chunks and
many short prompts a step, as long_context_attention.py's prefill grid runs them, each
tree with the shipped tile and this tree with a few more), the largest difference between
the two trees' outputs, and a 32k prompt's TTFT through the engine with each tree's
kernel swapped in, alternated.

One JSON line per row to OUT/prefill_attention_ab.jsonl.

    python3 docs/bench/prefill_attention_ab.py [--ttft llama3-8b-random:32768,...] [--tiles ...]
        [--classes llama3-8b,gemma3-12b-global] (--classes "": the TTFT rows alone)
"""
import argparse
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from long_context_attention import CLASSES, prefill_batch, seconds  # noqa: E402

from roseinfer.plugins.attention import triton_paged  # noqa: E402

BASE = ".base/roseinfer/plugins/attention/triton_paged.py"
SHAPES = ((32768, 1), (8192, 1), (512, 16), (128, 32))  # (prompt, prompts)
# block_m, block_n, warps, stages: tiles of the earlier sweep's best rows
TILES = ["128,64,8,2", "128,64,8,3", "128,128,8,2", "64,64,4,3", "128,32,4,2"]


def base_module():
    spec = importlib.util.spec_from_file_location("triton_paged_base", BASE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tile(text: str) -> dict:
    m, n, w, s = map(int, text.split(","))
    return dict(block_m=m, block_n=n, num_warps=w, num_stages=s)


def kernels(cls, tiles: list[dict], base, out) -> None:
    name, heads, kv_heads, head_dim = cls
    shipped = dict(triton_paged.TUNING["prefill"])
    triton_paged.PREFILL_LONG_TUNING = {}  # every step on the tile each variant names
    variants = [("before", base, shipped), ("after", triton_paged, shipped)] + [
        ("after", triton_paged, t) for t in tiles if t != shipped]
    for length, seqs in SHAPES:
        k_cache, v_cache, steps = prefill_batch(length, seqs, 4096, kv_heads, head_dim)
        qs = [torch.randn(int(a.query_start[-1]), heads, head_dim, device="cuda",
                          dtype=torch.bfloat16) for a in steps]
        flops = 2 * heads * head_dim * length ** 2 * seqs
        outs = {}
        for label, module, t in variants:
            module.TUNING["prefill"] = t
            backend = module.TritonPagedAttention()
            call = lambda: [backend.forward(q, k_cache, v_cache, a, head_dim ** -0.5)  # noqa: E731
                            for q, a in zip(qs, steps)]
            try:
                outs.setdefault(label, call())
                ms = seconds(call) * 1e3
            except Exception as e:  # noqa: BLE001 - a tile out of shared memory
                print(f"  skip {label} {t}: {type(e).__name__}", flush=True)
                continue
            finally:
                module.TUNING["prefill"] = shipped
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(outs["before"], outs[label]))
            row = {"class": name, "prompt": length, "seqs": seqs, "label": label, **t,
                   "ms": ms, "tflops": flops / ms / 1e9, "max_diff_vs_before": diff}
            out.write(json.dumps(row) + "\n")
            print(f"  {name} {seqs:2d} x {length:6d} {label:>6} {list(t.values())}: "
                  f"{ms:9.3f} ms {row['tflops']:6.1f} TFLOP/s (max diff {diff:.2e})", flush=True)


def ttft(spec: str, base, out, rounds: int = 2) -> None:
    """A whole prompt's prefill through the engine, this tree's kernel and .base's swapped
    in turn into the plugin module (its forward looks the kernel up when it launches), this
    tree's with its long-step tiles and with the short ones alone. Prompt steps run
    eagerly (no mixed graphs: a graph would hold the kernel it captured)."""
    from roseinfer import LLM, SamplingParams
    model, length = spec.split(":")
    llm = LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=1, mixed_graph_max_tokens=0,
              enable_prefix_cache=False, max_model_len=int(length) + 512)
    long_tiles = triton_paged.PREFILL_LONG_TUNING
    variants = {"after": (triton_paged._paged_attention_kernel, long_tiles),
                "after-short-tiles": (triton_paged._paged_attention_kernel, {}),
                "before": (base._paged_attention_kernel, {})}
    labels = list(variants)
    for i in range(len(labels) * (rounds + 1)):  # a first, untimed pass compiles each
        label = labels[i % len(labels)]
        triton_paged._paged_attention_kernel, triton_paged.PREFILL_LONG_TUNING = variants[label]
        prompt = [(7 * j + i) % 1000 + 1 for j in range(int(length))]
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        torch.cuda.synchronize()
        s = time.perf_counter() - t
        if i >= len(labels):
            row = {"model": model, "prompt": int(length), "label": label, "ttft_s": s}
            out.write(json.dumps(row) + "\n")
            print(f"  TTFT {model} {length} {label}: {s:.3f} s", flush=True)
    triton_paged._paged_attention_kernel, triton_paged.PREFILL_LONG_TUNING = variants["after"]
    llm.engine.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--classes", default=",".join(c[0] for c in CLASSES))
    ap.add_argument("--tiles", default=";".join(TILES), help="block_m,block_n,warps,stages;...")
    ap.add_argument("--ttft", default="", help="MODEL:PROMPT,..., e.g. llama3-8b-random:32768")
    args = ap.parse_args()
    base = base_module()
    tiles = [tile(t) for t in args.tiles.split(";") if t]
    print(torch.cuda.get_device_name(), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "prefill_attention_ab.jsonl"), "a") as out:
        for cls in CLASSES:
            if cls[0] in args.classes.split(","):
                kernels(cls, tiles, base, out)
        for spec in filter(None, args.ttft.split(",")):
            ttft(spec, base, out)


if __name__ == "__main__":
    main()

"""The MoE experts at one or two tokens: a tile per (token, choice) pair, unsorted
(fused_experts at up to ``PER_PAIR_TOKENS`` tokens), against the expert-sorted tiles
that ``align_blocks`` lays out (every token count above it), in one process.

    python3 docs/bench/moe_per_pair.py [--peak-tbps 4.2] [--check]   # --check: CPU, interpreted
    python3 docs/bench/moe_per_pair.py --sweep   # per-pair tiles: BLOCK_N, BLOCK_K, warps, stages

Per shape (Qwen3-30B-A3B's 128 x (2048 -> 768), top 8; DeepSeek-V2-Lite's 64 x (2048 ->
1408), top 6; gpt-oss-20b's 32 x (2880 -> 2880), top 4, clamped GLU and biases), in bf16
and with FP8 experts, and token count 1, 2: µs per layer's experts in a CUDA graph of 8
layers (each its own weights, so they come from memory), the chosen experts' bytes over
the copy rate, and the largest difference between the two.
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

import torch

from roseinfer.layers import moe
from roseinfer.layers.moe import ClampedGlu, fused_experts
from roseinfer.layers.moe_routing import select_experts

# (name, experts, top k, hidden, expert width, gpt-oss's GLU and biases)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, False), ("deepseek-v2-lite", 64, 6, 2048, 1408, False),
          ("gpt-oss-20b", 32, 4, 2880, 2880, True)]


@contextmanager
def sorted_tiles():
    """fused_experts with every token count through align_blocks."""
    saved, moe.PER_PAIR_TOKENS = moe.PER_PAIR_TOKENS, 0
    try:
        yield
    finally:
        moe.PER_PAIR_TOKENS = saved


def layer(e, top_k, h, i, gpt_oss, fp8, tokens, device, dtype, gen):
    def randn(*shape, scale=1.0):  # drawn where they live: the GPU's shapes are GBs
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    w13, w2 = randn(e, 2 * i, h, scale=0.02), randn(e, h, i, scale=0.02)
    scales = None
    if fp8:  # e4m3 with a scale per row, as SparseMoE.to_fp8 keeps them
        scales = tuple(w.float().abs().amax(-1) / 448 for w in (w13, w2))
        w13, w2 = ((w.float() / s[..., None]).to(torch.float8_e4m3fn)
                   for w, s in zip((w13, w2), scales))
    biases = (randn(e, 2 * i, scale=0.02), randn(e, h, scale=0.02)) if gpt_oss else None
    x = randn(tokens, h)
    weights, ids = select_experts(torch.randn(tokens, e, generator=gen, device=device), top_k,
                                  True, use_triton=False)
    return dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids, scales=scales, biases=biases,
                glu=ClampedGlu(1.702, 7.0) if gpt_oss else None)


def run(L, use_triton=None):
    return fused_experts(L["x"], L["w13"], L["w2"], L["weights"], L["ids"], use_triton,
                         scales=L["scales"], biases=L["biases"], glu=L["glu"])


def both(L):
    """(per pair, sorted) results of one layer."""
    got = run(L, True)
    with sorted_tiles():
        return got, run(L, True)


TILES = [(64, 256, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (32, 256, 4, 3),
         (64, 256, 8, 3), (128, 256, 8, 3), (32, 128, 4, 4)]


@contextmanager
def per_pair_tile(tile):
    """fused_experts' per-pair tiles set to ``tile`` (FP8's own tile left as it is)."""
    saved = moe._config
    n, k, warps, stages = tile

    def config(pairs, fp8=False, per_pair=False, elem_bytes=2):
        if per_pair and not fp8:
            return dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)
        return saved(pairs, fp8, per_pair, elem_bytes)
    moe._config = config
    try:
        yield
    finally:
        moe._config = saved


def sweep():
    """Per-pair tiles at one and two tokens, bf16 experts, µs a layer."""
    from decode_attention_sweep import time_graph
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, e, top_k, h, i, gpt_oss in SHAPES:
        for tokens in (1, 2):
            layers = [layer(e, top_k, h, i, gpt_oss, False, tokens, "cuda", torch.bfloat16, gen)
                      for _ in range(8)]
            with sorted_tiles():
                cells = [f"sorted {time_graph([lambda L=L: run(L) for L in layers]) * 1e6:.1f}"]
            for tile in TILES:
                try:
                    with per_pair_tile(tile):
                        us = time_graph([lambda L=L: run(L) for L in layers]) * 1e6
                except Exception as err:  # noqa: BLE001 - a tile the compiler refuses
                    cells.append(f"{tile} {type(err).__name__}")
                    continue
                cells.append(f"{tile} {us:.1f}")
            print(f"{name} x{tokens}: " + "; ".join(cells), flush=True)


def check():
    """CPU, interpreted: both layouts equal the torch twin on small shapes."""
    gen = torch.Generator().manual_seed(0)
    for name, e, top_k, h, i, gpt_oss in SHAPES:
        for tokens in (1, 2):
            L = layer(e, top_k, h // 16, i // 16, gpt_oss, False, tokens, "cpu",
                      torch.float32, gen)
            want = run(L, False)
            for got in both(L):
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, (name, tokens, err)
            print(f"{name} x{tokens}: both layouts equal the torch twin")


def bench(peak):
    from decode_attention_sweep import time_graph
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (name, e, top_k, h, i, gpt_oss), fp8 in ((s, f) for s in SHAPES for f in (False, True)):
        for tokens in (1, 2):
            layers = [layer(e, top_k, h, i, gpt_oss, fp8, tokens, "cuda", torch.bfloat16, gen)
                      for _ in range(8)]
            chosen = torch.unique(layers[0]["ids"]).numel()
            bytes_ = chosen * 3 * h * i * (1 if fp8 else 2)
            per_pair = time_graph([lambda L=L: run(L) for L in layers])
            with sorted_tiles():
                aligned = time_graph([lambda L=L: run(L) for L in layers])
            got, want = both(layers[0])
            diff = ((got - want).float().abs().max() / want.float().abs().max()).item()
            print(f"{name}{' fp8' if fp8 else ''} x{tokens}: sorted {aligned * 1e6:.1f} us "
                  f"({bytes_ / peak / aligned:.0%} of the copy rate), per pair "
                  f"{per_pair * 1e6:.1f} us ({bytes_ / peak / per_pair:.0%}): "
                  f"{aligned / per_pair:.2f}x; max difference {diff:.1e}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-tbps", type=float, default=4.2)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    if args.check:
        check()
    elif args.sweep:
        sweep()
    else:
        bench(args.peak_tbps * 1e12)

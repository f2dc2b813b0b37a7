"""A candidate for the MoE experts at one or two tokens: each (token, choice) pair's
expert streamed as the skinny linears stream a dense weight, against fused_experts'
grouped GEMM (layers/moe.py).

The grouped GEMM pads each expert's pairs to a 16-row tile and needs the pairs sorted by
expert first (``align_blocks``); at one token every tile holds one real row. Here program
(pair, column block) reads its pair's expert rows over the whole of K, the pair's row
padded to the tensor cores' 16 as the skinny kernel pads its rows, with gate_up's
activation (SiLU, or gpt-oss's clamped form) and down's routing weight in the epilogues
as the grouped GEMM has them; no sort. Then the same sum over each token's choices.

    python3 docs/bench/moe_gemv.py [--peak-tbps 4.2] [--check]   # --check: CPU, interpreted

Per shape (Qwen3-30B-A3B's 128 x (2048 -> 768), top 8; DeepSeek-V2-Lite's 64 x (2048 ->
1408), top 6; gpt-oss-20b's 32 x (2880 -> 2880), top 4, clamped GLU and biases) and
token count 1, 2: µs per layer's experts in a CUDA graph of 8 layers (each its own
weights, so they come from memory), the chosen experts' bytes over the copy rate, and
the largest difference from fused_experts.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from roseinfer.core.triton_support import kernel as _kernel, tl, triton
from roseinfer.layers.moe import ClampedGlu, _glu, _of_rows, _sum_choices, fused_experts
from roseinfer.layers.moe_routing import select_experts


@_kernel
def _expert_gemv_kernel(a_ptr, w_ptr, scale_ptr, bias_ptr, c_ptr, weights_ptr, ids_ptr, N, K,
                        pairs_per_row, s_a, s_we, s_wn, s_se, s_be, s_c, alpha, limit,
                        SCALED: tl.constexpr, BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                        CLAMPED: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """C[pair] = A[pair // pairs_per_row] @ W[its expert].T, with the grouped GEMM's
    epilogues (``SWIGLU``, ``CLAMPED``, ``SCALED``, ``BIAS``, ``MUL_WEIGHTS``); a pair of
    expert -1 (another rank's) writes nothing."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    row = (pair // pairs_per_row).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, 16)
    w_rows = w_ptr + expert * s_we + cols[:, None] * s_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + row * s_a + rows[:, None] * 0 + ks[None, :],
                    mask=(rows == 0)[:, None] & (ks < K)[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=(cols < N)[:, None] & (ks < K)[None, :],
                    other=0.0)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
        if SWIGLU:
            w = tl.load(w_rows + N * s_wn + ks[None, :],
                        mask=(cols < N)[:, None] & (ks < K)[None, :], other=0.0)
            up = tl.dot(a, tl.trans(w.to(a.dtype)), up, input_precision=PRECISION)
    if SCALED:
        acc *= _of_rows(scale_ptr + expert * s_se, cols, N)
        if SWIGLU:
            up *= _of_rows(scale_ptr + expert * s_se + N, cols, N)
    if BIAS:
        acc += _of_rows(bias_ptr + expert * s_be, cols, N)
        if SWIGLU:
            up += _of_rows(bias_ptr + expert * s_be + N, cols, N)
    if SWIGLU:
        acc = _glu(acc.to(c_ptr.dtype.element_ty).to(tl.float32),
                   up.to(c_ptr.dtype.element_ty).to(tl.float32), alpha, limit, CLAMPED)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pair)
    tl.store(c_ptr + pair.to(tl.int64) * s_c + rows[:, None] * 0 + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=(rows == 0)[:, None] & (cols < N)[None, :])


def _gemv(a, w, scale, bias, weights, ids, pairs_per_row, swiglu, glu, block_n, block_k,
          warps, stages):
    pairs, n, k = ids.numel(), w.shape[1] // (2 if swiglu else 1), w.shape[2]
    c = torch.zeros((pairs, n), dtype=a.dtype, device=a.device)
    _expert_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        a, w, w if scale is None else scale, w if bias is None else bias, c, weights, ids,
        n, k, pairs_per_row, a.stride(0), w.stride(0), w.stride(1),
        0 if scale is None else scale.stride(0), 0 if bias is None else bias.stride(0),
        c.stride(0), glu.alpha if glu else 1.0, glu.limit if glu else 0.0,
        SCALED=scale is not None, BIAS=bias is not None, SWIGLU=swiglu,
        CLAMPED=glu is not None, MUL_WEIGHTS=not swiglu, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    return c


def experts_gemv(x, w13, w2, weights, ids, scales=None, biases=None, glu=None,
                 tile=(32, 512, 4, 3)):
    """fused_experts' result through the candidate: gate_up, then down, then the sum."""
    ids_flat = ids.flatten().contiguous()
    flat_weights = weights.flatten().float().contiguous()
    (s13, s2), (b13, b2) = scales or (None, None), biases or (None, None)
    act = _gemv(x.contiguous(), w13, s13, b13, flat_weights, ids_flat, ids.shape[1], True, glu,
                *tile)
    down = _gemv(act, w2, s2, b2, flat_weights, ids_flat, 1, False, None, *tile)
    return _sum_choices(down, ids)


# (name, experts, top k, hidden, expert width, gpt-oss's GLU and biases)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, False), ("deepseek-v2-lite", 64, 6, 2048, 1408, False),
          ("gpt-oss-20b", 32, 4, 2880, 2880, True)]


def layer(e, top_k, h, i, gpt_oss, tokens, device, dtype, gen):
    def randn(*shape, scale=1.0):  # drawn where they live: the GPU's shapes are GBs
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    w13, w2 = randn(e, 2 * i, h, scale=0.02), randn(e, h, i, scale=0.02)
    biases = (randn(e, 2 * i, scale=0.02), randn(e, h, scale=0.02)) if gpt_oss else None
    x = randn(tokens, h)
    logits = torch.randn(tokens, e, generator=gen, device=device)
    weights, ids = select_experts(logits, top_k, True, use_triton=False)
    return x, w13, w2, weights, ids, biases, ClampedGlu(1.702, 7.0) if gpt_oss else None


def check():
    """CPU, interpreted: the candidate equals fused_experts' torch twin on small shapes."""
    gen = torch.Generator().manual_seed(0)
    for name, e, top_k, h, i, gpt_oss in SHAPES:
        for tokens in (1, 2):
            x, w13, w2, weights, ids, biases, glu = layer(e, top_k, h // 16, i // 16, gpt_oss,
                                                         tokens, "cpu", torch.float32, gen)
            want = fused_experts(x, w13, w2, weights, ids, use_triton=False, biases=biases,
                                 glu=glu)
            got = experts_gemv(x, w13, w2, weights, ids, biases=biases, glu=glu,
                               tile=(16, 32, 4, 1))
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"{name} x{tokens}: max |difference| / max |value| {err:.1e}")
            assert err < 1e-5, name


def bench(peak):
    from decode_attention_sweep import time_graph
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, e, top_k, h, i, gpt_oss in SHAPES:
        for tokens in (1, 2):
            layers = [layer(e, top_k, h, i, gpt_oss, tokens, "cuda", torch.bfloat16, gen)
                      for _ in range(8)]
            chosen = torch.unique(layers[0][4]).numel()
            bytes_ = chosen * 3 * h * i * 2
            ref = [fused_experts(x, w13, w2, wt, ids, biases=b, glu=g)
                   for x, w13, w2, wt, ids, b, g in layers]
            base = time_graph([lambda L=L: fused_experts(L[0], L[1], L[2], L[3], L[4],
                                                         biases=L[5], glu=L[6])
                               for L in layers])
            print(f"{name} x{tokens}: fused_experts {base * 1e6:.1f} us "
                  f"({bytes_ / peak / base:.0%} of the copy rate)", flush=True)
            for tile in ((16, 512, 4, 3), (32, 512, 4, 3), (32, 256, 4, 4), (64, 256, 4, 3),
                         (32, 1024, 8, 3), (16, 1024, 4, 2)):
                try:
                    t = time_graph([lambda L=L, tile=tile: experts_gemv(
                        L[0], L[1], L[2], L[3], L[4], biases=L[5], glu=L[6], tile=tile)
                        for L in layers])
                    got = experts_gemv(*layers[0][:5], biases=layers[0][5], glu=layers[0][6],
                                       tile=tile)
                except Exception as err:  # noqa: BLE001 - a tile the compiler refuses
                    print(f"  {tile}: {type(err).__name__}")
                    continue
                diff = ((got - ref[0]).float().abs().max() / ref[0].float().abs().max()).item()
                print(f"  gemv {tile}: {t * 1e6:.1f} us ({bytes_ / peak / t:.0%}), "
                      f"{base / t:.2f}x; max difference {diff:.1e}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-tbps", type=float, default=4.2)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    if args.check:
        check()
    else:
        bench(args.peak_tbps * 1e12)

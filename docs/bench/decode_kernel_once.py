"""One decode attention call per launch for a kernel profiler to read: triton_paged over a
Llama-3-8B-shaped paged cache (32 query heads over 8 KV heads of 128), CACHE (bfloat16 or
float8_e4m3fn), BATCH x CONTEXT, three calls (profile the last).

    CACHE=float8_e4m3fn BATCH=1 CONTEXT=32768 ncu -k regex:_paged_decode --launch-skip 2 \\
        --launch-count 1 python3 docs/bench/decode_kernel_once.py
"""
import os

import torch

from roseinfer.core.attention import AttnMetadata
from roseinfer.plugins.attention import triton_paged

BLOCK = 16


def main():
    dtype = getattr(torch, os.environ.get("CACHE", "bfloat16"))
    batch, ctx = int(os.environ.get("BATCH", 1)), int(os.environ.get("CONTEXT", 32768))
    blocks = batch * ctx // BLOCK
    k_cache = torch.randn(blocks + 1, 8, BLOCK, 128, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(dtype)
    table = (torch.randperm(blocks, device="cuda").int() + 1).view(batch, -1)
    attn = AttnMetadata(table, torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
                        torch.arange(batch + 1, dtype=torch.int32, device="cuda"), 1, ctx)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    backend = triton_paged.TritonPagedAttention()
    for _ in range(3):
        backend.forward(q, k_cache, v_cache, attn, 128 ** -0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

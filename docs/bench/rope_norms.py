"""q/k norms and RoPE on CUDA: the unfused way (two norm launches, then RoPE) against the
one RoPE launch that norms each head first (``HeadNorms``), with a program per head or
per token's q or k (``fused.ROPE_HEAD_ROWS``), per attention shape and token count; and
RoPE alone, both ways, for a shape without norms. 20 calls captured in one CUDA graph,
µs per call, median of 5 replays (moe_router.py's timing).

    python3 docs/bench/rope_norms.py
"""
import torch

from moe_router import per_call_us  # this folder's
from roseinfer.layers import fused

SHAPES = {"qwen3-1.7b": (16, 8, 128), "qwen3-30b-a3b": (32, 4, 128),
          "gemma3-12b": (16, 8, 256), "llama3-8b (no norms)": (32, 8, 128)}


def main() -> None:
    for name, (heads, kv_heads, dim) in SHAPES.items():
        cos = torch.randn(4096, dim // 2, device="cuda")
        sin = torch.randn_like(cos)
        w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
        norms = None if "no norms" in name else fused.HeadNorms(w, w, 1e-6)
        for tokens in (1, 4, 16, 64):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda",
                              dtype=torch.bfloat16)
            q, k = qkv[:, :heads * dim], qkv[:, heads * dim:(heads + kv_heads) * dim]
            pos = torch.randint(0, 4096, (tokens,), device="cuda", dtype=torch.int32)

            def unfused():
                qn, kn = q, k
                if norms is not None:
                    qn = fused.add_rms_norm(q.reshape(-1, dim), None, w, 1e-6)[0].view(q.shape)
                    kn = fused.add_rms_norm(k.reshape(-1, dim), None, w, 1e-6)[0].view(k.shape)
                fused.apply_rope(qn, kn, pos, cos, sin, heads, kv_heads)

            fused.ROPE_HEAD_ROWS = 0  # the unfused RoPE as it was: its programs per token
            row = {"unfused": per_call_us(unfused)}
            for label, rows in (("per head", 1 << 30), ("per token", 0)):
                fused.ROPE_HEAD_ROWS = rows
                row[label] = per_call_us(
                    lambda: fused.apply_rope(q, k, pos, cos, sin, heads, kv_heads, norms=norms))
            print(f"{name}, {tokens} tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                  flush=True)


if __name__ == "__main__":
    main()

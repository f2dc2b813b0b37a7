"""A conversation's second turn on a hybrid model through the prefix cache: its TTFT against
a cold prompt of the same length, in one engine. Turn 1 is a prompt and its reply; turn 2
is turn 1, the reply and a new message, so the cache holds its attention blocks and the
recurrent state kept at the reply's last block boundary (core/state_snapshots.py). The
cold prompt is as long with other tokens. Each pair runs ROUNDS times with fresh tokens;
medians printed, times from the request's submission to its first token.

The model is Qwen3-Next's layer pattern (three gated DeltaNet layers to one gated attention
layer, experts) at a size a CPU runs, random weights (transformers' Qwen3NextForCausalLM).

Usage: python3 docs/bench/hybrid_prefix.py [--prompt 1024] [--reply 64] [--message 32]
  [--rounds 5] [--device cpu]
"""
import argparse
import statistics
import time

import torch

from roseinfer import LLM, SamplingParams


def model():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=256, shared_expert_intermediate_size=512,
        max_position_embeddings=8192, tie_word_embeddings=False)
    return Qwen3NextForCausalLM(config).eval()


def ttft(llm, prompt) -> tuple[float, int]:
    """(seconds from submission to the first token, one token asked for; prompt tokens the
    prefix cache held)."""
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    return time.perf_counter() - start, out.num_cached_tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--reply", type=int, default=64)
    p.add_argument("--message", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(10, 32000, (n,), generator=gen).tolist()

    llm = LLM(model(), device=args.device, dtype="float32", max_model_len=8192)
    llm.generate([tokens(64)], SamplingParams(max_tokens=4))  # warm-up
    second, cold, hits = [], [], []
    for _ in range(args.rounds):
        first = tokens(args.prompt)
        reply = llm.generate([first], SamplingParams(max_tokens=args.reply, temperature=0,
                                                     ignore_eos=True))[0].token_ids
        turn2 = first + reply + tokens(args.message)
        took, hit = ttft(llm, turn2)
        second.append(took)
        hits.append(hit)
        cold.append(ttft(llm, tokens(len(turn2)))[0])
    s, c = statistics.median(second), statistics.median(cold)
    print(f"turn 2 of {len(turn2)} tokens, {hits[-1]} from the cache: TTFT {s * 1e3:.1f} ms; "
          f"a cold prompt as long: {c * 1e3:.1f} ms; ratio {s / c:.3f} (medians of "
          f"{args.rounds}; each turn 2: {', '.join(f'{t * 1e3:.1f}' for t in second)} ms; "
          f"cold: {', '.join(f'{t * 1e3:.1f}' for t in cold)} ms)")


if __name__ == "__main__":
    main()

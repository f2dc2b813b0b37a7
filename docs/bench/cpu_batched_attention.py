"""The CPU's batched decode attention, timed inside the engine: the gathered blocks as
they lie (torch_sdpa's ``_decode_blocks``) against one padded copy per sequence and SDPA
with a mask (gather_context), alternated; GPT-2 small, 16 rows, greedy.

    python3 docs/bench/cpu_batched_attention.py [--max-tokens 64] [--rounds 4]
"""
import argparse
import time

import torch.nn.functional as F

import roseinfer.plugins.attention.torch_sdpa as sdpa
from roseinfer import LLM, SamplingParams


def gathered(q, k_cache, v_cache, index, padding, scale):
    n = index.shape[1] * k_cache.shape[2]
    k = sdpa.gather_context(k_cache, index, n)
    v = sdpa.gather_context(v_cache, index, n)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=~padding, scale=scale,
                                          enable_gqa=True).squeeze(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    spent = [0.0]

    def timed(impl):
        def run(*a):
            t = time.perf_counter()
            out = impl(*a)
            spent[0] += time.perf_counter() - t
            return out
        return run

    llm = LLM("gpt2-random", device="cpu", dtype="float32", enable_prefix_cache=False)
    prompts = [[15496] * (1 if i % 2 == 0 else 4) for i in range(16)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    first = None
    for _ in range(args.rounds):
        for name, impl in (("blocks", sdpa._decode_blocks), ("gather+SDPA", gathered)):
            sdpa_impl, sdpa._decode_blocks = sdpa._decode_blocks, timed(impl)
            llm.generate(prompts, params)
            spent[0] = 0.0
            t = time.perf_counter()
            ids = [o.token_ids for o in llm.generate(prompts, params)]
            wall = time.perf_counter() - t
            sdpa._decode_blocks = sdpa_impl
            first = first or ids
            print(f"{name:12s} attention {spent[0] * 1e3 / args.max_tokens:.2f} ms a step, "
                  f"step {wall * 1e3 / args.max_tokens:.2f} ms, ids as the first run's: {ids == first}")


if __name__ == "__main__":
    main()

"""One request with an image against the same request without it: TTFT (the image's
preparation and the vision tower included) and TPOT, batch 1, on a vision-language model
(default the Qwen2.5-VL-7B shape, random weights). The prompt is TEXT random tokens with
one image token in the middle; the image is random pixels of SIZE x SIZE (a fresh one each
round, and the prefix cache off, so nothing is reused). TTFT: one token asked for; TPOT:
(time for NEW tokens - TTFT) / (NEW - 1). Medians of ROUNDS.

Usage: python3 docs/bench/vision_language.py [--model qwen2.5-vl-7b-random] [--size 1024]
  [--text 64] [--new 128] [--rounds 3] [--device cuda] [--dtype bfloat16]
"""
import argparse
import statistics
import time

import numpy as np
import torch

from roseinfer import LLM, SamplingParams


def picture(size: int, seed: int):
    from PIL import Image
    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255)
                           .astype("uint8"))


def timed(llm, prompt, tokens: int) -> tuple[float, object]:
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0,
                                                ignore_eos=True))[0]
    return time.perf_counter() - start, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-vl-7b-random")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=8192,
              enable_prefix_cache=False)
    image_token = llm.engine.model.image_token_id
    gen = torch.Generator().manual_seed(0)
    rows = {"image": ([], []), "text": ([], [])}
    for r in range(args.rounds + 1):  # the first round warms up
        text = torch.randint(1000, 100000, (args.text,), generator=gen).tolist()
        half = args.text // 2
        prompts = {"image": {"prompt_token_ids": text[:half] + [image_token] + text[half:],
                             "multi_modal_data": {"image": picture(args.size, r)}},
                   "text": text}
        for kind, prompt in prompts.items():
            ttft, out = timed(llm, prompt, 1)
            total, _ = timed(llm, prompt, args.new)
            if r:
                rows[kind][0].append(ttft)
                rows[kind][1].append((total - ttft) / (args.new - 1))
            if kind == "image" and r == 0:
                print(f"the image prompt: {len(out.prompt_token_ids)} tokens "
                      f"({len(out.prompt_token_ids) - args.text} of the image)", flush=True)
    med = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in rows.items()}
    for kind, (ttft, tpot) in med.items():
        print(f"{kind}: TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms "
              f"(rounds: {', '.join(f'{t * 1e3:.1f}' for t in rows[kind][0])} ms; "
              f"{', '.join(f'{t * 1e3:.2f}' for t in rows[kind][1])} ms)")
    print(f"TPOT with the image / without: {med['image'][1] / med['text'][1]:.3f}; "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}")


if __name__ == "__main__":
    main()

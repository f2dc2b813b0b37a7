"""One request with an image against the same request without it, and a second turn with
the same image: TTFT (the image's preparation and the vision tower included) and TPOT,
batch 1, on a vision-language model (default the Qwen2.5-VL-7B shape, random weights).
The prompt is TEXT random tokens with one image token in the middle; the image is random
pixels of SIZE x SIZE, a fresh one (and fresh text) each round, so neither the encoder
cache nor the prefix cache holds it. The second turn is the first turn's prompt and answer
and 16 more tokens with the same image: its features come from the encoder cache and its
blocks from the prefix cache. Each request runs once, the engine stepped here: TTFT to
the first token, TPOT the rest over NEW - 1. Medians of ROUNDS.

Usage: python3 docs/bench/vision_language.py [--model qwen2.5-vl-7b-random] [--size 1024]
  [--text 64] [--new 128] [--rounds 3] [--device cuda] [--dtype bfloat16] [--max-model-len 8192]
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


def timed(llm, prompt, tokens: int) -> tuple[float, float, object]:
    """(TTFT, TPOT, the final output) of one request run alone."""
    eng, rid = llm.engine, f"r{time.perf_counter_ns()}"
    start = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(max_tokens=tokens, temperature=0,
                                                ignore_eos=True))
    first = final = None
    while final is None:
        for out in eng.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    return first - start, (time.perf_counter() - first) / (tokens - 1), final


def with_image(ids: list[int], image) -> dict:
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-vl-7b-random")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    image_token = llm.engine.model.image_token_id
    gen = torch.Generator().manual_seed(0)
    rows = {"image": ([], []), "text": ([], []), "second turn": ([], [])}
    for r in range(args.rounds + 1):  # the first round warms up
        text, more = ([t if t != image_token else 10 for t in torch.randint(
            10, min(100000, llm.engine.vocab_size), (n,), generator=gen).tolist()]
            for n in (args.text, 16))
        half = args.text // 2
        image = picture(args.size, r)
        prompt = text[:half] + [image_token] + text[half:]
        results = {"image": timed(llm, with_image(prompt, image), args.new),
                   "text": timed(llm, text, args.new)}
        answer = results["image"][2].token_ids
        results["second turn"] = timed(llm, with_image(prompt + answer + more, image), args.new)
        for kind, (ttft, tpot, out) in results.items():
            if r:
                rows[kind][0].append(ttft)
                rows[kind][1].append(tpot)
        if r == 0:
            n = len(results["image"][2].prompt_token_ids)
            print(f"the image prompt: {n} tokens ({n - args.text} of the image)", flush=True)
    print(f"encoder cache: {llm.engine.encoder.cache.hits} hits, "
          f"{llm.engine.encoder.cache.misses} misses")
    med = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in rows.items()}
    for kind, (ttft, tpot) in med.items():
        print(f"{kind}: TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms "
              f"(rounds: {', '.join(f'{t * 1e3:.1f}' for t in rows[kind][0])} ms; "
              f"{', '.join(f'{t * 1e3:.2f}' for t in rows[kind][1])} ms)")
    print(f"second turn's TTFT / the first's: {med['second turn'][0] / med['image'][0]:.3f}")
    print(f"TPOT with the image / without: {med['image'][1] / med['text'][1]:.3f}; "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}")


if __name__ == "__main__":
    main()

"""Text chats decoding while image requests arrive: the chats' time between tokens (TPOT)
with the images against the same chats alone, on a vision-language model (default the
Qwen2.5-VL-7B shape, random weights), the engine stepped here.

CHATS text requests (random prompts of TEXT tokens) decode NEW tokens each; once every
one has its first token, IMAGES image requests (a fresh SIZE x SIZE image each, TEXT
tokens around it, 16 new tokens; prepared beforehand, as a worker's reader threads prepare
them off the step loop) are added, RATE a second (0: all at once). Each chat's
gaps between its tokens are recorded from then until it ends; p50 and p99 over all chats,
with the images and, in the same process, without them. One JSON line to
OUT/vision_burst.jsonl, with the steps over 50 ms while the chats decode and how much of
them the vision tower took (its phase of the step, timed around it), to tell the tower's
part of a stall from the prompts' prefill.

Usage: python3 docs/bench/vision_burst.py [--model qwen2.5-vl-7b-random] [--chats 16]
  [--images 32] [--rate 0] [--size 1024] [--text 64] [--new 256] [--device cuda]
  [--dtype bfloat16] [--max-model-len 8192] [--in-step] [--max-mixed-prefill-tokens N]

--in-step runs the tower's calls in the steps (``encoder_beside_steps=False``) instead of
beside them, as the engine did before; --max-mixed-prefill-tokens caps the prompt tokens a
step carries while the chats decode (default: no cap on a GPU).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from vision_language import picture  # noqa: E402

from roseinfer import LLM, SamplingParams  # noqa: E402
from roseinfer.core import multimodal  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(llm, args, with_images: bool, round_: int) -> dict:
    eng, image_token = llm.engine, llm.engine.model.image_token_id
    gen = torch.Generator().manual_seed(round_)

    def text(n: int) -> list[int]:
        return [t if t != image_token else 10 for t in torch.randint(
            10, min(100000, eng.vocab_size), (n,), generator=gen).tolist()]
    chats = [f"chat-{round_}-{i}" for i in range(args.chats)]
    for rid in chats:
        eng.add_request(rid, text(args.text), SamplingParams(
            max_tokens=args.new, temperature=0, ignore_eos=True))
    last, gaps, started = {}, [], {}
    to_add = list(range(args.images)) if with_images else []
    # prepared before, as a worker's reader threads prepare them off the step loop
    pixels = [multimodal.preprocess(eng.model, [picture(args.size, 1000 * round_ + i)])
              for i in to_add]
    begun, steps = None, []  # per step during the burst: (wall, of it the tower's) seconds
    encode, tower = eng._encode_images, [0.0]

    def timed_encode():
        start = time.perf_counter()
        try:
            return encode()
        finally:
            tower[0] += time.perf_counter() - start
    eng._encode_images = timed_encode
    while eng.has_unfinished():
        now = time.perf_counter()
        if begun is not None and to_add and (args.rate <= 0 or
                                             now - begun >= to_add[0] / args.rate):
            batch = to_add if args.rate <= 0 else [to_add[0]]
            for i in batch:
                half = args.text // 2
                ids = text(args.text)
                eng.add_request(f"image-{round_}-{i}", {
                    "prompt_token_ids": ids[:half] + [image_token] + ids[half:],
                    "multi_modal_data": {"image": pixels[i]}},
                    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            to_add = to_add[len(batch):]
        tower[0], stepped = 0.0, time.perf_counter()
        outs = eng.step()
        if begun is not None:
            steps.append((time.perf_counter() - stepped, tower[0]))
        for out in outs:
            t = time.perf_counter()
            if out.request_id in chats and out.new_token_ids:
                if begun is not None and out.request_id in last:
                    gaps.append((t - last[out.request_id]) / len(out.new_token_ids))
                last[out.request_id] = t
                started[out.request_id] = True
        if begun is None and len(started) == len(chats):
            begun = time.perf_counter()
    eng._encode_images = encode
    slow = [(w, t) for w, t in steps if w > 0.05]
    return {"images": with_images, "p50_ms": percentile(gaps, 0.5) * 1e3,
            "p99_ms": percentile(gaps, 0.99) * 1e3, "mean_ms": statistics.mean(gaps) * 1e3,
            "gaps": len(gaps), "steps": len(steps), "steps_over_50ms": len(slow),
            "slow_steps_s": sum(w for w, _ in slow), "slow_steps_tower_s": sum(t for _, t in slow),
            "tower_s": sum(t for _, t in steps), "longest_step_ms": max(w for w, _ in steps) * 1e3}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-vl-7b-random")
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--text", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--in-step", action="store_true")
    p.add_argument("--max-mixed-prefill-tokens", type=int)
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              max_model_len=args.max_model_len, max_num_seqs=args.chats + args.images,
              encoder_beside_steps=False if args.in_step else None,
              max_mixed_prefill_tokens=args.max_mixed_prefill_tokens)
    run(llm, args, True, 0)  # warm-up: compiles, captures, fills the allocator
    rows = [run(llm, args, images, r) for r in (1, 2) for images in (False, True)]
    out = open(os.path.join(os.environ.get("OUT", "."), "vision_burst.jsonl"), "a")
    for row in rows:
        out.write(json.dumps({**vars(args), **row}) + "\n")
        print(f"{'with' if row['images'] else 'without'} images: TPOT p50 {row['p50_ms']:.2f} "
              f"ms, p99 {row['p99_ms']:.2f} ms, mean {row['mean_ms']:.2f} ms ({row['gaps']} "
              f"gaps); {row['steps_over_50ms']} of {row['steps']} steps over 50 ms, "
              f"{row['slow_steps_s']:.2f} s, of it the tower {row['slow_steps_tower_s']:.2f} s "
              f"(the tower in all: {row['tower_s']:.2f} s; the longest step "
              f"{row['longest_step_ms']:.0f} ms)", flush=True)
    base = [r for r in rows if not r["images"]]
    burst = [r for r in rows if r["images"]]
    print(f"p99 with / without: {statistics.median(r['p99_ms'] for r in burst) / statistics.median(r['p99_ms'] for r in base):.3f}; "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}")


if __name__ == "__main__":
    main()

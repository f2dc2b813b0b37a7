"""Where a vision tower's call goes: one image through ``encode_images`` (the tower and
merger as the engine runs them), timed warm, then under torch's profiler: the time a
call, its FLOPs against the card's rate, and the kernels and host ops that take the most.

Usage: python3 docs/bench/tower_profile.py [--model qwen2.5-vl-7b-random] [--size 1024]
  [--device cuda] [--dtype bfloat16] [--top 25] [--max-model-len 8192] [--conv3d]

--conv3d runs the patch embedding as transformers' Conv3d, not as the linear the engine
runs (layers/patch_embed.py), for the A/B.
"""
import argparse
import os
import sys
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from vision_language import picture  # noqa: E402

from roseinfer import LLM  # noqa: E402
from roseinfer.core import multimodal  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-vl-7b-random")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--conv3d", action="store_true")
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    model = llm.engine.model
    if args.conv3d:
        embed = model.visual.patch_embed
        embed.forward = types.MethodType(type(embed).forward, embed)
    pixels = multimodal.preprocess(model, [picture(args.size, 0)])
    patches, grids = pixels.patches[0], pixels.grids
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def call():
        out = model.encode_images(patches, grids)
        sync()
        return out
    for _ in range(3):
        out = call()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    params = sum(t.numel() for n, t in model.named_parameters() if n.startswith("visual.") or
                 n.startswith(("vision_tower.", "multi_modal_projector.")))
    flops = 2 * params * patches.shape[0]  # the linears' products, attention left out
    print(f"{args.model}, a {args.size}^2 image: {patches.shape[0]} patches -> {out.shape[0]} "
          f"tokens; {seconds * 1e3:.1f} ms a call (median of 5); about {flops / 1e12:.2f} "
          f"TFLOP of linears: {flops / seconds / 1e12:.0f} TFLOP/s", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        call()
    key = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                    max_name_column_width=70))


if __name__ == "__main__":
    main()

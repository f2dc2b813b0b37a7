"""One MoE layer's routing and experts (layers/moe_routing.py select_experts,
layers/moe.py fused_experts), CUDA-graph captured, against the bytes its chosen experts
hold: Qwen3-30B-A3B's expert shape (128 experts, top 8, hidden 2048, 768 per expert),
bf16, random router logits.

With --fbgemm, beside it: fbgemm-gpu-genai's grouped GEMMs over the same routing, the
token rows sorted by expert (``bf16bf16bf16_grouped_stacked``; with --fp8 the rows
rounded to e4m3 by the FP8 linears' ``quantize_rows`` and ``f8f8bf16_rowwise_grouped_stacked``,
W8A8), SiLU-and-mul between, the weighted sum after; its largest difference from
fused_experts over fused_experts' largest magnitude is printed too.

Usage: python3 docs/bench/moe_layer.py [--peak-tbps 4.8] [--fp8] [--fbgemm]
"""
import argparse

import torch

from roseinfer.layers import moe
from roseinfer.layers.fp8_linear import fbgemm_rowwise, quantize_rows
from roseinfer.layers.fused import silu_and_mul
from roseinfer.layers.moe import fused_experts
from roseinfer.layers.moe_routing import select_experts

p = argparse.ArgumentParser()
p.add_argument("--peak-tbps", type=float, default=3.35)
p.add_argument("--sweep", action="store_true", help="also time other decode tilings")
p.add_argument("--profile", action="store_true", help="list each kernel's time at one token")
p.add_argument("--fp8", action="store_true", help="experts in FP8, a scale per row (W8A16)")
p.add_argument("--fbgemm", action="store_true", help="time fbgemm's grouped GEMMs beside it")
args = p.parse_args()
CHOSEN = moe._config
E, K, H, I = 128, 8, 2048, 768
gen = torch.Generator(device="cuda").manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02).bfloat16()
w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.02).bfloat16()
expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
scales = None
if args.fp8:
    layer = moe.SparseMoE(H, I, E, K, True).cuda()
    layer.w13, layer.w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    layer.to_fp8()
    w13, w2, scales = layer.w13, layer.w2, (layer.w13_scale, layer.w2_scale)
    expert_bytes = w13[0].numel() + w2[0].numel() + 4 * (scales[0][0].numel() + scales[1][0].numel())
print(f"{torch.cuda.get_device_name()}, peak {args.peak_tbps} TB/s, "
      f"experts in {'fp8' if args.fp8 else 'bf16'}")


def graph_us(fn) -> float:
    """Microseconds a replay of a CUDA graph of ``fn`` takes, over 200."""
    fn()  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 200
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def fbgemm_experts(x, weights, ids):
    """The module doc's fbgemm path: each (token, choice) pair a row, sorted by expert."""
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    token = order // K
    # a count per expert without bincount, whose output size waits for the host
    m_sizes = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    act = silu_and_mul(grouped(x[token], w13, scales and scales[0], m_sizes))
    down = grouped(act, w2, scales and scales[1], m_sizes)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, down.float() * weights.flatten()[order, None].float())
    return out.to(x.dtype)


def grouped(rows, w, w_scale, m_sizes):
    if w_scale is None:
        return torch.ops.fbgemm.bf16bf16bf16_grouped_stacked(rows, w, m_sizes)
    q, x_scale = quantize_rows(rows)
    return torch.ops.fbgemm.f8f8bf16_rowwise_grouped_stacked(q, w, x_scale, w_scale, m_sizes)


def run(tokens: int) -> None:
    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(tokens, E, device="cuda", generator=gen)
    layer = lambda: fused_experts(x, w13, w2, *select_experts(logits, K, True),
                                 scales=scales)
    us = graph_us(layer)
    chosen = select_experts(logits, K, True)[1].unique().numel()
    floor_us = chosen * expert_bytes / (args.peak_tbps * 1e12) * 1e6
    print(f"tokens {tokens:4d}: {us:7.1f} us, {chosen:3d} experts read, floor {floor_us:6.1f} us "
          f"({floor_us / us:.0%} of it)")
    if fbgemm:
        ours = layer().float()
        theirs = fbgemm_experts(x, *select_experts(logits, K, True)).float()
        err = ((theirs - ours).abs().max() / ours.abs().max()).item()
        fb_us = graph_us(lambda: fbgemm_experts(x, *select_experts(logits, K, True)))
        print(f"             fbgemm {fb_us:7.1f} us ({floor_us / fb_us:.0%} of the floor), "
              f"{err:.4f} off fused_experts")


fbgemm = args.fbgemm and fbgemm_rowwise(torch.device("cuda")) is not None
if args.fbgemm and not fbgemm:
    print("fbgemm-gpu-genai does not load here: its path is not timed")
for tokens in (1, 4, 16, 64, 256):
    run(tokens)
if args.sweep:
    for cfg in ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
                {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 2, "num_stages": 5}):
        moe._config = lambda pairs, fp8=False, cfg=cfg: cfg if pairs <= 256 else CHOSEN(pairs)
        print(cfg)
        for tokens in (1, 16):
            run(tokens)

if args.profile:  # each kernel's time at one token: where the time above goes
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(1, E, device="cuda", generator=gen)
    for _ in range(3):
        fused_experts(x, w13, w2, *select_experts(logits, K, True), scales=scales)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fused_experts(x, w13, w2, *select_experts(logits, K, True), scales=scales)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))

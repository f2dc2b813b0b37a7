"""The MoE router alone, on CUDA: cuBLAS's GEMV then the routing kernel, against
``layers/moe_routing.route`` (the GEMV split over hidden slices, the partials summed by the routing
kernel) at each slice width, per router shape and token count. Each variant is 20 calls
captured in one CUDA graph, replayed; µs per call, median of 5 replays.

    python3 docs/bench/moe_router.py
"""
import statistics

import torch

from roseinfer.layers import moe_routing as moe

SHAPES = {"qwen3-30b-a3b": (2048, 128, 8), "gpt-oss-20b": (2880, 32, 4),
          "mixtral-8x7b": (4096, 8, 2)}
SLICES = (32, 64, 128, 256)


def per_call_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    for name, (hidden, experts, top_k) in SHAPES.items():
        gate = torch.nn.Linear(hidden, experts, bias=name == "gpt-oss-20b",
                               device="cuda", dtype=torch.bfloat16)
        for tokens in (1, 4, 16):
            h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            row = {"cublas": per_call_us(
                lambda: moe.select_experts(gate(h), top_k, True))}
            for width in SLICES:
                moe.ROUTER_SLICE = width
                row[f"slice {width}"] = per_call_us(lambda: moe.route(h, gate, top_k, True))
            print(f"{name} ({hidden} -> {experts}, top {top_k}), {tokens} tokens: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()

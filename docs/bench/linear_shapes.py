"""What the linear benches share: Llama-3-8B's linear shapes, and timing a call over
COPIES copies of a weight as one CUDA graph (so weights come from memory, as in a
decode step)."""
import argparse
import json

import torch

from roseinfer.layers.skinny_linear import graph_time

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
COPIES = 8


def per_call(fn) -> float:
    """ms per call of ``fn(i)``, i over the copies."""
    return graph_time(lambda: [fn(i) for i in range(COPIES)]) / COPIES


def run(measure_shape) -> None:
    """``measure_shape(n, k) -> row`` for each shape; prints each row, and writes them
    all to --output-json."""
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of "
                   + ", ".join(SHAPES))
    args = p.parse_args()
    out = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        out[name] = row = measure_shape(n, k)
        print(name, json.dumps({a: (round(b, 4) if isinstance(b, float) else b)
                                for a, b in row.items()}), flush=True)
        torch.cuda.empty_cache()  # the shape's weights are gone with its row's closure
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)

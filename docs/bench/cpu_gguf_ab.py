"""The GGUF block kernels of this tree against those of the tree in .base (`git archive REV
roseinfer | tar -x -C .base`), each built under a namespace of its own, in one process, on
the default model's own tensors (layer 0 and the head): µs a call over weights streamed
from memory (as cpu_gguf_kernels.py times them), rounds alternated, and the largest
difference between the two builds' products relative to the product's size.

    python3 docs/bench/cpu_gguf_ab.py [--rows 1,4] [--rounds 3]
"""
import argparse
from pathlib import Path

import torch

from cpu_gguf_kernels import KINDS, STREAM_BYTES, gguf_tensors, per_call
from roseinfer.layers import gguf_linear
from roseinfer.layers.extensions import build_library

BEFORE = Path(".base/roseinfer/layers/gguf_blocks.cpp")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from roseinfer.models.loader import ALIASES
    builds = {"before": build_library(BEFORE, "roseinfer_gguf_before", (
                  *gguf_linear.NATIVE, "-DGGUF_NS=roseinfer_gguf_before"),
                  gguf_linear._cpu(), "the GGUF block kernels before",
                  headers=tuple(h for h in (BEFORE.with_name(p.name) for p in gguf_linear.HEADERS)
                                if h.exists())),
              "after": gguf_linear.build()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; µs a call, the "
          "best of each round")
    for name, (kind, raw, deq) in gguf_tensors(ALIASES["SmolLM2-135M-Instruct"]()).items():
        n, k = deq.shape
        copies = [raw.clone() for _ in range(max(2, min(64, STREAM_BYTES // raw.numel())))]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k)
            times = {b: [] for b in builds}
            for _ in range(args.rounds):
                for b, ops in builds.items():
                    times[b].append(per_call(lambda w: ops.mm(x, w, KINDS[kind]), copies))
            ys = {b: ops.mm(x, raw, KINDS[kind]) for b, ops in builds.items()}
            diff = ((ys["after"] - ys["before"]).abs().max() / ys["before"].abs().max()).item()
            before, after = min(times["before"]), min(times["after"])
            print(f"| {name} | {kind} | {n} x {k} | {rows} | {before:.1f} | {after:.1f} | "
                  f"{after / before:.3f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()

"""GGUF's quantized blocks multiplied as they are stored, on the CPU, beside the float
linears, on the default model's own tensors.

The blocks kernel (roseinfer/layers/gguf_blocks.cpp, built by torch's cpp_extension; the
engine's for cpu_weight_dtype="gguf", since it measured fastest here) reads each weight
row's blocks in the file's layout (Q4_1: fp16 scale and min, 16 bytes of
nibbles, 32 weights; Q8_0: fp16 scale and 32 int8) and rounds each row of x to int8 per
block of 32 first, as llama.cpp does (its Q8_1 and Q8_0 activations): a block's product
is one u8 x s8 dot (`vpdpbusd`), scaled. Beside it, per shape and row count: float32
`F.linear` and oneDNN's packed kernel (the engine's two float32 choices), bfloat16 in
oneDNN's packed layout and ATen's weight-only int8 (`cpu_weight_dtype`), all over
weights streamed from memory (256 MB of copies in turn), two threads.

Prints a table, µs per call, and each kernel's relative error against the float64
product of the de-quantized weights.

    python3 docs/bench/cpu_gguf_kernels.py [--rows 1,4,16,64]
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from roseinfer.layers import gguf_linear

STREAM_BYTES = 256 << 20
KINDS = {"Q4_1": 3, "Q8_0": 8}  # ggml's type numbers, as the kernels take them


def gguf_tensors(path: str) -> dict:
    """One layer's linears and the tied head, as stored: {name: (kind, raw [N, bytes],
    de-quantized float32 [N, K])}."""
    import gguf
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if t.name.startswith("blk.0.") or t.name == "token_embd.weight":
            if t.tensor_type.name not in KINDS:
                continue
            raw = torch.from_numpy(np.ascontiguousarray(t.data))
            deq = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).astype(np.float32))
            out[t.name.removeprefix("blk.0.")] = (t.tensor_type.name, raw, deq)
    return out


def per_call(fn, copies, reps=3) -> float:
    """µs a call, each call on the next copy of the weights (from memory, as in a step)."""
    for c in copies[:2]:
        fn(c)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for c in copies:
            fn(c)
        best = min(best, (time.perf_counter() - start) / len(copies))
    return best * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--gguf", default=None, help="default: the default model's file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = args.gguf
    if path is None:
        from roseinfer.models.loader import ALIASES
        path = ALIASES["SmolLM2-135M-Instruct"]()
    ops = gguf_linear.build()
    tensors = gguf_tensors(path)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; µs a call "
          "(relative error against float64 of the de-quantized weight)")
    print("| tensor | kind | N x K | rows | gguf blocks | float32 F.linear | "
          "float32 oneDNN packed | bfloat16 oneDNN packed | int8 weight-only |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (kind, raw, deq) in tensors.items():
        n, k = deq.shape
        copies = max(2, min(64, STREAM_BYTES // (n * k * 4)))
        for rows in rows_list:
            x = torch.randn(rows, k)
            want = (x.double() @ deq.double().T)

            def err(y):
                return ((y.double() - want).norm() / want.norm()).item()
            raws = [raw.clone() for _ in range(copies)]
            f32 = [deq.clone() for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in f32]
            bf = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in f32]
            scale = deq.abs().amax(1).clamp(min=1e-12) / 127
            i8 = [(w / scale[:, None]).round().to(torch.int8) for w in f32]
            ones = torch.ones(n, dtype=torch.bfloat16)
            cells = []
            for fn, ws, post in (
                    (lambda w: ops.mm(x, w, KINDS[kind]), raws, None),
                    (lambda w: F.linear(x, w), f32, None),
                    (lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                     packed, None),
                    (lambda w: torch.ops.mkldnn._linear_pointwise(
                        x.bfloat16(), w, None, "none", [], "").float(), bf, None),
                    (lambda w: torch.ops.aten._weight_int8pack_mm(
                        x.bfloat16(), w, ones).float() * scale, i8, None)):
                us = per_call(fn, ws)
                cells.append(f"{us:.1f} ({err(fn(ws[0])):.1e})")
            print(f"| {name} | {kind} | {n} x {k} | {rows} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()

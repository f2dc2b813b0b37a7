"""Long-context decode end to end: decode_profile.py's step at each (batch, context), with
the decode attention tuning as shipped and as it was before (long_context_attention.py's
BEFORE), in one process, on one GPU. Prints a table; one JSON line per row to
OUT/long_context_decode.jsonl.

    PEAK_TB_S=4.2 python3 docs/bench/long_context_decode.py llama3-8b-random:1:32768 ...
"""
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import decode_profile  # noqa: E402
from long_context_attention import BEFORE, before_num_splits  # noqa: E402

from roseinfer.plugins.attention import triton_paged  # noqa: E402


def run(spec: str, label: str) -> dict:
    model, batch, context = spec.split(":")
    shipped = dict(triton_paged.DECODE_TUNING), dict(triton_paged.FP8_TILE)
    rule = triton_paged.num_splits
    if label == "before":
        for cls, tile in BEFORE.items():
            triton_paged.DECODE_TUNING[cls] = dict(shipped[0][cls], **tile)
        triton_paged.num_splits = before_num_splits
        triton_paged.FP8_TILE = {"block_n": 128}  # as settings() has it
    try:
        row = decode_profile.profile(model, int(batch), int(context))
    finally:
        triton_paged.DECODE_TUNING, triton_paged.FP8_TILE = map(dict, shipped)
        triton_paged.num_splits = rule
        gc.collect()
        torch.cuda.empty_cache()
    return dict(row, label=label)


def main():
    out = open(os.path.join(os.environ.get("OUT", "."), "long_context_decode.jsonl"), "a")
    rows = []
    for spec in sys.argv[1:]:
        for label in ("shipped", "before"):
            rows.append(run(spec, label))
            out.write(json.dumps(rows[-1]) + "\n")
            out.flush()
    print(f"\n{'shape':>26} {'label':>8} {'step ms':>8} {'floor':>6} {'attn ms':>8} {'prefill s':>9}")
    for r in rows:
        print(f"{r['model']:>16} {r['batch']:3d}x{r['context']:6d} {r['label']:>8} "
              f"{r['step_ms']:8.3f} {r['fraction']:6.1%} {r['attention_ms']:8.3f} "
              f"{r['prefill_s']:9.3f}")


if __name__ == "__main__":
    main()

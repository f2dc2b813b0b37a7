"""The decode attention's split merge folded into the kernel (the last split of a row's
group merges, triton_paged.FOLD_MERGE) against a merge launch of its own: decode_profile's
step for each MODEL:BATCH:CONTEXT, both ways in one process, on one GPU. One JSON line per
row to OUT/fold_merge.jsonl.

    PEAK_TB_S=4.2 python3 docs/bench/fold_merge_decode.py llama3-8b-random:1:512 ...
"""
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import decode_profile  # noqa: E402

from roseinfer.plugins.attention import triton_paged  # noqa: E402


def main():
    out = open(os.path.join(os.environ.get("OUT", "."), "fold_merge.jsonl"), "w")
    rows = []
    for spec in sys.argv[1:]:
        model, batch, context = spec.split(":")
        for fold in (True, False):
            triton_paged.FOLD_MERGE = fold
            row = dict(decode_profile.profile(model, int(batch), int(context)), fold_merge=fold)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            gc.collect()
            torch.cuda.empty_cache()
    for r in rows:
        print(f"{r['model']} {r['batch']} x {r['context']} fold_merge={r['fold_merge']}: "
              f"step {r['step_ms']:.3f} ms ({r['fraction']:.1%} of floor), "
              f"{r['kernels_per_step']:.0f} kernels a step", flush=True)


if __name__ == "__main__":
    main()

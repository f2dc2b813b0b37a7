"""KV blocks the Llama-3-8B shape gets on this GPU: under the rule before
gpu_memory_utilization (half the memory free after the weights), and now (default 0.9)
with the bf16 and the FP8 cache. Prints one JSON object.

    python docs/bench/kv_memory.py [--model llama3-8b-random]
"""
import argparse
import gc
import json

import torch

from roseinfer import LLM
from roseinfer.models import loader


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b-random")
    args = p.parse_args()
    model, _, _ = loader.load(args.model, dtype=torch.bfloat16, device="cuda")
    free, total = torch.cuda.mem_get_info()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "total_gib": total / 2**30,
           "free_after_weights_gib": free / 2**30}
    for cache in ("auto", "fp8"):
        with LLM(args.model, dtype="bfloat16", kv_cache_dtype=cache) as llm:
            kv = llm.engine.kv_cache
            per_block = sum(t[0].numel() * t.element_size() for t in (*kv.k, *kv.v))
            blocks = kv.scratch_block
            del kv  # close() must free it
            out[cache] = {"blocks": blocks, "bytes_per_block": per_block,
                          "cache_gib": blocks * per_block / 2**30,
                          "used_after_start_gib": (total - torch.cuda.mem_get_info()[0]) / 2**30}
            if cache == "auto":
                out["blocks_before"] = int(free * 0.5 // per_block)
        gc.collect()
        torch.cuda.empty_cache()
    for cache in ("auto", "fp8"):
        out[cache]["x_before"] = out[cache]["blocks"] / out["blocks_before"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

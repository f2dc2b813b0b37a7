"""KV memory one long sequence holds, read back from the block manager: the Gemma-3-12B
shape (five 1,024-token window layers to each global one) against the same shape with
every layer global. One request of ``--context`` random prompt tokens is prefilled and
decoded ``--decode`` tokens, then the blocks it holds are counted. Prints one JSON object.

    python docs/bench/window_memory.py [--context 32768] [--decode 64]
"""
import argparse
import json
import random

from roseinfer import LLM, SamplingParams


def held(model: str, context: int, decode: int, **config) -> dict:
    with LLM(model, max_model_len=context + decode + 16, max_num_seqs=1,
             enable_prefix_cache=False, cuda_graphs=False, **config) as llm:
        engine, rng = llm.engine, random.Random(0)
        prompt = [rng.randrange(2, llm.engine.vocab_size) for _ in range(context)]
        engine.add_request("long", prompt, SamplingParams(max_tokens=decode, temperature=0,
                                                         ignore_eos=True))
        seq = engine.seqs["long"]
        while seq.num_computed < context + decode - 1:
            engine.step()
        blocks, kv = engine.blocks, engine.kv_cache
        per_block = sum(t[0].numel() * t.element_size() for t in (*kv.k, *kv.v))
        tables = blocks.tables(seq)
        out = {"tokens": seq.num_computed, "groups": list(kv.groups.windows),
               "held_per_group": [sum(b != blocks.null for b in t) for t in tables],
               "blocks_in_use": blocks.num_blocks - blocks.num_free,
               "bytes_per_block": per_block}
        out["kv_gib"] = out["blocks_in_use"] * per_block / 2**30
        while engine.has_unfinished():
            engine.step()
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3-12b-random")
    p.add_argument("--baseline", default="gemma3-12b-full-random")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    config = {"device": args.device, "dtype": args.dtype}
    out = {m: held(m, args.context, args.decode, **config) for m in (args.model, args.baseline)}
    out["ratio"] = out[args.model]["kv_gib"] / out[args.baseline]["kv_gib"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

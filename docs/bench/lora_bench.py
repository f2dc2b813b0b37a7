"""Multi-LoRA serving on one GPU against the base model, in one process, one run: random
base weights built on the GPU (the Llama-3-8B shape by default) and random rank-r
adapters on every projection (q, k, v, o, gate, up, down), written in PEFT's format.

Parts (each prints one JSON line; all go to --output-json):
- b1: one request, 512 prompt tokens; TPOT = (time for 129 new tokens - time for 1) / 128,
  for the base model, a LoRA engine serving the base model, and one adapter.
- b64-8: 64 x (512 -> 256), completion tokens/s; base vs 8 adapters mixed evenly.
- b64-64: the same over 64 adapters with --max-loras 16 (each request its own adapter),
  with the slots' swaps and the host time they took.

Usage: PYTHONPATH=. python3 docs/bench/lora_bench.py [--model llama3-8b-random] [--rank 16]
  [--parts b1,b64-8,b64-64] [--output-json out.json]
  or, for `roseinfer bench serve --lora-modules ...` (docs/bench/lora.sh):
  PYTHONPATH=. python3 docs/bench/lora_bench.py --write-adapters DIR [--count 16]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from roseinfer import LLM, SamplingParams

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(path: str, cfg, rank: int, seed: int) -> None:
    """A random PEFT adapter of rank ``rank`` on every projection of every layer."""
    from safetensors.torch import save_file

    from roseinfer.models.lora_adapter import _dims

    dims, g = _dims(cfg), torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, block in MODULES.items():
            n_in, n_out = dims[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            for part, shape in (("A", (rank, n_in)), ("B", (n_out, rank))):
                t = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01
                tensors[f"{key}.lora_{part}.weight"] = t.cpu()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(MODULES)}, f)


def engine(model: str, max_seqs: int, **lora) -> LLM:
    return LLM(model, dtype="bfloat16", max_num_seqs=max_seqs, max_model_len=1024,
               enable_prefix_cache=False, **lora)


def timed(llm: LLM, prompts, max_tokens: int, loras=None) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def tpot(llm: LLM, prompt, lora=None, repeats: int = 3) -> float:
    """Seconds per output token past the first, the best of ``repeats``."""
    timed(llm, [prompt], 8, lora)  # warm
    return min((timed(llm, [prompt], 129, lora)[0] - timed(llm, [prompt], 1, lora)[0]) / 128
               for _ in range(repeats))


def throughput(llm: LLM, prompts, loras=None, repeats: int = 2) -> float:
    timed(llm, prompts[:8], 16, loras[:8] if loras else None)  # warm
    return max(n / s for s, n in (timed(llm, prompts, 256, loras) for _ in range(repeats)))


def close(llm: LLM) -> None:
    llm.close()
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b-random")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--parts", default="b1,b64-8,b64-64")
    p.add_argument("--output-json", default=None)
    p.add_argument("--write-adapters", default=None, metavar="DIR",
                   help="only write --count random adapters (a0, a1, ...) under DIR and say "
                        "their --lora-modules")
    p.add_argument("--count", type=int, default=16)
    args = p.parse_args()
    if args.write_adapters:
        from roseinfer.models.loader import model_info

        cfg = model_info(args.model, tokenizer=False)[0]
        for i in range(args.count):
            write_adapter(os.path.join(args.write_adapters, f"a{i}"), cfg, args.rank, i)
        print(" ".join(f"a{i}={os.path.join(args.write_adapters, f'a{i}')}"
                       for i in range(args.count)))
        return
    parts = args.parts.split(",")
    rows = []

    def report(**row):
        row.update(model=args.model, rank=args.rank, gpu=torch.cuda.get_device_name())
        print(json.dumps(row), flush=True)
        rows.append(row)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (512,), generator=g).tolist() for _ in range(64)]
    folder = tempfile.mkdtemp(prefix="lora-bench-")
    base = engine(args.model, 64)
    cfg = base.engine.hf_config
    n_adapters = 64 if "b64-64" in parts else 8
    start = time.perf_counter()
    paths = {f"a{i}": os.path.join(folder, f"a{i}") for i in range(n_adapters)}
    for i, path in enumerate(paths.values()):
        write_adapter(path, cfg, args.rank, i)
    print(f"{n_adapters} adapters written in {time.perf_counter() - start:.1f} s", flush=True)
    if "b1" in parts:
        report(part="b1", engine="base", tpot_ms=1000 * tpot(base, prompts[0]))
    if "b64-8" in parts:
        report(part="b64-8", engine="base", tok_s=throughput(base, prompts))
    close(base)
    if "b1" in parts or "b64-8" in parts:
        llm = engine(args.model, 64, enable_lora=True, max_loras=8, max_lora_rank=args.rank)
        for name in list(paths)[:8]:
            llm.add_lora(name, paths[name])
        if "b1" in parts:
            report(part="b1", engine="lora, base requests", tpot_ms=1000 * tpot(llm, prompts[0]))
            report(part="b1", engine="lora, one adapter",
                   tpot_ms=1000 * tpot(llm, prompts[0], "a0"))
        if "b64-8" in parts:
            names = [f"a{i % 8}" for i in range(64)]
            report(part="b64-8", engine="8 adapters mixed", tok_s=throughput(llm, prompts, names))
        close(llm)
    if "b64-64" in parts:
        llm = engine(args.model, 64, enable_lora=True, max_loras=16, max_lora_rank=args.rank,
                     max_cpu_loras=64)
        for name, path in paths.items():
            llm.add_lora(name, path)
        loras = llm.engine.loras
        swaps, swap_s = loras.num_swaps, loras.swap_s
        names = [f"a{i}" for i in range(64)]
        tok_s = throughput(llm, prompts, names, repeats=1)
        torch.cuda.synchronize()  # one swap, host to GPU and waited for
        start = time.perf_counter()
        loras.load(0, "a0", paths["a0"])
        torch.cuda.synchronize()
        report(part="b64-64", engine="64 adapters, 16 slots", tok_s=tok_s,
               swaps=loras.num_swaps - swaps - 1,
               swap_host_ms_each=1000 * (loras.swap_s - swap_s) / max(1, loras.num_swaps - swaps),
               swap_synced_ms=1000 * (time.perf_counter() - start))
        close(llm)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

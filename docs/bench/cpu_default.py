"""The default model on the CPU: lower-precision weights against float32, and load time.

    python3 docs/bench/cpu_default.py [--model SmolLM2-135M-Instruct] [--prompts 16]
        [--compiled-step auto|off|build] [--prompt-tokens 512] [--only "float32,gguf blocks"]

Prints, for float32, bfloat16 and int8 linear weights, the GGUF file's own blocks
(``cpu_weight_dtype``), the default ("auto": the blocks for a .gguf file) and for a
bfloat16 model (``dtype``): batch-1 decode ms/token (64
new tokens of one question, after a warm-up), prompt tokens a second (one prompt of
``--prompt-tokens``), how many of N greedy 64-token continuations equal the first
variant's, and the time of ``LLM(model)`` in this process (imports done).
Speed against transformers: ``roseinfer bench offline --compare-hf`` (docs/benchmarks.md).
"""
import argparse
import time

import torch

from roseinfer import LLM, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "How many legs does a spider have?", "What is 12 times 12?",
             "Write a haiku about the sea.", "Who wrote Hamlet?",
             "What is photosynthesis?", "Give me a synonym for happy.",
             "What is the boiling point of water?", "Explain gravity in one sentence.",
             "What language is spoken in Brazil?", "Tell me a fun fact about cats.",
             "What is the largest planet?", "How do I make tea?",
             "What does CPU stand for?", "Translate 'good morning' to Spanish."]


def decode_ms(llm: LLM, prompt: str) -> float:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return (time.perf_counter() - start) * 1000 / len(out.token_ids)


def prompt_tok_s(llm: LLM, tokens: int) -> float:
    """Prompt tokens a second: a prompt of ``tokens`` ids, one new token (after a warm-up)."""
    ids = [(i * 7919) % 40000 + 100 for i in range(tokens)]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([ids], params)
    start = time.perf_counter()
    llm.generate([ids[1:] + [5]], params)  # not the prefix just cached
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--compiled-step", default="auto", help="cpu_compiled_step: auto, off, build")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the prompt rate's prompt")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    greedy = SamplingParams(max_tokens=64, temperature=0)
    prompts = QUESTIONS[:args.prompts]
    reference = None
    variants = {"float32": {"cpu_weight_dtype": "float32"}, "default": {}, "bfloat16 weights": {"cpu_weight_dtype": "bfloat16"},
                "int8 weights": {"cpu_weight_dtype": "int8"}, "gguf blocks": {"cpu_weight_dtype": "gguf"},
                "bfloat16 model": {"dtype": "bfloat16"}}
    only = args.only.split(",") if args.only else list(variants)
    for name, options in ((n, o) for n, o in variants.items() if n in only):
        start = time.perf_counter()
        llm = LLM(args.model, device="cpu", cpu_compiled_step=args.compiled_step,
                  **{"dtype": "float32", **options})
        load_s = time.perf_counter() - start
        ids = [o.token_ids for o in llm.generate(prompts, greedy)]
        reference = reference or ids
        same = sum(a == b for a, b in zip(ids, reference))
        print(f"{name:16s} load {load_s:5.2f} s  batch 1: {decode_ms(llm, prompts[0]):6.1f} "
              f"ms/token  prompt of {args.prompt_tokens}: "
              f"{prompt_tok_s(llm, args.prompt_tokens):6.1f} tok/s  "
              f"greedy equal to {only[0]}: {same}/{len(prompts)}", flush=True)
        del llm


if __name__ == "__main__":
    main()

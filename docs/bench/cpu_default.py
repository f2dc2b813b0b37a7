"""The default model on the CPU: lower-precision weights against float32, and load time.

    python3 docs/bench/cpu_default.py [--model SmolLM2-135M-Instruct] [--prompts 16]
                                      [--compiled-step auto|off|build]

Prints, for float32, bfloat16 and int8 linear weights and the GGUF file's own blocks
(``cpu_weight_dtype``) and
for a bfloat16 model (``dtype``), batch-1 decode ms/token (64 new tokens of one
chat prompt, after a warm-up), how many of N greedy 64-token chat continuations
equal float32's, and the time of ``LLM(model)`` in this process (imports done).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--compiled-step", default="auto", help="cpu_compiled_step: auto, off, build")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    greedy = SamplingParams(max_tokens=64, temperature=0)
    prompts = QUESTIONS[:args.prompts]
    reference = None
    variants = {"float32": {}, "bfloat16 weights": {"cpu_weight_dtype": "bfloat16"},
                "int8 weights": {"cpu_weight_dtype": "int8"}, "gguf blocks": {"cpu_weight_dtype": "gguf"},
                "bfloat16 model": {"dtype": "bfloat16"}}
    for name, options in variants.items():
        start = time.perf_counter()
        llm = LLM(args.model, device="cpu", cpu_compiled_step=args.compiled_step,
                  **{"dtype": "float32", **options})
        load_s = time.perf_counter() - start
        ids = [o.token_ids for o in llm.generate(prompts, greedy)]
        reference = reference or ids
        same = sum(a == b for a, b in zip(ids, reference))
        print(f"{name:16s} load {load_s:5.2f} s  batch 1: {decode_ms(llm, prompts[0]):6.1f} "
              f"ms/token  greedy equal to float32: {same}/{len(prompts)}")
        del llm


if __name__ == "__main__":
    main()

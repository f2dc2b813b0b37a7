"""What a quantization method costs in accuracy, on a real model's weights (the default
model, SmolLM2-135M-Instruct, unless given): 16 prompts, the float model's greedy 64 tokens
after each, then each method scores the same prompt + tokens (teacher-forced, through
prompt_logprobs). Prints, per method, the mean absolute difference of the top-1 log
probability against the float model's, and the greedy agreement: the share of positions
where the method's most likely token is the float model's.

    python3 docs/bench/quant_accuracy.py [MODEL] [--methods fp8,int4] [--device cpu]
"""
import argparse

from roseinfer import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a",
           "The three laws of thermodynamics", "To make a good cup of tea,", "SELECT name FROM",
           "In 1905, Albert Einstein", "The quick brown fox", "Photosynthesis is the process",
           "import numpy as np\n", "Dear hiring manager,", "The main causes of the French",
           "A haiku about autumn:", "Water boils at", "The difference between a list and",
           "My favourite book is"]
NEW = 64


def top1(entries):
    """(token, logprob) of the most likely token at each scored position."""
    return [e.top[0] for e in entries]


def scored(llm, prompts):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    return [top1(o.prompt_logprobs[1:]) for o in llm.generate(prompts, params)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="SmolLM2-135M-Instruct")
    p.add_argument("--methods", default="fp8,int4")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    common = dict(device=args.device, dtype="float32", cpu_compiled_step="off")
    with LLM(args.model, **common) as llm:
        ids = [llm.tokenizer.encode(t) for t in PROMPTS]
        outs = llm.generate(ids, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
        full = [i + o.token_ids for i, o in zip(ids, outs)]
        base = scored(llm, full)
    print(f"{args.model}, {len(PROMPTS)} prompts x {NEW} tokens, teacher-forced on the float "
          f"model's greedy tokens ({args.device}, float32 activations)")
    print(f"{'method':8} {'top-1 logprob MAD':>18} {'greedy agreement':>17}")
    for method in args.methods.split(","):
        with LLM(args.model, quantization=method, **common) as llm:
            got = scored(llm, full)
        # only the positions after each prompt: the generated tokens
        pairs = [(b, g) for i, bs, gs in zip(ids, base, got)
                 for b, g in list(zip(bs, gs))[len(i) - 1:]]
        mad = sum(abs(b[1] - g[1]) for b, g in pairs) / len(pairs)
        agree = sum(b[0] == g[0] for b, g in pairs) / len(pairs)
        print(f"{method:8} {mad:18.4f} {agree:17.1%}")


if __name__ == "__main__":
    main()

"""Where bfloat16 weights (the LM head too) leave float32's greedy path: float32's gap
between its first two choices there (nats). Run from the repository root:
python3 docs/bench/cpu-gguf/floats-zen5/bf16head_ties.py"""
import runpy
QUESTIONS = runpy.run_path("docs/bench/cpu_default.py")["QUESTIONS"]
from roseinfer import LLM, SamplingParams
f32 = LLM("SmolLM2-135M-Instruct", device="cpu", cpu_weight_dtype="float32", cpu_compiled_step="off")
outs = f32.generate(QUESTIONS, SamplingParams(max_tokens=64, temperature=0, logprobs=2))
bf = LLM("SmolLM2-135M-Instruct", device="cpu", cpu_weight_dtype="bfloat16", cpu_compiled_step="off")
got = [o.token_ids for o in bf.generate(QUESTIONS, SamplingParams(max_tokens=64, temperature=0))]
for q, o, g in zip(QUESTIONS, outs, got):
    w = o.token_ids
    if w == g:
        continue
    i = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
    top = o.logprobs[i].top if i < len(w) else None
    gap = top[0][1] - top[1][1] if top and len(top) > 1 else None
    print(f"{q!r}: leaves at token {i}; float32's top two there {top}, gap {gap}")

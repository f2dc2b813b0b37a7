"""The model families at one real shape each, on CUDA in bf16, random weights.

For each family: transformers' model is built on the GPU (its own init) and
decodes 8 prompts of 64 random ids greedily for 32 tokens with float32 weights,
then with bf16 weights; roseinfer loads the bf16 model and does the same. Both
bf16 runs are set against float32: how many ids match and where the first
difference falls (random weights leave small margins between the top logits,
so bf16 rounding flips some), and the first token's log probability error.
Then roseinfer alone: batch 1 (512 in, 128 out) and 64 x
(512 in, 256 out), tokens/s against the decode bytes floor.

    for f in qwen2 qwen3 mistral phi3 deepseek_v2 deepseek_v3; do
        python3 docs/bench/families_gpu.py $f; done
"""
import gc
import sys
import time

import torch
import transformers

from roseinfer import LLM, SamplingParams
from roseinfer.bench.floor import decode_floor
from roseinfer.models.loader import RANDOM

ALIASES = {"qwen2": "qwen2.5-1.5b-random", "qwen3": "qwen3-1.7b-random",
           "mistral": "mistral-7b-random", "phi3": "phi3-mini-random",
           "deepseek_v2": "deepseek-v2-lite-random",
           "deepseek_v3": "moonlight-16b-a3b-random"}  # models/loader.py
PROMPTS, NEW = 8, 32


def build(family: str):
    cfg, _ = RANDOM[ALIASES[family]]()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    return model


@torch.inference_mode()
def reference(hf, prompts: torch.Tensor, dtype) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy ids and first-token log probabilities, with weights in ``dtype``."""
    hf.to(dtype)  # bf16 -> fp32 -> bf16 round-trips exactly
    ids = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW,
                      do_sample=False, eos_token_id=None, pad_token_id=0)[:, 64:].tolist()
    return ids, torch.log_softmax(hf(prompts).logits[:, -1].float(), dim=-1)


def agreement(runs: dict, ref32) -> str:
    """Each bf16 run against float32 transformers: greedy ids that match, where the
    first difference falls, and the first token's log probability error."""
    ids32, lp32 = ref32
    lines = []
    for name, (ids, lp) in runs.items():
        same = sum(a == b for r, o in zip(ids32, ids) for a, b in zip(r, o))
        first = sorted(next((k for k, (a, b) in enumerate(zip(r, o)) if a != b), NEW)
                       for r, o in zip(ids32, ids))
        err = max(abs(lp[i] - lp32[i, o[0]].item()) for i, o in enumerate(ids))
        lines.append(f"{name}: {same}/{PROMPTS * NEW} greedy ids as float32's, first difference "
                     f"at {first}; first-token logprob max |error| {err:.4f}")
    return "\n  ".join(lines)


def speed(llm, batch: int, new: int) -> str:
    prompts = [[(13 * i + j) % 30000 + 100 for j in range(512)] for i in range(batch)]
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    floor = decode_floor(llm.engine, [512] * batch, [new] * batch)
    tps = batch * new / dt
    return (f"{batch} x (512 in, {new} out): {tps:,.0f} tok/s, {dt / new * 1e3:.2f} ms/step; "
            f"floor {floor['output_throughput']:,.0f} tok/s; {tps / floor['output_throughput']:.1%}")


def main(family: str) -> None:
    """One family per process: an engine's memory is not handed back within one."""
    hf = build(family)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, hf.config.vocab_size - 100, (PROMPTS, 64), generator=g).cuda()
    ref32 = reference(hf, prompts, torch.float32)
    hf_ids, hf_lp = reference(hf, prompts, torch.bfloat16)
    llm = LLM(hf, device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=2048,
              enable_prefix_cache=False)
    outs = llm.generate(prompts.tolist(), SamplingParams(max_tokens=NEW, temperature=0,
                                                         ignore_eos=True, logprobs=0))
    runs = {"transformers bf16": (hf_ids, [hf_lp[i, r[0]].item() for i, r in enumerate(hf_ids)]),
            "roseinfer bf16": ([o.token_ids for o in outs], [o.logprobs[0].logprob for o in outs])}
    print(f"== {family} ({ALIASES[family]}, {sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B"
          f" parameters)\n  {agreement(runs, ref32)}", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    for batch, new in ((1, 128), (64, 256)):
        print("  " + speed(llm, batch, new), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

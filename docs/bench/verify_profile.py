"""Where a verify step (k + 1 positions) spends its time against a plain decode step, on
CUDA: the Llama-3-8B shape, random weights, batch 1, a 512-token prompt. Drafts come from
the bench's `always` proposer (k random tokens every step, never paused), so each round
is one verify step that keeps one token. For each kind: wall time per step and the
kernels of 20 steps (torch.profiler sees the kernels a CUDA graph launches).

    python3 docs/bench/verify_profile.py [MODEL] [K]
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_profile import kernel_table, steps  # noqa: E402
from speculative import BenchProposers  # noqa: E402

from roseinfer import LLM, SamplingParams  # noqa: E402
from roseinfer.core import speculation  # noqa: E402
from roseinfer.core.plugins import PluginRegistry  # noqa: E402


def main(model: str = "llama3-8b-random", k: int = 4) -> None:
    speculation.MIN_ROUNDS = 1 << 30  # never pause: every step verifies
    plugins = PluginRegistry()
    plugins.register(BenchProposers(), name="bench-proposers")
    llm = LLM(model, plugins=plugins, device="cuda", dtype="bfloat16", max_num_seqs=1,
              enable_prefix_cache=False, max_model_len=2048, speculative="always",
              num_speculative_tokens=k)
    eng = llm.engine
    for kind, speculative in (("plain", False), ("verify", True)):
        eng.add_request(kind, [(7 * j) % 1000 + 1 for j in range(512)], SamplingParams(
            max_tokens=1000, temperature=0, ignore_eos=True, speculative=speculative))
        while any(s.num_computed < s.num_prompt_tokens for s in eng.seqs.values()):
            eng.step()
        steps(eng, 10)
        torch.cuda.synchronize()
        t = time.perf_counter()
        tokens = steps(eng, 40)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 40
        rows, _ = kernel_table(eng, 20)
        gpu = sum(us for _, _, us in rows) / 20
        print(f"\n== {kind}: {wall * 1e3:.3f} ms a step (wall), {tokens / 40:.2f} tokens a step, "
              f"GPU busy {gpu / 1e3:.3f} ms a step, {sum(c for _, c, _ in rows) / 20:.0f} kernels")
        for name, count, us in rows[:18]:
            print(f"  {us / 20:9.1f} us/step {count / 20:6.1f}x  {name[:100]}")
        eng.abort(kind)
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *(int(a) for a in sys.argv[2:3]))

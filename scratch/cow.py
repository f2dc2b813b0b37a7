import sys; sys.path.insert(0,".")
from tests.models import tiny_gpt2
from tests.test_greedy_equality import mixed_prompts
from roseinfer import LLM, SamplingParams
from roseinfer.core import runner as R
calls=[]
orig=R.ModelRunner.copy_block
R.ModelRunner.copy_block=lambda self,s,d:(calls.append((s,d)),orig(self,s,d))
hf=tiny_gpt2()
llm=LLM(hf, device="cpu", block_size=4, num_kv_blocks=24, enable_prefix_cache=True, decode_steps_min_seqs=1)
outs=llm.generate(mixed_prompts(4, seed=3), SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))
print(len(calls))
llm=LLM(hf, device="cpu", block_size=4, num_kv_blocks=128, enable_prefix_cache=True)
outs=llm.generate([list(range(10,27))]*3 + [list(range(10,25))], SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True))
print(len(calls))

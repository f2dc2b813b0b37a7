import sys, time, logging
sys.path.insert(0, ".")
logging.basicConfig(level=logging.INFO)
from tests.models import tiny_gpt2, tiny_llama, hf_greedy
from roseinfer import LLM, SamplingParams
fam = sys.argv[1]
hf = tiny_gpt2() if fam == "gpt2" else tiny_llama()
path = f"/tmp/tiny-{fam}"
hf.save_pretrained(path)
prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [100]]
t = time.time()
llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=8, tensor_parallel_size=2)
print("start", time.time() - t)
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
for p, o in zip(prompts, outs):
    ref = hf_greedy(hf, p, 12)
    print(o.token_ids == ref, o.token_ids, ref)
llm.engine.close()
print("total", time.time() - t)

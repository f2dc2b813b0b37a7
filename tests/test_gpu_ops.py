"""Checks of CUDA-only code paths; skipped without a GPU."""
import pytest
import torch
import torch.nn.functional as F

from roseinfer.models.gpt2 import linear_gelu_tanh

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_gelu_epilogue_is_the_tanh_form(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).cuda().to(dtype)
    x = torch.randn(33, 64, device="cuda", dtype=dtype)
    ref = F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()), approximate="tanh")
    erf = F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()))
    out = linear_gelu_tanh(x, lin).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out - ref).norm() / ref.norm() < tol
    if dtype == torch.float32:  # fp16 rounding is as large as the erf/tanh gap
        assert (out - ref).abs().max() < (out - erf).abs().max()  # tanh, not erf


def test_seeded_sampling_is_the_same_with_and_without_graphs_and_neighbours(gpt2_model):
    """On CUDA a seeded request's tokens depend on its seed and positions only:
    the same alone (eager), in a batch with others (graphs and decode windows)
    and with graphs off; unseeded neighbours sample too."""
    from roseinfer import LLM, SamplingParams
    from tests.test_greedy_equality import mixed_prompts

    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=77,
                            ignore_eos=True)
    others = SamplingParams(max_tokens=24, temperature=1.0, min_p=0.05, ignore_eos=True)
    prompts = mixed_prompts(40, seed=3)

    def run(batch, **config):
        llm = LLM(gpt2_model, device="cuda", dtype="float32", block_size=4, num_kv_blocks=1024,
                  max_num_seqs=48, decode_steps=8, decode_steps_min_seqs=8, **config)
        params = [seeded] + [others] * (len(batch) - 1)
        return [o.token_ids for o in llm.generate(batch, params)]

    alone = run(prompts[:1], cuda_graphs=False)[0]
    assert run(prompts, cuda_graphs=True)[0] == alone
    assert run(prompts, cuda_graphs=False)[0] == alone
    assert run(prompts[:1] + prompts[20:], cuda_graphs=True)[0] == alone
    assert len(set(alone)) > 1


def test_the_largest_steps_run_right_after_start():
    """gpu_memory_utilization (default 0.9): the KV cache takes what is left of it after
    the weights and the measured activations of the largest steps, and those steps then
    run: a prompt of max_num_batched_tokens tokens beside max_num_seqs - 1 short ones,
    then max_num_seqs decode rows."""
    from roseinfer import LLM, SamplingParams

    tokens, seqs = 8192, 256
    with LLM("llama3-1b-random", max_num_seqs=seqs, max_num_batched_tokens=tokens,
             max_model_len=tokens + 64) as llm:
        free, total = torch.cuda.mem_get_info()
        cache = llm.engine.kv_cache
        cache_bytes = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        assert total - free <= 0.9 * total + (1 << 30)  # the captured graphs' pool aside
        assert cache_bytes >= 0.7 * total  # the 1B shape's weights are 2.5 GB
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(128, 100_000, (n,), generator=gen).tolist()
                   for n in [tokens] + [8] * (seqs - 1)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0,
                                                    ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4] * seqs

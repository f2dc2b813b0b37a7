"""Logit bias, penalties and log probabilities (core/logits.py) against
transformers: its generate with its own logits processors, and the log_softmax
of its logits (float32)."""
import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from tests.conftest import DEVICE
from tests.models import hf_greedy
from tests.test_greedy_equality import mixed_prompts

PROMPTS = [[5, 9, 5, 9, 5], list(range(30, 41)), [7]]


def llm_for(hf, **config):
    return LLM(hf, **{"device": DEVICE, "dtype": "float32", "block_size": 4,
                      "num_kv_blocks": 128, "max_num_seqs": 8, **config})


def hf_logits(hf, ids) -> torch.Tensor:
    """Next-token logits after every prefix of ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def reference_greedy(hf, prompt, n, process):
    """Greedy decoding over transformers' logits with ``process(logits, ids)``."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(process(hf_logits(hf, ids)[-1], ids).argmax()))
    return ids[len(prompt):]


def greedy(**kw):
    return SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logprobs_equal_transformers_log_softmax(family, request):
    hf = request.getfixturevalue(f"{family}_model")
    outs = llm_for(hf).generate(PROMPTS, greedy(logprobs=5))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
        ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids), -1)[len(prompt) - 1:-1]
        assert len(out.logprobs) == 10
        for i, lp in enumerate(out.logprobs):
            assert lp.token_id == out.token_ids[i]
            assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-4
            top_vals, top_ids = ref[i].topk(5)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert max(abs(v - r) for (_, v), r in zip(lp.top, top_vals.tolist())) < 1e-4


def check_prompt_logprobs(hf, prompt, entries, k):
    """One entry per prompt token, None first, each the log_softmax of transformers'
    logits at the position before it."""
    assert len(entries) == len(prompt) and entries[0] is None
    ref = torch.log_softmax(hf_logits(hf, prompt), -1)
    for i, lp in enumerate(entries[1:], start=1):
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        top_vals, _ = ref[i - 1].topk(k)
        assert len(lp.top) == k
        assert all(abs(v - r) < 1e-4 for (_, v), r in zip(lp.top, top_vals.tolist()))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prompt_logprobs_equal_transformers_log_softmax(family, request):
    """Prompts in chunks of at most 8 tokens, beside a request that does not ask."""
    hf = request.getfixturevalue(f"{family}_model")
    prompts = PROMPTS + [list(range(50, 71))]
    params = [greedy(prompt_logprobs=3)] * len(prompts) + [greedy()]
    outs = llm_for(hf, max_num_batched_tokens=8).generate(prompts + [[3, 4, 5]], params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
        check_prompt_logprobs(hf, prompt, out.prompt_logprobs, 3)
    assert outs[-1].prompt_logprobs is None


def test_prompt_logprobs_compute_a_cached_prefix_again(llama_model):
    llm = llm_for(llama_model, enable_prefix_cache=True)
    prompt = list(range(30, 51))
    llm.generate([prompt], greedy())  # its full blocks are cached now
    out = llm.generate([prompt], greedy(prompt_logprobs=0))[0]
    check_prompt_logprobs(llama_model, prompt, out.prompt_logprobs, 0)
    assert llm.generate([prompt], greedy())[0].token_ids == out.token_ids


def test_sampled_logprobs_are_of_the_tempered_distribution(gpt2_model):
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True, logprobs=0)
    out = llm_for(gpt2_model).generate([PROMPTS[1]], params)[0]
    ref = torch.log_softmax(hf_logits(gpt2_model, PROMPTS[1] + out.token_ids) / 0.7, -1)
    for i, lp in enumerate(out.logprobs):
        assert lp.top == []
        assert abs(lp.logprob - ref[len(PROMPTS[1]) - 1 + i, lp.token_id].item()) < 1e-4


def test_deltas_carry_one_logprob_per_new_id(gpt2_model):
    eng = llm_for(gpt2_model).engine
    eng.add_request("a", PROMPTS[1], greedy(logprobs=2))
    eng.add_request("b", PROMPTS[0], greedy())
    seen = {"a": 0, "b": 0}
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == "a":
                assert [lp.token_id for lp in out.new_logprobs] == out.new_token_ids
                assert all(len(lp.top) == 2 for lp in out.new_logprobs)
            else:
                assert out.new_logprobs is None
            seen[out.request_id] += len(out.new_token_ids)
    assert seen == {"a": 10, "b": 10}


def test_logprobs_in_decode_windows(gpt2_model):
    """Windows of 4 steps: one logprob per id, each id's own."""
    prompts = mixed_prompts(4, seed=11)
    llm = llm_for(gpt2_model, decode_steps=4, decode_steps_min_seqs=2)
    outs = llm.generate(prompts, greedy(logprobs=1, repetition_penalty=1.2))
    for prompt, out in zip(prompts, outs):
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        ref = reference_greedy(gpt2_model, prompt, 10,
                               lambda logits, ids: _repetition(logits, ids, 1.2))
        assert out.token_ids == ref


def _repetition(logits, ids, penalty):
    seen = torch.tensor(sorted(set(ids)))
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU sampler; the CPU's uses torch generators")
def test_seeded_sampling_with_logits_work_is_the_same_with_and_without_graphs(gpt2_model):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=21,
                            ignore_eos=True, logprobs=2, presence_penalty=0.5)
    prompts = mixed_prompts(8, seed=12)

    def run(**config):
        llm = llm_for(gpt2_model, decode_steps=4, decode_steps_min_seqs=2, **config)
        return [o.token_ids for o in llm.generate(prompts, params)]
    assert run(cuda_graphs=True) == run(cuda_graphs=False)


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_equals_transformers(penalty, llama_model):
    outs = llm_for(llama_model).generate(PROMPTS, greedy(repetition_penalty=penalty))
    for prompt, out in zip(PROMPTS, outs):
        ref = llama_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                   repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), prompt


def test_logit_bias_equals_transformers_sequence_bias(gpt2_model):
    bias = {11: 8.0, 12: 6.5, 200: -100.0}
    outs = llm_for(gpt2_model).generate(PROMPTS, greedy(logit_bias=bias))
    for prompt, out in zip(PROMPTS, outs):
        ref = gpt2_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                  sequence_bias={(t,): b for t, b in bias.items()},
                                  eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), prompt
    assert any(t in (11, 12) for o in outs for t in o.token_ids)


def test_frequency_and_presence_penalties_follow_openai(gpt2_model):
    freq, pres = 1.5, 0.8

    def process(logits, ids):
        out = torch.tensor(ids[len(prompt):], dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[0]).float()
        return logits - freq * counts - pres * (counts > 0).float()

    params = greedy(frequency_penalty=freq, presence_penalty=pres)
    for prompt, out in zip(PROMPTS, llm_for(gpt2_model).generate(PROMPTS, params)):
        assert out.token_ids == reference_greedy(gpt2_model, prompt, 10, process)


def test_penalized_and_plain_requests_share_batches(llama_model):
    """Penalized rows beside plain ones (graphs and decode windows on a GPU for
    the plain batches), a preemption-free mix, and prompts that arrive later."""
    prompts = mixed_prompts(6, seed=9)
    params = [greedy(repetition_penalty=1.3) if i % 2 else greedy() for i in range(6)]
    llm = llm_for(llama_model, decode_steps=4, decode_steps_min_seqs=2)
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        ref = llama_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                   repetition_penalty=p.repetition_penalty, eos_token_id=None,
                                   pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), prompt


@pytest.mark.parametrize("kwargs,field", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_logit_bias_past_the_vocabulary_is_refused(gpt2_model):
    eng = llm_for(gpt2_model).engine
    with pytest.raises(InvalidRequestError, match="vocabulary") as e:
        eng.add_request("a", [1, 2], greedy(logit_bias={512: 1.0}))
    assert e.value.field == "logit_bias"

"""n > 1 samples of one prompt: computed once, each sample its own sequence."""
import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from tests.conftest import DEVICE
from tests.models import hf_greedy
from tests.test_greedy_equality import mixed_prompts

PROMPT = list(range(40, 70))  # 30 tokens: 7 full blocks of 4 before the last token


def llm_for(hf, **config):
    return LLM(hf, **{"device": DEVICE, "dtype": "float32", "block_size": 4, "num_kv_blocks": 128,
                      "enable_prefix_cache": False, **config})


def computed_tokens(llm):
    """Counts the tokens every scheduled step computes."""
    sched, counted = llm.engine.scheduler, []
    schedule = sched.schedule

    def counting():
        batch = schedule()
        counted.append(sum(batch.num_tokens) * batch.steps)
        return batch
    sched.schedule = counting
    return counted


def test_greedy_samples_share_the_prompt_and_equal_transformers(gpt2_model):
    llm = llm_for(gpt2_model)
    counted = computed_tokens(llm)
    outs = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=8, temperature=0,
                                                 ignore_eos=True))[0]
    want = hf_greedy(gpt2_model, PROMPT, 8)
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.token_ids == want and o.finish_reason == "length" for o in outs)
    # The prompt once (30), each other sample its last partial block (2), 8 tokens each
    # minus the one its prompt step sampled.
    assert sum(counted) == 30 + 2 * 2 + 3 * 7
    assert llm.engine.blocks.num_free == 128 and not llm.engine.groups


def test_seeded_samples_differ_and_each_equals_its_own_seed(gpt2_model):
    llm = llm_for(gpt2_model)
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    outs = llm.generate([PROMPT, [5, 6]], params)
    assert len({tuple(o.token_ids) for o in outs[0]}) == 4
    alone = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=10, temperature=1.0,
                                                       seed=7 + i, ignore_eos=True)
                                        for i in range(4)])
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in alone]
    again = llm.generate([PROMPT], params)[0]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[0]]


def test_preemption_and_the_prefix_cache_keep_every_sample(gpt2_model):
    prompts = mixed_prompts(4, seed=3)
    params = SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True)
    llm = llm_for(gpt2_model, num_kv_blocks=24, enable_prefix_cache=True,
                  decode_steps_min_seqs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0, "the pool should have forced preemption"
    for prompt, samples in zip(prompts, outs):
        assert all(o.token_ids == hf_greedy(gpt2_model, prompt, 12) for o in samples)
    assert llm.engine.blocks.num_free == 24


def test_abort_ends_every_sample(gpt2_model):
    llm = llm_for(gpt2_model)
    eng = llm.engine
    eng.add_request("a", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort("a")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    finals = {o.index: o.finish_reason for o in outs if o.finished}
    assert finals == {0: "abort", 1: "abort", 2: "abort"}
    assert eng.blocks.num_free == 128 and not eng.groups and not eng.seqs
    eng.add_request("a", [1, 2], SamplingParams(max_tokens=1))  # the rid is free again


def test_a_resumed_request_runs_its_unfinished_samples_from_their_tokens(gpt2_model):
    eng = llm_for(gpt2_model).engine
    emitted = {1: [7, 8, 9], 2: [3]}  # each sample's tokens already handed out
    eng.add_request("r", PROMPT, SamplingParams(n=3, max_tokens=10, temperature=0,
                                                ignore_eos=True),
                    indexes=[1, 2], emitted_ids=emitted)
    got = {1: [], 2: []}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.index] += o.new_token_ids
    for i, ids in emitted.items():
        assert got[i] == hf_greedy(gpt2_model, PROMPT + ids, 10 - len(ids))


def test_prompt_logprobs_come_with_the_first_sample(gpt2_model):
    outs = llm_for(gpt2_model).generate([PROMPT], SamplingParams(n=2, max_tokens=2,
                                                                 prompt_logprobs=1))[0]
    assert len(outs[0].prompt_logprobs) == len(PROMPT) and outs[1].prompt_logprobs is None


@pytest.mark.parametrize("n", [0, 17, 2.0])
def test_n_out_of_range_is_refused(n):
    with pytest.raises(InvalidRequestError, match=r"n: must be an integer in \[1, 16\]"):
        SamplingParams(n=n)


def test_bad_indexes_are_refused(gpt2_model):
    eng = llm_for(gpt2_model).engine
    with pytest.raises(InvalidRequestError, match="indexes"):
        eng.add_request("x", [1], SamplingParams(n=2), indexes=[2])
    assert not eng.seqs and not eng.groups

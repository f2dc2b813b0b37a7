"""Greedy token ids equal transformers' generate, across the engine's options."""
import random

import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.core.plugins import default_registry
from tests.conftest import DEVICE
from tests.models import hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def mixed_prompts(n=5, seed=0, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 23))] for _ in range(n)]


def check(hf, prompts, max_tokens=12, **config):
    config = {"device": DEVICE, "dtype": "float32", "block_size": 4, "num_kv_blocks": 128,
              "max_num_seqs": 8,
              **config}
    llm = LLM(hf, **config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf, prompt, max_tokens), prompt
        assert out.finish_reason == "length"
    return llm


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batch_of_mixed_lengths(family, request):
    hf = request.getfixturevalue(f"{family}_model")
    check(hf, mixed_prompts(), max_tokens=20)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_single_prompt_large_blocks(family, request):
    hf = request.getfixturevalue(f"{family}_model")
    check(hf, [[5, 6, 7]], block_size=16)


@pytest.mark.parametrize("decode_steps", [1, 3, 8])
def test_decode_windows(decode_steps, gpt2_model):
    """Windows of several decode steps cross block boundaries (blocks of 4)."""
    check(gpt2_model, mixed_prompts(6, seed=2), max_tokens=21, decode_steps=decode_steps,
          decode_steps_min_seqs=1)


def test_untied_and_tied_llama():
    from tests.models import tiny_llama
    check(tiny_llama(tie_word_embeddings=True), mixed_prompts(3, seed=1))


def test_prefix_cache_with_shared_prefixes(llama_model):
    shared = list(range(10, 27))  # 17 tokens: four full blocks of 4 plus one
    prompts = [shared + [40], shared + [41, 42], shared[:9], shared]
    llm = check(llama_model, prompts, enable_prefix_cache=True)
    # second round: every prompt's full blocks are now cached
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(llama_model, p, 12) for p in prompts]
    assert llm.engine.blocks.cached, "full blocks should have been published to the cache"


def test_chunked_prefill(gpt2_model):
    check(gpt2_model, mixed_prompts(4, seed=2), max_num_batched_tokens=7)


BACKENDS = default_registry().names("kv_append")
STORES = default_registry().names("metadata")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_kv_append_backend(backend, llama_model):
    # equal-length prompts: decode steps share one offset, the full-batch shape
    prompts = [p[:5] for p in mixed_prompts(6, seed=3) if len(p) >= 5][:3]
    llm = check(llama_model, prompts, max_tokens=6, kv_append_backend=backend)
    assert llm.engine.kv_cache.steps_by_backend[backend] >= 4


@pytest.mark.parametrize("store", STORES)
def test_every_metadata_store(store, gpt2_model):
    shared = list(range(30, 42))
    check(gpt2_model, [shared + [1], shared + [2], [7]], metadata_store=store,
          enable_prefix_cache=True)


@pytest.mark.parametrize("attention", default_registry().names("attention"))
def test_every_attention_backend(attention, llama_model):
    check(llama_model, mixed_prompts(3, seed=4), max_tokens=6, attention_backend=attention)

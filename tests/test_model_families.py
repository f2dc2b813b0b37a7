"""The Llama-like families (Mistral, Qwen2, Qwen3): greedy ids equal transformers'
generate on random tiny configs, across block sizes, batches of mixed lengths and the
prefix cache; a sliding window bounds the context."""
import pytest

from roseinfer import LLM
from tests.models import tiny_family
from tests.test_greedy_equality import check, mixed_prompts

FAMILIES = ["mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return tiny_family(request.param, sliding_window=None)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_transformers(family_model, block_size):
    check(family_model, mixed_prompts(6, seed=block_size), max_tokens=16, block_size=block_size)


def test_prefix_cache_keeps_greedy_equal(family_model):
    shared = mixed_prompts(1, seed=7)[0] * 3
    prompts = [shared + p for p in mixed_prompts(4, seed=8)]
    llm = check(family_model, prompts, enable_prefix_cache=True)
    check(family_model, prompts, enable_prefix_cache=True)  # second pass: cached blocks
    assert llm.engine.blocks.prefix_cache


def test_a_sliding_window_bounds_the_context():
    llm = LLM(tiny_family("mistral", sliding_window=64), device="cpu", dtype="float32",
              num_kv_blocks=128, block_size=4)
    assert llm.engine.max_model_len == 64

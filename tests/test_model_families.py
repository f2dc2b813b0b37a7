"""The Llama-like families (Mistral, Qwen2, Qwen3, Phi-3; Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE and gpt-oss; Gemma 2 and 3): greedy ids equal transformers' generate on random
tiny configs, across block sizes, batches of mixed lengths and the prefix cache; sliding
windows attend over their last tokens only; LongRoPE bounds the context."""
import pytest
import torch

from roseinfer import LLM, SamplingParams
from tests.models import hf_greedy, per_expert_checkpoint, tiny_family
from tests.test_greedy_equality import check, mixed_prompts

FAMILIES = ["mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
            "gpt_oss", "gemma2", "gemma3_text"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return tiny_family(request.param)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_transformers(family_model, block_size):
    check(family_model, mixed_prompts(6, seed=block_size), max_tokens=16, block_size=block_size)


def test_prefix_cache_keeps_greedy_equal(family_model):
    shared = mixed_prompts(1, seed=7)[0] * 3
    prompts = [shared + p for p in mixed_prompts(4, seed=8)]
    llm = check(family_model, prompts, enable_prefix_cache=True)
    check(family_model, prompts, enable_prefix_cache=True)  # second pass: cached blocks
    assert llm.engine.blocks.prefix_cache


@pytest.mark.parametrize("family, window", [
    ("mistral", dict(sliding_window=6)), ("mixtral", dict(sliding_window=5)),
    # Qwen2's windows start at layer max_window_layers: layer 0 full, layer 1 windowed
    ("qwen2", dict(sliding_window=4, use_sliding_window=True, max_window_layers=1))])
@pytest.mark.parametrize("chunk", [None, 8])
def test_sliding_windows_equal_transformers(family, window, chunk):
    """Prompts several windows long, prefilled whole or in 8-token chunks across window
    edges, then decoded past more windows; the window no longer bounds the context."""
    model = tiny_family(family, **window)
    prompts = mixed_prompts(5, seed=9) + [list(range(3, 40))]
    llm = check(model, prompts, max_tokens=20, max_num_batched_tokens=chunk or 2048,
                enable_prefix_cache=True)
    assert llm.engine.max_model_len == 256
    # again: the prompts' full blocks come from the prefix cache
    again = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in again] == [hf_greedy(model, p, 20) for p in prompts]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_sliding_windows_through_preemption_and_n_samples():
    """Gemma 3's mixed layers (4-token windows beside global ones): a pool small enough
    to preempt, three greedy samples per prompt, the prefix cache on; every sample
    equals transformers'."""
    model = tiny_family("gemma3_text")
    prompts = mixed_prompts(4, seed=3)
    llm = LLM(model, device="cpu", dtype="float32", block_size=4, num_kv_blocks=40,
              max_num_seqs=8, enable_prefix_cache=True, decode_steps_min_seqs=1)
    outs = llm.generate(prompts, SamplingParams(n=3, max_tokens=16, temperature=0,
                                                ignore_eos=True))
    assert llm.engine.stats().num_preemptions > 0, "the pool should have forced preemption"
    for prompt, samples in zip(prompts, outs):
        assert all(o.token_ids == hf_greedy(model, prompt, 16) for o in samples)


def test_olmoe_clipping_q_k_and_v():
    """OLMoE's ``clip_qkv`` bounds q, k and v after its norms (1.0 clips most of them)."""
    check(tiny_family("olmoe", clip_qkv=1.0), mixed_prompts(4, seed=6), max_tokens=16)


def test_phi3_with_partial_rotary():
    """Phi-4-mini's kind of config: a quarter of each head's dims do not rotate."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    check(tiny_family("phi3", sliding_window=None, rope_parameters=rope),
          mixed_prompts(5, seed=4), max_tokens=16)


def test_longrope_bounds_the_context_to_its_original_length():
    """Past its original context LongRoPE changes frequencies (transformers switches
    tables on the fly); built once here, the short-context tables bound the context."""
    half = 6  # head dim 12: rotary dims come in 6 pairs
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [4.0] * half, "original_max_position_embeddings": 128}
    model = tiny_family("phi3", sliding_window=None, max_position_embeddings=512,
                        original_max_position_embeddings=128, rope_parameters=rope)
    llm = check(model, mixed_prompts(3, seed=5), max_tokens=12)
    assert llm.engine.max_model_len == 128


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_load_stacked_or_one_per_expert(family):
    """transformers holds the experts stacked; checkpoints on disk hold one tensor per
    expert and projection, under each family's own names: both become the same w13
    and w2."""
    from roseinfer.models.moe import MoeForCausalLM

    model = tiny_family(family, sliding_window=None)
    want = MoeForCausalLM.convert_hf_state_dict(model.state_dict(), model.config)
    got = MoeForCausalLM.convert_hf_state_dict(per_expert_checkpoint(model), model.config)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_gemma3_vision_language_checkpoint_serves_text_prompts(tmp_path):
    """Gemma 3's released checkpoints are vision-language ones (``gemma3``): one saved
    as transformers saves it loads, tower and all (models/gemma3_vl.py; images:
    tests/test_gemma3_vl.py), and greedy ids on text prompts equal transformers' own."""
    import transformers

    text = tiny_family("gemma3_text").config.to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=500,
                                       boi_token_index=501, eoi_token_index=502)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (a scale of 1): make them matter
        for name, p in hf.model.language_model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    prompts = mixed_prompts(4, seed=11)
    with LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=128,
             block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))
        assert type(llm.engine.model).__name__ == "Gemma3ForConditionalGeneration"
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]

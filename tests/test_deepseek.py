"""DeepSeek-V2's and V3's architecture (multi-head latent attention, absorbed; DeepSeekMoE's
routing beside shared experts; dense first layers) against transformers' own models on
tiny random configs: greedy ids equal, with and without a query LoRA, interleaved RoPE or
not, YaRN with its softmax mscale, V2's greedy and group-limited softmax routing, the
prefix cache."""
import pytest
import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM)

from roseinfer import LLM, SamplingParams
from roseinfer.layers.moe_routing import GroupedTopK
from tests.conftest import DEVICE
from tests.models import hf_greedy
from tests.test_greedy_equality import check, mixed_prompts

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 64}


def tiny_deepseek(version: int = 3, **overrides):
    torch.manual_seed(0)
    config, model_class = (DeepseekV3Config, DeepseekV3ForCausalLM) if version == 3 else \
        (DeepseekV2Config, DeepseekV2ForCausalLM)
    config = config(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
        "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "initializer_range": 0.2,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **overrides})
    model = model_class(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)  # else every expert ties
            if version == 3:
                torch.nn.init.normal_(layer.mlp.gate.e_score_correction_bias, std=0.3)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("overrides", [
    {}, {"q_lora_rank": None}, {"rope_interleave": False},
    {"rope_parameters": YARN}, {"norm_topk_prob": False, "n_shared_experts": 2}],
    ids=["v3", "no-q-lora", "rope-halves", "yarn", "unnormalised-2-shared"])
def test_greedy_equals_transformers(overrides):
    check(tiny_deepseek(**overrides), mixed_prompts(5, seed=3), max_tokens=16)


@pytest.mark.parametrize("overrides", [
    {"topk_method": "greedy"},
    {"topk_method": "greedy", "routed_scaling_factor": 1.0, "norm_topk_prob": False},
    {"topk_method": "group_limited_greedy", "q_lora_rank": None, "routed_scaling_factor": 1.5}],
    ids=["v2-greedy", "v2-lite-greedy-fused-routing", "v2-lite-group-limited"])
def test_v2_greedy_equals_transformers(overrides):
    check(tiny_deepseek(2, **overrides), mixed_prompts(5, seed=4), max_tokens=16)


def test_prefix_cache_and_block_size_keep_it_equal():
    model = tiny_deepseek()
    shared = mixed_prompts(1, seed=7)[0] * 3
    prompts = [shared + p for p in mixed_prompts(3, seed=8)]
    check(model, prompts, enable_prefix_cache=True, block_size=16)
    check(model, prompts, enable_prefix_cache=True, block_size=16)


def test_an_fp8_cache_equals_transformers_with_a_rounding_cache():
    """kv_cache_dtype fp8: each latent row rounded to e4m3 as it is stored; transformers'
    cache holds the same two parts (the normed latent, the turned RoPE key), so a cache
    that rounds what it is given is the reference. The prefix cache shares blocks."""
    from tests.test_quantization import fp8_cache_reference, STEPS
    hf = tiny_deepseek()
    shared = list(range(10, 33))
    prompts = mixed_prompts(3, seed=9) + [shared, shared + [40, 41]]
    want = [fp8_cache_reference(hf, p) for p in prompts]
    llm = LLM(hf, device=DEVICE, dtype="float32", kv_cache_dtype="fp8", block_size=4,
              num_kv_blocks=96, enable_prefix_cache=True)
    assert llm.engine.kv_cache.k[0].dtype == torch.float8_e4m3fn
    got = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0,
                                               ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert want != [hf_greedy(hf, p, STEPS) for p in prompts], "rounding must show here"


def test_grouped_routing_equals_transformers_router():
    """The experts' set and weights from V3's router (groups by their two best, the
    bias choosing, the scores weighing), on 64 random tokens."""
    model = tiny_deepseek(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    router = model.model.layers[1].mlp.gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    ours = GroupedTopK(16, 4, 4, 2, router.routed_scaling_factor, True)
    ours.e_score_correction_bias.copy_(router.e_score_correction_bias)
    weights, ids = ours.select(logits)
    same_choices(weights, ids, want_w, want_ids)


def same_choices(weights, ids, want_w, want_ids):
    """Each token's experts the same set, each with the same weight."""
    for got_i, got_w, w_i, w_w in zip(ids.long().cpu(), weights.cpu(), want_ids.long().cpu(),
                                      want_w.cpu()):
        assert sorted(got_i.tolist()) == sorted(w_i.tolist())
        torch.testing.assert_close(got_w[got_i.argsort()], w_w[w_i.argsort()])


# (experts, groups, groups kept, top k): V3 and R1; Moonlight; GLM-4.5 (160, one group)
ROUTERS = [(256, 8, 4, 8), (64, 1, 1, 6), (160, 1, 1, 8), (16, 4, 2, 4)]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", ROUTERS, ids=lambda s: "e{}-g{}-kg{}-k{}".format(*s))
def test_the_grouped_routing_kernel_equals_torch(shape, renormalize):
    """One launch for V3's routing: the same experts and weights as the torch ops, for
    decode rows and a prompt's."""
    experts, groups, kept, top_k = shape
    ours = GroupedTopK(experts, top_k, groups, kept, 2.5, renormalize).to(DEVICE)
    gen = torch.Generator().manual_seed(experts + groups)
    ours.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.3)
    logits = (torch.randn(40, experts, generator=gen) * 2).to(DEVICE)
    want = ours.select(logits, use_triton=False)
    same_choices(*ours.select(logits, use_triton=True), *want)


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_grouped_routing_sums_the_split_router(tokens):
    """At decode sizes the router's GEMV runs split over the hidden dims and the routing
    kernel sums its partials: the same choices as the router linear's logits routed."""
    experts, hidden = 256, 200
    gen = torch.Generator().manual_seed(tokens)
    gate = torch.nn.Linear(hidden, experts, bias=False).to(DEVICE)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(experts, hidden, generator=gen) * 0.1)
    ours = GroupedTopK(experts, 8, 8, 4, 2.5, True).to(DEVICE)
    ours.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.3)
    h = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    with torch.no_grad():
        same_choices(*ours(h, gate, use_triton=True), *ours.select(gate(h), use_triton=False))


@pytest.mark.parametrize("overrides", [{}, {"use_qk_norm": True, "attention_bias": False}],
                         ids=["glm-4.5", "qk-norm"])
def test_glm4_moe_equals_transformers(overrides):
    """GLM-4.5: GQA with q/k/v biases and partial rotary, DeepSeekMoE past a dense layer;
    its multi-token-prediction layer in the checkpoint is left out."""
    check(tiny_glm4_moe(**overrides), mixed_prompts(5, seed=5), max_tokens=16)


def tiny_glm4_moe(**overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(0)
    config = Glm4MoeConfig(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "attention_bias": True, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
        "initializer_range": 0.2, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
        **overrides})
    model = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)
            torch.nn.init.normal_(layer.mlp.gate.e_score_correction_bias, std=0.3)
        for name, p in model.named_parameters():
            if name.endswith("bias") and "proj" in name:
                torch.nn.init.normal_(p, std=0.5)
    return model


def test_multi_token_prediction_layers_are_left_out():
    """DeepSeek-V3's and GLM-4.5's checkpoints hold their MTP layer after the last one."""
    from roseinfer.models.deepseek import DeepseekForCausalLM
    model = tiny_deepseek()
    sd = {**model.state_dict(), "model.layers.3.eh_proj.weight": torch.zeros(4, 4),
          "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(4, 4)}
    converted = DeepseekForCausalLM.convert_hf_state_dict(sd, model.config)
    assert not [k for k in converted if k.startswith("layers.3.")]
    assert any(k.startswith("layers.2.") for k in converted)


def block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in e4m3 with one scale per block x block values (absmax / 448), as
    DeepSeek-V3's checkpoints hold weights: (e4m3 weight, scale_inv)."""
    rows, cols = w.shape
    scale = torch.zeros(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_a_block_fp8_checkpoint_equals_its_dequantized_weights(tmp_path):
    """A checkpoint as DeepSeek-V3's FP8 release lays it out (every projection and expert
    in e4m3 with 16 x 16 block scales here, experts one per file name, the router and
    norms in float): loaded, its greedy ids equal transformers' model holding the same
    weights de-quantized by hand."""
    from safetensors.torch import save_file
    model = tiny_deepseek()
    sd, reference = {}, {}
    for key, t in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):  # one per expert
            prefix = key.rsplit(".", 1)[0]
            for e, w in enumerate(t):
                parts = w.chunk(2) if key.endswith("gate_up_proj") else (w,)
                names = ("gate_proj", "up_proj") if len(parts) == 2 else ("down_proj",)
                for name, part in zip(names, parts):
                    sd[f"{prefix}.{e}.{name}.weight"] = part.contiguous()
        else:
            sd[key] = t
    for key in list(sd):
        if key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight"):
            q, scale = block_fp8(sd[key].float(), 16)
            sd[key], sd[key + "_scale_inv"] = q, scale
            dequantized = q.float() * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[
                :q.shape[0], :q.shape[1]]
            reference[key] = dequantized
    with torch.no_grad():  # transformers' model holds the de-quantized values
        for key, t in reference.items():
            if ".experts." not in key:
                model.get_parameter(key).copy_(t)
        for i, layer in enumerate(model.model.layers):
            if i < model.config.first_k_dense_replace:
                continue
            prefix = f"model.layers.{i}.mlp.experts"
            for e in range(layer.mlp.experts.gate_up_proj.shape[0]):
                layer.mlp.experts.gate_up_proj[e].copy_(torch.cat(
                    [reference[f"{prefix}.{e}.gate_proj.weight"],
                     reference[f"{prefix}.{e}.up_proj.weight"]]))
                layer.mlp.experts.down_proj[e].copy_(reference[f"{prefix}.{e}.down_proj.weight"])
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [16, 16],
                                        "activation_scheme": "dynamic", "fmt": "e4m3"}
    model.config.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=128)
    assert llm.engine.model.quantization == "block_fp8"
    prompts = mixed_prompts(4, seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12), prompt


def test_the_cache_holds_each_latent_row_once():
    """Latent attention's rows are its keys and values: one tensor a layer, each token's
    row kv_lora_rank + qk_rope_head_dim wide, shared by every head."""
    llm = check(tiny_deepseek(), mixed_prompts(2, seed=1), max_tokens=4)
    cache = llm.engine.kv_cache
    assert cache.values_are_keys and all(k is v for k, v in zip(cache.k, cache.v))
    assert cache.k[0].shape[1:] == (1, 4, 32 + 8)  # one KV head, blocks of 4, latent 32 + RoPE 8

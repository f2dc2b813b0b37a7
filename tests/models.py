"""Small random-weight transformers models used as references in tests.

A large initializer range makes logits peaked, so greedy choices are far
from ties and token-exact comparisons test the math, not rounding.
"""
import torch


def tiny_gpt2(vocab=512, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**{**dict(n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=vocab,
                               initializer_range=0.2, bos_token_id=0, eos_token_id=1),
                        **overrides})
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(vocab=512, **overrides):
    """GQA (6 query heads on 2 KV heads) and head_dim 12 (not a power of two)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=vocab, hidden_size=72, intermediate_size=144, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(LlamaConfig(**{**base, **overrides})).eval()


def tiny_family(family, vocab=512, **overrides):
    """A Llama-like family at tiny_llama's shape: "mistral", "qwen2", "qwen3", "phi3", or a
    mixture of experts, each with 8 experts and top 2: "qwen3_moe" (of 48; its second layer
    dense), "qwen2_moe" (the same, and a shared expert of 96), "mixtral", "olmoe" and
    "gpt_oss" (of 48, in every layer; gpt-oss's layers alternate 4-token windows with
    full attention, and have sinks); "gemma2" and "gemma3_text" (a 4-token window layer,
    then a global one; Gemma 2's soft caps low enough to bite)."""
    import transformers

    torch.manual_seed(0)
    names = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
             "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral",
             "olmoe": "Olmoe", "gpt_oss": "GptOss", "gemma2": "Gemma2",
             "gemma3_text": "Gemma3"}[family]
    config = getattr(transformers, "Gemma3TextConfig" if family == "gemma3_text" else
                     f"{names}Config")
    base = dict(vocab_size=vocab, hidden_size=72, intermediate_size=144, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    if family == "phi3":  # its default pad id (32000) is past a tiny vocabulary
        base["pad_token_id"] = 0
    if family in ("qwen3_moe", "qwen2_moe"):
        base.update(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=family == "qwen3_moe", mlp_only_layers=[1])
    if family == "qwen2_moe":
        base.update(shared_expert_intermediate_size=96)
    if family == "mixtral":
        base.update(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    if family == "olmoe":
        base.update(intermediate_size=48, num_experts=8, num_experts_per_tok=2, pad_token_id=0)
    if family == "gpt_oss":  # YaRN as the real one, over a tiny original context
        base.update(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=4, pad_token_id=0, rope_parameters={
                        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                        "original_max_position_embeddings": 64})
    if family in ("gemma2", "gemma3_text"):
        base.update(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    query_pre_attn_scalar=16, pad_token_id=0)
    if family == "gemma2":
        # eager: transformers' SDPA path (its default in some versions) drops the cap
        base.update(attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                    attn_implementation="eager")
    model = getattr(transformers, f"{names}ForCausalLM")(config(**{**base, **overrides})).eval()
    if family in ("qwen2", "qwen2_moe"):  # q/k/v biases start at 0: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if family in MOE_FAMILIES:  # a router starts at 0: every expert would tie
        for layer in model.model.layers:
            router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
            if router is not None:
                torch.nn.init.normal_(router.weight, std=0.5)
    if family == "gpt_oss":  # sinks and biases as large as the scores and activations
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
            for b in (layer.mlp.router.bias, layer.mlp.experts.gate_up_proj_bias,
                      layer.mlp.experts.down_proj_bias):
                torch.nn.init.normal_(b, std=0.5)
    if family in ("gemma2", "gemma3_text"):  # Gemma's norms start at 0 (a scale of 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.uniform_(p, -0.5, 0.5)
    if family in ("qwen3", "qwen3_moe", "olmoe"):  # the q/k norms start at 1: make them matter
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return model


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


def per_expert_checkpoint(model) -> dict:
    """``model``'s state dict as checkpoints on disk hold its experts: one tensor per expert
    and projection (Mixtral's ``block_sparse_moe.experts.E.w1``, w3, w2; the others'
    ``mlp.experts.E.gate_proj``, up_proj, down_proj), where transformers stacks them."""
    mixtral = model.config.model_type == "mixtral"
    module = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {k.replace(".mlp.gate.", f".{module}.gate."): v for k, v in model.state_dict().items()
           if ".mlp.experts." not in k}
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2)
            for name, t in zip(names, (gate, up, down[e])):
                out[f"model.layers.{i}.{module}.experts.{e}.{name}.weight"] = t
    return out


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' own greedy generate: the reference token ids."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()

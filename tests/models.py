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
    """A Llama-like family at tiny_llama's shape: "mistral", "qwen2", "qwen3", "phi3",
    "qwen3_moe" (8 experts, top 2, of 48 each; its second layer dense) or "mixtral" (8
    experts, top 2, of 48 each, in every layer)."""
    import transformers

    torch.manual_seed(0)
    names = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
             "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[family]
    config = getattr(transformers, f"{names}Config")
    base = dict(vocab_size=vocab, hidden_size=72, intermediate_size=144, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2,
                tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    if family == "phi3":  # its default pad id (32000) is past a tiny vocabulary
        base["pad_token_id"] = 0
    if family == "qwen3_moe":
        base.update(moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True, mlp_only_layers=[1])
    if family == "mixtral":
        base.update(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    model = getattr(transformers, f"{names}ForCausalLM")(config(**{**base, **overrides})).eval()
    if family == "qwen2":  # q/k/v biases start at 0: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if family in ("qwen3_moe", "mixtral"):  # a router starts at 0: every expert would tie
        for layer in model.model.layers[:1 if family == "qwen3_moe" else None]:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.5)
    if family in ("qwen3", "qwen3_moe"):  # the q/k norms start at 1: make them matter
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return model


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' own greedy generate: the reference token ids."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()

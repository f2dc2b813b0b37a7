"""Random-weight models at real shapes, by name (``RANDOM``: name -> a maker of
(transformers config, tokenizer or None)), for benchmarks: speed is the same as trained
weights'. The loader makes them on the target device in the target dtype (an 8B shape in
seconds, not minutes)."""
from __future__ import annotations


def _random_gpt2():
    from transformers import GPT2Config

    from roseinfer.models.loader import CACHE_DIR
    from roseinfer.models.tokenizers import gpt2_tokenizer
    return GPT2Config(), gpt2_tokenizer(CACHE_DIR)


def _random_smollm2():
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return cfg, None


def _random_llama3(layers: int, hidden: int, intermediate: int, heads: int, tied: bool):
    def config():
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=8, head_dim=hidden // heads,
                           max_position_embeddings=131072, rope_theta=500000.0,
                           rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=128000,
                           eos_token_id=128001), None
    return config


def _random_family(name: str, **shape):
    """transformers' ``{name}Config`` (Qwen2, Qwen3, Mistral, Phi3, Qwen3Moe, Mixtral,
    GptOss, Gemma2, Gemma3Text, Qwen3Next, DeepseekV2/V3, Glm4Moe) at a real shape."""
    def config():
        import transformers
        return getattr(transformers, f"{name}Config")(**{"max_position_embeddings": 32768,
                                                         **shape}), None
    return config


def _random_qwen2_5_vl_7b():
    """Qwen2.5-VL-7B-Instruct's shape: Qwen2-7B's decoder with M-RoPE, a 32-block tower of
    1,280 (full attention in every eighth block, windows of 112 pixels in the others)."""
    from transformers import Qwen2_5_VLConfig

    from roseinfer.models.loader import text_part
    return text_part(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=128000, rope_parameters={
                             "rope_type": "default", "mrope_section": [16, 24, 24],
                             "rope_theta": 1e6}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        tie_word_embeddings=False)), None


def _random_qwen3_vl_8b():
    """Qwen3-VL-8B-Instruct's shape: Qwen3-8B's decoder with interleaved M-RoPE, a 27-block
    tower of 1,152 over 16-pixel patches, DeepStack from blocks 8, 16 and 24."""
    from transformers import Qwen3VLConfig

    from roseinfer.models.loader import text_part
    return text_part(Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=262144, rope_parameters={
                             "rope_type": "default", "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True, "rope_theta": 5e6}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                           out_hidden_size=4096, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]),
        tie_word_embeddings=False)), None


def _random_gemma3_12b_vl():
    """Gemma-3-12B-it's shape with its images: the 12B decoder and SigLIP-so400m (27 layers
    of 1,152, 896 x 896 pixels in 14-pixel patches) pooled to 256 tokens an image."""
    from transformers import Gemma3Config

    from roseinfer.models.loader import text_part
    return text_part(Gemma3Config(
        text_config=GEMMA3_12B, vision_config=dict(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
            num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, image_token_index=262144, boi_token_index=255999,
        eoi_token_index=256000)), None


GEMMA3_12B = dict(
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=1024, max_position_embeddings=131072, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})

RANDOM = {"gpt2-random": _random_gpt2, "smollm2-random": _random_smollm2,
          "llama3-1b-random": _random_llama3(16, 2048, 8192, 32, tied=True),
          "llama3-8b-random": _random_llama3(32, 4096, 14336, 32, tied=False),
          "llama3-70b-random": _random_llama3(80, 8192, 28672, 64, tied=False),
          "qwen2.5-1.5b-random": _random_family(
              "Qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
              num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
              tie_word_embeddings=True, rope_theta=1e6),
          "qwen3-1.7b-random": _random_family(
              "Qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              tie_word_embeddings=True, rope_theta=1e6),
          "mistral-7b-random": _random_family(
              "Mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
              sliding_window=None, rope_theta=1e6),
          "qwen3-30b-a3b-random": _random_family(
              "Qwen3Moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
              moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
              num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
              norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6),
          "mixtral-8x7b-random": _random_family(
              "Mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
              num_local_experts=8, num_experts_per_tok=2, sliding_window=None, rope_theta=1e6),
          "gpt-oss-20b-random": _random_family(  # experts in bf16, not MXFP4
              "GptOss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
              num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
              head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
              max_position_embeddings=131072, tie_word_embeddings=False),
          "deepseek-v2-lite-random": _random_family(
              "DeepseekV2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
              moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
              num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
              topk_method="greedy", routed_scaling_factor=1.0, first_k_dense_replace=1,
              tie_word_embeddings=False),
          # Moonlight-16B-A3B: DeepSeek-V3's architecture at V2-Lite's size (latent
          # attention without a query LoRA, 64 experts of 1,408 + 2 shared, top 6)
          "moonlight-16b-a3b-random": _random_family(
              "DeepseekV3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
              moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
              num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
              n_shared_experts=2, routed_scaling_factor=2.446, first_k_dense_replace=1,
              norm_topk_prob=True, max_position_embeddings=8192, rope_theta=50000.0,
              tie_word_embeddings=False),
          # GLM-4.5-Air: DeepSeekMoE routing (128 experts of 1,408 + 1 shared, top 8)
          # beside grouped-query attention with half the head dims rotated and q/k/v
          # biases; 106 B parameters: FP8 on one H200, or bf16 over two
          "glm-4.5-air-random": _random_family(
              "Glm4Moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
              moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
              num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1,
              num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
              routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5,
              rope_theta=1e6, max_position_embeddings=131072, attention_bias=True,
              use_qk_norm=False, tie_word_embeddings=False),
          "gemma2-9b-random": _random_family(
              "Gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
              num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
              query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
              final_logit_softcapping=30.0, max_position_embeddings=8192),
          "gemma3-12b-random": _random_family("Gemma3Text", **GEMMA3_12B),
          # every layer global: what Gemma 3's window layers are measured against
          "gemma3-12b-full-random": _random_family(
              "Gemma3Text", **GEMMA3_12B, layer_types=["full_attention"] * 48),
          # Qwen3-Next-80B-A3B: transformers' defaults are its shape (48 layers, 3 gated
          # DeltaNet to 1 gated attention, 512 experts of 512 + a shared one, top 10)
          "qwen3-next-80b-a3b-random": _random_family(
              "Qwen3Next", max_position_embeddings=262144, rope_parameters={
                  "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
          # Granite-4.0-H-Small: 40 layers, 4 of them NoPE attention (5, 15, 25, 35) and 36
          # Mamba2, each followed by 72 experts of 768 (top 10) beside a shared 1,536; 32 B
          "granite-4.0-h-small-random": _random_family(
              "GraniteMoeHybrid", vocab_size=100352, hidden_size=4096, num_hidden_layers=40,
              num_attention_heads=32, num_key_value_heads=8, intermediate_size=768,
              shared_intermediate_size=1536, num_local_experts=72, num_experts_per_tok=10,
              mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
              layer_types=["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3
              + ["mamba"] * 4, position_embedding_type="nope", tie_word_embeddings=True,
              max_position_embeddings=131072),
          "phi3-mini-random": _random_family(
              "Phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
              pad_token_id=0, rope_theta=10000.0),
          "qwen2.5-vl-7b-random": _random_qwen2_5_vl_7b,
          "qwen3-vl-8b-random": _random_qwen3_vl_8b,
          "gemma3-12b-vl-random": _random_gemma3_12b_vl}

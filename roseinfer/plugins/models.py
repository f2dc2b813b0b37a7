"""Built-in model families by transformers ``model_type``. Mistral, Qwen2, Qwen3 and
Phi-3 are Llama plus flags the config sets (roseinfer/models/llama.py); Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE and gpt-oss are Llama's layers with mixture-of-experts MLPs
(roseinfer/models/moe.py); Gemma 2 and 3 have their own layers (roseinfer/models/gemma.py).
BERT, RoBERTa, XLM-RoBERTa and ModernBERT are encoders, served by the pooling runner
(roseinfer/models/bert.py, modernbert.py, core/pooling.py). DeepSeek-V2 and V3 have latent attention and
DeepSeekMoE, GLM-4.5 DeepSeekMoE beside Llama's attention (roseinfer/models/deepseek.py).
Granite 4.0-H has Mamba2 layers beside attention ones (roseinfer/models/granite_hybrid.py),
Qwen3-Next gated DeltaNet ones (roseinfer/models/qwen3_next.py), Nemotron-H Mamba2 blocks
beside attention and MLP blocks (roseinfer/models/nemotron_h.py). Qwen2.5-VL takes images
beside Qwen2's decoder (roseinfer/models/qwen2_5_vl.py, core/multimodal.py), Qwen3-VL
beside Qwen3's (roseinfer/models/qwen3_vl.py), Gemma 3 beside Gemma 3's
(roseinfer/models/gemma3_vl.py)."""
from roseinfer.core.hookspecs import hookimpl


@hookimpl
def roseinfer_register_model_architectures(register):
    from roseinfer.models.bert import BertModel
    from roseinfer.models.deepseek import DeepseekForCausalLM, Glm4MoeForCausalLM
    from roseinfer.models.gemma import GemmaForCausalLM
    from roseinfer.models.gemma3_vl import Gemma3ForConditionalGeneration
    from roseinfer.models.gpt2 import GPT2ForCausalLM
    from roseinfer.models.granite_hybrid import GraniteHybridForCausalLM
    from roseinfer.models.nemotron_h import NemotronHForCausalLM
    from roseinfer.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from roseinfer.models.qwen3_next import Qwen3NextForCausalLM
    from roseinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from roseinfer.models.modernbert import ModernBertModel
    from roseinfer.models.llama import LlamaForCausalLM
    from roseinfer.models.moe import MoeForCausalLM

    register("gpt2", GPT2ForCausalLM)
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        register(model_type, LlamaForCausalLM)
    for model_type in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"):
        register(model_type, MoeForCausalLM)
    for model_type in ("gemma2", "gemma3_text"):
        register(model_type, GemmaForCausalLM)
    register("gemma3", Gemma3ForConditionalGeneration)
    for model_type in ("bert", "roberta", "xlm-roberta"):
        register(model_type, BertModel)
    register("modernbert", ModernBertModel)
    for model_type in ("deepseek_v2", "deepseek_v3"):
        register(model_type, DeepseekForCausalLM)
    register("glm4_moe", Glm4MoeForCausalLM)
    register("granitemoehybrid", GraniteHybridForCausalLM)
    register("qwen3_next", Qwen3NextForCausalLM)
    register("nemotron_h", NemotronHForCausalLM)
    for model_type in ("qwen2_5_vl", "qwen2_5_vl_text"):
        register(model_type, Qwen2_5_VLForConditionalGeneration)
    for model_type in ("qwen3_vl", "qwen3_vl_text"):
        register(model_type, Qwen3VLForConditionalGeneration)

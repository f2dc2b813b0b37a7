"""Model families by transformers ``model_type``."""
from roseinfer.models.gpt2 import GPT2ForCausalLM
from roseinfer.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "gpt2": GPT2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
}


def model_class(hf_config):
    try:
        return ARCHITECTURES[hf_config.model_type]
    except KeyError:
        raise ValueError(
            f"model type {hf_config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}") from None

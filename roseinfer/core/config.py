"""EngineConfig: one validated dataclass, from kwargs, a TOML file or the CLI."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import tomllib
from dataclasses import dataclass, fields
from typing import Optional

from roseinfer.core.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    # On a GPU: the share of its whole memory this engine may take (vLLM's option). The
    # KV cache gets what is left of it after the weights and the activations of the
    # largest step, measured at start (core/device_side.py).
    gpu_memory_utilization: float = 0.9
    # On the CPU: the share of the available memory the KV cache takes (at most 2 GiB).
    kv_cache_memory_fraction: float = 0.5
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: Optional[int] = None
    kv_append_backend: str = "auto"
    metadata_store: str = "slots"
    attention_backend: str = "auto"
    enable_prefix_cache: bool = True
    cuda_graphs: bool = True
    # Decode steps run back to back on the device when no sequence is in
    # prefill and at least decode_steps_min_seqs are decoding: the host then
    # schedules once per window and stops pacing the GPU. Tokens stream out
    # in groups of up to decode_steps; a request that arrives mid-window
    # waits for it to end, which small batches (where the host keeps up step
    # by step anyway) are spared.
    decode_steps: int = 8
    decode_steps_min_seqs: int = 32
    # Requests with a priority (lower first) age: one of priority p ranks as if it had
    # arrived p x this many seconds later, so it waits behind later arrivals of a lower
    # value q for at most (p - q) x this long (core/scheduler.py).
    priority_aging_s: float = 10.0
    # Steps that carry prefill chunks run as CUDA graphs too, captured for
    # token-count buckets up to this many tokens (default and cap:
    # max_num_batched_tokens; 0: only decode steps run as graphs). Under
    # steady arrivals most steps carry a chunk; launched from Python, each
    # costs milliseconds of host time (docs/benchmarks.md).
    mixed_graph_max_tokens: Optional[int] = None
    # Prefill tokens a step may carry while sequences decode: every decoding
    # request waits for the whole step. Default: no cap on CUDA (a cap
    # starved prefill under arrivals there), 16 on the CPU, where a
    # 128-token chunk made a GPT-2 step 4x a decode step (docs/benchmarks.md,
    # "Decoding while maximum-size prompts arrive").
    max_mixed_prefill_tokens: Optional[int] = None
    # A vision-language model's tower runs on a thread and CUDA stream beside the
    # steps, so that the sequences decoding meanwhile do not wait for it (default:
    # on a GPU; core/image_encoder.py). Off, a step runs the tower's call itself.
    encoder_beside_steps: Optional[bool] = None
    # The logits processor (a plugin name) that enforces a request's
    # response_format: JSON schema, any JSON object, or a regex.
    structured_output: str = "xgrammar"
    # The tool-call parser (a plugin name: hermes, llama3_json, mistral) that finds the
    # calls in a chat output under tool_choice "auto"; "auto" picks by the model's family
    # (core/tools.py).
    tool_call_parser: str = "auto"
    # The reasoning parser (a plugin name: qwen3, deepseek_r1) that splits a chat output's
    # thinking from its answer; "auto" picks by the model's family, "none" splits nothing
    # (core/reasoning.py).
    reasoning_parser: str = "auto"
    # generate, or pooling (embed, score, classify: core/pooling_engine.py); "auto": pooling
    # for a model that only pools (an encoder such as BERT), generate otherwise.
    runner: str = "auto"
    # A language model scored by its next-token logits of these tokens (the pooling
    # runner; core/token_classifier.py): Qwen3-Reranker's "no,yes". A comma-separated
    # string or a sequence.
    classifier_from_token: tuple[str, ...] | str | None = None
    # Processes (one per GPU, cuda:0..N-1) that each hold 1/N of every layer's
    # heads and MLP and of the vocabulary (docs/architecture.md, "Tensor parallelism").
    tensor_parallel_size: int = 1
    # Under tensor parallelism, place whole experts of a mixture of experts on each rank
    # (1/N of the experts each) instead of 1/N of every expert's rows.
    enable_expert_parallel: bool = False
    # A float32 model on the CPU may keep its linear weights (not the LM head's)
    # as bfloat16 or int8: a batch-1 step reads every weight once, so fewer bytes
    # make it faster, and greedy output drifts from float32's (layers/cpu_weights.py;
    # docs/benchmarks.md measures both). "gguf": a .gguf model's quantized linears
    # (the LM head's too) multiplied as the file's blocks (layers/gguf_linear.py). "auto":
    # gguf for a .gguf model where its kernels build here (a C++ compiler; once, cached),
    # float32 otherwise.
    cpu_weight_dtype: str = "auto"
    # A quantization method (a plugin name: fp8, int4) to quantize a float model with at
    # load; a quantized checkpoint's own quantization_config picks its method unset
    # (models/quantization.py).
    quantization: Optional[str] = None
    # "fp8": the KV cache holds keys and values as e4m3 (scale 1, saturated at 448),
    # twice a 16-bit cache's blocks in the same memory.
    kv_cache_dtype: str = "auto"
    # One sequence's decode step on the CPU as AOTInductor code (core/cpu_step.py):
    # "auto" uses it once built for this model shape and machine, where it measured
    # faster than eager; "build" builds it first if missing (minutes, once); "off".
    cpu_compiled_step: str = "auto"
    # Speculative decoding (core/speculation.py): a proposer plugin's name (ngram,
    # draft), the most tokens it proposes a step (default 8 on CUDA, where checking 9
    # positions costs about what 5 do; 4 on the CPU, where each costs: docs/benchmarks.md),
    # the model the draft proposer runs, and the most running sequences a step
    # speculates with (a larger batch is no longer bound by reading the weights).
    speculative: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    draft_model: Optional[str] = None
    speculative_disable_by_batch_size: int = 8
    # LoRA adapters (core/lora.py): requests may name one of the adapters loaded; up to
    # max_loras of them sit in the GPU's slots at once, up to max_cpu_loras (default: as
    # many) stay in host memory, the others are read from disk again when needed.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    seed: Optional[int] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "decode_steps",
                    "decode_steps_min_seqs", "speculative_disable_by_batch_size", "max_loras",
                    "max_lora_rank")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        v = self.mixed_graph_max_tokens
        if v is not None and (not isinstance(v, int) or v < 0):
            raise ConfigError(f"mixed_graph_max_tokens must be an integer >= 0 or unset, got {v!r}")
        v = self.max_mixed_prefill_tokens
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ConfigError(f"max_mixed_prefill_tokens must be a positive integer or unset, "
                              f"got {v!r}")
        v = self.num_speculative_tokens
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ConfigError(f"num_speculative_tokens must be a positive integer or unset, "
                              f"got {v!r}")
        v = self.max_cpu_loras
        if v is not None and (not isinstance(v, int) or v < self.max_loras):
            raise ConfigError(f"max_cpu_loras must be an integer >= max_loras "
                              f"({self.max_loras}) or unset, got {v!r}")
        for name in ("num_kv_blocks", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 2):
                raise ConfigError(f"{name} must be an integer >= 2 or unset, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization!r}")
        if not (isinstance(self.priority_aging_s, (int, float)) and self.priority_aging_s > 0):
            raise ConfigError(f"priority_aging_s must be a number > 0, got {self.priority_aging_s!r}")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 0.95]")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.cpu_weight_dtype not in ("auto", "float32", "bfloat16", "int8", "gguf"):
            raise ConfigError(f"cpu_weight_dtype must be auto, float32, bfloat16, int8 or "
                              f"gguf, got {self.cpu_weight_dtype!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ConfigError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if isinstance(self.classifier_from_token, str):
            self.classifier_from_token = tuple(self.classifier_from_token.split(","))
        if self.classifier_from_token is not None:
            self.classifier_from_token = tuple(self.classifier_from_token)
            if not self.classifier_from_token or not all(self.classifier_from_token):
                raise ConfigError("classifier_from_token: name one token or more, e.g. no,yes")
            if self.runner == "generate":
                raise ConfigError("classifier_from_token scores in the pooling runner: leave "
                                  "runner auto or set it to pooling")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.cpu_compiled_step not in ("auto", "build", "off"):
            raise ConfigError(f"cpu_compiled_step must be auto, build or off, got "
                              f"{self.cpu_compiled_step!r}")
        if self.device != "auto" and not self.device.split(":")[0] in ("cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str, section: str = "engine", **overrides) -> "EngineConfig":
        """Read ``[engine]`` from a TOML file (keys as the field names); overrides win."""
        with open(path, "rb") as f:
            data = tomllib.load(f).get(section, {})
        return cls.from_kwargs(**{**data, **overrides})

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def turned_off(cfg: EngineConfig, why: str, settings: dict) -> EngineConfig:
    """``cfg`` with ``settings`` (name: the value that turns it off) applied, those that
    change it logged with ``why`` (what in the model cannot run under them)."""
    off = {name: value for name, value in settings.items() if getattr(cfg, name) != value}
    if off:
        log.info("%s: %s", why, ", ".join(f"{k}={v}" for k, v in off.items()))
    return dataclasses.replace(cfg, **off)


def engine_args_parser() -> argparse.ArgumentParser:
    """Parent parser with the model and engine flags every command shares."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="model dir, .gguf file, hub id, or alias (default: %(default)s)")
    g.add_argument("--tokenizer", default=None, help="tokenizer dir or hub id (default: the model's)")
    g.add_argument("--config", default=None, help="roseinfer.toml with an [engine] section")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   type=lora_module, help="LoRA adapters (PEFT folders) requests may name; "
                   "implies --enable-lora")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            g.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction)
        else:
            conv = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            g.add_argument(flag, dest=f.name, type=conv, default=None)
    return p


def lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Flags given on the command line override the TOML file, which overrides defaults."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
             if getattr(args, f.name, None) is not None}
    if getattr(args, "lora_modules", None):
        given.setdefault("enable_lora", True)
    if getattr(args, "config", None):
        return EngineConfig.from_toml(args.config, **given)
    return EngineConfig.from_kwargs(**given)

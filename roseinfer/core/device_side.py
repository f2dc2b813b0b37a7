"""The device side of an engine: the model on its device, its KV cache and the runner
that steps them. The engine builds it for rank 0, and each other rank of a
tensor-parallel group builds its own here too (core/tp_workers.py)."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from roseinfer.core import speculation, tp
from roseinfer.core.config import EngineConfig
from roseinfer.core.cuda_graphs import Layout, padding_step
from roseinfer.core.errors import ConfigError
from roseinfer.core.kv_cache import KVCache
from roseinfer.core.kv_groups import KVGroups
from roseinfer.core.plugins import PluginRegistry
from roseinfer.core import multimodal, recurrent
from roseinfer.core.state_snapshots import StateSnapshots
from roseinfer.core.runner import ModelRunner
from roseinfer.models import loader
from roseinfer.layers.attention import PagedAttention

log = logging.getLogger(__name__)


@dataclass
class DeviceSide:
    model: torch.nn.Module
    hf_config: Any
    tokenizer: Any
    dtype: torch.dtype
    kv_cache: KVCache
    runner: ModelRunner
    max_model_len: int
    config: EngineConfig  # as built: what the model cannot serve turned off (recurrent.py)
    loras: Any = None  # core/lora.py's Loras, with enable_lora


def build_kv_cache(model, cfg: EngineConfig, plugins: PluginRegistry, device: torch.device,
                   dtype: torch.dtype, step_peak: int = 0,
                   num_blocks: int | None = None, layers_beside: int = 0) -> KVCache:
    """The model's paged KV cache: ``num_blocks`` (else config's num_kv_blocks) blocks, or
    as many as the memory left allows with ``step_peak`` bytes kept for a step and, per
    block, room for ``layers_beside`` layers more of the same shape (a proposer's cache
    over the same blocks)."""
    groups, kv_heads, head_dim, values_are_keys = _kv_shape(model)
    names = plugins.names("kv_append")
    if cfg.kv_append_backend != "auto":
        plugins.get("kv_append", cfg.kv_append_backend)  # fail early, listing names
    plugins.get("metadata", cfg.metadata_store)
    if cfg.kv_cache_dtype == "fp8":
        dtype = torch.float8_e4m3fn
    backends = {n: plugins.create("kv_append", n) for n in names}
    tensors = 1 if values_are_keys else 2  # latent attention's rows are both
    per_block = tensors * (groups.size + layers_beside) * kv_heads * cfg.block_size * \
        head_dim * dtype.itemsize
    # every rank of a tensor-parallel group holds the same blocks
    num_blocks = num_blocks or cfg.num_kv_blocks or tp.smallest(
        _blocks_for_memory(cfg, device, per_block, step_peak))
    return KVCache(groups, num_blocks, kv_heads, cfg.block_size, head_dim, dtype,
                   device, backends, cfg.kv_append_backend, values_are_keys)


def build_runner(model, kv_cache: KVCache, cfg: EngineConfig, plugins: PluginRegistry,
                 device: torch.device, max_model_len: int, peers=None) -> ModelRunner:
    attention = plugins.create("attention", attention_name(cfg, plugins, device))
    mixed_tokens = cfg.mixed_graph_max_tokens
    # steps that check drafts: k + 1 tokens for each sequence of a speculating batch
    per_seq = speculation.draft_tokens(cfg, device) + 1
    verify_tokens = per_seq * min(cfg.speculative_disable_by_batch_size, cfg.max_num_seqs) \
        if cfg.speculative else 0
    if not getattr(attention, "mixed_graphs", False):  # docs/plugins.md
        mixed_tokens = verify_tokens = 0
    return ModelRunner(model, kv_cache, attention, device, cfg.max_num_seqs,
                       cfg.max_num_batched_tokens, max_model_len, cfg.cuda_graphs,
                       cfg.decode_steps,
                       cfg.max_num_batched_tokens if mixed_tokens is None else mixed_tokens,
                       peers, (min(verify_tokens, cfg.max_num_batched_tokens), per_seq),
                       cfg.enable_lora)


def weights_decided(cfg: EngineConfig, spec, device: torch.device) -> EngineConfig:
    """``cfg`` with cpu_weight_dtype "auto" decided: gguf for a .gguf model run in float32
    on the CPU on one process, unquantized, where the block kernels build (once, cached);
    float32 otherwise."""
    if cfg.cpu_weight_dtype != "auto":
        return cfg
    gguf = device.type == "cpu" and resolve_dtype(cfg.dtype, device) == torch.float32 \
        and cfg.quantization is None and cfg.tensor_parallel_size == 1 \
        and loader.is_gguf(spec) and _block_kernels_build()
    return cfg.replace(cpu_weight_dtype="gguf" if gguf else "float32")


def _block_kernels_build() -> bool:
    from roseinfer.layers.gguf_linear import build
    try:
        build()
        return True
    except RuntimeError as e:  # no compiler here: the file's values in float32, as before
        log.warning("%s; the GGUF model runs de-quantized to float32 (slower)", e)
        return False


def _cpu_weight_dtype(cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    if cfg.cpu_weight_dtype != "float32" and (device.type != "cpu" or dtype != torch.float32):
        raise ConfigError(f"cpu_weight_dtype {cfg.cpu_weight_dtype} applies to float32 models "
                          f"on the CPU, not {dtype} on {device}: on a GPU use dtype bfloat16")
    if cfg.cpu_weight_dtype != "float32" and cfg.quantization is not None:
        raise ConfigError(f"cpu_weight_dtype {cfg.cpu_weight_dtype} and quantization "
                          f"{cfg.quantization} both set the weights' precision: choose one")
    return cfg.cpu_weight_dtype


def build(spec, tokenizer, cfg: EngineConfig, plugins: PluginRegistry, device: torch.device,
          peers=None) -> DeviceSide:
    """The model (this rank's shards of it), its KV cache and a runner on ``device``.
    Every rank of a tensor-parallel group builds through here, so their collectives come
    in the same order; rank 0 passes ``peers``, the other ranks' handle."""
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    model, hf_config, tokenizer = loader.load(
        spec, tokenizer, dtype, device, seed=cfg.seed or 0, plugins=plugins,
        cpu_weight_dtype=_cpu_weight_dtype(cfg, device, dtype), quantization=cfg.quantization)
    cfg = speculation.decided(multimodal.decided(recurrent.decided(cfg, model), model), plugins)
    snapshots = recurrent.snapshot_rows(cfg, model)
    recurrent.bind(model, cfg.max_num_seqs + 1 + snapshots, device, dtype)  # a row a table row
    loras = _loras(model, hf_config, cfg, device, dtype) if cfg.enable_lora else None
    peak = 0
    if device.type == "cuda" and cfg.num_kv_blocks is None:
        peak = step_peak(model, hf_config, cfg, plugins, device, dtype)
    weights, layers = speculation.beside(cfg, plugins, hf_config, dtype)
    kv_cache = build_kv_cache(model, cfg, plugins, device, dtype, peak + weights,
                              layers_beside=layers)
    max_model_len = _max_model_len(cfg, hf_config, kv_cache)
    shift = multimodal.bind(model, cfg.max_num_seqs + 1, device)  # before graphs capture
    runner = build_runner(model, kv_cache, cfg, plugins, device, max_model_len, peers)
    runner.rope_shift = shift
    if snapshots:
        runner.snapshots = StateSnapshots(model, cfg.max_num_seqs + 1, snapshots,
                                          kv_cache.block_size)
    return DeviceSide(model, hf_config, tokenizer, dtype, kv_cache, runner, max_model_len,
                      cfg, loras)


def _loras(model, hf_config, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
    """The model's projections in LoRA slots, and the adapters' bookkeeping over them."""
    from roseinfer.core.lora import Loras
    from roseinfer.layers import lora
    from roseinfer.models import lora_adapter

    modules = lora.attach(model, cfg.max_loras, cfg.max_lora_rank, dtype)

    def read(name: str, path: str):
        adapter = lora_adapter.read(name, path, hf_config, type(model).shard_rule,
                                    cfg.max_lora_rank, set(modules), dtype)
        # packed per projection, pinned on CUDA: a slot fills in two copies each, without
        # stalling the host
        adapter.weights = {k: modules[k].pack(parts, device.type == "cuda")
                           for k, parts in adapter.weights.items()}
        return adapter
    return Loras(modules, read, cfg.max_loras, cfg.max_cpu_loras or cfg.max_loras)


@torch.inference_mode()
def step_peak(model, hf_config, cfg: EngineConfig, plugins: PluginRegistry,
              device: torch.device, dtype: torch.dtype) -> int:
    """Bytes the largest steps the config allows take beyond the weights, measured as vLLM
    does: a runner without CUDA graphs over a cache of one block runs a step of
    max_num_batched_tokens prompt tokens (as many sequences as a step holds), then a
    decode step of max_num_seqs rows, padding only (their K/V land in the scratch block).
    Each rank of a tensor-parallel group runs them, collectives and all."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = build_kv_cache(model, cfg, plugins, device, dtype, num_blocks=1)
    runner = build_runner(model, cache, cfg.replace(cuda_graphs=False), plugins, device,
                          _max_model_len(cfg, hf_config, None))
    tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    runner.capture_mixed(*padding_step(runner, Layout(tokens, cfg.max_num_seqs + 1, True)))
    runner.capture_step(*padding_step(runner, Layout(cfg.max_num_seqs, cfg.max_num_seqs, False)))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner, cache
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def attention_name(cfg: EngineConfig, plugins: PluginRegistry, device: torch.device) -> str:
    name = cfg.attention_backend
    if name != "auto":
        plugins.get("attention", name)
        return name
    return "triton_paged" if device.type == "cuda" else "torch_sdpa"


def _max_model_len(cfg: EngineConfig, hf_config, kv_cache: KVCache | None) -> int:
    """The config's or the model's context, at most what the cache holds for one sequence
    (``kv_cache`` None: not bounded by one)."""
    context = _context_len(hf_config)
    if cfg.max_model_len and cfg.max_model_len > context:
        # Past it the RoPE tables (or GPT-2's position embeddings) end: positions there
        # would be read out of bounds.
        raise ConfigError(f"max_model_len {cfg.max_model_len} is more than the model's "
                          f"context of {context} positions (its config's "
                          "max_position_embeddings): pass at most that")
    context = cfg.max_model_len or context
    held = kv_cache and kv_cache.groups.max_tokens(kv_cache.scratch_block, cfg.block_size)
    return context if held is None else min(context, held)


def settle_heap() -> None:
    """Move every object alive now (torch, transformers, the model) out of the
    cyclic GC's reach. Each step allocates small objects, so full collections
    come often; traversing millions of long-lived objects made them stall steps
    for milliseconds."""
    gc.collect()
    gc.freeze()


def leave_group(runner: ModelRunner, peers) -> None:
    """Rank 0's part of closing a tensor-parallel engine: the runner's CUDA graphs go
    first (graphs that captured NCCL collectives kept the communicators' teardown from
    returning on two H100s), then the other ranks are stopped and the group left."""
    runner.graphs = None
    release()
    peers.close()


def release() -> None:
    """Free what a dropped device side held (its CUDA graphs among it): settle_heap froze
    it, and frozen cycles are never collected."""
    gc.unfreeze()
    gc.collect()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but no CUDA GPU is visible; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _kv_shape(model) -> tuple[KVGroups, int, int, bool]:
    """(KV groups of the layers, K/V heads, head dim, whether values are the keys) from
    the module's PagedAttention layers: any family that attends through them gets its
    cache, whatever its config calls them."""
    attn = sorted((m for m in model.modules() if isinstance(m, PagedAttention)),
                  key=lambda m: m.layer_idx)
    if not attn:
        raise ConfigError(f"{type(model).__name__} has no PagedAttention layer: a model "
                          "module must attend through roseinfer.layers.attention.PagedAttention")
    return (KVGroups.of([m.window for m in attn]), attn[0].num_kv_heads, attn[0].head_dim,
            attn[0].values_are_keys)


def _context_len(hf) -> int:
    """The model's context. LongRoPE (Phi-3's long-context variants) switches to other
    frequencies past its original context, and the tables here are built once: that
    bounds it. (A sliding window does not: window layers attend over their window.)"""
    context = getattr(hf, "n_positions", None) or hf.max_position_embeddings
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) == "longrope":
        context = min(context, hf.original_max_position_embeddings)
    return context


def _blocks_for_memory(cfg: EngineConfig, device: torch.device, per_block: int,
                       step_peak: int) -> int:
    if device.type == "cuda":
        # What this process may still take of gpu_memory_utilization x the whole GPU,
        # less the step's activations; whatever else holds memory (other processes too)
        # counts as taken.
        free, total = torch.cuda.mem_get_info(device)
        budget = total * cfg.gpu_memory_utilization - (total - free) - step_peak
        if budget < 2 * per_block:
            raise ConfigError(
                f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB x "
                f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves "
                f"{budget / 2**30:.2f} GiB after the weights, what else holds memory "
                f"({(total - free) / 2**30:.1f} GiB in all) and a step's activations "
                f"({step_peak / 2**30:.2f} GiB): raise gpu_memory_utilization, lower "
                f"max_num_batched_tokens or max_num_seqs, or free the GPU")
    else:
        import psutil
        budget = min(psutil.virtual_memory().available * cfg.kv_cache_memory_fraction, 2 << 30)
    return max(int(budget // per_block), 2)

"""The decode bytes floor: the least time a run's decode steps can take on the
GPU's memory bandwidth, reading every weight once per step and every cached
K/V entry once per generated token (of a sliding-window layer, only its window's).
Of a mixture of experts a step reads only the experts its tokens chose: expected
under uniform routing for the step's batch (layers/moe.py, ``expert_bytes``).
Prefill (compute-bound) is not counted, so on prefill-heavy runs the fraction
overstates how far decode is from it."""
from __future__ import annotations

import math

import torch

from roseinfer.layers.attention import PagedAttention


# What the real-shape benchmarks count an H100 SXM (HBM3) at; its spec says 3.35 TB/s.
PEAK_BYTES_PER_S = 3.0e12


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every weight, but of an embedding table only the
    rows it looks up (nothing, to first order). A tied LM head still reads the whole
    table: the head holds it (or its padded or packed copy) as its own weight. A module
    holding a weight in two layouts, of which a step reads one (CpuLinear), says which
    with step_weights()."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            continue
        tensors = m.step_weights() if hasattr(m, "step_weights") else [
            *m._parameters.values(), *vars(m).values()]  # also weights outside parameters
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = id(t) if t.is_mkldnn else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(kv_cache) -> int:
    """K and V of one token, all layers: [blocks, kv_heads, block_size, head_dim] each
    (one tensor where the values are the keys: latent attention's)."""
    return kv_cache.num_layers * _layer_kv_bytes(kv_cache)


def _layer_kv_bytes(kv_cache) -> int:
    k = kv_cache.k[0]
    return (1 if kv_cache.values_are_keys else 2) * k.shape[1] * k.shape[3] * k.element_size()


def keys_read(prompt: int, new: int, window: int | None = None) -> int:
    """Keys a layer reads to decode ``new`` tokens after ``prompt``: token t reads the
    prompt and the t tokens before it, or of a ``window`` layer at most ``window``."""
    lo, hi = prompt, prompt + new - 1  # the first token's keys, the last one's
    if window is None or hi <= window:
        return (lo + hi) * new // 2
    if lo >= window:
        return new * window
    return (lo + window) * (window - lo + 1) // 2 + (hi - window) * window


def kv_bytes_read(engine, prompt_lens: list[int], output_lens: list[int]) -> int:
    """K/V bytes the run's decode tokens read, layer by layer (each with its window)."""
    windows = {m.layer_idx: m.window for m in engine.model.modules()
               if isinstance(m, PagedAttention)}
    total = 0
    for layer in range(engine.kv_cache.num_layers):
        keys = sum(keys_read(p, n, windows.get(layer)) for p, n in zip(prompt_lens, output_lens))
        total += keys * _layer_kv_bytes(engine.kv_cache)
    return total


def routed_bytes(model: torch.nn.Module, tokens: int) -> float:
    """Expert bytes a step of ``tokens`` reads, over the model's mixtures of experts."""
    return sum(m.expert_bytes(tokens) for m in model.modules() if hasattr(m, "expert_bytes"))


def decode_floor(engine, prompt_lens: list[int], output_lens: list[int],
                 peak: float = PEAK_BYTES_PER_S) -> dict:
    """Floor seconds and tokens/s for decoding ``output_lens`` after ``prompt_lens``,
    with at most ``max_num_seqs`` sequences per step."""
    weights = weight_bytes(engine.model)
    kv_tok = kv_bytes_per_token(engine.kv_cache)
    batch = min(engine.config.max_num_seqs, len(output_lens))
    steps = max(max(output_lens), math.ceil(sum(output_lens) / batch))
    # Each step counted at the full batch's experts: exact where the requests decode
    # equally long (the benchmarks' workloads), an upper bound otherwise.
    experts = steps * routed_bytes(engine.model, batch)
    kv = kv_bytes_read(engine, prompt_lens, output_lens)
    seconds = (steps * weights + experts + kv) / peak
    return {"peak_bytes_per_s": peak, "weight_bytes": weights, "kv_bytes_per_token": kv_tok,
            "expert_bytes_per_step": experts / steps, "decode_steps": steps, "seconds": seconds,
            "output_throughput": sum(output_lens) / seconds}

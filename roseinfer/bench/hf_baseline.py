"""The transformers baseline: `generate` on the same weights and prompts, in this process.

Variants: "dynamic" (the default DynamicCache) and "static" (StaticCache, with the decode
forward compiled by torch.compile; on CUDA transformers uses mode "reduce-overhead", i.e.
CUDA graphs). All requests go as one left-padded batch, greedy unless the workload samples
(then with the same temperature, top-p and top-k); with ignore-EOS every row
makes exactly max_new_tokens tokens (EOS is not a stop id and min_new_tokens is set).
"""
from __future__ import annotations

import logging

import torch

from roseinfer.bench.timing import now, sync
from roseinfer.bench.workloads import HF_VARIANTS as VARIANTS, Workload

log = logging.getLogger("roseinfer.bench")


class VariantUnavailable(Exception):
    """This variant cannot run here (e.g. torch.compile fails); the bench goes on without it."""


def load_hf_model(spec: str, seed: int = 0, device="cpu", dtype=torch.float32):
    """(transformers model, tokenizer or None) with the same weights the engine loads."""
    from roseinfer.models import loader

    return loader.hf_model(spec, seed, device, dtype)


def left_padded(prompt_ids: list[list[int]], pad_id: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, p in enumerate(prompt_ids):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def generate_kwargs(model, w: Workload, variant: str, pad_id: int) -> dict:
    kw = {"max_new_tokens": w.max_new_tokens, "do_sample": False, "pad_token_id": pad_id,
          "temperature": None, "top_p": None, "top_k": None}
    if w.sampling:  # the same distribution; the tokens differ from ours, as two seeds would
        kw.update(do_sample=True, temperature=w.sampling["temperature"],
                  top_p=w.sampling["top_p"], top_k=w.sampling["top_k"] or None)
    if w.ignore_eos:
        kw.update(min_new_tokens=w.max_new_tokens, eos_token_id=None)
    if variant == "static":
        from transformers import CompileConfig

        kw["cache_implementation"] = "static"
        if model.device.type != "cuda":
            cc = CompileConfig(mode="default")  # reduce-overhead means CUDA graphs
            cc._compile_all_devices = True       # transformers compiles only on GPUs otherwise
            kw["compile_config"] = cc
    elif variant != "dynamic":
        raise ValueError(f"unknown --hf-variants entry {variant!r}; known: {', '.join(VARIANTS)}")
    return kw


def eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def run_hf(model, tokenizer, w: Workload, variant: str) -> dict:
    """One timed generate over all requests. Raises VariantUnavailable when it cannot run."""
    if len(set(w.output_lens)) > 1:
        raise VariantUnavailable("one generate call makes one output length for all requests")
    device = model.device
    stop_ids = set() if w.ignore_eos else eos_ids(model, tokenizer)
    pad_id = min(stop_ids) if stop_ids else 0
    ids, mask = left_padded(w.prompt_ids, pad_id, device)
    kw = generate_kwargs(model, w, variant, pad_id)
    sync(device)
    t0 = now()
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, **kw)
    except Exception as e:
        if variant == "dynamic":
            raise
        raise VariantUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    sync(device)
    duration = now() - t0
    outputs = [_until_stop(row, stop_ids) for row in out[:, ids.shape[1]:].tolist()]
    n_in = sum(len(p) for p in w.prompt_ids)
    n_out = sum(len(o) for o in outputs)
    return {"duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
            "output_throughput": n_out / duration,
            "total_token_throughput": (n_in + n_out) / duration,
            "compiled": hasattr(model, "_compiled_call") and variant == "static",
            "outputs": outputs}


def _until_stop(row: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[:i + 1]
    return row

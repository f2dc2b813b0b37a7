"""Which one-sequence decode step an engine runs: eager, or the compiled one
(core/cpu_step.py) where it applies. With ``cpu_compiled_step="auto"`` and nothing built
yet, the build starts in the background once the first requests are answered, and the
engine swaps it in between requests."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Optional

import torch

from roseinfer.core import cpu_step
from roseinfer.core.device_side import attention_name
from roseinfer.core.errors import ConfigError
from roseinfer.models import loader

log = logging.getLogger(__name__)


class StepChoice:
    """Takes the engine as an argument rather than holding it: the engine must stay
    collectable without the cycle collector (its finalizer leaves a TP group)."""

    def __init__(self, engine, spec):
        engine.runner.compiled = compiled_step(engine)
        self.background: Optional[cpu_step.BackgroundBuild] = None  # a build under way
        self.to_build = _build_wanted(engine, spec)

    def kind(self, runner) -> str:
        if runner.compiled is not None:
            return "compiled"
        return "building" if self.background is not None else "eager"

    def start_build(self, idle: bool) -> None:
        # after the first answer, not beside it: starting a process beside the
        # model's first steps delayed the default model's first answer by 0.5 s
        if self.to_build is not None and idle:
            self.background, self.to_build = cpu_step.start_background(*self.to_build), None

    def swap_in(self, engine, between_requests: bool) -> None:
        """Between requests: the background build ended; use its step where it pays."""
        build = self.background
        if build is None or not between_requests or not build.done():
            return
        self.background = None
        engine.runner.compiled = compiled_step(engine)
        log.warning("event=cpu_step_build_ended after_s=%.0f decision=%s", time.monotonic()
                    - build.started, "used" if engine.runner.compiled is not None else
                    "not used (slower than eager, or failed: see %s)" % build.path.with_suffix(
                        ".json"))


def compiled_step(engine) -> Optional[cpu_step.CompiledStep]:
    """The compiled one-sequence decode step (core/cpu_step.py), where it applies: a
    float32 model on the CPU, unquantized, on one process, through the CPU's own cache
    and attention plugins, its layers in one KV group (core/kv_groups.py)."""
    cfg = engine.config
    if not _applies(engine):
        if cfg.cpu_compiled_step == "build":
            raise ConfigError("cpu_compiled_step build applies to a float32 model on the CPU "
                              "with the default KV-append and attention plugins, "
                              "no quantization method, the model's KV "
                              "cache dtype, no tensor parallelism, no window layers "
                              "beside full ones, no latent attention, and no LoRA "
                              "adapters")
        return None
    return cpu_step.prepare(cfg.cpu_compiled_step, engine.model, engine.hf_config,
                            engine.kv_cache, engine.kv_cache.backends["torch_index"],
                            engine.runner.attention, engine.max_model_len, loader.CACHE_DIR)


def _applies(engine) -> bool:
    cfg = engine.config
    return (engine.device.type == "cpu" and engine.dtype == torch.float32
            and cfg.cpu_weight_dtype in ("float32", "gguf", "bfloat16", "int8")
            and cfg.tensor_parallel_size == 1
            and engine.model.quantization is None and cfg.kv_cache_dtype == "auto"
            and not cfg.enable_lora
            and cfg.kv_append_backend in ("auto", "torch_index")
            and len(engine.kv_cache.groups) == 1
            and not engine.kv_cache.values_are_keys  # its inputs would alias
            and attention_name(cfg, engine.plugins, engine.device) == "torch_sdpa")


def _build_wanted(engine, spec) -> Optional[tuple]:
    """``cpu_step.start_background``'s arguments, with ``cpu_compiled_step="auto"`` and no
    build yet for a model the CPU step applies to: it starts once the first requests are
    answered. A model given as an instance cannot be loaded by another process: it stays
    eager, as before."""
    cfg = engine.config
    if cfg.cpu_compiled_step != "auto" or engine.runner.compiled is not None or \
            not isinstance(spec, (str, os.PathLike)) or not _applies(engine):
        return None
    path = cpu_step.step_path(loader.CACHE_DIR, engine.model, engine.hf_config, engine.kv_cache)
    if cpu_step.is_built(path):
        return None
    return spec, dataclasses.asdict(cfg), path

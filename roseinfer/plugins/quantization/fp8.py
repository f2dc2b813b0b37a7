"""FP8 (e4m3) weights with per-channel or per-tensor scales; activations rounded to FP8
per token where the checkpoint says so, and at load (W8A8 dynamic, as vLLM's
``--quantization fp8``). Reads compressed-tensors ``float-quantized`` checkpoints, as
llm-compressor's FP8 and FP8_DYNAMIC schemes write them. On GPUs with FP8 (compute
capability 8.9 and up) W8A8 linears keep their weights in FP8 and run FP8 kernels
(layers/fp8_linear.py); elsewhere the de-quantized values. Mixtures of experts keep their
experts in FP8 too, with activations unrounded (W8A16), and their routers in the model's
dtype."""
from __future__ import annotations

import torch

from roseinfer.core.errors import ConfigError
from roseinfer.layers.fp8_linear import runs_here, to_fp8
from roseinfer.layers.moe import SparseMoE
from roseinfer.models.quantization import Fp8ActivationLinear, absmax_scale, fp8_rows, \
    quantizable


def _groups(qc: dict) -> list[dict]:
    return list((qc.get("config_groups") or {}).values())


class Fp8:
    formats = "compressed-tensors float-quantized (8-bit float weights, per channel or tensor)"

    @staticmethod
    def reads(qc: dict) -> bool:
        weights = [g.get("weights") or {} for g in _groups(qc)]
        return qc.get("quant_method") == "compressed-tensors" and bool(weights) and all(
            w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)

    def __init__(self, qc: dict | None):
        self.from_checkpoint = qc is not None
        self.dynamic_activations = True  # at load: W8A8, as vLLM's fp8
        if qc is not None:
            for group in _groups(qc):
                strategy = group["weights"].get("strategy")
                if strategy not in ("channel", "tensor"):
                    raise ConfigError(f"fp8 reads per-channel and per-tensor weight scales, "
                                      f"not strategy {strategy!r}")
            acts = [g.get("input_activations") for g in _groups(qc)]
            if any(a and not a.get("dynamic") for a in acts):
                raise ConfigError("fp8 reads dynamic (per-token) activations; this checkpoint "
                                  "has static input scales (llm-compressor's FP8 scheme): "
                                  "quantize it with FP8_DYNAMIC")
            if qc.get("kv_cache_scheme"):
                raise ConfigError("fp8 does not read a checkpoint's KV cache scales yet; use "
                                  "one without kv_cache_scheme, and --kv-cache-dtype fp8")
            self.dynamic_activations = all(a and a.get("type") == "float" for a in acts)

    def load_weights(self, tensors: dict) -> dict:
        """``<layer>.weight`` (e4m3) times ``<layer>.weight_scale`` -> a float weight."""
        out = {}
        for key, view in tensors.items():
            if key.endswith(".weight_scale"):
                continue
            t = view[:]
            scale_key = key + "_scale"
            if key.endswith(".weight") and scale_key in tensors:
                scale = tensors[scale_key][:].float()
                t = t.float() * (scale if scale.dim() == 2 else scale.reshape(()))
            out[key] = t
        return out

    def quantize(self, model) -> None:
        with torch.no_grad():
            for _, linear in quantizable(model):
                if self.dynamic_activations and runs_here(linear.weight.device):
                    # FP8 in memory. A checkpoint's values come back as they were: its
                    # per-channel scales are absmax / 448 (llm-compressor's observer), and
                    # the model dtype's rounding of value x scale (2^-9) is well under
                    # half an e4m3 step (2^-5)
                    to_fp8(linear)
                    continue
                if not self.from_checkpoint:
                    w = linear.weight.float()
                    linear.weight.copy_(fp8_rows(w, absmax_scale(w)))
                if self.dynamic_activations:
                    linear.__class__ = Fp8ActivationLinear
            for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
                self._quantize_experts(moe)

    def _quantize_experts(self, moe: SparseMoE) -> None:
        """Experts in FP8 per output row, activations in the model's dtype (W8A16: a decode
        step reads the same bytes as W8A8, and no activation is rounded)."""
        if runs_here(moe.w13.device):
            moe.to_fp8()
        elif not self.from_checkpoint:
            for w in (moe.w13, moe.w2):
                w.copy_(fp8_rows(w.float(), absmax_scale(w.float())).to(w.dtype))

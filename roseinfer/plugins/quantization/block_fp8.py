"""Block-scaled FP8 checkpoints, as DeepSeek-V3, Kimi K2 and the Qwen3 FP8 releases hold
them (``quant_method: fp8`` with ``weight_block_size``, transformers'
FineGrainedFP8Config): each ``<linear>.weight`` in e4m3 beside ``.weight_scale_inv``, one
float32 scale per block of ``weight_block_size`` (128 x 128) values; the experts' too.

Today the weights are de-quantized at load into the model's dtype (e4m3 value times its
block's scale, exact in float32): outputs are what the format computes, but the weights
take the float model's bytes. A block-scaled W8A8 GEMM that keeps them in FP8 on the GPU
is the next step. Nothing is quantized at load: ``quantization="block_fp8"`` on a float
model is refused."""
from __future__ import annotations

import torch

from roseinfer.core.errors import ConfigError


class BlockFp8:
    formats = "fp8 with weight_block_size (DeepSeek-V3's block-scaled e4m3 weights)"

    @staticmethod
    def reads(qc: dict) -> bool:
        return qc.get("quant_method") == "fp8" and bool(qc.get("weight_block_size"))

    def __init__(self, qc: dict | None):
        if qc is None:
            raise ConfigError("block_fp8 reads block-scaled FP8 checkpoints; it does not "
                              "quantize a float model at load: use fp8 for that")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"block_fp8 reads e4m3 weights, not {qc.get('fmt')!r}")
        self.block = tuple(qc["weight_block_size"])

    def load_weights(self, tensors: dict) -> dict:
        """``<p>.weight`` x ``<p>.weight_scale_inv`` -> a float32 ``<p>.weight``; every
        other tensor as it is."""
        out = {}
        for key, view in tensors.items():
            if key.endswith(".weight_scale_inv"):
                continue
            scale = tensors.get(key + "_scale_inv") if key.endswith(".weight") else None
            out[key] = view[:] if scale is None else dequantize(view[:], scale[:], self.block)
        return out

    def quantize(self, model) -> None:
        """Nothing: the weights were de-quantized at load."""


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 ``w`` [out, in] times the scale of its (block[0] x block[1]) block, float32;
    the last blocks may be partial."""
    rows, cols = w.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ConfigError(f"block_fp8: a [{rows}, {cols}] weight needs {list(expected)} block "
                          f"scales, got {list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w.float() * scale[:rows, :cols]

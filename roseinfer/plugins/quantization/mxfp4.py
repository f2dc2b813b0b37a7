"""MXFP4 expert weights, as gpt-oss's checkpoints hold them (``quant_method: mxfp4``): each
``<experts>.<proj>_blocks`` (FP4 e2m1 values, two a byte) with its ``_scales`` (an 8-bit
power of two per 32 values). They are de-quantized at load, by transformers' own
``convert_moe_packed_tensors``, into the bf16 layout gpt-oss's float checkpoints hold,
which the family then reads as it reads those. The experts then take bf16 memory (about
four times MXFP4's): a kernel that keeps them packed is issue work not done yet. Nothing
is quantized at load: ``quantization="mxfp4"`` on a float model is refused."""
from __future__ import annotations

from roseinfer.core.errors import ConfigError


class Mxfp4:
    formats = "mxfp4 (gpt-oss's expert weights: FP4 blocks of 32 with a shared exponent)"

    @staticmethod
    def reads(qc: dict) -> bool:
        return qc.get("quant_method") == "mxfp4"

    def __init__(self, qc: dict | None):
        if qc is None:
            raise ConfigError("mxfp4 reads gpt-oss's MXFP4 checkpoints; it does not quantize "
                              "a float model at load: use fp8 or int4 for that")

    def load_weights(self, tensors: dict) -> dict:
        """``<p>_blocks`` and ``<p>_scales`` -> ``<p>`` in bfloat16 (FP4 values times a power
        of two are exact there); every other tensor as it is."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        out = {}
        for key, view in tensors.items():
            if key.endswith("_scales"):
                continue
            if key.endswith("_blocks"):
                base = key.removesuffix("_blocks")
                if base + "_scales" not in tensors:
                    raise ConfigError(f"mxfp4: {key} has no {base}_scales beside it")
                out[base] = convert_moe_packed_tensors(view[:], tensors[base + "_scales"][:])
            else:
                out[key] = view[:]
        return out

    def quantize(self, model) -> None:
        """Nothing: the experts were de-quantized at load."""

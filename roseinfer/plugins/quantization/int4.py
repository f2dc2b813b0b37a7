"""4-bit integer weights with a scale (and zero point) per group of 128 input columns,
weight-only (W4A16). Reads AWQ (GEMM layout), GPTQ (act-order through its g_idx) and
compressed-tensors ``pack-quantized`` checkpoints; at load it rounds a float model's
weights to the nearest level of each group (symmetric, no calibration): groups of 128,
or of 64 or 32 where 128 does not divide a linear's input size (SmolLM2's 576). On
GPUs a bfloat16 model quantized at load keeps the weights of groups of 128 packed, half
a byte each, and runs torch's int4 kernel (layers/int4_linear.py); smaller groups, and a
checkpoint's weights, are de-quantized to the model's dtype at load, on every device."""
from __future__ import annotations

import torch

from roseinfer.core.errors import ConfigError
from roseinfer.layers.int4_linear import GROUP, dequantize, quantize, runs_here, to_int4
from roseinfer.models.quantization import quantizable

GROUPS = (128, 64, 32)  # at load: the largest that divides the input size
# AWQ's GEMM kernels pack columns 0..7 of a word as nibbles 0, 2, 4, 6, 1, 3, 5, 7:
# column c sits in nibble AWQ_NIBBLE[c].
AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (low nibble first), along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    parts = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 0:
        return parts.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return parts.reshape(packed.shape[0], -1)


def _compressed_tensors(qc: dict):
    groups = list((qc.get("config_groups") or {}).values())
    return [g.get("weights") or {} for g in groups]


class Int4:
    formats = ("awq (GEMM), gptq (4-bit), compressed-tensors pack-quantized (4-bit int, "
               "symmetric, group or channel)")

    @staticmethod
    def reads(qc: dict) -> bool:
        method = qc.get("quant_method")
        if method in ("awq", "gptq"):
            return qc.get("bits") == 4
        weights = _compressed_tensors(qc)
        return method == "compressed-tensors" and qc.get("format") == "pack-quantized" and \
            bool(weights) and all(w.get("type") == "int" and w.get("num_bits") == 4
                                  for w in weights)

    def __init__(self, qc: dict | None):
        self.qc = qc
        self.kind = None if qc is None else qc["quant_method"]
        if self.kind == "awq" and qc.get("version", "gemm").lower() != "gemm":
            raise ConfigError(f"int4 reads AWQ's GEMM layout, not version {qc['version']!r}")
        if self.kind == "compressed-tensors":
            for w in _compressed_tensors(qc):
                if not w.get("symmetric", True):
                    raise ConfigError("int4 reads symmetric compressed-tensors weights; this "
                                      "checkpoint has zero points (asymmetric)")

    def load_weights(self, tensors: dict) -> dict:
        read = {"awq": _awq, "gptq": self._gptq, "compressed-tensors": _packed}[self.kind]
        out, layers = {}, {}
        for key, view in tensors.items():
            layer, _, part = key.rpartition(".")
            if part in ("qweight", "qzeros", "scales", "g_idx", "weight_packed",
                        "weight_scale", "weight_shape"):
                layers.setdefault(layer, {})[part] = view[:]
            else:
                out[key] = view[:]
        for layer, parts in layers.items():
            out[layer + ".weight"] = read(parts)
        return out

    def _gptq(self, p: dict) -> torch.Tensor:
        q = nibbles(p["qweight"], dim=0)                       # [K, N]
        zeros = nibbles(p["qzeros"], dim=1)                     # [K / G, N]
        if self.qc.get("checkpoint_format", "gptq") == "gptq":  # v1 stores zero - 1
            zeros = zeros + 1
        g = p["g_idx"].long() if "g_idx" in p else torch.arange(q.shape[0]) // self.qc[
            "group_size"]
        return ((q - zeros[g]) * p["scales"][g].float()).t().contiguous()

    def quantize(self, model) -> None:
        if self.qc is not None:
            return
        with torch.no_grad():
            for _, linear in quantizable(model):
                k = linear.weight.shape[1]
                group = next((g for g in GROUPS if k % g == 0), None)
                if group is None:
                    raise ConfigError(f"int4 at load needs input sizes that are multiples of "
                                      f"{GROUPS[-1]}; a linear has {k}")
                if group == GROUP and runs_here(linear.weight.device, linear.weight.dtype):
                    to_int4(linear)  # packed in memory, run by the int4 kernels
                else:
                    linear.weight.copy_(dequantize(*quantize(linear.weight, group)))


def _awq(p: dict) -> torch.Tensor:
    q = nibbles(p["qweight"], dim=1)[:, _awq_columns(p["qweight"].shape[1])]   # [K, N]
    zeros = nibbles(p["qzeros"], dim=1)[:, _awq_columns(p["qzeros"].shape[1])]  # [K / G, N]
    group = q.shape[0] // zeros.shape[0]
    w = (q - zeros.repeat_interleave(group, 0)) * p["scales"].float().repeat_interleave(group, 0)
    return w.t().contiguous()


def _awq_columns(words: int) -> torch.Tensor:
    """Index of column c's nibble among a row's unpacked nibbles."""
    c = torch.arange(words * 8)
    return c // 8 * 8 + torch.tensor(AWQ_NIBBLE)[c % 8]


def _packed(p: dict) -> torch.Tensor:
    rows, cols = (int(v) for v in p["weight_shape"])
    q = nibbles(p["weight_packed"], dim=1)[:, :cols] - 8          # signed, [N, K]
    scale = p["weight_scale"].float()
    group = cols // scale.shape[1] if scale.shape[1] > 1 else cols
    return q * scale.repeat_interleave(group, 1)[:, :cols]

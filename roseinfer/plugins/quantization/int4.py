"""4-bit integer weights with a scale and a zero point per group of input columns,
weight-only (W4A16). Reads AWQ (GEMM layout), GPTQ and compressed-tensors
``pack-quantized`` checkpoints; at load it rounds a float model's weights to the
nearest level of each group (symmetric, no calibration): groups of 128, or of 64 or 32
where 128 does not divide a linear's input size (SmolLM2's 576).

Under tensor parallelism each rank cuts a checkpoint's packed parts as they are stored
(``part_shard``: the cut of the layer's weight, in words, groups or rows), and reads
only its own. A layer is read into one form, levels [N, K] with scales and zeros
[N, K / group] (``<layer>.levels``, ``.scales``, ``.zeros``), which the family fuses as
it fuses weights. On GPUs (bfloat16, layers/int4_linear.py) every
linear whose input size is whole tiles of 128 stays packed, half a byte a weight: group
sizes 32, 64, 128 and larger, and per-channel scales. What does not pack is
de-quantized to the model's dtype at load, as on every CPU: input sizes that are not
multiples of 128, and GPTQ's act-order (groups not contiguous along the input)."""
from __future__ import annotations

import torch

from roseinfer.core.errors import ConfigError
from roseinfer.layers.int4_linear import dequantize, packs, quantize, runs_here, to_int4
from roseinfer.models.quantization import quantizable
from roseinfer.models.sharding import Shard

GROUPS = (128, 64, 32)  # at load: the largest that divides the input size
PARTS = ("levels", "scales", "zeros")
# Where each format's packed parts hold a layer's outputs (N) and inputs (K):
# part -> (dim of N, outputs per element, dim of K, inputs per element); None: kept whole
# under such a cut. "group": one element per group of inputs.
LAYOUTS = {
    "awq": {"qweight": (1, 8, 0, 1), "qzeros": (1, 8, 0, "group"),
            "scales": (1, 1, 0, "group")},
    "gptq": {"qweight": (1, 1, 0, 8), "qzeros": (1, 8, 0, "group"),
             "scales": (1, 1, 0, "group"), "g_idx": (None, 1, 0, 1)},
    "compressed-tensors": {"weight_packed": (0, 1, 1, 8), "weight_scale": (0, 1, 1, "group"),
                           "weight_shape": (None, 1, None, 1)},
}
# AWQ's GEMM kernels pack columns 0..7 of a word as nibbles 0, 2, 4, 6, 1, 3, 5, 7:
# column c sits in nibble AWQ_NIBBLE[c].
AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (low nibble first), along ``dim``, as uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    parts = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [..., 8]
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

    def part_shard(self, key: str, shard, tensors: dict):
        """The cut of a packed part that matches ``shard``, the cut of its layer's
        weight [N, K] (models/sharding.py): this rank reads only its own words."""
        part = key.rpartition(".")[2]
        layout = LAYOUTS[self.kind].get(part)
        if shard is None or layout is None:
            return shard  # whole, or not a packed part (a bias, a norm, the embeddings)
        dim, per = layout[:2] if shard.dim == 0 else layout[2:]
        if per == "group":
            per = self._group()
            if self.kind == "gptq" and self.qc.get("desc_act") and shard.dim == 1:
                per = None  # act-order: a rank's inputs may use any group
        if dim is None or per is None:
            return None
        if any(a % per or b % per for a, b in shard.ranges):
            raise ConfigError(f"{key}: its packing ({per} per element) does not split evenly "
                              f"over the ranks; use fewer ranks")
        return Shard(dim, tuple((a // per, b // per) for a, b in shard.ranges), shard.once,
                     shard.absent)

    def _group(self) -> int | None:
        """Inputs per scale; None for one scale per output (channel)."""
        if self.kind == "compressed-tensors":
            w = _compressed_tensors(self.qc)[0]
            return w.get("group_size") if w.get("strategy") == "group" else None
        group = self.qc.get("group_size", -1)
        return None if group in (-1, None) else group

    def load_weights(self, tensors: dict) -> dict:
        """Each quantized layer's tensors -> its levels, scales and zeros (or, for an
        act-order GPTQ layer, its de-quantized weight)."""
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
            got = read(parts)
            if isinstance(got, torch.Tensor):
                out[layer + ".weight"] = got
            else:
                out.update({f"{layer}.{p}": t for p, t in zip(PARTS, got)})
        return out

    def _gptq(self, p: dict):
        q = nibbles(p["qweight"], dim=0).t()                       # [N, K]
        zeros = nibbles(p["qzeros"], dim=1)[:, :q.shape[0]].t()    # [N, K / G]
        if self.qc.get("checkpoint_format", "gptq") == "gptq":     # v1 stores zero - 1
            zeros = zeros + 1
        scales = p["scales"].t()
        g = p["g_idx"].long() if "g_idx" in p else None
        group = self._group() or q.shape[1]
        if g is not None and not torch.equal(g - g[0], torch.arange(q.shape[1]) // group):
            # act-order: a column's group is its g_idx, not its place (scales kept whole)
            return ((q.float() - zeros[:, g].float()) * scales[:, g].float()).contiguous()
        if g is not None and scales.shape[1] > q.shape[1] // group:  # kept whole (desc_act)
            first = int(g[0])
            scales, zeros = (t[:, first:first + q.shape[1] // group] for t in (scales, zeros))
        return q.contiguous(), scales.contiguous(), zeros.contiguous()

    def load_state(self, model, state: dict, device) -> dict:
        """Make each linear with levels in ``state`` an Int4Linear (packed), or, where
        it does not pack, give it the de-quantized weight; the state to load the rest."""
        for key in [k for k in state if k.endswith(".levels")]:
            layer = key.removesuffix(".levels")
            levels, scales, zeros = (state.pop(f"{layer}.{p}") for p in PARTS)
            linear = model.get_submodule(layer)
            if self._packs(linear, levels.shape[1], levels.shape[1] // scales.shape[1]):
                to_int4(linear, *(t.to(device) for t in (levels, scales, zeros)))
                # what the model's own loading then reads back into the packed linear
                state.update(linear.kernel.state_dict(prefix=f"{layer}.kernel."))
            else:
                state[f"{layer}.weight"] = dequantize(levels, scales, zeros)
        return state

    @staticmethod
    def _packs(linear, k: int, group: int) -> bool:
        w = linear.weight
        return runs_here(w.device, w.dtype) and packs(k, group)

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
                levels, scales = quantize(linear.weight, group)
                if self._packs(linear, k, group):
                    to_int4(linear, levels, scales)  # packed in memory, run by the kernels
                else:
                    linear.weight.copy_(dequantize(levels, scales))


def _awq(p: dict):
    q = nibbles(p["qweight"], dim=1)[:, _awq_columns(p["qweight"].shape[1])]   # [K, N]
    zeros = nibbles(p["qzeros"], dim=1)[:, _awq_columns(p["qzeros"].shape[1])]  # [K / G, N]
    return q.t().contiguous(), p["scales"].t().contiguous(), zeros.t().contiguous()


def _awq_columns(words: int) -> torch.Tensor:
    """Index of column c's nibble among a row's unpacked nibbles."""
    c = torch.arange(words * 8)
    return c // 8 * 8 + torch.tensor(AWQ_NIBBLE)[c % 8]


def _packed(p: dict):
    """compressed-tensors: signed levels -8..7 (stored + 8), scale per group or channel."""
    # the stored shape is the whole layer's; a rank's cut of the inputs is its words'
    cols = min(int(p["weight_shape"][1]), 8 * p["weight_packed"].shape[1])
    q = nibbles(p["weight_packed"], dim=1)[:, :cols]                # [N, K], level + 8
    scale = p["weight_scale"]
    return q, scale, torch.full(scale.shape, 8, dtype=torch.uint8)

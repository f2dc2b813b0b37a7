"""A GGUF file's quantized linears kept as its blocks (``cpu_weight_dtype="gguf"``).

The model is loaded de-quantized first (models/loader.py converts the file once); then
each linear whose weight the file stores in a kind the block kernels read
(layers/gguf_linear.py) takes the file's rows of blocks in place of its float32 weight.
The file's names become transformers' through transformers' own GGUF map, with its
processing (llama.cpp's q/k row order undone: rows of blocks permute as rows of weights
do), and transformers' names become the family's through the family's own
``convert_hf_state_dict``, which fuses q/k/v and gate/up by rows as it fuses float
weights. Each swap is checked: sample rows of the blocks, de-quantized, must equal the
float weight they replace, or the load stops, naming the linear.

Fused linears whose parts the file stores in different kinds (llama.cpp's mixed quants
keep some v or down projections wider), and the LM head where the file has no quantized
one, keep their float32 weights. The family's blocks are kept under the cache after the
first load, so that later starts read them in a fraction of a second.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from roseinfer.core.errors import ConfigError
from roseinfer.layers.embedding import LogitsHead
from roseinfer.layers import gguf_repack
from roseinfer.layers.gguf_repack import REPACKED, repack
from roseinfer.layers.gguf_linear import BLOCK_BYTES, GgufLinear, build

log = logging.getLogger(__name__)


def keep_blocks(model: nn.Module, gguf_path: str, hf_config) -> int:
    """Swap the model's linears for GgufLinears over ``gguf_path``'s blocks; returns how
    many were swapped."""
    build()
    blocks = _cached_blocks(model, gguf_path, hf_config)
    for name, (kind, rows) in blocks.items():
        parent, attr, linear = _linear(model, name)
        _check(name, linear.weight, rows, kind)
        setattr(parent, attr, GgufLinear(rows, kind, linear.in_features, linear.bias))
    log.info("%d linears read %s's blocks as stored", len(blocks), gguf_path)
    return len(blocks)


def _cached_blocks(model, gguf_path: str, hf_config) -> dict:
    """_family_blocks, kept under the cache after the first load (transformers' name map
    takes seconds: a meta model of its class, and a name table for each of its modules),
    keyed by the file's size and time, the family and this code."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from roseinfer.models.loader import CACHE_DIR

    stat = os.stat(gguf_path)
    code = "".join(Path(m.__file__).read_text() for m in (sys.modules[__name__], gguf_repack))
    key = hashlib.sha256(f"{stat.st_size}-{stat.st_mtime_ns}-{type(model).__name__}-{code}"
                         .encode()).hexdigest()[:16]
    path = os.path.join(CACHE_DIR, "gguf_blocks", f"{Path(gguf_path).stem}-{key}.safetensors")
    if os.path.exists(path):
        with safe_open(path, framework="pt") as f:
            kinds = f.metadata()
            return {name: (int(kinds[name]), f.get_tensor(name)) for name in f.keys()}
    blocks = _family_blocks(model, gguf_path, hf_config)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # processes loading at once each write their own
    save_file({name: rows for name, (_, rows) in blocks.items()}, tmp,
              metadata={name: str(kind) for name, (kind, _) in blocks.items()})
    os.replace(tmp, path)
    return blocks


def _family_blocks(model, gguf_path: str, hf_config) -> dict:
    """{module path of a float linear: (kind, rows of blocks)} for the file's tensors of a
    kind the kernels read, under the family's names."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    processor = _processor(hf_config, reader)
    names = _hf_names(hf_config, processor)
    rows, kinds = {}, {}
    for t in reader.tensors:
        kind = int(t.tensor_type)
        hf = names.get(t.name)
        if (kind not in BLOCK_BYTES and kind not in REPACKED) or hf is None:
            continue
        raw = np.array(processor.process(t.data, t.name).weights)
        if kind in REPACKED:
            kind, raw = repack(kind, raw)
        rows[hf] = torch.from_numpy(raw).view(torch.uint8).reshape(raw.shape[0], -1)
        kinds[hf] = kind
    out = {key.removesuffix(".weight"): v for key, v in _fused(model, hf_config, rows, kinds)}
    # the LM head: its own tensor, or the tied embedding's
    head = "model.embed_tokens.weight" if getattr(hf_config, "tie_word_embeddings", False) \
        else "lm_head.weight"
    if head in rows:
        out["head.linear"] = (kinds[head], rows[head])
    return {name: v for name, v in out.items() if _linear(model, name)[2] is not None}


def _fused(model, hf_config, rows: dict, kinds: dict):
    """(family key, (kind, rows of blocks)) for each weight the family builds from the
    file's tensors, where all its parts are of one kind. The family's own
    ``convert_hf_state_dict`` runs on each row's (tensor, row) index, so that its fusing
    (and any reordering of rows) is followed as it is, whatever the parts' widths."""
    names = list(rows)
    index = {hf: torch.stack([torch.full((len(r),), i), torch.arange(len(r))], 1)
             for i, (hf, r) in enumerate(rows.items())}
    for key, at in model.convert_hf_state_dict(index, hf_config).items():
        if not key.endswith(".weight") or key == "lm_head.weight" or at.dim() != 2 \
                or at.shape[1] != 2:
            continue
        parts = [names[i] for i in at[:, 0].unique().tolist()]
        if len({kinds[hf] for hf in parts}) != 1:
            continue  # a fused linear of mixed kinds keeps its float weight
        starts = torch.tensor([0] + [len(rows[hf]) for hf in parts]).cumsum(0)
        place = {names.index(hf): start for hf, start in zip(parts, starts.tolist())}
        picks = torch.tensor([place[i] for i in at[:, 0].tolist()]) + at[:, 1]
        yield key, (kinds[parts[0]], torch.cat([rows[hf] for hf in parts])[picks])


def _processor(hf_config, reader):
    """transformers' processing of the file's tensors (llama.cpp's q/k row order undone)."""
    import transformers.modeling_gguf_pytorch_utils as tg

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return tg.TENSOR_PROCESSORS.get(arch, tg.TensorProcessor)(config=hf_config.to_dict())


def _hf_names(hf_config, processor) -> dict:
    """{GGUF tensor name: transformers' name}, by transformers' own map."""
    import transformers.modeling_gguf_pytorch_utils as tg
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = hf_config.to_dict()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    return tg.get_gguf_hf_weights_map(hf_model, processor)


def _linear(model, name: str):
    """(parent, attribute, nn.Linear) at module path ``name``; None where it is not a
    float linear (a family that keeps that weight otherwise)."""
    parent_name, _, attr = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        return None, attr, None
    child = getattr(parent, attr, None)
    if isinstance(parent, LogitsHead) or isinstance(child, nn.Linear):
        return parent, attr, child if isinstance(child, nn.Linear) else None
    return parent, attr, None


def _check(name: str, weight: torch.Tensor, rows: torch.Tensor, kind: int) -> None:
    n, k = weight.shape
    if rows.shape[0] != n or rows.shape[1] != k // 32 * BLOCK_BYTES[kind]:
        raise ConfigError(f"{name}: the GGUF file's blocks ({tuple(rows.shape)}) do not "
                          f"hold its {n} x {k} weight; use cpu_weight_dtype float32")
    sample = sorted({0, 1, n // 3, n // 2, n - 1})
    got = torch.ops.roseinfer_gguf.dequantize(rows[sample].contiguous(), kind, k)
    if not torch.allclose(got, weight[sample].float(), rtol=1e-6, atol=1e-7):
        raise ConfigError(f"{name}: the GGUF file's blocks de-quantize to other values than "
                          f"the converted weight; use cpu_weight_dtype float32")

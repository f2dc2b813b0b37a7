"""How a model's token states become one vector or score per input: the pooling a
sentence-transformers directory declares (``modules.json``, its Pooling and Normalize
modules, ``prompts``, the max sequence length, a cross-encoder's activation), or the
family's default, and the pooling itself over packed sequences."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.pooling_task import PoolingTask
from roseinfer.layers.encoder_attention import Packed

MODES = ("cls", "mean", "last")
# sentence-transformers' older Pooling config: one flag per mode
_OLD_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_lasttoken": "last"}
_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingSpec:
    mode: str = "cls"
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_len: int | None = None
    # A cross-encoder's activation over its logits (sentence-transformers': sigmoid for
    # one label); None: the logits as they are.
    activation: str | None = None
    matryoshka: tuple[int, ...] | bool = False  # dims a vector may be cut to; True: any

    def prompt(self, name: str | None) -> str:
        name = name or self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise InvalidRequestError("prompt_name", f"{name!r} is not one of the model's "
                                      f"prompts: {', '.join(self.prompts) or 'none'}")
        return self.prompts[name]

    def check_dimensions(self, dimensions: int | None, width: int) -> None:
        if dimensions is None:
            return
        if not self.matryoshka:
            raise InvalidRequestError("dimensions", "this model does not declare Matryoshka "
                                      "dimensions (matryoshka_dimensions in its config): "
                                      "leave dimensions out")
        allowed = self.matryoshka if self.matryoshka is not True else range(1, width + 1)
        if not isinstance(dimensions, int) or dimensions not in allowed:
            raise InvalidRequestError("dimensions", f"must be one of {list(allowed)[:16]}, "
                                      f"got {dimensions!r}")


def spec_of(path, hf_config, decoder: bool) -> PoolingSpec:
    """The directory's sentence-transformers pooling, else the family's default: the
    first token for encoders, the last for decoders, normalised."""
    default = PoolingSpec(mode="last" if decoder else "cls",
                          activation=_activation(hf_config, None), matryoshka=_matryoshka(hf_config))
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return default
    modules = _read(path, "modules.json")
    if modules is None:
        return default
    kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    unknown = sorted(set(kinds) - set(_MODULES))
    if unknown:
        raise ValueError(f"{path}: sentence-transformers modules {unknown} are not supported "
                         f"(supported: {', '.join(_MODULES)})")
    pooling = _read(os.path.join(path, kinds.get("Pooling", "1_Pooling")), "config.json") or {}
    st = _read(path, "config_sentence_transformers.json") or {}
    bert = _read(path, "sentence_bert_config.json") or {}
    tokenizer = _read(path, "tokenizer_config.json") or {}
    return PoolingSpec(
        mode=_mode(pooling, default.mode), normalize="Normalize" in kinds,
        prompts={k: v for k, v in (st.get("prompts") or {}).items()},
        default_prompt_name=st.get("default_prompt_name"),
        max_len=bert.get("max_seq_length") or tokenizer.get("model_max_length"),
        activation=default.activation, matryoshka=default.matryoshka)


def _mode(pooling: dict, default: str) -> str:
    mode = {"lasttoken": "last"}.get(pooling.get("pooling_mode"), pooling.get("pooling_mode"))
    if mode is None:
        mode = next((m for k, m in _OLD_MODES.items() if pooling.get(k)), default)
    if mode not in MODES:
        raise ValueError(f"pooling mode {mode!r} is not supported; supported: {', '.join(MODES)}")
    return mode


def _activation(hf_config, default):
    st = getattr(hf_config, "sentence_transformers", None) or {}
    name = str(st.get("activation_fn") or "").rsplit(".", 1)[-1]
    if name:
        return {"Sigmoid": "sigmoid", "Identity": None}.get(name, name)
    return "sigmoid" if getattr(hf_config, "num_labels", 0) == 1 else default


def _matryoshka(hf_config):
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(dims)
    return bool(getattr(hf_config, "is_matryoshka", False))


def _read(folder, name: str):
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def pool(hidden: torch.Tensor, packed: Packed, mode: str) -> torch.Tensor:
    """[B, H] float32 from packed token states [N, H]."""
    hidden = hidden.float()
    if mode == "cls":
        return hidden[packed.starts]
    if mode == "last":
        return hidden[packed.ends]
    sums = hidden.new_zeros(len(packed.lens), hidden.shape[-1]).index_add_(
        0, packed.seq_index, hidden)
    return sums / torch.tensor(packed.lens, device=hidden.device, dtype=hidden.dtype)[:, None]


def finish(vectors: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Cut to ``dimensions`` (Matryoshka), then normalised where the model's are."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, dim=-1) if normalize else vectors


def activate(logits: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(logits.float())
    if activation is None:
        return logits.float()
    raise ValueError(f"activation {activation!r} is not supported (sigmoid, Identity)")


@dataclass
class Prepared:
    """A task tokenized and checked: its items' (ids, token types) in input order, the
    order they run in (longest first), and whether their rows are pooled vectors or a
    classifier's logits."""
    task: PoolingTask
    items: list
    order: list[int]
    logits: bool

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.items)


@dataclass
class PoolingOutput:
    """A finished pooling request, as the worker's publisher reads outputs: one final
    output, no tokens. ``result``: [n, dim] vectors (embed), or a list of floats (score)
    or of probability lists (classify); ``item_tokens``: each input's token count."""
    request_id: str
    finish_reason: str
    task: PoolingTask | None = None
    result: object = None
    item_tokens: list[int] = field(default_factory=list)
    labels: list[str] | None = None  # classify: the classes' names, by index
    error: str | None = None
    index: int = 0
    finished: bool = True
    new_token_ids: tuple = ()
    new_text: str = ""
    new_logprobs: None = None
    prompt_logprobs: None = None
    token_ids: tuple = ()
    num_cached_tokens: int = 0

    @property
    def prompt_token_ids(self) -> range:
        """As long as the inputs' tokens together (usage counts its length)."""
        return range(sum(self.item_tokens))

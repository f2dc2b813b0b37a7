"""The pooling runner: models that embed, score or classify instead of generating.

Inputs are tokenized (with the model's prompt for embeddings, as pairs for a
cross-encoder), sorted by length and packed into batches of at most
``max_num_batched_tokens`` tokens without padding; each batch runs the model once and is
pooled (core/pooling.py). There is no KV cache and nothing to schedule between steps."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from roseinfer.core.config import EngineConfig
from roseinfer.core.device_side import resolve_device, resolve_dtype
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.pooling import activate, finish, pool, spec_of
from roseinfer.layers.encoder_attention import Packed
from roseinfer.models import loader

Input = Union[str, list[int]]
TRUNCATE = (None, "right", "left")


class PoolingEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None,
                 plugins=None):
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.hf_config, _ = loader.load(
            model, None, self.dtype, self.device, seed=config.seed or 0, plugins=plugins)
        path = tokenizer or (model if isinstance(model, (str, os.PathLike)) else None)
        self.tokenizer = _tokenizer(path)
        self.spec = spec_of(model, self.hf_config, decoder=False)
        limits = [self.hf_config.max_position_embeddings - self.model.position_offset,
                  self.spec.max_len, config.max_model_len]
        self.max_model_len = min(n for n in limits if n)
        self.classifier = self.model.head is not None

    def close(self) -> None:
        self.model = None

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Input], dimensions: int | None = None,
              truncate: str | None = None, prompt_name: str | None = None,
              normalize: bool | None = None) -> list[Pooled]:
        """One float32 vector per input, in order."""
        width = self.hf_config.hidden_size
        self.spec.check_dimensions(dimensions, width)
        prompt = self.spec.prompt(prompt_name)
        encoded = [self._encode(x, None, truncate, prompt, i) for i, x in enumerate(inputs)]
        norm = self.spec.normalize if normalize is None else normalize
        return self._run(encoded, lambda h, p: finish(pool(h, p, self.spec.mode), norm,
                                                      dimensions))

    @torch.inference_mode()
    def score(self, query: Input, documents: Sequence[Input],
              truncate: str | None = None) -> list[Pooled]:
        """Each document's relevance to ``query`` (a float tensor): a cross-encoder's score
        of the pair, or an embedder's cosine similarity of the two (tokens: both's)."""
        if not self.classifier:
            q, *docs = self.embed([query, *documents], truncate=truncate, normalize=True)
            return [Pooled(q.value @ d.value, q.tokens + d.tokens) for d in docs]
        pairs = [self._encode(query, d, truncate, "", i) for i, d in enumerate(documents)]
        return [Pooled(activate(p.value, self.spec.activation)[0], p.tokens)
                for p in self._run(pairs, self._logits)]

    @torch.inference_mode()
    def classify(self, inputs: Sequence[Input], truncate: str | None = None
                 ) -> list[Pooled]:
        """Each input's class probabilities: a softmax over the labels (a sigmoid of one)."""
        if not self.classifier:
            raise InvalidRequestError("task", "this model has no classification head: "
                                      "use embed")
        encoded = [self._encode(x, None, truncate, "", i) for i, x in enumerate(inputs)]
        return [Pooled(_probs(p.value), p.tokens) for p in self._run(encoded, self._logits)]

    def _logits(self, hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
        return self.model.classify(hidden, packed).float()

    def _encode(self, text: Input, pair: Input | None, truncate, prompt: str, index: int):
        """(ids, token types) of one input; too long without ``truncate``: refused."""
        if truncate not in TRUNCATE:
            raise InvalidRequestError("truncate", f"must be left, right or unset, got {truncate!r}")
        if not isinstance(text, str) or (pair is not None and not isinstance(pair, str)):
            if pair is not None or not _ids(text):
                raise InvalidRequestError("input", f"item {index} must be a string or a list "
                                          "of token ids (a pair: two strings)")
            ids, types = list(text), None
            if any(not 0 <= i < self.hf_config.vocab_size for i in ids):
                raise InvalidRequestError("input", f"item {index} has token ids outside the "
                                          f"vocabulary (0 to {self.hf_config.vocab_size - 1})")
            if truncate and len(ids) > self.max_model_len:
                ids = ids[:self.max_model_len] if truncate == "right" else ids[-self.max_model_len:]
        else:
            if not text or pair == "":
                raise InvalidRequestError("input", f"item {index} is an empty string")
            tok = self.tokenizer
            if tok is None:
                raise InvalidRequestError("input", "this model has no tokenizer: send token ids")
            tok.truncation_side = truncate or "right"
            enc = tok(prompt + text, pair, truncation="only_second" if pair else True,
                      max_length=self.max_model_len) if truncate else tok(prompt + text, pair)
            ids, types = enc["input_ids"], None
            if pair is not None and self.hf_config.type_vocab_size > 1:  # not RoBERTa's
                types = enc.get("token_type_ids")
        if not ids or len(ids) > self.max_model_len:
            what = "is empty" if not ids else (
                f"has {len(ids)} tokens, over the model's {self.max_model_len}: shorten it or "
                "set truncate")
            raise InvalidRequestError("input", f"item {index} {what}",
                                      code="too_long" if ids else "bad_request")
        return ids, types

    def _run(self, encoded: list, reduce) -> list[Pooled]:
        """``reduce(hidden, packed)`` -> [B, ...] over batches of at most the token budget,
        longest inputs first; rows back in input order."""
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
        out: list = [None] * len(encoded)
        budget = max(self.config.max_num_batched_tokens, self.max_model_len)
        batch, tokens = [], 0
        for i in order + [None]:
            size = 0 if i is None else len(encoded[i][0])
            if batch and (i is None or tokens + size > budget):
                for j, row in zip(batch, self._batch([encoded[j] for j in batch], reduce)):
                    out[j] = Pooled(row, len(encoded[j][0]))
                batch, tokens = [], 0
            if i is not None:
                batch.append(i)
                tokens += size
        return out

    def _batch(self, encoded: list, reduce) -> torch.Tensor:
        lens = [len(ids) for ids, _ in encoded]
        types = None
        if any(t is not None for _, t in encoded):
            types = [x for ids, t in encoded for x in (t or [0] * len(ids))]
        packed = Packed.of(lens, types, self.device)
        ids = torch.tensor([x for ids, _ in encoded for x in ids], device=self.device)
        return reduce(self.model(ids, packed), packed).cpu()


@dataclass(frozen=True)
class Pooled:
    """One input's result (a vector, a score's logits, class logits) and its token count."""
    value: torch.Tensor
    tokens: int


def pooling_runner(model, runner: str, plugins=None) -> bool:
    """Whether ``model`` runs in the pooling runner: asked for, or (``auto``) a family
    that only pools."""
    if runner != "auto":
        return runner == "pooling"
    from roseinfer.models import model_class
    config = model.config if hasattr(model, "config") else loader.model_info(
        model, tokenizer=False)[0]
    try:
        return getattr(model_class(config, plugins), "pooling_only", False)
    except ValueError:
        return False  # an unknown family: the generate engine says so, naming the ones known


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)


def _ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in x)


def _tokenizer(path):
    """transformers' tokenizer: pairs, token types and truncation are its to do."""
    if path is None:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)

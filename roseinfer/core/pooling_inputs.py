"""A pooling request's inputs as token ids, checked: texts tokenized in one call of the
model's tokenizer (pairs for a cross-encoder, with their token types), token-id lists
checked against the vocabulary, each against the model's length."""
from __future__ import annotations

from dataclasses import dataclass

from roseinfer.core.errors import InvalidRequestError


@dataclass(frozen=True)
class InputRules:
    max_len: int
    vocab_size: int
    token_types: bool  # the model reads a pair's segments (BERT; not RoBERTa)

    def encode(self, tok, inputs: list, field: str, truncate, prompt: str = "",
               query: str | None = None) -> list[tuple[list[int], list[int] | None]]:
        """(ids, token types) of each input; ``query``: each text is the second of a pair
        after it. Too long without ``truncate``: refused, naming the item."""
        out: list = [None] * len(inputs)
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                if not x:
                    raise InvalidRequestError(field, f"item {i} is an empty string")
            elif query is None and _ids(x):
                out[i] = self._ids(list(x), field, i, truncate), None
            else:
                raise InvalidRequestError(field, f"item {i} must be a string or a list of "
                                          "token ids (a cross-encoder's documents: strings)")
        if texts:
            self._tokenize(tok, [prompt + inputs[i] for i in texts], texts, out, field,
                           truncate, query)
        for i, (ids, _) in enumerate(out):
            if not ids:
                raise InvalidRequestError(field, f"item {i} is empty")
            if len(ids) > self.max_len:
                raise InvalidRequestError(field, f"item {i} has {len(ids)} tokens, over the "
                                          f"model's {self.max_len}: shorten it or set truncate",
                                          code="too_long")
        return out

    def _tokenize(self, tok, texts: list[str], where: list[int], out: list, field: str,
                  truncate, query) -> None:
        if tok is None:
            raise InvalidRequestError(field, "this model has no tokenizer: send token ids")
        tok.truncation_side = truncate or "right"
        limit = {"truncation": "only_second" if query is not None else True,
                 "max_length": self.max_len} if truncate else {}
        enc = tok([query] * len(texts), texts, **limit) if query is not None else \
            tok(texts, **limit)
        types = enc.get("token_type_ids") if query is not None and self.token_types else None
        for j, i in enumerate(where):
            out[i] = enc["input_ids"][j], None if types is None else types[j]

    def _ids(self, ids: list[int], field: str, index: int, truncate) -> list[int]:
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise InvalidRequestError(field, f"item {index} has token ids outside the "
                                      f"vocabulary (0 to {self.vocab_size - 1})")
        if truncate and len(ids) > self.max_len:
            return ids[:self.max_len] if truncate == "right" else ids[-self.max_len:]
        return ids


def _ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in x)

"""Incremental, UTF-8 safe detokenization with stop strings.

Each sequence streams its ids through the Rust tokenizer's ``DecodeStream``
(about a microsecond a token): a multi-byte character split across tokens
comes out once complete instead of as U+FFFD, and the stream is primed with
the prompt's last ids so that the first token keeps its leading space. Text
that might be the start of a stop string is held back until it cannot be.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, context_ids: list[int], stop: list[str]):
        self.backend = backend_of(tokenizer)
        self.stream = DecodeStream(skip_special_tokens=True)
        if context_ids:
            self.stream.step(self.backend, context_ids[-CONTEXT_TOKENS:])
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""      # all decoded text (stop string cut off once found)
        self.released = 0   # chars of text already handed out
        self.stopped = False  # a stop string ended the text

    def add(self, ids) -> bool:
        """Decode new ids (one or a list); True if a stop string ended the text."""
        new = self.stream.step(self.backend, ids)
        if not new:
            return False  # incomplete character: wait for more bytes
        start = max(len(self.text) - self.holdback, 0)
        self.text += new
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return bool(hits)

    def take(self, ids: list[int]) -> int:
        """Decode ids up to the one that completes a stop string (``stopped``
        tells whether one did); returns how many were taken."""
        if not self.stop:
            self.add(ids)  # one call for the lot: nothing can stop it early
            return len(ids)
        for i, token in enumerate(ids):
            if self.add(token):
                return i + 1
        return len(ids)

    def release(self, final: bool) -> str:
        """Text safe to hand out now; everything once the request is final."""
        end = len(self.text) if final else max(len(self.text) - self.holdback, self.released)
        out = self.text[self.released:end]
        self.released = end
        return out


def backend_of(tokenizer):
    """The Rust ``tokenizers.Tokenizer`` behind a transformers tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} has no fast (Rust) tokenizer; "
                         "load the model's tokenizer.json, or pass token ids without a tokenizer")
    return backend

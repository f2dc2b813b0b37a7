"""Incremental, UTF-8 safe detokenization with stop strings, batched per step.

Each step decodes only a short window of ids per sequence (the prefix/read
offsets of vLLM's scheme): O(new tokens), and a multi-byte character split
across tokens is held back until complete instead of surfacing as U+FFFD.
Text that might be the start of a stop string is held back until it cannot
be. All sequences of a step are decoded in one call into the tokenizer.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, token_ids: list[int], num_prompt: int, stop: list[str]):
        self.ids = token_ids  # the sequence's live list: no copy
        self.prefix = max(num_prompt - CONTEXT_TOKENS, 0)
        self.read = num_prompt
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""      # all decoded text (stop string cut off once found)
        self.released = 0   # chars of text already handed out

    def windows(self) -> tuple[list[int], list[int]]:
        """The ids to decode: the context alone, and the context plus new ids."""
        return self.ids[self.prefix:self.read], self.ids[self.prefix:]

    def advance(self, prefix_text: str, full: str, final: bool = False) -> bool:
        """Take the decoded windows; True if a stop string ended the text."""
        if len(full) <= len(prefix_text) or (full.endswith("\ufffd") and not final):
            return False  # incomplete character: wait for more bytes
        self.prefix, self.read = self.read, len(self.ids)
        start = max(len(self.text) - self.holdback, 0)
        self.text += full[len(prefix_text):]
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def release(self, final: bool) -> str:
        """Text safe to hand out now; everything once the request is final."""
        end = len(self.text) if final else max(len(self.text) - self.holdback, self.released)
        out = self.text[self.released:end]
        self.released = end
        return out


class BatchDecoder:
    """Decodes many id windows in one call (the Rust tokenizer's batch decode
    when the tokenizer has one and its output is the same as ``decode``)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda ws: backend.decode_batch(ws, skip_special_tokens=True)
        else:
            self._decode = lambda ws: tokenizer.batch_decode(ws, skip_special_tokens=True)

    def step(self, seqs, finals) -> list[bool]:
        """Advance each sequence's detokenizer; returns which hit a stop string."""
        pairs = [s.detok.windows() for s in seqs]
        texts = self._decode([a for a, _ in pairs] + [b for _, b in pairs])
        k = len(seqs)
        return [s.detok.advance(texts[i], texts[k + i], final)
                for i, (s, final) in enumerate(zip(seqs, finals))]

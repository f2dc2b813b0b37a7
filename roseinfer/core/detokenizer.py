"""Incremental, UTF-8 safe detokenization with stop strings.

Each step decodes only a short window of ids (the prefix/read offsets of
vLLM's scheme): O(new tokens), and a multi-byte character split across
tokens is held back until complete instead of surfacing as U+FFFD. Text that
might be the start of a stop string is held back until it cannot be.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, token_ids: list[int], num_prompt: int, stop: list[str]):
        self.tok = tokenizer
        self.ids = token_ids  # the sequence's live list: no copy
        self.prefix = max(num_prompt - CONTEXT_TOKENS, 0)
        self.read = num_prompt
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""      # all decoded text (stop string cut off once found)
        self.released = 0   # chars of text already handed out

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def step(self, final: bool = False) -> bool:
        """Decode ids appended since the last call; True if a stop string ended the text."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) <= len(prefix_text) or (full.endswith("\ufffd") and not final):
            return False  # incomplete character: wait for more bytes
        new = full[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        start = max(len(self.text) - self.holdback, 0)
        self.text += new
        return self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> bool:
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

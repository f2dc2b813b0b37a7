"""From a raw request entry to what the engine takes, off the step loop.

Everything here grows with the entry (decoding, the chat template, tokenization), so the
worker's reader thread does it, and the loop only hands the result to the engine. Sizes
are checked first, against limits that come from the model and the worker's flags, so a
hostile entry costs at most a length check (docs/protocol.md, "Limits").
"""
from __future__ import annotations

import copy
from typing import Optional

from roseinfer.frontends.redis_streams.protocol import Limits, Request, decode_request
from roseinfer.models.tokenizers import as_chat


class Admission:
    def __init__(self, engine, chat_template: bool, max_entry_bytes: int = Limits.max_entry_bytes):
        tokenizer = getattr(engine, "tokenizer", None)
        # Its own copy: transformers' fast tokenizers change their settings on each
        # encode, which is not safe beside the loop's detokenizers on the shared one.
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        context = getattr(engine, "max_model_len", None)
        self.limits = Limits(max_entry_bytes, context, _max_prompt_chars(self.tokenizer, context))

    def __call__(self, entry_id: str, fields: dict) -> Request:
        """The entry as a request whose text prompt is already token ids; raises
        InvalidRequestError naming what is wrong or too large."""
        req = decode_request(entry_id, fields, self.limits)
        if isinstance(req.prompt, str) and self.tokenizer is not None:
            req.prompt = self.tokenizer.encode(self.templated(req.prompt))
        return req

    def templated(self, text: str) -> str:
        return as_chat(self.tokenizer, text) if self.chat_template else text


def _max_prompt_chars(tokenizer, context: Optional[int]) -> Optional[int]:
    """The most characters a prompt that fits the context can have: no token's text is
    longer than its vocabulary entry (byte-level BPE spells each byte as one character)."""
    if tokenizer is None or context is None:
        return None
    return context * max(len(token) for token in tokenizer.get_vocab())

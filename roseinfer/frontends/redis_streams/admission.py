"""From a raw request entry to what the engine takes, off the step loop.

Everything here grows with the entry (decoding, the chat template, tokenization, compiling
a response_format's grammar), so the worker's reader thread does it, and the loop only
hands the result to the engine. Sizes are checked first, against limits that come from
the model and the worker's flags, so a hostile entry costs at most a length check
(docs/protocol.md, "Limits"); a grammar's compile time is not bounded by its size, but
it leaves the step loop running (xgrammar releases the GIL while it compiles).
"""
from __future__ import annotations

import copy
from typing import Optional

from roseinfer.core import multimodal, reasoning
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.plugins import default_registry
from roseinfer.core.tools import ToolStream, parser_name
from roseinfer.frontends.redis_streams.protocol import Chat, Limits, Request
from roseinfer.frontends.redis_streams.request_entry import decode_request
from roseinfer.models.tokenizers import as_chat


class Admission:
    def __init__(self, engine, chat_template: bool, max_entry_bytes: int = Limits.max_entry_bytes):
        tokenizer = getattr(engine, "tokenizer", None)
        # Its own copy: transformers' fast tokenizers change their settings on each
        # encode, which is not safe beside the loop's detokenizers on the shared one.
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat_template = chat_template and self.has_template
        context = getattr(engine, "max_model_len", None)
        self.limits = Limits(max_entry_bytes, context, _max_prompt_chars(self.tokenizer, context))
        self.processors = getattr(engine, "processors", None)
        plugins = getattr(engine, "plugins", None) or default_registry()
        config = getattr(engine, "config", None)
        hf_config = getattr(engine, "hf_config", None)
        self.tool_parser = plugins.create("tool_parser", parser_name(
            getattr(config, "tool_call_parser", "auto"), hf_config))
        name = reasoning.parser_name(getattr(config, "reasoning_parser", "auto"), hf_config)
        self.reasoning = plugins.create("reasoning_parser", name) if name else None
        self.prepare = getattr(engine, "prepare", None)  # a pooling engine's (core/pooling_engine.py)
        self.tasks = set(getattr(engine, "tasks", ("generate",)))
        self.model = getattr(engine, "model", None)  # a vision-language model prepares images
        encoder = getattr(engine, "encoder", None)
        self.images_seen = encoder.cache if encoder is not None else None  # not prepared again

    def __call__(self, entry_id: str, fields: dict) -> Request:
        """The entry as a request whose text prompt is already token ids; raises
        InvalidRequestError naming what is wrong or too large."""
        req = decode_request(entry_id, fields, self.limits)
        if req.pooling is None and "generate" not in self.tasks:
            raise InvalidRequestError("task", "this worker's model pools: send task embed, "
                                      "score or classify")
        if req.pooling is not None and self.prepare is None:
            raise InvalidRequestError("task", f"task {req.pooling.task} needs a worker whose "
                                      "model pools (an embedding or scoring model, or "
                                      "serve --pooling-model); this one generates")
        if req.pooling is not None:  # tokenized and checked here, off the step loop
            req.prompt = self.prepare(req.pooling, self.tokenizer)
            return req
        if isinstance(req.prompt, Chat):
            chat = req.prompt
            pixels = self._images(chat)
            text = self._render(chat)
            if pixels is not None:
                text = multimodal.prompt_text(self.model, self.tokenizer, text)
            if self.reasoning is not None:
                req.reasoning_inside = self.reasoning.opened(text)
                # response_format and forced tool calls constrain the answer alone
                req.params.answer_gate = reasoning.answer_gate(self.reasoning, self.tokenizer,
                                                               req.reasoning_inside)
            req.prompt = self.tokenizer.encode(text)
            if pixels is not None:
                req.prompt = {"prompt_token_ids": req.prompt,
                              "multi_modal_data": {"image": pixels}}
        elif isinstance(req.prompt, str) and self.tokenizer is not None:
            text = req.prompt if req.raw else self.templated(req.prompt)
            req.prompt = self.tokenizer.encode(text)
        if req.params.constrained and self.processors is not None:
            # a grammar compiles here, not in the loop
            if req.tools is not None and req.tools.forced:
                req.tools.prepare(self.processors, req.params)
            else:
                self.processors.prepare(req.params)
        return req

    def _images(self, chat: Chat):
        """A chat's images decoded and prepared for the model (here, off the step loop),
        or None where it has none."""
        if not chat.images:
            return None
        images, fields = zip(*chat.images)
        return multimodal.preprocess(self.model, list(images), list(fields), self.images_seen)

    def tool_streams(self, req: Request):
        """A maker of each sample's ToolStream, for a request with tools; else None."""
        if req.tools is None:
            return None
        parser = self.tool_parser if req.tools.choice == "auto" else None
        return lambda: ToolStream(req.tools, parser)

    def reasoning_streams(self, req: Request, emitted_ids=None):
        """A maker of each sample's ReasoningStream (by its index), for a request whose
        output is split; else None. ``emitted_ids(index)``: a resumed request's ids sent
        so far, whose text puts each stream where the first owner's was."""
        if req.reasoning_inside is None:
            return None

        def make(index: int):
            stream = reasoning.stream_for(self.reasoning, self.tokenizer, req.reasoning_inside)
            if emitted_ids is not None:  # what it hands out was sent already
                ids = emitted_ids(index)
                stream.feed(self.tokenizer.decode(ids), ids)
            return stream
        return make

    def templated(self, text: str) -> str:
        return as_chat(self.tokenizer, text) if self.chat_template else text

    def _render(self, chat: Chat) -> str:
        """Messages through the model's chat template (also on a --raw worker: a
        conversation has no other form)."""
        if not self.has_template:
            raise InvalidRequestError(
                "messages", "this worker's model has no chat template; send prompt instead")
        # tools only when there are: without, a JsonTokenizer renders plain messages itself
        tools = {"tools": list(chat.tools.tools)} if chat.tools is not None else {}
        return self.tokenizer.apply_chat_template(chat.messages, tokenize=False,
                                                  add_generation_prompt=True, **tools,
                                                  **(chat.template_kwargs or {}))


def _max_prompt_chars(tokenizer, context: Optional[int]) -> Optional[int]:
    """The most characters a prompt that fits the context can have: no token's text is
    longer than its vocabulary entry (byte-level BPE spells each byte as one character)."""
    if tokenizer is None or context is None:
        return None
    return context * max(len(token) for token in tokenizer.get_vocab())

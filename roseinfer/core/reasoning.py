"""Reasoning kept apart from the answer: models that think between tags before they answer
(Qwen3, DeepSeek-R1, QwQ) have their output split, as it streams, into reasoning and
content. A reasoning parser (a plugin: plugins/reasoning_parsers.py) names the tags and
whether a prompt already opened them; a ``ReasoningStream`` splits one sample's text.

Only chat requests are split (their prompt is the model's chat template's), and tool
calls and the answer's text are found in the content alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from roseinfer.core.tools import held_from

# "auto" parsers by the model's family (its config's model_type), as vLLM names them.
# DeepSeek-R1's distillations keep their base's family (qwen2, llama): name them
# with reasoning_parser deepseek_r1.
FAMILY_PARSERS = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "gpt_oss": "gpt_oss"}
OFF = "none"


def parser_name(configured: str, hf_config) -> Optional[str]:
    """The reasoning parser a worker uses: the one configured, its model family's for
    "auto", or None (outputs are all content)."""
    if configured == OFF:
        return None
    if configured != "auto":
        return configured
    return FAMILY_PARSERS.get(getattr(hf_config, "model_type", None))


class ReasoningParser(Protocol):
    """What a reasoning parser plugin's factory() returns."""
    start: str  # the tag that opens the reasoning, e.g. "<think>"
    end: str    # the tag that closes it

    def opened(self, prompt: str) -> bool:
        """Whether an output of this rendered ``prompt`` begins inside the reasoning (the
        template opened the tag, or the model always thinks first)."""

    # Optional: ``stream(tokenizer)``, a stream of its own (as ReasoningStream's, plus
    # ``calls``) for a format that tags cannot describe (plugins' GptOss).


def stream_for(parser: ReasoningParser, tokenizer, inside: bool):
    """One sample's splitter: the parser's own, or ReasoningStream over its tags."""
    make = getattr(parser, "stream", None)
    return make(tokenizer) if make is not None else ReasoningStream(parser, inside)


class ReasoningStream:
    """One sample's output as (reasoning, content) pieces as it streams.

    An output may open with the start tag (dropped); inside, text is reasoning up to the
    first end tag (dropped), and everything after it is content. A tag's first characters
    are held back until the next text shows whether the tag follows. So the pieces
    together are the output without those two tags, whatever the chunk boundaries."""

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.parser = parser
        self.opening = True       # at the output's start: the start tag may come
        self.inside = inside      # in the reasoning
        self.held = ""            # text not handed out yet
        self.calls = []           # tags hold no tool calls: the content's parser finds them

    def feed(self, new_text: str, ids=()) -> tuple[str, str]:
        """The (reasoning, content) that can go out now (of the text; ``ids``, its
        tokens, are for parsers that read them)."""
        text = self.held + new_text
        start, end = self.parser.start, self.parser.end
        if self.opening:
            if start.startswith(text):  # the tag, or the start of it so far
                if text == start:
                    self.opening, self.inside, self.held = False, True, ""
                else:
                    self.held = text
                return "", ""
            self.opening = False
            if text.startswith(start):
                text, self.inside = text[len(start):], True
        if not self.inside:
            self.held = ""
            return "", text
        at = held_from(text, end)
        if text.startswith(end, at):
            self.inside, self.held = False, ""
            return text[:at], text[at + len(end):]
        self.held = text[at:]
        return text[:at], ""

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held at the end of the output: a tag's beginning that the
        output ended in was text, not a tag."""
        held, self.held = self.held, ""
        return (held, "") if self.inside else ("", held)


@dataclass(frozen=True)
class AnswerGate:
    """Where a reasoning model's answer begins, so that structured output
    (response_format, forced tool calls) constrains the answer, not the thinking:
    after the text ``end`` (special tokens written out); ``start``, the first id of the
    thinking's opening tag where the output may or may not open it (None: the output
    begins inside the thinking)."""
    start: Optional[int]
    end: str


def answer_gate(parser: ReasoningParser, tokenizer, inside: bool) -> AnswerGate:
    """The gate for an output of a prompt that ``inside`` says opened the thinking or
    not. A parser may name where its answer begins itself: ``answer_marker`` (the text
    after which the answer comes) and ``always_inside``."""
    inside = inside or getattr(parser, "always_inside", False)
    start = None if inside else tokenizer.encode(parser.start, add_special_tokens=False)[0]
    return AnswerGate(start, getattr(parser, "answer_marker", parser.end))


class Gated:
    """A logits processor's state for one request behind an AnswerGate: "maybe" (the
    first token: the grammar's tokens or the thinking's opening one), "closed" (in the
    thinking: no constraint) until the output's text holds the gate's end, then "open":
    the state sees the tokens after the one that completed it. The text is decoded
    here, as tags split into different tokens in context than alone."""

    def __init__(self, inner, gate: AnswerGate, tokenizer):
        from tokenizers.decoders import DecodeStream

        from roseinfer.core.detokenizer import backend_of
        self.inner, self.gate = inner, gate
        self.phase = "closed" if gate.start is None else "maybe"
        self.backend, self.decoder, self.text = backend_of(tokenizer), \
            DecodeStream(skip_special_tokens=False), ""

    def accept(self, token_ids: list[int]) -> None:
        for i, token in enumerate(token_ids):
            if self.phase == "maybe":
                self.phase = "closed" if token == self.gate.start else "open"
            if self.phase == "open":
                self.inner.accept(list(token_ids[i:]))
                return
            self.text = (self.text + (self.decoder.step(self.backend, token) or ""))[
                -2 * len(self.gate.end):]
            if self.gate.end in self.text:
                self.phase = "open"
                if token_ids[i + 1:]:
                    self.inner.accept(list(token_ids[i + 1:]))
                return

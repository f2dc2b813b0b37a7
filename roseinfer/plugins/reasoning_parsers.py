"""Reasoning parsers, named as vLLM names them: the tags around a model's thinking, and
whether a prompt opened them (core/reasoning.py splits the output).

- ``qwen3``: ``<think>...</think>`` before the answer, when the model thinks: Qwen3's
  hybrid models write the opening tag themselves, and with ``enable_thinking`` false
  their template writes an empty pair into the prompt, so the output is all answer;
  QwQ and Qwen3's thinking-only models have the template open it.
- ``deepseek_r1``: the same tags; DeepSeek-R1 always thinks first, whether or not its
  template opened the tag, so an output without ``</think>`` is all reasoning.
- ``gpt_oss``: harmony's channels (``GptOss``), and the tool calls in them.
"""
from __future__ import annotations

from roseinfer.core.hookspecs import hookimpl


@hookimpl
def roseinfer_register_reasoning_parsers(register):
    register("qwen3", Qwen3)
    register("deepseek_r1", DeepSeekR1)
    register("gpt_oss", GptOss)


class Qwen3:
    start, end = "<think>", "</think>"

    def opened(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(self.start)


class DeepSeekR1(Qwen3):
    def opened(self, prompt: str) -> bool:
        return True


class GptOss:
    """gpt-oss's harmony format, read token by token: each message is ``<|channel|>NAME
    [to=RECIPIENT] [<|constrain|>json]<|message|>TEXT`` ended by ``<|end|>`` (another
    message follows, after ``<|start|>assistant``), ``<|call|>`` or ``<|return|>``. The
    ``analysis`` channel is reasoning, ``final`` (and ``commentary`` to no one, a
    preamble) the answer, ``commentary`` to ``functions.NAME`` a tool call.

    The special tokens are not in the detokenized text, so this reads the ids, with
    the model's own tokenizer. openai-harmony does the same, but loads its o200k encoding
    from the network on first use, which a worker need not reach."""
    start, end = "<|channel|>analysis<|message|>", "<|end|>"  # for docs and listings
    # structured output constrains the final channel's text (core/reasoning.AnswerGate)
    answer_marker, always_inside = "<|channel|>final<|message|>", True

    def opened(self, prompt: str) -> bool:
        return False

    def stream(self, tokenizer):
        return HarmonyStream(tokenizer)


class HarmonyStream:
    SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                "<|return|>", "<|call|>")

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        from roseinfer.core.detokenizer import backend_of
        self.backend, self.decode_stream = backend_of(tokenizer), DecodeStream
        ids = {tokenizer.convert_tokens_to_ids(t): t for t in self.SPECIALS}
        self.special = {i: t for i, t in ids.items() if i is not None and i >= 0}
        self.header: list[int] = []  # the current message's header, up to <|message|>
        self.body = None             # its text's DecodeStream, once in the text
        self.channel, self.recipient, self.args = "", None, ""
        self.calls = []

    def feed(self, text: str, ids) -> tuple[str, str]:
        thought, answer = "", ""
        for token in ids:
            kind = self.special.get(token)
            if self.body is None:  # in a header
                if kind == "<|message|>":
                    self._open()
                elif kind not in ("<|start|>", "<|end|>"):
                    self.header.append(token)
            elif kind is not None:
                self._close(kind)
            else:
                piece = self.body.step(self.backend, token) or ""
                if self.recipient is not None:
                    self.args += piece
                elif self.channel == "analysis":
                    thought += piece
                else:
                    answer += piece
        return thought, answer

    def finish(self) -> tuple[str, str]:
        if self.body is not None:
            self._close("<|return|>")  # cut short: its call is not whole
        return "", ""

    def _open(self) -> None:
        import re
        head = self.backend.decode(self.header, skip_special_tokens=False)
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        recipient = re.search(r"to=functions\.([^\s<]+)", head)
        self.channel = channel.group(1) if channel else "final"
        self.recipient = recipient.group(1) if recipient else None
        self.header, self.body, self.args = [], self.decode_stream(skip_special_tokens=False), ""

    def _close(self, kind: str) -> None:
        from roseinfer.core.tools import new_call
        if self.recipient is not None and kind in ("<|call|>", "<|end|>"):
            self.calls.append(new_call(self.recipient, self.args.strip() or "{}"))
        self.body, self.recipient = None, None

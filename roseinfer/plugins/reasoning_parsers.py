"""Reasoning parsers, named as vLLM names them: the tags around a model's thinking, and
whether a prompt opened them (core/reasoning.py splits the output).

- ``qwen3``: ``<think>...</think>`` before the answer, when the model thinks: Qwen3's
  hybrid models write the opening tag themselves, and with ``enable_thinking`` false
  their template writes an empty pair into the prompt, so the output is all answer;
  QwQ and Qwen3's thinking-only models have the template open it.
- ``deepseek_r1``: the same tags; DeepSeek-R1 always thinks first, whether or not its
  template opened the tag, so an output without ``</think>`` is all reasoning.
"""
from __future__ import annotations

from roseinfer.core.hookspecs import hookimpl


@hookimpl
def roseinfer_register_reasoning_parsers(register):
    register("qwen3", Qwen3)
    register("deepseek_r1", DeepSeekR1)


class Qwen3:
    start, end = "<think>", "</think>"

    def opened(self, prompt: str) -> bool:
        return prompt.rstrip().endswith(self.start)


class DeepSeekR1(Qwen3):
    def opened(self, prompt: str) -> bool:
        return True

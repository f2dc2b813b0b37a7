"""LLM: the offline facade over Engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from roseinfer.core import content_parts, reasoning
from roseinfer.core.config import EngineConfig, config_from_args
from roseinfer.core.engine import Engine, Prompt
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.outputs import ClassificationOutput, EmbeddingOutput, RequestOutput, \
    ScoringOutput
from roseinfer.core.pooling_task import PoolingTask
from roseinfer.core.pooling_engine import PoolingEngine, pooling_runner
from roseinfer.core.sampling import SamplingParams
from roseinfer.core.tools import ToolCall, ToolStream, check_tools, parser_name


@dataclass
class ChatOutput:
    """One assistant turn: its content, the tool calls it made, why it ended
    ("tool_calls" when it made any), and the engine's output (ids, logprobs)."""
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    output: RequestOutput
    reasoning: str = ""  # a reasoning model's thinking (config reasoning_parser), apart


class LLM:
    """Generates (``generate``, ``chat``), or, for a model that pools (config ``runner``),
    embeds, scores and classifies (``embed``, ``score``, ``classify``)."""

    def __init__(self, model, tokenizer=None, plugins=None, **config):
        config = EngineConfig.from_kwargs(**config)
        pooling = pooling_runner(model, config.runner, plugins, config.classifier_from_token)
        self.engine = (PoolingEngine if pooling else Engine)(model, tokenizer, config, plugins)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Release the model, its KV cache and GPU memory, and stop the other ranks of a
        tensor-parallel group; a new LLM can be made in this process after."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter saved at ``path`` as ``name`` (the LLM must be made
        with ``enable_lora=True``); ``generate(..., lora=name)`` then runs with it."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def generate(self, prompts: list[Prompt],
                 params: Union[SamplingParams, list[SamplingParams], None] = None,
                 use_tqdm: bool = False,
                 lora: Union[str, list[Optional[str]], None] = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt whose
        params ask for n > 1 samples gets the list of its n outputs, by index. ``lora``:
        the adapter every prompt runs with, or one per prompt (None: the base model)."""
        self._check_runner(Engine, "generate")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list: [\"text\", ...] or [[ids], ...]")
        params = params or SamplingParams()
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} SamplingParams for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} adapters for {len(prompts)} prompts")
        ids = [f"gen-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p, adapter in zip(ids, prompts, per, loras):
                self.engine.add_request(rid, prompt, p, lora=adapter)
        except BaseException:  # a refused prompt: the ones added before it leave too
            for rid in ids:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        final: dict[tuple[str, int], RequestOutput] = {}
        for out in self._drive(sum(p.n for p in per), use_tqdm):
            final[out.request_id, out.index] = out
        return [final[rid, 0] if p.n == 1 else [final[rid, i] for i in range(p.n)]
                for rid, p in zip(ids, per)]

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool = True,
             chat_template_kwargs: dict | None = None) -> ChatOutput:
        """One assistant turn for ``messages``, rendered with the tools by the model's chat
        template, as a worker renders them (core/tools.py): tool_choice "auto" parses the
        calls out of the text with the model family's parser (config tool_call_parser),
        "required" or a named function constrains the output to calls. A reasoning
        model's thinking is split from the content (config reasoning_parser);
        ``chat_template_kwargs`` go to the template (e.g. ``{"enable_thinking": False}``).
        A message's content may be a list of OpenAI content parts, text and images as
        bytes or data URLs (core/content_parts.py), for a vision-language model."""
        self._check_runner(Engine, "chat")
        spec = check_tools(tools, tool_choice, parallel_tool_calls)
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("chat answers one turn: use n=1 (generate takes n > 1)")
        messages, images = _content_parts(messages)
        prompt = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True,
            **({"tools": list(spec.tools)} if spec is not None else {}),
            **(chat_template_kwargs or {}))
        if spec is not None and spec.forced:
            params = dataclasses.replace(params, response_format=spec.constraint())
            spec.prepare(self.engine.processors, params)
        parser = self._reasoning_parser()
        if parser is not None:  # structured output constrains the answer alone
            params = dataclasses.replace(params, answer_gate=reasoning.answer_gate(
                parser, self.tokenizer, parser.opened(prompt)))
        (out,) = self.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}
                                if images else prompt], params)
        thought, text, found = self._split_reasoning(prompt, out)
        if spec is None:
            return ChatOutput(text, [], out.finish_reason, out, thought)
        parser = None
        if spec.choice == "auto":
            parser = self.engine.plugins.create("tool_parser", parser_name(
                self.engine.config.tool_call_parser, self.engine.hf_config))
        stream = ToolStream(spec, parser)
        content = stream.feed(text)
        rest, calls = stream.finish()
        calls += found
        return ChatOutput(content + rest, calls, "tool_calls" if calls else out.finish_reason,
                          out, thought)

    def embed(self, inputs: list[Union[str, list[int]]], dimensions: int | None = None,
              truncate: str | None = None, prompt_name: str | None = None
              ) -> list[EmbeddingOutput]:
        """One vector per input (a text, or token ids), pooled and normalised as the model
        declares (a sentence-transformers directory's modules); ``dimensions``: cut to
        that many (Matryoshka models only); ``truncate`` ("right" or "left"): an input
        over the model's length is cut on that side instead of refused; ``prompt_name``:
        one of the model's prompts (e.g. "query") put before each text."""
        self._check_runner(PoolingEngine, "embed")
        out = self._pool(PoolingTask("embed", _listed(inputs), dimensions=dimensions,
                                     truncate=truncate, prompt_name=prompt_name))
        return [EmbeddingOutput(v.tolist(), n) for v, n in zip(out.result, out.item_tokens)]

    def score(self, query: Union[str, list[int]], documents: list[Union[str, list[int]]],
              truncate: str | None = None) -> list[ScoringOutput]:
        """Each document's relevance to ``query``: a cross-encoder's score of the pair (its
        activation applied, sentence-transformers' sigmoid for one label), or an
        embedder's cosine similarity (``num_tokens``: the document's)."""
        self._check_runner(PoolingEngine, "score")
        out = self._pool(PoolingTask("score", _listed(documents), query=query,
                                     truncate=truncate))
        tokens = out.item_tokens[-len(out.result):]  # an embedder's first is the query's
        return [ScoringOutput(s, n) for s, n in zip(out.result, tokens)]

    def classify(self, inputs: list[Union[str, list[int]]], truncate: str | None = None
                 ) -> list[ClassificationOutput]:
        """Each input's class probabilities, by the model's ``id2label`` order."""
        self._check_runner(PoolingEngine, "classify")
        out = self._pool(PoolingTask("classify", _listed(inputs), truncate=truncate))
        return [ClassificationOutput(p, n) for p, n in zip(out.result, out.item_tokens)]

    def _pool(self, task: PoolingTask):
        """One pooling request through the engine's queue, to its output."""
        rid = f"pool-{id(task)}"
        self.engine.add_request(rid, self.engine.prepare(task))
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    return out

    def _check_runner(self, kind: type, task: str) -> None:
        if not isinstance(self.engine, kind):
            other = "a model that pools (runner='pooling')" if kind is PoolingEngine else \
                "a model that generates (runner='generate')"
            raise InvalidRequestError("task", f"{task} needs {other}; this LLM's model "
                                      f"{'pools' if kind is Engine else 'generates'}")

    def _reasoning_parser(self):
        name = reasoning.parser_name(self.engine.config.reasoning_parser, self.engine.hf_config)
        return None if name is None else self.engine.plugins.create("reasoning_parser", name)

    def _split_reasoning(self, prompt: str, out) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls in its reasoning format) of a chat output, as a
        worker splits it."""
        parser = self._reasoning_parser()
        if parser is None:
            return "", out.text, []
        stream = reasoning.stream_for(parser, self.tokenizer, parser.opened(prompt))
        thought, content = stream.feed(out.text, out.token_ids)
        more_thought, more_content = stream.finish()
        return thought + more_thought, content + more_content, stream.calls

    def _drive(self, total: int, use_tqdm: bool) -> Iterable[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="samples", unit="sample")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    if bar is not None:
                        bar.update()
                    yield out
        if bar is not None:
            bar.close()


def _listed(inputs) -> list:
    if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)) or (
            inputs and isinstance(inputs[0], int)):
        raise TypeError("inputs must be a list: [\"text\", ...] or [[ids], ...]")
    return list(inputs)


def llm_from_args(args) -> LLM:
    """An LLM from the flags of ``roseinfer.core.config.engine_args_parser``."""
    import dataclasses

    config = config_from_args(args)
    llm = LLM(args.model, tokenizer=args.tokenizer, **dataclasses.asdict(config))
    for name, path in getattr(args, "lora_modules", None) or ():
        llm.add_lora(name, path)
    return llm


def _content_parts(messages: list[dict]) -> tuple[list[dict], list[bytes]]:
    """The messages as the chat template takes them, and their images' bytes in order."""
    out, images = [], []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            content, found = content_parts.parse(m["content"], f"messages[{i}].content")
            m = {**m, "content": content}
            images += [data for data, _ in found]
        out.append(m)
    return out, images

"""Structured output (response_format, on xgrammar) and logits-processor plugins.

The reference for a constrained greedy run is independent of xgrammar: greedy
decoding over transformers' logits, keeping at each step only the tokens whose
text leaves the output a prefix of one string of the (finite) language.
"""
import itertools
import json
import re

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.plugins import PluginRegistry
from roseinfer.models.tokenizers import gpt2_tokenizer
from tests.conftest import DEVICE
from tests.models import tiny_gpt2
from tests.test_logits import hf_logits

EOS = 50256
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                           "ok": {"type": "boolean"}},
          "required": ["answer", "ok"]}
# Every output SCHEMA allows, in the compact layout structured output writes.
LANGUAGE = [json.dumps({"answer": a, "ok": ok})
            for a, ok in itertools.product(["yes", "no", "maybe"], [True, False])]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
CODE = {"type": "regex", "pattern": "[a-z]{3}-[0-9]{2}"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return gpt2_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def hf():
    return tiny_gpt2(vocab=50257, bos_token_id=EOS, eos_token_id=EOS)


@pytest.fixture(scope="module")
def llm(hf, tok):
    return llm_for(hf, tok)


def llm_for(hf, tok, plugins=None, **config):
    return LLM(hf, tokenizer=tok, plugins=plugins, **{
        "device": DEVICE, "dtype": "float32", "block_size": 4, "num_kv_blocks": 256,
        "max_num_seqs": 8, **config})


@pytest.fixture(scope="module")
def token_texts(tok):
    return [tok.decode([t]) for t in range(50257)]


def reference(hf, token_texts, prompt, language, max_tokens):
    """Greedy over transformers' logits among the tokens that keep the text a
    prefix of a string of ``language`` (EOS once it is one)."""
    ids, text = list(prompt), ""
    for _ in range(max_tokens):
        if text in language:
            return ids[len(prompt):] + [EOS]
        allowed = [t for t, s in enumerate(token_texts) if s and t != EOS
                   and any(w.startswith(text + s) for w in language)]
        logits = hf_logits(hf, ids)[-1]
        token = allowed[int(logits[allowed].argmax())]
        ids.append(token)
        text += token_texts[token]
    return ids[len(prompt):]


def test_json_schema_greedy_equals_the_reference_beside_free_rows(llm, hf, token_texts):
    prompts = [[464, 3280, 318], [40, 892, 326, 340, 373, 257], [3673]]
    schema = SamplingParams(max_tokens=40, temperature=0, response_format=JSON_SCHEMA)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate([prompts[2]], free)[0].token_ids
    outs = llm.generate(prompts, [schema, schema, free])
    for prompt, out in zip(prompts[:2], outs):
        assert out.token_ids == reference(hf, token_texts, prompt, LANGUAGE, 40)
        assert out.text in LANGUAGE and out.finish_reason == "stop"
        json.loads(out.text)
    assert outs[2].token_ids == alone  # unconstrained rows of the batch are untouched


def test_past_the_grammar_end_a_request_ignoring_eos_repeats_it(llm):
    out = llm.generate([[464, 3280, 318]], SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, response_format=JSON_SCHEMA))[0]
    assert out.text in LANGUAGE and out.finish_reason == "length"
    ends = out.token_ids.index(EOS)
    assert out.token_ids[ends:] == [EOS] * (40 - ends)


def test_sampled_regex_outputs_match_and_seeds_repeat(llm):
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, response_format=CODE)
              for s in range(6)]
    outs = llm.generate([[11, 12, 13]] * 6, params)
    for out in outs:
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", out.text), out.text
        assert out.finish_reason == "stop"
    assert len({o.text for o in outs}) > 1, "six seeds should not all sample one code"
    again = llm.generate([[11, 12, 13]], params[3])[0]
    assert again.token_ids == outs[3].token_ids


def test_logprobs_come_from_the_masked_distribution(llm):
    out = llm.generate([[7, 8]], SamplingParams(max_tokens=20, temperature=0, logprobs=5,
                                                response_format=CODE))[0]
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", out.text)
    for lp in out.logprobs:
        assert lp.logprob > -1e9 and all(v > -1e9 for _, v in lp.top)
    # After "abc-" only digits may follow; masked ids are no alternatives.
    digits = out.logprobs[-3]
    assert {t for t, _ in digits.top} <= {t for t in range(50257) if llm.tokenizer.decode([t]).isdigit()}
    assert sum(torch.tensor([v for _, v in digits.top]).exp()) <= 1.0 + 1e-5


def test_a_resumed_request_continues_its_grammar(llm):
    first = llm.generate([[20, 21]], SamplingParams(max_tokens=20, temperature=0,
                                                    response_format=CODE))[0]
    head = first.token_ids[:2]
    eng = llm.engine
    eng.add_request("resumed", [20, 21], SamplingParams(max_tokens=20, temperature=0,
                                                        response_format=CODE), emitted_ids=head)
    ids = []
    while eng.has_unfinished():
        for o in eng.step():
            ids += o.new_token_ids
    assert head + ids == first.token_ids


def test_preemption_keeps_constrained_outputs(hf, tok, llm):
    prompts = [[30 + i, 40 + i, 50 + i] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, response_format=JSON_SCHEMA)
    tight = llm_for(hf, tok, num_kv_blocks=20)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0, "the pool should have forced preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    assert tight.engine.blocks.num_free == 20 and not tight.engine.seqs


@pytest.mark.parametrize("fmt, says", [
    ({"type": "xml"}, "type is one of"),
    ({"type": "json_schema", "json_schema": {"type": "object"}}, 'under "schema"'),
    ({"type": "regex", "pattern": "(unclosed"}, "cannot compile its regex"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "cannot compile"),
])
def test_bad_formats_are_refused_by_name(llm, fmt, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as e:
        llm.engine.add_request("bad", [1, 2], SamplingParams(response_format=fmt))
    assert e.value.field == "response_format"
    assert "bad" not in llm.engine.seqs


def test_text_format_is_free_text():
    assert SamplingParams(response_format={"type": "text"}).response_format is None


def test_a_model_without_tokenizer_refuses_structured_output(gpt2_model):
    llm = LLM(gpt2_model, device="cpu", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate([[1, 2]], SamplingParams(response_format=CODE))


class BanTokens:
    """An outside logits processor: the ids in its args can never be sampled."""
    applied = 0

    def __init__(self, ctx):
        self.vocab = ctx.vocab_size

    def start(self, args, prompt_ids):
        if not isinstance(args, dict) or not all(0 <= t < self.vocab for t in args.get("ids", [])):
            raise ValueError("takes {'ids': [token ids below the vocabulary size]}")
        return BanState(args["ids"])

    def apply(self, logits, rows, states):
        BanTokens.applied += 1
        for row, state in zip(rows, states):
            logits[row, state.ids] = float("-inf")


class BanState:
    def __init__(self, ids):
        self.ids, self.seen = ids, []

    def accept(self, token_ids):
        self.seen += token_ids


class BanPlugin:
    @hookimpl
    def roseinfer_register_logits_processors(self, register):
        register("ban_tokens", BanTokens)


def test_an_outside_logits_processor_is_chosen_by_name(hf, tok):
    reg = PluginRegistry(load_entry_points=False)
    reg.register(BanPlugin(), name="outside")
    llm = llm_for(hf, tok, plugins=reg)
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], free)[0].token_ids
    banned = sorted(set(plain[:3]))
    out = llm.generate([[5, 6, 7]], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True,
        logits_processors={"ban_tokens": {"ids": banned}}))[0]
    expected, ids = [], [5, 6, 7]
    for _ in range(8):  # transformers' greedy with the same ids banned
        logits = hf_logits(hf, ids)[-1]
        logits[banned] = float("-inf")
        ids.append(int(logits.argmax()))
    assert out.token_ids == ids[3:] and not set(banned) & set(out.token_ids)
    assert BanTokens.applied >= 8
    (_, state), = out.seq.constraints
    assert state.seen == out.token_ids
    with pytest.raises(InvalidRequestError, match="takes") as e:
        llm.engine.add_request("x", [1], SamplingParams(logits_processors={"ban_tokens": 3}))
    assert e.value.field == "logits_processors"
    with pytest.raises(InvalidRequestError, match="ban_tokens, xgrammar"):
        llm.engine.add_request("y", [1], SamplingParams(logits_processors={"nope": {}}))


class Script:
    """Forces a given text's tokens first (then leaves the logits alone): a model that
    thinks before it answers, for the answer gate below."""

    def __init__(self, ctx):
        self.tokenizer = ctx.tokenizer

    def start(self, args, prompt_ids):
        return ScriptState(self.tokenizer.encode(args))

    def apply(self, logits, rows, states):
        for row, state in zip(rows, states):
            if state.at < len(state.ids):
                keep = logits[row, state.ids[state.at]].clone()
                logits[row] = float("-inf")
                logits[row, state.ids[state.at]] = keep


class ScriptState:
    def __init__(self, ids):
        self.ids, self.at = ids, 0

    def accept(self, token_ids):
        self.at += len(token_ids)


class ScriptPlugin:
    @hookimpl
    def roseinfer_register_logits_processors(self, register):
        register("script", Script)


@pytest.mark.parametrize("inside", [False, True], ids=["writes-the-tag", "prompt-opened"])
def test_a_reasoning_models_answer_is_constrained_not_its_thinking(hf, tok, inside):
    """With an answer gate (a reasoning parser's, core/reasoning.py) the grammar waits for
    </think>: the thinking is free (here scripted), the answer matches the pattern. An
    output that opens the tag itself may (the tag's first token kept beside the
    grammar's), or may answer at once, constrained from its first token."""
    from roseinfer.core.reasoning import answer_gate
    reg = PluginRegistry(load_entry_points=False)
    reg.register(ScriptPlugin(), name="script")
    llm = llm_for(hf, tok, plugins=reg)
    parser = reg.create("reasoning_parser", "qwen3")
    thinking = ("" if inside else "<think>") + "Let me see.</think>"
    out = llm.generate([[5, 6, 7]], SamplingParams(
        max_tokens=24, temperature=0, response_format=CODE, logits_processors={"script": thinking},
        answer_gate=answer_gate(parser, tok, inside)))[0]
    assert out.text.startswith(thinking) and re.fullmatch(CODE["pattern"], out.text[len(thinking):])
    assert out.finish_reason == "stop"
    if not inside:  # no thinking at all: the grammar from the first token
        free = llm.generate([[5, 6, 7]], SamplingParams(
            max_tokens=24, temperature=0, response_format=CODE,
            answer_gate=answer_gate(parser, tok, False)))[0]
        assert re.fullmatch(CODE["pattern"], free.text)

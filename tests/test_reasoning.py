"""Reasoning split from the answer (core/reasoning.py, plugins/reasoning_parsers.py): at
every chunk boundary the pieces reassemble the output without its tags, and no tag's
characters leak into either."""
import itertools

import pytest

from roseinfer.core.plugins import PluginRegistry
from roseinfer.core.reasoning import ReasoningStream, parser_name

REGISTRY = PluginRegistry(load_entry_points=False)
# (output, opened by the prompt) -> (reasoning, content)
CASES = {
    ("<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", False):
        ("\nLet me see: 2 + 2.\n", "\n\nIt is 4."),
    ("It is 4.", False): ("", "It is 4."),                       # enable_thinking off
    ("<thin", False): ("", "<thin"),                              # cut short: not a tag
    ("a</think>b", False): ("", "a</think>b"),                    # never opened: all answer
    ("\nso 4\n</think>\n\n4", True): ("\nso 4\n", "\n\n4"),      # the template opened it
    ("<think>x</think>y", True): ("x", "y"),                      # opened, and written again
    ("still thinking </thi", True): ("still thinking </thi", ""),  # max_tokens mid-tag
    ("x</think>y</think>z", True): ("x", "y</think>z"),           # only the first closes
    ("</think>", True): ("", ""),
    ("<think></think>", False): ("", ""),
    ("<<think>>", False): ("", "<<think>>"),
}


def split(parser, text, inside, cuts):
    stream, reasoning, content = ReasoningStream(parser, inside), "", ""
    for a, b in zip((0,) + cuts, cuts + (len(text),)):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("case", list(CASES), ids=[repr(c[0][:12]) for c in CASES])
def test_every_split_point_gives_the_same_pieces(name, case):
    text, inside = case
    parser = REGISTRY.create("reasoning_parser", name)
    for n in range(3):  # up to three chunk boundaries anywhere, and one chunk a character
        for cuts in itertools.combinations(range(1, len(text)), n):
            assert split(parser, text, inside, cuts) == CASES[case], cuts
    assert split(parser, text, inside, tuple(range(1, len(text)))) == CASES[case]


def test_pieces_are_streamed_as_they_come():
    """Reasoning goes out before the answer starts; only a tag's possible start waits."""
    stream = ReasoningStream(REGISTRY.create("reasoning_parser", "qwen3"), False)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>one two") == ("one two", "")
    assert stream.feed(" three</") == (" three", "")
    assert stream.feed("think>Four") == ("", "Four")
    assert stream.feed(" five") == ("", " five")
    assert stream.finish() == ("", "")


def test_which_prompts_open_the_reasoning():
    qwen3 = REGISTRY.create("reasoning_parser", "qwen3")
    assert qwen3.opened("<|im_start|>assistant\n<think>\n")
    assert not qwen3.opened("<|im_start|>assistant\n")
    assert not qwen3.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert REGISTRY.create("reasoning_parser", "deepseek_r1").opened("<｜Assistant｜>")


def test_parser_names():
    class Config:
        model_type = "qwen3"
    assert parser_name("auto", Config) == "qwen3"
    assert parser_name("auto", None) is None
    assert parser_name("none", Config) is None
    assert parser_name("deepseek_r1", None) == "deepseek_r1"


def test_llm_chat_splits_the_reasoning_then_finds_calls_in_the_answer(monkeypatch):
    """LLM.chat with a reasoning parser (the output scripted: the default model writes no
    tags): the thinking apart, and a tool call found in the answer alone, though the
    thinking wrote one too."""
    from types import SimpleNamespace

    from roseinfer import LLM

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    text = ('<think>Call {"name": "get_time", "parameters": {}}? No.</think>\n'
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    with LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=64,
             cpu_compiled_step="off", reasoning_parser="qwen3") as llm:
        prompts = []
        monkeypatch.setattr(llm, "generate", lambda p, params: prompts.append(p[0]) or [
            SimpleNamespace(text=text, token_ids=[], finish_reason="stop")])
        out = llm.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=[weather],
                       chat_template_kwargs={"enable_thinking": False})
    assert out.reasoning == 'Call {"name": "get_time", "parameters": {}}? No.'
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    assert out.finish_reason == "tool_calls" and prompts[0].endswith("assistant\n")


HARMONY = {
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant"
    "<|channel|>final<|message|>It is 4 ✓.<|return|>": ("User asks 2+2. Easy.", "It is 4 ✓.", []),
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}"
    "<|call|>": ("Need the weather.", "", [("get_weather", '{"city": "Oslo"}')]),
    "<|channel|>analysis<|message|>Cut sh": ("Cut sh", "", []),   # max_tokens mid-thought
    "<|channel|>final<|message|>Hi": ("", "Hi", []),
}


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    """GPT-2's tokenizer with harmony's special tokens, as gpt-oss's has them."""
    from roseinfer.models.tokenizers import gpt2_tokenizer
    from roseinfer.plugins.reasoning_parsers import HarmonyStream
    tokenizer = gpt2_tokenizer(str(tmp_path_factory.mktemp("tokenizer-cache")))
    tokenizer.add_special_tokens({"additional_special_tokens": list(HarmonyStream.SPECIALS)})
    return tokenizer


@pytest.mark.parametrize("text", list(HARMONY), ids=[t[30:50] for t in HARMONY])
def test_harmony_channels_at_every_split(harmony_tokenizer, text):
    """gpt_oss: the analysis channel is reasoning, final the answer, commentary to a
    function a call; at any token boundaries, and through multi-byte characters."""
    from roseinfer.core.reasoning import stream_for
    parser = REGISTRY.create("reasoning_parser", "gpt_oss")
    ids = harmony_tokenizer.encode(text)
    want = HARMONY[text]
    for n in range(3):
        for cuts in itertools.chain(itertools.combinations(range(1, len(ids)), n),
                                    [tuple(range(1, len(ids)))]):
            stream, got = stream_for(parser, harmony_tokenizer, False), ["", ""]
            for a, b in zip((0,) + cuts, cuts + (len(ids),)):
                piece = ids[a:b]
                pair = stream.feed(harmony_tokenizer.decode(piece, skip_special_tokens=True), piece)
                got = [g + p for g, p in zip(got, pair)]
            got = [g + p for g, p in zip(got, stream.finish())]
            assert (*got, [(c.name, c.arguments) for c in stream.calls]) == want, cuts

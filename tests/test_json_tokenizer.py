"""JsonTokenizer (models/json_tokenizer.py) against transformers' tokenizer of the same
files: the same ids, texts and chat prompts, without importing transformers."""
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from roseinfer.models import json_tokenizer
from tests.test_smollm2 import QUESTION

TEXTS = ["What is the capital of France?", "  leading and trailing  ", "naïve café — 東京 🙂",
         "line one\nline two\ttab", "<|im_start|>user\nhi<|im_end|>", "don't stop , now !", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]
# Loop controls, namespace, tojson, raise_exception and the special tokens, as templates use them.
TEMPLATE = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role') }}{% endif %}"
            "{% if m['role'] == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
            "<{{ m['role'] }} {{ ns.n }}>{{ m['content'] | tojson }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def _tokenizer_dir(tmp_path, template=TEMPLATE, **settings):
    tmp_path.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20 + [c["content"] for cs in CONVERSATIONS for c in cs],
                            trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>",
              "chat_template": template, **settings}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _assert_same(path, mine):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    assert mine.eos_token_id == hf.eos_token_id is not None
    assert mine.get_vocab() == hf.get_vocab() and len(mine) == len(hf)
    for text in TEXTS:
        assert mine.encode(text) == hf.encode(text), text
        assert mine.encode(text, add_special_tokens=False) == \
            hf.encode(text, add_special_tokens=False), text
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(hf.get_vocab())) for _ in range(rng.randrange(1, 12))]
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip), ids
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            assert mine.apply_chat_template(conversation, tokenize=False,
                                            add_generation_prompt=prompt) == \
                hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)


def test_a_tokenizer_json_encodes_decodes_and_chats_as_transformers(tmp_path):
    path = _tokenizer_dir(tmp_path)
    mine = json_tokenizer.load(path)
    assert isinstance(mine, json_tokenizer.JsonTokenizer)
    _assert_same(path, mine)
    with pytest.raises(Exception, match="unknown role"):
        mine.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tokenizers_that_transformers_reads_differently_are_left_to_it(tmp_path):
    assert json_tokenizer.load(_tokenizer_dir(tmp_path / "a", add_bos_token=True)) is None
    assert json_tokenizer.load(_tokenizer_dir(tmp_path / "b", tokenizer_class="LlamaTokenizerFast")) \
        is None
    assert json_tokenizer.load(_tokenizer_dir(tmp_path / "c", clean_up_tokenization_spaces=True)) \
        is None
    named = [{"name": "default", "template": TEMPLATE}]
    assert json_tokenizer.load(_tokenizer_dir(tmp_path / "d", template=named)) is None
    assert json_tokenizer.load(str(tmp_path)) is None  # no tokenizer files at all


def test_what_it_does_not_render_itself_is_rendered_by_transformers(tmp_path):
    """A template with transformers' own {% generation %} tag, and a call with tools."""
    template = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}" \
               "{% endfor %}{% if tools %}{{ tools | length }}{% endif %}"
    path = _tokenizer_dir(tmp_path, template=template)
    mine = json_tokenizer.load(path)
    conversation = CONVERSATIONS[1]
    assert mine.apply_chat_template(conversation) == "Be brief.HiHello!Bye"
    assert mine.apply_chat_template(conversation, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]) == \
        "Be brief.HiHello!Bye1"
    assert mine.model_max_length == mine.hf.model_max_length  # any other attribute: transformers'
    assert mine("Hi Bye")["input_ids"] == mine.hf("Hi Bye")["input_ids"]


@pytest.mark.slow
def test_the_default_model_has_one_and_generates_without_transformers():
    import subprocess
    import sys

    from roseinfer.models.loader import ALIASES, _converted_gguf

    path = _converted_gguf(ALIASES["SmolLM2-135M-Instruct"]())
    mine = json_tokenizer.load(path)
    assert mine is not None
    _assert_same(path, mine)
    code = ("import sys; from roseinfer.cli import main; "
            f"main(['generate', {QUESTION!r}, '--max-tokens', '8', "
            "'--num-kv-blocks', '64']); print('transformers' in sys.modules)")
    # The first run on a fresh cache builds the GGUF blocks' cache (models/gguf_blocks.py),
    # which reads the file's layout through transformers; the runs after it do not.
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
        assert "Paris" in out.stdout, out.stdout + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr[-2000:]

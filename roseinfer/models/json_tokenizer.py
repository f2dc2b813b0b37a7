"""A model's tokenizer.json run by the `tokenizers` library alone, for a fast start.

A transformers tokenizer costs a process its transformers import and AutoTokenizer's
setup: about 3 s of `roseinfer generate`'s start on 2 cores (docs/benchmarks.md). What
generation needs of a tokenizer (encode, decode, the EOS id, the vocabulary, the Rust
tokenizer for streaming, one conversation through the chat template) is here, with
transformers' semantics: ``TokenizersBackend`` and ``PreTrainedTokenizerFast`` run the
file as it is, and the chat template renders in the same sandboxed jinja2 environment.
Everything else (structured output's grammar compiler, chat requests with tools, any
other attribute) goes to the transformers tokenizer, loaded on first use as ``hf``.
"""
from __future__ import annotations

import json
import os
import threading
from datetime import datetime
from typing import Optional

# The tokenizer classes that are tokenizer.json as it is: others (LlamaTokenizerFast,
# say) rebuild parts of it from tokenizer_config.json's flags.
AS_IS_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")  # what transformers hands a chat template


def load(path: str) -> Optional["JsonTokenizer"]:
    """The directory's tokenizer as a JsonTokenizer, or None where transformers would
    read it differently than the file says (or clean up the spaces of decoded text)."""
    settings = _read_json(os.path.join(path, "tokenizer_config.json"))
    if settings is None or not os.path.exists(os.path.join(path, "tokenizer.json")):
        return None
    as_is = settings.get("tokenizer_class") in AS_IS_CLASSES and \
        not settings.get("clean_up_tokenization_spaces") and \
        not {"add_bos_token", "add_eos_token"} & set(settings) and \
        isinstance(settings.get("chat_template", ""), str)  # not a list of named templates
    return JsonTokenizer(path, settings) if as_is else None


class JsonTokenizer:
    def __init__(self, path: str, settings: dict):
        from tokenizers import Tokenizer

        self.path = path
        self.backend_tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.special_tokens_map = {k: _content(settings[k]) for k in SPECIAL_TOKENS
                                   if settings.get(k) is not None}
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = None if eos is None else self.backend_tokenizer.token_to_id(eos)
        self.chat_template = settings.get("chat_template") or _read_text(
            os.path.join(path, "chat_template.jinja"))
        self._hf, self._hf_lock = None, threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def apply_chat_template(self, conversation, tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs):
        """A conversation of plain string messages through the template, as text; any
        other call is transformers'."""
        plain = all(isinstance(m, dict) and all(isinstance(v, str) for v in m.values())
                    and set(m) <= {"role", "content"} for m in conversation)
        if self.chat_template and plain and not tokenize and not kwargs:
            import jinja2
            try:
                return _compiled(self.chat_template).render(
                    messages=[dict(m) for m in conversation],
                    add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
            except jinja2.TemplateSyntaxError:
                pass  # a tag of transformers' own ({% generation %}): rendered there
        return self.hf.apply_chat_template(conversation, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    @property
    def hf(self):
        """The transformers tokenizer of the same files (imports transformers once)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer
                self._hf = AutoTokenizer.from_pretrained(self.path)
            return self._hf

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy and pickle probe dunders: no transformers for those
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __deepcopy__(self, memo) -> "JsonTokenizer":
        # Nothing here changes as it encodes (a transformers tokenizer does, hence copies).
        return self


_templates: dict = {}


def _compiled(template: str):
    """The template compiled as transformers compiles chat templates: a sandbox, blocks
    trimmed, loop controls, and its tojson, raise_exception and strftime_now."""
    if template not in _templates:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        _templates[template] = env.from_string(template)
    return _templates[template]


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _read_json(path: str) -> Optional[dict]:
    text = _read_text(path)
    return None if text is None else json.loads(text)


def _read_text(path: str) -> Optional[str]:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()

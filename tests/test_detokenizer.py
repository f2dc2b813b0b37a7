"""Incremental detokenization against the tokenizer's own full decode."""
import pytest

from roseinfer.core.detokenizer import IncrementalDetokenizer
from roseinfer.models.loader import CACHE_DIR
from roseinfer.models.tokenizers import gpt2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer(CACHE_DIR)


def stream(tok, prompt, text, stop=()):
    """Feed ``text``'s ids one at a time; returns the released pieces and the detokenizer."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop))
    pieces = []
    for t in tok.encode(text):
        hit = detok.add(t)
        pieces.append(detok.release(final=hit))
        if hit:
            break
    else:
        pieces.append(detok.release(final=True))
    return pieces, detok


def test_multibyte_characters_never_surface_as_replacement(tok):
    text = " café 🤖 naïve 日本語 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "test needs split characters"
    pieces, _ = stream(tok, "Say:", text)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_across_token_boundaries_is_cut_and_never_released(tok):
    text = " The answer is forty-two. END OF STORY and more"
    pieces, detok = stream(tok, "Q:", text, stop=["OF STO"])
    assert "".join(pieces) == " The answer is forty-two. END "
    assert detok.text == " The answer is forty-two. END "
    assert not any("OF" in p for p in pieces)


def test_holdback_releases_everything_when_no_stop_matches(tok):
    text = " nothing to see here"
    pieces, _ = stream(tok, "x", text, stop=["zzzz"])
    assert "".join(pieces) == text

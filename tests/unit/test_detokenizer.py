"""Incremental detokenization equals a full decode, also across multi-byte UTF-8 characters
split over tokens; stop strings are found across token boundaries."""

from __future__ import annotations

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Paris est la capitale de la France — café, naïve, über.",
    "中文测试：北京是中国的首都。日本語のテキストも。",
    "Emoji 🤖🚀👍🏽 and math ∑∫√ and a tab\tnewline\n end",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode-stream", "window"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text, use_stream):
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, SamplingParams())
    assert det._stream is not None  # a fast tokenizer streams through tokenizers' DecodeStream
    if not use_stream:
        det._stream = None  # the window path, used for slow tokenizers
    pieces = []
    for t in ids:
        before = det.text
        det.update(t)
        assert det.text.startswith(before)
        pieces.append(det.text[len(before):])
        assert "\ufffd" not in det.text
    assert "".join(pieces) == tok.decode(ids) == det.text


def test_multibyte_character_held_until_complete(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    det = IncrementalDetokenizer(tok, SamplingParams())
    for t in ids[:-1]:
        det.update(t)
        assert det.text == ""
    det.update(ids[-1])
    assert det.text == "🤖"


def test_stop_string_across_tokens(tok):
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["ma del"]))
    hit = None
    for t in ids:
        hit = det.update(t)
        if hit:
            break
    assert hit == "ma del" and det.text == "alpha beta gam"


def test_visible_text_holds_back_possible_stop_prefix(tok):
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["STOPPING"]))
    for t in tok.encode("some words here"):
        det.update(t)
    assert det.visible_text(False) == det.text[: len(det.text) - 7]
    assert det.visible_text(True) == det.text

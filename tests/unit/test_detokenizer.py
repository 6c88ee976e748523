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


@pytest.fixture(scope="module")
def spaced_tok():
    """A word-level tokenizer without a decoder: `tokenizers` joins every token, special ones
    included, with a space, the case `spaces_between_special_tokens` is for."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    return fast


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode-stream", "window"])
@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(spaced_tok, spaces, use_stream):
    a, b = spaced_tok.convert_tokens_to_ids(["<a>", "<b>"])
    ids = [1, a, b, a, 2]
    det = IncrementalDetokenizer(spaced_tok, SamplingParams(skip_special_tokens=False,
                                                            spaces_between_special_tokens=spaces))
    if not use_stream:
        det._stream = None
    for t in ids:
        det.update(t)
    assert spaced_tok.decode(ids, skip_special_tokens=False) == "hello <a> <b> <a> world"
    assert det.text == ("hello <a> <b> <a> world" if spaces else "hello <a><b><a> world")
    # skipped special tokens are unaffected by the flag
    det = IncrementalDetokenizer(spaced_tok, SamplingParams(spaces_between_special_tokens=spaces))
    for t in ids:
        det.update(t)
    assert det.text == spaced_tok.decode(ids, skip_special_tokens=True)

"""The characters-per-token bound that lets the server refuse a huge prompt before tokenising it:
present only where it provably holds, and never below what a real tokenisation shows."""

from __future__ import annotations

import math

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from streamsd.server.token_bound import MAX_COMPOSITION, max_chars_per_token

TEXTS = [
    "hello world " * 50,
    "Über naïve café — 日本語 🚀 é è ê " * 20,
    "    \t\n\n  " * 40,
    "e\u0301" * 100 + "\u1100\u1161\u11a8" * 50 + "\u03a9\u0313\u0342\u0345" * 50,
    "".join(chr(c) for c in range(32, 3000, 7)),
]


def _bpe(**kw) -> Tokenizer:
    return Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, merges=[("a", "b")], **kw))


def test_byte_level_bpe_bounds_every_text(tiny_tokenizer):
    backend = tiny_tokenizer.backend_tokenizer
    bound = max_chars_per_token(backend)
    assert bound == max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    for text in TEXTS:
        assert len(backend.encode(text).ids) >= math.ceil(len(text) / bound), text[:40]


def test_composing_normalizer_widens_the_bound(tiny_tokenizer):
    backend = Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    bound = max_chars_per_token(backend)
    assert bound == MAX_COMPOSITION * max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    for text in TEXTS:
        assert len(backend.encode(text).ids) >= math.ceil(len(text) / bound)


def test_tokenizers_that_can_drop_or_fold_characters_have_no_bound():
    whitespace = _bpe(unk_token="[UNK]")
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    stripping = _bpe(unk_token="[UNK]")
    stripping.normalizer = normalizers.Strip()
    fused = _bpe(unk_token="[UNK]", fuse_unk=True)
    no_unk = _bpe()  # drops characters it does not know
    wordpiece = Tokenizer(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    for tok in (whitespace, stripping, fused, no_unk, wordpiece):
        assert max_chars_per_token(tok) is None
    assert len(no_unk.encode("abcccccccc").ids) == 1  # why: ten characters, one token
    assert max_chars_per_token(_bpe(unk_token="[UNK]")) == 5
    assert max_chars_per_token(_bpe(byte_fallback=True, unk_token="[UNK]", fuse_unk=True)) == 5

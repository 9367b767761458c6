"""Piecewise tokenisation of rendered chats (engine/pieces.py) gives the tokenizer's own ids."""

from __future__ import annotations

import random

from tokenizers import AddedToken

from streamsd.engine.pieces import PieceCache
from tests.tiny import CORPUS, build_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FILLERS = [" ", "\n", "\n\n", "  ", "\t", "x", "é", "日本", "12", "🚀", "<|im", "|>", "<", "end|>"]


def _text(rng: random.Random, parts: int) -> str:
    out = []
    for _ in range(parts):
        kind = rng.random()
        if kind < 0.3:
            out.append(rng.choice(SPECIAL))
        elif kind < 0.6:
            out.append(rng.choice(FILLERS))
        else:
            words = rng.choice(CORPUS).split(" ")
            out.append(" ".join(words[rng.randrange(len(words)) :]))
    return "".join(out)


def test_pieces_give_the_tokenizers_ids_on_any_text():
    """Random texts of special tokens, spaces, multi-byte characters, broken token fragments and long
    repeated runs: piecewise ids equal whole-text ids, short pieces as well as cached long ones."""
    tok = build_tokenizer()
    cache = PieceCache.build(tok, min_chars=16)
    assert cache.pattern is not None and cache.backend is tok.backend_tokenizer  # pieces through tokenizers
    rng = random.Random(0)
    texts = [_text(rng, rng.randrange(1, 40)) for _ in range(300)]
    for text in texts + texts[:50]:  # the repeats come from the cache
        assert cache.encode(text) == list(tok.encode(text, add_special_tokens=False)), repr(text)
    assert cache.hits > 0


def test_a_chat_repeating_its_system_prompt_tokenises_it_once():
    tok = build_tokenizer()
    cache = PieceCache.build(tok)
    system = " ".join(CORPUS) * 3
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}?"}] for i in range(5)]
    for i, chat in enumerate(chats):
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert cache.encode(text) == list(tok.encode(text, add_special_tokens=False))
        assert cache.hits == i  # the system message's piece, from the second chat on
    assert len(cache._pieces) == 1


def test_encode_within_tokenises_only_where_few_characters_are_new():
    """A chat whose long system message was seen before is within a small budget of new characters
    (its short pieces counted as new) and gives the tokenizer's ids; the first such chat, or a long
    new message, is not, and nothing of it is tokenised or remembered."""
    tok = build_tokenizer()
    cache = PieceCache.build(tok, min_chars=64)
    system = " ".join(CORPUS) * 3
    question = [{"role": "system", "content": system}, {"role": "user", "content": "a short question?"}]
    text = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert cache.pattern is not None
    new = sum(len(p) for p in cache.pattern.split(text)[::2] if system not in p)  # the template's and the question
    assert cache.encode_within(text, 200) is None and not cache._pieces
    assert cache.encode_within(text, len(text)) == list(tok.encode(text, add_special_tokens=False))
    assert cache.encode_within(text, new - 1) is None
    assert cache.encode_within(text, new) == list(tok.encode(text, add_special_tokens=False))
    long = [{"role": "system", "content": system}, {"role": "user", "content": system[::-1]}]
    text = tok.apply_chat_template(long, tokenize=False, add_generation_prompt=True)
    assert cache.encode_within(text, 200) is None and len(cache._pieces) == 1


def test_encode_within_a_cache_that_tokenises_whole_counts_every_character():
    tok = build_tokenizer()
    tok.add_tokens([AddedToken("<tool>", lstrip=True)])
    cache = PieceCache.build(tok)
    assert cache.pattern is None
    text = "a <tool> b <|im_end|> c"
    assert cache.encode_within(text, len(text) - 1) is None
    assert cache.encode_within(text, len(text)) == list(tok.encode(text, add_special_tokens=False))


def test_the_cache_keeps_at_most_its_characters_least_recently_used_out_first():
    tok = build_tokenizer()
    cache = PieceCache.build(tok, min_chars=10, max_chars=100)
    pieces = [f"piece {i} " + "a" * 30 for i in range(6)]  # ~40 characters each
    for p in pieces:
        cache.encode(p)
    assert cache._chars <= 100 and list(cache._pieces) == pieces[-2:]
    cache.encode(pieces[4])
    cache.encode(pieces[0])
    assert list(cache._pieces) == [pieces[4], pieces[0]]


def test_short_pieces_are_kept_by_count_least_recently_used_out_first():
    """A template's short pieces (role headers, separators) recur in every request: they are kept apart
    from the long pieces, at most `short_pieces` of them, and give the tokenizer's ids."""
    tok = build_tokenizer()
    cache = PieceCache.build(tok, short_pieces=3)
    chat = [{"role": "user", "content": "a question?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    want = list(tok.encode(text, add_special_tokens=False))
    assert cache.encode(text) == want and cache.encode(text) == want
    assert 0 < cache._short_piece.cache_info().currsize <= 3 and not cache._pieces
    for p in ("one", "two", "three", "two", "four"):
        assert list(cache.encode(p)) == list(tok.encode(p, add_special_tokens=False))
    info = cache._short_piece.cache_info()
    assert info.currsize == 3
    for p in ("three", "two", "four"):  # kept: least recently used out first
        cache.encode(p)
    assert cache._short_piece.cache_info().hits == info.hits + 3
    cache.encode("one")  # evicted
    assert cache._short_piece.cache_info().misses == info.misses + 1


def test_tokenizers_whose_added_tokens_take_spaces_or_normalise_tokenise_whole():
    """An added token that strips the spaces beside it (or is matched after normalisation) is not a
    plain split point: every text is then tokenised whole."""
    for flags in (dict(lstrip=True), dict(rstrip=True), dict(normalized=True), dict(single_word=True)):
        tok = build_tokenizer()
        tok.add_tokens([AddedToken("<tool>", **flags)])
        cache = PieceCache.build(tok)
        assert cache.pattern is None, flags
        text = "a <tool> b <|im_end|> c"
        assert cache.encode(text) == list(tok.encode(text, add_special_tokens=False))

"""Tokenising a chat prompt piece by piece between its special tokens, the long pieces remembered.

A rendered chat is its messages between special tokens (`<|im_start|>system\\n...<|im_end|>`): every
request of an API client repeats its system message, and every turn of a chat repeats the turns
before it. A fast tokenizer splits its input at its added tokens before anything else and tokenises
each piece on its own (normalising, pre-tokenising and merging never cross an added token), so the
ids of a text are its pieces' ids end to end, and a piece seen before needs no second pass. That
matters where prompts are long: 2,000 tokens take 4-8 ms of a CPU core to tokenise, and 32 requests
sharing a 2,000-token system prompt spent ~250 ms of tokeniser time before their first prefill.

Each piece is tokenised by the tokenizers library's own `Tokenizer` (the fast tokenizer's backend)
rather than through transformers' `encode`, whose per-call work took ~100 us of a CPU core for a piece
of a few words: a chat's template pieces and its new message, in every request. Even so a short piece
costs ~9 us, and a chat template puts four or five in every request (role headers, separators, a
default system message): functools' LRU of SHORT_PIECES keeps them apart from the long ones. On a 2-core
EPYC, a one-message chat (a new question each time) took 89 us to tokenise without it and 47 with it;
rendered and tokenised, 138 and 95.

This holds only where the split is the whole story: every added token matched as it is written (not
after normalisation, not stripping the spaces beside it, not only as a whole word). `PieceCache.build`
checks that, and also compares piecewise and whole tokenisation of a probe text; where either fails,
every prompt is tokenised whole. Tests compare the two on many texts (tests/engine/test_pieces.py).
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from typing import Any

MIN_CHARS = 256  # shorter pieces go to the short pieces' LRU, counted by entries
SHORT_PIECES = 4096  # short pieces kept (at most ~1 MB of text)
MAX_CHARS = 4_000_000  # characters of text the cache keeps pieces of (~1M tokens of ids)


class PieceCache:
    def __init__(self, tokenizer: Any, pattern: re.Pattern[str] | None, ids: dict[str, int],
                 min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS, backend: Any = None,
                 short_pieces: int = SHORT_PIECES):
        """Use `build`; `pattern` None tokenises every text whole. `backend`: the tokenizers library's
        `Tokenizer` behind a fast `tokenizer`, which tokenises the pieces (with a `pattern` only)."""
        self.tokenizer = tokenizer
        self.backend = backend
        self.pattern = pattern
        self.ids = ids  # added token -> id
        self.min_chars, self.max_chars = min_chars, max_chars
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # least recently used first
        self._chars = 0
        self._short_piece = functools.lru_cache(maxsize=short_pieces)(self._tokenise)  # pieces under min_chars
        self._lock = threading.Lock()  # prompts are tokenised on a thread pool
        self.hits = 0

    @staticmethod
    def build(tokenizer: Any, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS,
              short_pieces: int = SHORT_PIECES) -> PieceCache:
        added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
        plain = [t for t in added.values() if not (t.lstrip or t.rstrip or t.single_word or t.normalized)]
        if not added or len(plain) != len(added):
            return PieceCache(tokenizer, None, {})
        # Longest first: at one position the regex takes the first alternative that matches, as the
        # tokenizer's own matcher takes the longest (leftmost-longest).
        contents = sorted({t.content for t in plain}, key=len, reverse=True)
        ids = {t.content: i for i, t in added.items()}
        cache = PieceCache(tokenizer, re.compile("(" + "|".join(map(re.escape, contents)) + ")"), ids, min_chars,
                           max_chars, tokenizer.backend_tokenizer, short_pieces)
        probe = "".join(f" {c}\n{c}x {c}{c}  y\t{c}" for c in contents[:8]) + " \u00e9\u4e2d 12 "
        if cache.encode(probe) != cache.whole(probe):
            return PieceCache(tokenizer, None, {})
        return cache

    def whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _tokenise(self, piece: str) -> tuple[int, ...]:
        return tuple(self.backend.encode(piece, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no special tokens added), as `whole` gives them."""
        if self.pattern is None:
            return self.whole(text)
        return self._encode_parts(self.pattern.split(text))

    def encode_within(self, text: str, new_chars: int) -> list[int] | None:
        """`encode(text)` where at most `new_chars` of its characters lie in pieces not remembered; None,
        having tokenised nothing, where more do. Short pieces count as new (their LRU cannot be asked)."""
        if self.pattern is None:
            return self.whole(text) if len(text) <= new_chars else None
        parts = self.pattern.split(text)
        with self._lock:
            new = sum(len(p) for p in parts[::2] if len(p) < self.min_chars or p not in self._pieces)
        return self._encode_parts(parts) if new <= new_chars else None

    def _encode_parts(self, parts: list[str]) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(parts):  # odd places hold the added tokens split at
            if i % 2:
                ids.append(self.ids[part])
            elif part:
                ids.extend(self._piece(part))
        return ids

    def _piece(self, text: str) -> tuple[int, ...]:
        if len(text) < self.min_chars:
            return self._short_piece(text)
        with self._lock:
            got = self._pieces.get(text)
            if got is not None:
                self._pieces.move_to_end(text)
                self.hits += 1
                return got
        ids = self._tokenise(text)
        with self._lock:
            if text not in self._pieces and len(text) <= self.max_chars:
                self._pieces[text] = ids
                self._chars += len(text)
                while self._chars > self.max_chars:
                    old, _ = self._pieces.popitem(last=False)
                    self._chars -= len(old)
        return ids

"""How many characters of a prompt one token can stand for, read once from the tokenizer.

With such a bound C, a text of n characters needs at least ceil(n / C) tokens, so a prompt too long
for the context window is refused from its length alone, before seconds of tokenising. The bound
must never refuse a prompt that would fit, so it is given only where it provably holds: every
character of the text ends up inside some token, and no token covers more than C characters.

- The vocabulary's longest token string (added tokens included) bounds what one token covers:
  a byte-level token's characters are bytes (a character is one byte or more), a Metaspace `▁`
  stands for one space, byte-fallback tokens `<0x41>` are longer than the byte they stand for.
- Normalizers may merge characters: NFC/NFKC fold at most 4 code points into one (the longest
  canonical decomposition, e.g. U+1FAF); a string Replace of p by c folds len(p) into len(c).
  Normalizers that delete (Strip, StripAccents, Bert's control-character cleaning, Precompiled
  charsmaps) void the bound.
- Pre-tokenizers that drop characters (Whitespace, WhitespaceSplit, Bert, CharDelimiterSplit, a
  Split that removes its matches) void it.
- An added token that strips the whitespace beside it (lstrip/rstrip) covers any run of it: no bound.
- The model must give every character a token of its own: BPE with byte fallback, or with an
  unknown token it does not fuse into runs, or whose vocabulary holds the whole byte-level
  alphabet behind a ByteLevel pre-tokenizer (a BPE with no unknown token silently drops
  characters it lacks); Unigram with byte fallback. WordPiece and WordLevel map a whole word to
  one unknown token: no bound.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

MAX_COMPOSITION = 4  # code points NFC/NFKC fold into one character, at most
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"})
EXPANDING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})  # never fold characters together


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """C as above, or None when this tokenizer admits no such bound."""
    spec = json.loads(tokenizer.to_str())
    fold = _normalizer_fold(spec.get("normalizer"))
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    if fold is None or pre is None:
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not _covers_every_character(spec["model"], vocab, byte_level="ByteLevel" in pre):
        return None
    return max(len(t) for t in vocab) * fold


def _normalizer_fold(n: dict[str, Any] | None) -> int | None:
    """How many input characters one normalized character may stand for; None if it may delete."""
    if n is None:
        return 1
    kind = n["type"]
    if kind == "Sequence":
        fold = 1
        for part in n["normalizers"]:
            f = _normalizer_fold(part)
            if f is None:
                return None
            fold *= f
        return fold
    if kind in EXPANDING_NORMALIZERS:
        return 1
    if kind in ("NFC", "NFKC"):
        return MAX_COMPOSITION
    if kind == "Replace" and "String" in n["pattern"] and n["content"]:
        return max(1, math.ceil(len(n["pattern"]["String"]) / len(n["content"])))
    return None


def _pre_tokenizers(p: dict[str, Any] | None) -> set[str] | None:
    """The pre-tokenizers' kinds when none drops characters, else None."""
    if p is None:
        return set()
    if p["type"] == "Sequence":
        kinds: set[str] = set()
        for part in p["pretokenizers"]:
            sub = _pre_tokenizers(part)
            if sub is None:
                return None
            kinds |= sub
        return kinds
    if p["type"] not in KEEPING_PRE_TOKENIZERS or (p["type"] == "Split" and p.get("behavior") == "Removed"):
        return None
    return {p["type"]}


def _covers_every_character(model: dict[str, Any], vocab: dict[str, int], byte_level: bool) -> bool:
    if model.get("byte_fallback"):
        return model["type"] in ("BPE", "Unigram")
    if model["type"] != "BPE":
        return False
    if byte_level and all(c in vocab for c in ByteLevel.alphabet()):
        return True
    return model.get("unk_token") is not None and not model.get("fuse_unk")

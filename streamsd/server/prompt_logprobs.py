"""The prompt's part of a completion choice's logprobs, with `echo` and `logprobs` (as vLLM and
OpenAI answer): one entry per prompt token, the first with no logprob (nothing precedes it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def prompt_logprobs(decode: Callable[[list[int]], str], ids: list[int],
                    scored: list[tuple[float, list[tuple[int, float]]]]) -> dict[str, list[Any]]:
    """`scored`: prompt token i + 1's (logprob, top alternatives) from the engine (RequestOutput)."""
    texts = [decode([t]) for t in ids]
    offsets, at = [], 0
    for text in texts:  # where each token starts in the echoed text, counted over the tokens' own texts
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [None, *(lp for lp, _ in scored)],
        "top_logprobs": [None, *(by_text(decode, top) for _, top in scored)],
        "text_offset": offsets,
    }


def by_text(decode: Callable[[list[int]], str], top: list[tuple[int, float]]) -> dict[str, float]:
    """Alternatives (best first) keyed by their text: of ids that decode alike, the likeliest's logprob."""
    out: dict[str, float] = {}
    for i, v in top:
        out.setdefault(decode([i]), v)
    return out

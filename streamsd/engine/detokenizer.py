"""Incremental detokenisation with stop strings, token by token.

Text is released only when it is final: never half of a multi-byte character (the decoder's
replacement character means "wait for more bytes"), and never a suffix that could still be the
start of a stop string. Each released token keeps the slice of text it produced, so provenance
(draft or target) survives down to the browser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamsd.model.tokenizer import Tokenizer

PROMPT_CONTEXT = 6  # prompt tokens decoded ahead of the output so leading spaces come out right


@dataclass(slots=True)
class TokenInfo:
    id: int
    text: str
    draft: bool
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class _Pending:
    info: TokenInfo
    end: int  # offset in the full text where this token's text ends


@dataclass(slots=True)
class Detokenizer:
    decode: Callable[[list[int]], str]
    stops: list[str]
    ids: list[int]
    prefix_offset: int
    read_offset: int
    text: str = ""
    released: int = 0
    pending: list[_Pending] = field(default_factory=list)
    stopped: bool = False

    @staticmethod
    def for_prompt(tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str]) -> Detokenizer:
        tail = prompt_ids[-PROMPT_CONTEXT:]
        return Detokenizer(tokenizer.text_decoder(), stops, list(tail), 0, len(tail))

    def add(self, token: TokenInfo) -> None:
        """Decode one more token; its text may be empty until a character completes."""
        self.ids.append(token.id)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            token.text = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        else:
            token.text = ""
        self.text += token.text
        self.pending.append(_Pending(token, len(self.text)))

    def release(self, final: bool) -> tuple[str, list[TokenInfo]]:
        """Text and tokens that are now certain; `final` flushes what was held back."""
        limit = len(self.text)
        hit = self._find_stop()
        if hit is not None:
            limit, self.stopped = hit, True
        elif not final:
            limit -= self._held_back()
        out: list[TokenInfo] = []
        start = self.released
        while self.pending and (self.pending[0].end <= limit or self.stopped or final):
            p = self.pending.pop(0)
            begin = p.end - len(p.info.text)
            if begin >= limit and self.stopped:
                self.pending.clear()  # tokens wholly after the stop string are dropped
                break
            p.info.text = p.info.text[: max(0, limit - begin)]
            out.append(p.info)
        self.released = max(self.released, limit) if not self.stopped else limit
        return self.text[start : self.released], out

    def _find_stop(self) -> int | None:
        found = [i for s in self.stops if (i := self.text.find(s, max(0, self.released - len(s) + 1))) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest suffix of the unreleased text that begins some stop string."""
        tail = self.text[self.released :]
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:n]):
                    best = n
                    break
        return best

"""N-gram prompt lookup: find the latest earlier occurrence of the longest recent n-gram in
prompt + output and propose the tokens that followed it. q is one-hot; costs no GPU work.

Each request keeps an index of its n-grams (`NgramIndex`, in `Request.draft_state`), built lazily:
only a step that asks the request for drafts brings it up to date, over the tokens since its last
draft. A request the policy keeps plain costs the proposer nothing, and one that drafts pays per new
token, not a scan of its whole context per step.
"""

from __future__ import annotations

from streamsd.spec_decode.proposer import Proposal, ProposeItem, Proposer

WINDOW = 4096  # tokens back that a match may start


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int, window: int = WINDOW) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    if k <= 0:
        return []
    seq = tokens[-window:]
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = seq[size - n :]
        # Scan backwards so the most recent occurrence wins; it best predicts what comes next.
        for start in range(size - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                follow = seq[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramIndex:
    """One request's n-grams of each length in [n_min, n_max], each mapped to where its latest
    occurrence ends. `lookup` answers what `ngram_lookup` answers for the same tokens, which may only
    have grown since the last call (a request's tokens are appended to, never rewritten)."""

    __slots__ = ("n_max", "n_min", "window", "ends", "indexed")

    def __init__(self, n_max: int, n_min: int, window: int = WINDOW):
        self.n_max, self.n_min, self.window = n_max, n_min, window
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        # Occurrences ending at or before this position are indexed (-1: none). The one ending at the
        # last token is the suffix itself, whose match must lie before it: it is indexed a token later.
        self.indexed = -1

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        size = len(tokens)
        if size - 1 < self.indexed:  # fewer tokens than indexed: not this request's sequence any more
            self.ends = {n: {} for n in self.ends}
            self.indexed = -1
        self._catch_up(tokens, size - 1)
        lo = max(size - self.window, 0)  # the first position a match may start at
        for n in range(min(self.n_max, size - lo - 1), self.n_min - 1, -1):
            end = self.ends[n].get(tuple(tokens[size - n :]))
            if end is not None and end - n >= lo:
                return tokens[end : end + k]
        return []

    def _catch_up(self, tokens: list[int], upto: int) -> None:
        """Indexes the n-grams ending after `indexed` and at or before `upto`, oldest first, so that
        the latest occurrence of each wins."""
        for n, ends in self.ends.items():
            for end in range(max(self.indexed + 1, n), upto + 1):
                ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto)


class NgramProposer(Proposer):
    may_propose_fewer = True  # no earlier occurrence of the suffix: no draft

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        proposals = []
        for it in items:
            index = it.request.draft_state
            if index is None:
                index = it.request.draft_state = NgramIndex(self.n_max, self.n_min)
            proposals.append(Proposal(index.lookup(it.tokens, it.k), 0))
        return proposals

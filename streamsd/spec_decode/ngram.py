"""N-gram prompt lookup: find the latest earlier occurrence of the longest recent n-gram in
prompt + output and propose the tokens that followed it. q is one-hot; costs no GPU work."""

from __future__ import annotations

from streamsd.spec_decode.proposer import Proposal, ProposeItem, Proposer


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int, window: int = 4096) -> list[int]:
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


class NgramProposer(Proposer):

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        return [Proposal(ngram_lookup(it.tokens, it.k, self.n_max, self.n_min), 0) for it in items]

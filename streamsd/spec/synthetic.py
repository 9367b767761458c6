"""SYNTHETIC ACCEPTANCE — a benchmarking proposer, not a way to speed anything up.

It proposes the target's own greedy continuation, each draft independently corrupted with
probability 1 - alpha, so that at temperature 0 every draft is accepted with probability alpha
given the ones before it: exactly the i.i.d. model behind the analytic speedup
(1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)). It measures the system (verify cost, rejection
sampling, scheduling, graphs, host overhead) at a chosen acceptance, independent of any draft
model's quality — which is the only way to measure speculation on random-weight models.

Where the continuation comes from (no peeking at the step being verified): the caller runs the
target greedily ahead first — the benchmark's plain-decoding pass over the same prompts — and
hands the outputs in as the oracle. Verification stays the real, lossless one: a draft the
oracle got wrong is simply rejected. If the target's bf16 numerics in the verify shape pick a
different token than the oracle pass did (a near-tie), the oracle no longer matches the history;
from there the proposer proposes corrupted tokens only and counts a `desync`, so measured
acceptance falls below alpha and says so. The benchmark re-records the oracle from a warm-up spec
pass to make that rare.

Drafting cost: with an `inner` proposer (a draft model) its full work runs every step — cache
catch-up and k draft steps — and only its tokens are replaced, so the draft cost ratio c is the
real one; without it drafting is free (c = 0). Corruption is a pure function of (request seed,
position), so two passes over the same prompts propose the same drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamsd.spec.base import Proposal, ProposeItem, Proposer

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@dataclass(slots=True)
class _Track:
    checked: int = 0  # output tokens compared with the oracle so far
    in_sync: bool = True


@dataclass(slots=True)
class SyntheticCounters:
    proposed: int = 0
    kept: int = 0  # drafts equal to the oracle token
    desyncs: int = 0  # requests whose history left the oracle


@dataclass
class SyntheticProposer:
    oracle: dict[tuple[int, ...], list[int]]  # prompt ids -> the target's greedy continuation
    alpha: float
    vocab: int
    inner: Proposer | None = None
    counters: SyntheticCounters = field(default_factory=SyntheticCounters)
    _tracks: dict[str, _Track] = field(default_factory=dict)
    dense = False  # drafts are one-hot

    @property
    def keeps_cache(self) -> bool:  # type: ignore[override]
        return bool(self.inner is not None and self.inner.keeps_cache)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        inner = self.inner.propose(items) if self.inner is not None else [Proposal([], 0) for _ in items]
        out = []
        for it, prop in zip(items, inner, strict=True):
            drafts = self._drafts(it) if it.k > 0 else []
            out.append(Proposal(drafts, prop.draft_computed))
        return out

    def _drafts(self, it: ProposeItem) -> list[int]:
        r = it.request
        cont = self.oracle.get(tuple(r.prompt_ids), [])
        track = self._tracks.setdefault(r.request_id, _Track())
        n_prompt = len(r.prompt_ids)
        made = len(it.tokens) - n_prompt  # output tokens known after this step
        if track.in_sync:
            for i in range(track.checked, made):
                if i >= len(cont) or it.tokens[n_prompt + i] != cont[i]:
                    track.in_sync = False
                    self.counters.desyncs += 1
                    break
            track.checked = made
        drafts = []
        for j in range(it.k):
            i = made + j
            truth = cont[i] if track.in_sync and i < len(cont) else -1
            h = _mix64(_mix64(r.seed) ^ (i + 1))
            keep = truth >= 0 and (h >> 11) * (1.0 / (1 << 53)) < self.alpha
            if keep:
                drafts.append(truth)
                self.counters.kept += 1
            else:  # any token but the oracle's: a certain rejection at temperature 0
                base = max(truth, 0)
                drafts.append((base + 1 + (h >> 7) % (self.vocab - 1)) % self.vocab)
        self.counters.proposed += len(drafts)
        return drafts

    def reset(self, oracle: dict[tuple[int, ...], list[int]]) -> None:
        """A new oracle and fresh counters for another pass (request ids may repeat across passes)."""
        self.oracle = oracle
        self.counters = SyntheticCounters()
        self._tracks.clear()

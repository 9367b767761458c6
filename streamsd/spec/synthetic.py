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
acceptance falls below alpha and says so.

Several continuations per prompt (`add`): on a random-weight model in bf16 near-ties are common,
and which token wins one depends on the GEMM shape — plain decoding, a verify of width 1 + k, a
graph bucket. With k chosen per step the shapes of one pass are not those of the next, so a single
re-recorded oracle is left again (on the H200, 62 of 64 requests at B = 64), its drafts are all
rejected and an adaptive policy learns alpha ~ 0 and stops speculating. The benchmark therefore
adds every pass's outputs (plain, then warm-up spec passes) as alternative branches: a request
follows the most recently recorded branch that agrees with its history so far and switches branch
where its history takes another recorded side of a tie; only a history outside every branch is a
desync.

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
    branches: list[list[int]]  # the prompt's recorded continuations (looked up once per request)
    seed_hash: int  # _mix64 of the request's seed: corruption hashes it with each position
    checked: int = 0  # output tokens compared with the oracle so far
    in_sync: bool = True
    branch: int = -1  # which of the prompt's continuations the history follows (-1: the newest)


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
    # prompt ids -> every recorded continuation, oldest first (see the module doc)
    _branches: dict[tuple[int, ...], list[list[int]]] = field(default_factory=dict)
    dense = False  # drafts are one-hot

    def __post_init__(self) -> None:
        self._branches = {p: [list(c)] for p, c in self.oracle.items()}

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
        # Runs serially with the GPU at every speculative step of a benchmark, for every request: the
        # per-request lookups happen once (in the track), and the history is read in place.
        r = it.request
        track = self._tracks.get(r.request_id)
        if track is None:
            branches = self._branches.get(tuple(r.prompt_ids), [[]])
            track = self._tracks[r.request_id] = _Track(branches, _mix64(r.seed), branch=len(branches) - 1)
        branches = track.branches
        cont = branches[track.branch]
        tokens, n_prompt = it.tokens, len(r.prompt_ids)
        made = len(tokens) - n_prompt  # output tokens known after this step
        if track.in_sync:
            for i in range(track.checked, made):
                if i < len(cont) and tokens[n_prompt + i] == cont[i]:
                    continue
                # Another recorded side of this tie? The newest branch that agrees with all of it.
                out = tokens[n_prompt : n_prompt + i + 1]
                other = next((b for b in range(len(branches) - 1, -1, -1)
                              if len(branches[b]) > i and branches[b][: i + 1] == out), None)
                if other is None:
                    track.in_sync = False
                    self.counters.desyncs += 1
                    break
                track.branch, cont = other, branches[other]
            track.checked = made
        drafts = []
        for j in range(it.k):
            i = made + j
            truth = cont[i] if track.in_sync and i < len(cont) else -1
            h = _mix64(track.seed_hash ^ (i + 1))
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
        self._branches = {p: [list(c)] for p, c in oracle.items()}
        self.counters = SyntheticCounters()
        self._tracks.clear()

    def add(self, oracle: dict[tuple[int, ...], list[int]]) -> None:
        """Another pass's continuations as branches (preferred from now on), and fresh counters for
        the next pass."""
        for prompt, cont in oracle.items():
            known = self._branches.setdefault(prompt, [])
            if list(cont) in known:
                known.remove(list(cont))
            known.append(list(cont))
        self.oracle = {**self.oracle, **oracle}
        self.counters = SyntheticCounters()
        self._tracks.clear()

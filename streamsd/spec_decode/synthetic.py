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
re-recorded oracle is left again (on an H200, 62 of 64 requests at B = 64), its drafts are all
rejected and an adaptive policy learns alpha ~ 0 and stops speculating. The benchmark therefore
adds every pass's outputs (plain, then warm-up spec passes) as alternative branches: a request
follows the most recently recorded branch that agrees with its history so far and switches branch
where its history takes another recorded side of a tie; only a history outside every branch is a
desync.

Drafting cost: with an `inner` proposer (a draft model) its full work runs every step — cache
catch-up and k draft steps — and only its tokens are replaced, so the draft cost ratio c is the
real one; without it drafting is free (c = 0). Corruption is a pure function of (request seed,
position), so two passes over the same prompts propose the same drafts.

Each request's drafts are a table by output index (its branch's token where kept, else the
corruption), so without an inner proposer the drafts can also be made on the device (`chain`):
one gather straight behind the rejection sampler, from the accepted counts still on the device, as
an EAGLE head's chain is queued there, so the engine can queue a speculative step ahead like a plain
one (worker/lookahead.py). The host keeps checking each history against the branches as its tokens are read
and rewrites a request's row when it switches branch or leaves them: a step already queued then
drafted from the old row, which only costs acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from streamsd.model.graphs import GraphConfig
from streamsd.request import Request
from streamsd.spec_decode.proposer import DraftModel, Proposal, ProposeItem, Proposer

_M64 = (1 << 64) - 1
_SPARE = 64  # table columns past max_tokens: drafts past a request's end are asked for, never used


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """_mix64 of each uint64 (numpy's uint64 products wrap mod 2**64, as the masks above do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(slots=True)
class _Track:
    branches: list[list[int]]  # the prompt's recorded continuations (looked up once per request)
    seed_hash: int  # _mix64 of the request's seed: corruption hashes it with each position
    checked: int = 0  # output tokens compared with the oracle so far
    in_sync: bool = True
    branch: int = -1  # which of the prompt's continuations the history follows (-1: the newest)
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [width] the draft at each index
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # [width] drafts equal to the branch's
    row: int = -1  # its row of the device table (chain)
    stale: bool = True  # the device row does not hold `drafts` yet


@dataclass(slots=True)
class SyntheticCounters:
    proposed: int = 0
    kept: int = 0  # drafts equal to the oracle token (host-drafted steps)
    desyncs: int = 0  # requests whose history left the oracle


@dataclass
class SyntheticProposer(Proposer):
    oracle: dict[tuple[int, ...], list[int]]  # prompt ids -> the target's greedy continuation
    alpha: float
    vocab: int
    inner: Proposer | None = None
    counters: SyntheticCounters = field(default_factory=SyntheticCounters)
    _tracks: dict[str, _Track] = field(default_factory=dict)
    # prompt ids -> every recorded continuation, oldest first (see the module doc)
    _branches: dict[tuple[int, ...], list[list[int]]] = field(default_factory=dict)
    _width: int = 0  # columns of every track's table
    _table: torch.Tensor | None = None  # [rows, width] on the device: the tracks' drafts (chain)
    _rows: int = 0  # rows of it handed to tracks
    chains_on_device = True  # its `chain` gathers drafts from a device table; it needs no streams

    def __post_init__(self) -> None:
        self._branches = {p: [list(c)] for p, c in self.oracle.items()}

    @property
    def keeps_cache(self) -> bool:  # type: ignore[override]
        return bool(self.inner is not None and self.inner.keeps_cache)

    def draft_model(self) -> DraftModel | None:
        return self.inner.draft_model() if self.inner is not None else None

    def enable_cuda(self, graphs: GraphConfig | None, scratch_block: int) -> None:
        if self.inner is not None:
            self.inner.enable_cuda(graphs, scratch_block)

    def capture_graphs(self, max_batch: int) -> None:
        if self.inner is not None:
            self.inner.capture_graphs(max_batch)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        # Runs serially with the GPU at every speculative step of a benchmark, for every request: the
        # per-request lookups happen once (in the track), the history is read in place, and the
        # tables of new requests are made together (one by one they took ~3 ms at B = 128).
        inner = self.inner.propose(items) if self.inner is not None else [Proposal([], 0) for _ in items]
        drafting = [it for it in items if it.k > 0]
        made = [len(it.tokens) - len(it.request.prompt_ids) for it in drafting]  # output tokens known
        tracks = [self._sync(it.request, it.tokens, len(it.request.prompt_ids), m, m + it.k)
                  for it, m in zip(drafting, made, strict=True)]
        self._fill_many([t for t in tracks if t.drafts.shape[0] < self._width])
        drafts: dict[int, list[int]] = {}
        for it, m, track in zip(drafting, made, tracks, strict=True):
            self.counters.proposed += it.k
            self.counters.kept += int(track.kept[m : m + it.k].sum())
            drafts[id(it)] = track.drafts[m : m + it.k].tolist()
        return [Proposal(drafts.get(id(it), []), prop.draft_computed) for it, prop in zip(items, inner, strict=True)]

    def _sync(self, r: Request, tokens: list[int], offset: int, made: int, reach: int) -> _Track:
        """The request's track, its history (output token i at tokens[offset + i], `made` of them
        known) checked against the branches; its table is to be made `self._width` wide (`_fill_many`)."""
        track = self._tracks.get(r.request_id)
        if track is None:
            branches = self._branches.get(tuple(r.prompt_ids), [[]])
            track = self._tracks[r.request_id] = _Track(branches, _mix64(r.seed), branch=len(branches) - 1)
        self._width = max(self._width, reach, r.params.max_tokens + _SPARE)
        if track.in_sync:
            branches, cont = track.branches, track.branches[track.branch]
            for i in range(track.checked, made):
                if i < len(cont) and tokens[offset + i] == cont[i]:
                    continue
                # Another recorded side of this tie? The newest branch that agrees with all of it.
                out = tokens[offset : offset + i + 1]
                other = next((b for b in range(len(branches) - 1, -1, -1)
                              if len(branches[b]) > i and branches[b][: i + 1] == out), None)
                if other is None:
                    track.in_sync = False
                    self.counters.desyncs += 1
                    track.drafts = track.drafts[:0]  # every draft from here on a corruption
                    break
                track.branch, cont = other, branches[other]
                track.drafts = track.drafts[:0]
            track.checked = max(track.checked, made)
        return track

    def _fill_many(self, tracks: list[_Track]) -> None:
        """Each output index's draft: the branch's token with probability alpha (a pure function of
        the request's seed and the index), else any other token, which greedy verification rejects."""
        if not tracks:
            return
        width = self._width
        i = np.arange(1, width + 1, dtype=np.uint64)  # [W]
        seeds = np.array([t.seed_hash for t in tracks], dtype=np.uint64)[:, None]  # [n, 1]
        h = _mix64_array(seeds ^ i)  # [n, W]
        truth = np.full((len(tracks), width), -1, dtype=np.int64)  # [n, W]
        for row, t in zip(truth, tracks, strict=True):
            if t.in_sync:
                cont = t.branches[t.branch][:width]
                row[: len(cont)] = cont
        keep = (truth >= 0) & ((h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < self.alpha)  # [n, W]
        corrupt = np.maximum(truth, 0) + 1 + ((h >> np.uint64(7)) % np.uint64(self.vocab - 1)).astype(np.int64)
        drafts = np.where(keep, truth, corrupt % self.vocab)  # [n, W]
        for t, d, k in zip(tracks, drafts, keep, strict=True):
            t.drafts, t.kept, t.stale = d, k, True

    @torch.inference_mode()
    def chain(self, reqs: list[Request], starts: list[int], counts: list[int], ks: list[int], tokens: torch.Tensor,
              accepted: torch.Tensor, streams: torch.Tensor | None,
              device_starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """The next drafts [B, max k] on the device, queued behind a verify whose accepted counts [B]
        are still there (the contract of EagleProposer.chain): request i verified from starts[i] (or
        device_starts[i]), so its next draft 0 is output index start + accepted + 2 - prompt length.
        None with an inner proposer (its work is what is being measured)."""
        if self.inner is not None or not reqs:
            return None
        k, dev = max(ks), accepted.device
        tracks = [self._sync(r, r.output_ids, 0, len(r.output_ids), len(r.output_ids) + k) for r in reqs]
        self._fill_many([t for t in tracks if t.drafts.shape[0] < self._width])
        table = self._device_table(tracks, dev)
        host = np.array([[t.row * self._width for t in tracks],
                         [2 - len(r.prompt_ids) + (0 if device_starts is not None else s)
                          for r, s in zip(reqs, starts, strict=True)]], dtype=np.int64)  # [2, B]
        rows, offset = torch.from_numpy(host).to(dev, non_blocking=True)  # [B], [B]
        made = offset + accepted + (device_starts if device_starts is not None else 0)  # [B] next draft 0's index
        index = (made.unsqueeze(1) + torch.arange(k, device=dev)).clamp(0, self._width - 1)  # [B, k]
        self.counters.proposed += sum(ks)
        return table.view(-1)[rows.unsqueeze(1) + index]  # [B, k]

    def _device_table(self, tracks: list[_Track], dev: torch.device) -> torch.Tensor:
        """The device table holding every track's row (grown as tracks and widths come), stale rows copied."""
        need = self._rows + sum(t.row < 0 for t in tracks)
        table = self._table
        if table is None or table.shape[0] < need or table.shape[1] < self._width or table.device != dev:
            table = self._table = torch.zeros(max(2 * need, 64), self._width, dtype=torch.int64, device=dev)
            for t in self._tracks.values():
                t.stale = True
            if table.shape[1] > self._width:
                self._width = table.shape[1]
        for t in tracks:
            if t.row < 0:
                t.row, self._rows = self._rows, self._rows + 1
        stale = [t for t in tracks if t.stale]
        if stale:  # one copy for all of them: a new batch's rows one by one took ms at B = 128
            self._fill_many([t for t in stale if t.drafts.shape[0] < self._width])
            rows = torch.tensor([t.row for t in stale], dtype=torch.int64).to(dev, non_blocking=True)  # [n]
            table[rows] = torch.from_numpy(np.stack([t.drafts for t in stale])).to(dev, non_blocking=True)  # [n, W]
            for t in stale:
                t.stale = False
        return table

    def reset(self, oracle: dict[tuple[int, ...], list[int]]) -> None:
        """A new oracle and fresh counters for another pass (request ids may repeat across passes)."""
        self.oracle = oracle
        self._branches = {p: [list(c)] for p, c in oracle.items()}
        self.counters = SyntheticCounters()
        self._tracks.clear()
        self._rows = 0

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
        self._rows = 0

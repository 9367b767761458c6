"""Verification: the target's rows of each verifying entry -> the tokens it emits this step.

Greedy rows take the target's argmax; sampled ones race warped probabilities against keyed noise;
drafts pass or fail by rejection sampling against their q (one-hot, or dense from the q pool). A
step with no drafts is plain sampling. The step's one host read happens here, after an EAGLE
head's work has been queued behind the sampler (`chain`), so its drafts come back in the same read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from streamsd.model.kv_cache import h2d
from streamsd.request import Request
from streamsd.sample.grammar import apply_masks
from streamsd.sample.greedy import row_argmax
from streamsd.sample.penalties import penalise
from streamsd.sample.rejection import VerifyInput, rejection_sample
from streamsd.sample.sampler import sample_keyed, token_logprobs
from streamsd.sample.warp import WarpParams, warp
from streamsd.sched.plan import Scheduled


@dataclass(frozen=True, slots=True)
class Verified:
    tokens: list[list[int]]  # per verifying entry, the emitted tokens
    accepted: list[int]
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    drafts: list[list[int]] | None = None  # the next drafts, when the proposer ran behind the verify (chain)


# (tokens [B, K+1], accepted [B]) on the device -> the next drafts [B, k] queued behind them, or None
Chain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class Launched:
    """A verification queued on the device, not yet read."""

    tokens: torch.Tensor  # [B, K+1] emitted tokens, -1 past each row's
    accepted: torch.Tensor  # [B]
    drafts: torch.Tensor | None  # [B, k] the next drafts, when a chain queued them
    logprobs: list


class Verifier:
    def __init__(self, q_pool: torch.Tensor | None, vocab: int, device: torch.device, launched: threading.Event,
                 coupled: bool = False):
        self.q_pool = q_pool  # [slots, K, V] dense draft distributions, or None
        # The exact mode's rule for sampled rows (`_plain_tokens`): every verified position's token is
        # the one plain decoding samples there, and a draft is accepted while it equals that token.
        self.coupled = coupled
        self.vocab = vocab
        self.device = device
        self.launched = launched  # set once a step's GPU work is queued, just before its host read
        self.rejection = rejection_sample
        self._warp_cache: dict[tuple, WarpParams] = {}
        self.graph_greedy = 0  # verifications read from the graph's greedy result (no sampler queued)
        if device.type == "cuda":
            from streamsd.kernels.sample import rejection as kernel

            self.rejection = kernel.rejection_sample  # same decisions as the reference, one launch

    def verify(self, entries: list[Scheduled], logits: torch.Tensor, chain: Chain | None = None,
               greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> Verified:
        if not entries:
            self.launched.set()  # a prompt-chunk step: nothing to read back, its work is queued
            return Verified([], [], [])
        if max(e.num_drafts for e in entries) == 0:
            return self._sample_plain([e.request for e in entries], self._rows(entries, logits, 0))
        return self.read(self.launch(entries, logits, chain, greedy=greedy))

    def _rows(self, entries: list[Scheduled], logits: torch.Tensor, k: int) -> torch.Tensor:
        """Each entry's rows of the step's logits [rows, V] as [B, K+1, V], early stops suppressed and
        penalties applied."""
        return self.adjust_rows(entries, self._per_entry(entries, logits, k))

    def _per_entry(self, entries: list[Scheduled], x: torch.Tensor, k: int) -> torch.Tensor:
        """x [rows, ...], one row per verified token of the step -> [B, K+1, ...], each entry's rows;
        padding repeats an entry's last row and is never used."""
        nd = np.array([e.num_drafts for e in entries], dtype=np.int64)  # [B]
        if (nd == k).all() and x.shape[0] == len(entries) * (k + 1):
            return x.view(len(entries), k + 1, *x.shape[1:])  # uniform steps: no gather copy
        first = np.cumsum(1 + nd) - (1 + nd)  # [B] each entry's first row
        index = first[:, None] + np.minimum(np.arange(k + 1), nd[:, None])  # [B, K+1]
        return x[h2d(torch.from_numpy(index), torch.int64, self.device)]

    def launch(self, entries: list[Scheduled], logits: torch.Tensor, chain: Chain | None = None,
               positions: torch.Tensor | None = None, draft_ids: torch.Tensor | None = None,
               greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> Launched:
        """Queues the rejection sampler (and the chain behind it). `positions` [B, K+1] and `draft_ids`
        [B, K], on the device, replace the requests' own: a verify queued before the host knows them
        (worker/lookahead.py; its entries' tokens and drafts are then a step behind; positions only matter
        to sampled rows).
        `greedy`: this step's greedy verification, already computed by its graph (tokens [B, K+1],
        accepted [B]); taken, with no sampler, when every row is greedy and nothing is suppressed."""
        dev = self.device
        reqs = [e.request for e in entries]
        k = max(e.num_drafts for e in entries)
        # Every row greedy, nothing suppressed or penalised, no log-probabilities: only the target's
        # argmax is read.
        argmax_only = all(r.params.greedy and r.params.logprobs is None and not r.params.penalised
                          and not below_min_tokens(r) for r in reqs)
        if greedy is not None and greedy[0].shape[1] > k and argmax_only:
            tokens, accepted = greedy[0][:, : k + 1], greedy[1]  # [B, K+1], [B]: past K+1 only -1
            tokens = tokens if tokens.is_contiguous() else tokens.contiguous()
            self.graph_greedy += 1
            drafts = chain(tokens, accepted) if chain is not None else None  # [B, k'] queued behind it
            return Launched(tokens, accepted, drafts, [None] * len(reqs))
        rows: torch.Tensor | None = None
        if argmax_only:
            # Taken over the step's rows as they are, then gathered, so the [B, K+1, V] copy is never
            # made (on this CPU 7 ms of a 180 ms step at 32 requests).
            target_argmax = self._per_entry(entries, row_argmax(logits), k)  # [B, K+1]
        else:
            rows = self._rows(entries, logits, k)  # [B, K+1, V]
            target_argmax = row_argmax(rows)  # [B, K+1]
        dense = [r.q_slot is not None and not r.greedy_draft and e.num_drafts > 0
                 for e, r in zip(entries, reqs, strict=True)]
        # Every per-request integer in one queued copy (each pageable copy costs ~20 us of host time),
        # field after field so that each is a contiguous slice: the Triton sampler reads raw pointers.
        # Built as Python lists and converted once: per-row numpy assignments cost ~5 us a request.
        b = len(reqs)
        fields = np.array([(r.params.greedy, r.seed, d, e.num_drafts, r.q_slot if d else 0, r.num_tokens)
                           for e, r, d in zip(entries, reqs, dense, strict=True)], dtype=np.int64).T  # [6, B]
        parts = [fields[:5].ravel()]  # greedy, seed, dense q, drafts, q slot
        if positions is None:  # a verify queued ahead brings its drafts (and, sampling, positions) along
            parts.append((fields[5][:, None] + np.arange(k + 1)).ravel())  # [B * (K+1)]
        if draft_ids is None:
            parts.append(np.array([r.draft_ids[: e.num_drafts] + [0] * (k - e.num_drafts)
                                   for e, r in zip(entries, reqs, strict=True)], dtype=np.int64).ravel())  # [B * K]
        ints = h2d(torch.from_numpy(np.concatenate(parts)), torch.int64, dev)
        row_greedy, seeds, num_drafts, q_slots = ints[:b].bool(), ints[b : 2 * b], ints[3 * b : 4 * b], ints[4 * b : 5 * b]
        at = 5 * b
        if positions is None:
            positions = ints[at : at + b * (k + 1)].view(b, k + 1)  # [B, K+1]
            at += b * (k + 1)
        if draft_ids is None:
            draft_ids = ints[at:].view(b, k)  # [B, K]
        probs = None
        if self.coupled and rows is not None and not all(r.params.greedy for r in reqs):
            target_argmax = self._plain_tokens(reqs, rows, ints[:b], seeds, positions)  # [B, K+1]
            row_greedy = torch.ones_like(row_greedy)  # accept while the draft is that token: the greedy rule
        elif rows is not None and not all(r.params.greedy for r in reqs):
            probs = warp(rows.view(-1, self.vocab), self.warp_params(reqs), reps=k + 1).view(b, k + 1, -1)  # [B, K+1, V]
        q = None
        if any(dense) and self.q_pool is not None:
            q = self.q_pool[q_slots, :k]  # [B, K, V]
        tokens, accepted = self.rejection(VerifyInput(
            target_probs=probs,
            target_argmax=target_argmax,
            draft_ids=draft_ids,
            draft_probs=q,
            dense_q=ints[2 * b : 3 * b].bool(),
            num_drafts=num_drafts,
            greedy=row_greedy,
            uniforms=None,  # drawn by the sampler itself from (seed, position): rng.py's keyed numbers
            noise=None,
            seeds=seeds,
            positions=positions,
        ))
        drafts = chain(tokens, accepted) if chain is not None else None  # [B, k'] queued behind the sampler
        logprobs = self._logprobs(reqs, rows, tokens) if rows is not None else [None] * len(reqs)
        return Launched(tokens, accepted, drafts, logprobs)

    def _plain_tokens(self, reqs: list[Request], rows: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        """rows [B, K+1, V], greedy and seeds [B] int64, positions [B, K+1] -> [B, K+1]: at every verified
        position the token a plain step samples there (`_race`: the argmax of a greedy row, else the race
        of its warped p against the noise keyed by its seed and position). Accepting drafts while they
        equal these tokens emits exactly plain decoding's tokens, so it is lossless whatever the drafts'
        q; a draft d passes with probability p(d), as rejection sampling passes a one-hot q's. With the
        exact mode's batch-invariant logits a seeded request then samples the same text with and without
        speculation."""
        b, w, vocab = rows.shape
        ints = torch.stack([greedy.repeat_interleave(w), seeds.repeat_interleave(w), positions.reshape(-1)])  # [3, B*W]
        return sample_keyed(rows.reshape(b * w, vocab), self.warp_params(reqs).repeat(w), ints).view(b, w)

    def read(self, v: Launched) -> Verified:
        """The step's one host read: tokens, accepted counts, and the chained drafts with them."""
        self.launched.set()
        parts = [v.tokens, v.accepted.unsqueeze(1)] + ([v.drafts] if v.drafts is not None else [])
        return unpack(torch.cat(parts, dim=1).tolist(), v.tokens.shape[1], v.logprobs, drafts=v.drafts is not None)

    def _sample_plain(self, reqs: list[Request], rows: torch.Tensor) -> Verified:
        """A step with no drafts is plain decoding: no rejection sampler (`sample_plain`)."""
        tokens = self._race(reqs, rows[:, 0])  # [B]
        lp = self._logprobs(reqs, rows, tokens.unsqueeze(-1))
        self.launched.set()
        host_tokens = tokens.tolist()  # the step's one host read
        logprobs = [None if x is None else x[:1] for x in lp]
        return Verified([[t] for t in host_tokens], [0] * len(reqs), logprobs)

    def sample_plain(self, entries: list[Scheduled], logits: torch.Tensor, ahead: int = 0) -> torch.Tensor:
        """[B] tokens of a plain step on the device, from its logits [B, V], `ahead` tokens past each
        request's current end (a step queued ahead: worker/lookahead.py, which never queues a penalised
        request: its penalties would count tokens the host does not know yet); no host read."""
        rows = self.adjust_rows(entries, logits.unsqueeze(1), ahead)  # [B, 1, V]
        return self._race([e.request for e in entries], rows[:, 0], ahead)

    def _race(self, reqs: list[Request], logits: torch.Tensor, ahead: int = 0) -> torch.Tensor:
        """[B] tokens from logits [B, V] whose early stops are suppressed. All-greedy steps are an
        argmax; sampled rows race with the noise the rejection sampler would use for a bonus token at
        the same position, so a seeded request's output does not depend on which path a step took."""
        if all(r.params.greedy for r in reqs):
            return row_argmax(logits)  # [B]
        ints = h2d([[r.params.greedy for r in reqs], [r.seed for r in reqs], [r.num_tokens + ahead for r in reqs]],
                   torch.int64, self.device)  # [3, B]: greedy, seeds, positions
        return sample_keyed(logits, self.warp_params(reqs), ints)  # [B]

    def warp_params(self, reqs: list[Request]) -> WarpParams:
        """The batch's warp parameters on the device, built once per set of parameters: a batch keeps
        its requests for many steps, and building them is several launches and a copy."""
        key = tuple((r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p) for r in reqs)
        wp = self._warp_cache.get(key)
        if wp is None:
            if len(self._warp_cache) >= 64:
                self._warp_cache.clear()
            wp = self._warp_cache[key] = WarpParams.build(list(key), self.device)
        return wp

    def adjust_rows(self, entries: list[Scheduled], rows: torch.Tensor, ahead: int = 0,
                    depth: np.ndarray | None = None, bits: list[list[int]] | None = None) -> torch.Tensor:
        """The target distribution itself as each request asks for it: below min_tokens, EOS and stop
        ids are impossible; a request's logit bias and penalties apply (sample/penalties.py), then its
        grammar's mask (sample/grammar.py).
        rows [B, K+1, V]; `ahead`: tokens the requests will have gained before these rows (0 for any
        penalised one); `depth` [B, K+1]: how far past the pending token each row decides, and `bits`
        [B][K+1] the window rows on its path (a draft tree's; default a chain's)."""
        cells: list[tuple[int, int, int]] = []  # (row, window row, token) to ban
        pick: list[int] = []
        constrained: list[int] = []
        for b, e in enumerate(entries):
            p, r = e.request.params, e.request
            if p.penalties:
                pick.append(b)
            if p.constraint is not None:
                constrained.append(b)
            if not below_min_tokens(r, ahead):
                continue
            made = len(r.output_ids) + ahead
            banned = ([] if p.ignore_eos else list(r.eos_ids)) + list(p.stop_token_ids or [])
            for j in range(e.num_drafts + 1):
                if made + (j if depth is None else int(depth[b, j])) < p.min_tokens:
                    cells.extend((b, j, t) for t in banned if t < self.vocab)
        if cells:
            rows = rows.clone()
            at_rows, at_window, at_tokens = zip(*cells, strict=True)
            rows[list(at_rows), list(at_window), list(at_tokens)] = float("-inf")
        if pick:
            assert ahead == 0, "a penalised request's step was prepared before its tokens were known"
            rows = penalise(entries, rows, bits, pick)
        if constrained:
            # A tree step carries constrained requests without drafts (EngineCore._spec_k): row 0 only.
            assert ahead == 0, "a constrained request's step was prepared before its tokens were known"
            rows = apply_masks(entries, rows, constrained)
        return rows

    def _logprobs(self, reqs: list[Request], rows: torch.Tensor, tokens: torch.Tensor) -> list:
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        result: list = [None] * len(reqs)
        if not want:
            return result
        top_n = max(reqs[i].params.logprobs or 0 for i in want)
        sub = rows[want]  # [W, K+1, V]
        chosen_d, vals_d, ids_d = token_logprobs(sub.view(-1, self.vocab), tokens[want].view(-1), top_n)
        shape = (len(want), sub.shape[1])
        chosen, vals, ids = chosen_d.view(shape).tolist(), vals_d.view(*shape, -1).tolist(), ids_d.view(*shape, -1).tolist()
        for w, i in enumerate(want):
            n = reqs[i].params.logprobs or 0
            result[i] = [(chosen[w][j], list(zip(ids[w][j][:n], vals[w][j][:n], strict=True)))
                         for j in range(shape[1])]
        return result


def below_min_tokens(r: Request, ahead: int = 0) -> bool:
    """The request's next token (`ahead` past its end) may not stop it: `adjust_rows` then
    masks its EOS and stop ids."""
    return len(r.output_ids) + ahead < r.params.min_tokens


def unpack(host: list[list[int]], width: int, logprobs: list, drafts: bool = True) -> Verified:
    """Rows [tokens (width) | accepted | drafts, when chained] read in one piece -> what each entry emits:
    its accepted drafts and one token (and the next drafts)."""
    accepted = [r[width] for r in host]
    return Verified([r[: n + 1] for r, n in zip(host, accepted, strict=True)], accepted,
                    [None if x is None else x[: n + 1] for x, n in zip(logprobs, accepted, strict=True)],
                    [r[width + 1 :] for r in host] if drafts else None)

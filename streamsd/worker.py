"""The GPU worker: owns the models, the caches and the q pool; one `step(plan)` per engine step.

verify: one target forward over every scheduled token (prefill chunks, decode tokens, the last
token + cached drafts of each verifying request) -> rejection sampling -> one host read of the
emitted tokens -> propose the next drafts. Runs on one dedicated thread; never touches asyncio.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from streamsd.model.graphs import GraphRunner
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.request import Request
from streamsd.sampling import rng
from streamsd.sampling.rejection import VerifyInput, rejection_sample
from streamsd.sampling.sampler import sample_rows, token_logprobs
from streamsd.sampling.warp import WarpParams, warp
from streamsd.spec.base import ProposeItem, Proposer
from streamsd.step import EntryResult, Scheduled, StepPlan


@dataclass(frozen=True, slots=True)
class Verified:
    tokens: list[list[int]]  # per verifying entry, the emitted tokens
    accepted: list[int]
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    drafts: list[list[int]] | None = None  # the next drafts, when the proposer ran behind the verify (chain)


# (tokens [B, K+1], accepted [B]) on the device -> the next drafts [B, k] queued behind them, or None
Chain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


class Worker:
    def __init__(self, target: Transformer, cache: PagedKVCache, proposer: Proposer | None,
                 q_pool: torch.Tensor | None, device: torch.device):
        self.target = target
        self.cache = cache
        self.proposer = proposer
        self.q_pool = q_pool  # [slots, K, V] dense draft distributions, or None
        self.device = device
        self.vocab = target.args.vocab_size
        # CUDA graphs for decode/verify steps; build_runtime sets them on CUDA.
        self.graphs: GraphRunner | None = None
        self.rejection = rejection_sample
        # Set once a step's GPU work is queued, just before its host read: the engine then does the
        # previous step's text work while the GPU runs (see EngineCore.run).
        self.launched = threading.Event()
        if device.type == "cuda":
            from streamsd.kernels.rejection import rejection_sample_triton

            self.rejection = rejection_sample_triton  # same decisions as the reference, one launch

    def step(self, plan: StepPlan) -> list[EntryResult]:
        logits, hidden = self._forward(plan.entries)  # [rows, V], [tokens, layers * hidden] | None
        verified = self._verify([e for e in plan.entries if e.verifies], logits, self._chain(plan.entries, hidden))
        return self._propose(plan.entries, verified, hidden)

    def _chain(self, entries: list[Scheduled], hidden: torch.Tensor | None) -> Chain | None:
        """An EAGLE head's catch-up and drafts queued straight behind the verify (no host read in
        between, one read for both): when every entry verifies its last token and the same k drafts,
        so the head catches up on all 1 + k rows of each (spec/eagle_graphs.py says why that is safe)."""
        chain = getattr(self.proposer, "chain", None)
        if chain is None or hidden is None or not entries:
            return None
        k = entries[0].num_drafts
        if k == 0 or any(not e.verifies or e.num_tokens != 1 or e.num_drafts != k for e in entries):
            return None
        reqs, starts, ks = [e.request for e in entries], [e.start for e in entries], [e.k_next for e in entries]
        return lambda tokens, accepted: chain(reqs, starts, ks, tokens, accepted, hidden)

    # -- target forward -------------------------------------------------------------------------
    def _forward(self, entries: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids: list[int] = []
        rows: list[int] = []
        starts, counts, tables = [], [], []
        for e in entries:
            r = e.request
            toks = [r.token_at(i) for i in range(e.start, e.start + e.num_tokens)] + r.draft_ids[: e.num_drafts]
            if e.verifies:
                first = len(ids) + e.num_tokens - 1
                rows.extend(range(first, first + 1 + e.num_drafts))
            ids.extend(toks)
            starts.append(e.start)
            counts.append(len(toks))
            tables.append(r.blocks)
        # An EAGLE head reads the target's residual streams at every token this step computes.
        layers = tuple(getattr(self.proposer, "hidden_layers", ()))
        # A graph serves the step only if it captures exactly these streams (none, or the head's).
        fits = self.graphs is not None and self.graphs.hidden_layers == layers
        key = self.graphs.key_for(counts, tables) if self.graphs is not None and fits else None
        if self.graphs is not None and key is not None:
            if not layers:
                return self.graphs.run(key, ids, starts, counts, tables, rows), None
            return self.graphs.run_hidden(key, ids, starts, counts, tables, rows)  # views: read before the next replay
        layout = BatchLayout.build(starts, counts, tables, self.cache.block_size, self.device)
        out = self.target(h2d(ids, torch.int64, self.device), layout, self.cache,
                          h2d(rows, torch.int64, self.device), hidden_layers=layers,
                          hidden_rows=torch.arange(len(ids), device=self.device) if layers else None)
        return out.logits, torch.cat(out.hidden, dim=-1) if out.hidden else None  # [T, layers * hidden]

    # -- verification -------------------------------------------------------------------------
    def _verify(self, entries: list[Scheduled], logits: torch.Tensor, chain: Chain | None = None) -> Verified:
        if not entries:
            self.launched.set()  # a prompt-chunk step: nothing to read back, its work is queued
            return Verified([], [], [])
        dev = self.device
        reqs = [e.request for e in entries]
        k = max(e.num_drafts for e in entries)
        # Gather each entry's rows into [B, K+1]; padding repeats its last row and is never used.
        nd = np.array([e.num_drafts for e in entries], dtype=np.int64)  # [B]
        if (nd == k).all() and logits.shape[0] == len(entries) * (k + 1):
            rows = logits.view(len(entries), k + 1, -1)  # [B, K+1, V] uniform steps: no gather copy
        else:
            first = np.cumsum(1 + nd) - (1 + nd)  # [B] each entry's first row
            index = first[:, None] + np.minimum(np.arange(k + 1), nd[:, None])  # [B, K+1]
            rows = logits[h2d(torch.from_numpy(index), torch.int64, dev)]  # [B, K+1, V]
        rows = self._suppress_early_stops(entries, rows)
        if k == 0:
            return self._sample_plain(reqs, rows)
        dense = [r.q_slot is not None and not r.greedy_draft and e.num_drafts > 0
                 for e, r in zip(entries, reqs, strict=True)]
        # Every per-request integer in one queued copy (each pageable copy costs ~20 us of host time),
        # field after field so that each is a contiguous slice: the Triton sampler reads raw pointers.
        # Built as Python lists and converted once: per-row numpy assignments cost ~5 us a request.
        b = len(reqs)
        fields = np.array([(r.params.greedy, r.seed, d, e.num_drafts, r.q_slot if d else 0, r.num_tokens)
                           for e, r, d in zip(entries, reqs, dense, strict=True)], dtype=np.int64).T  # [6, B]
        pos_h = fields[5][:, None] + np.arange(k + 1)  # [B, K+1]
        ids_h = np.array([r.draft_ids[: e.num_drafts] + [0] * (k - e.num_drafts)
                          for e, r in zip(entries, reqs, strict=True)], dtype=np.int64)  # [B, K]
        host = np.concatenate([fields[:5].ravel(), pos_h.ravel(), ids_h.ravel()])  # greedy, seed, dense q, drafts, q slot
        ints = h2d(torch.from_numpy(host), torch.int64, dev)
        greedy, seeds, num_drafts, q_slots = ints[:b].bool(), ints[b : 2 * b], ints[3 * b : 4 * b], ints[4 * b : 5 * b]
        positions = ints[5 * b : 5 * b + b * (k + 1)].view(b, k + 1)  # [B, K+1]
        draft_ids = ints[5 * b + b * (k + 1) :].view(b, k)  # [B, K]
        probs = None
        noise = None
        if not all(r.params.greedy for r in reqs):
            wp = WarpParams.build([(r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p)
                                   for r in reqs], dev)
            probs = warp(rows.view(-1, self.vocab), wp.repeat(k + 1)).view(len(reqs), k + 1, -1)  # [B, K+1, V]
            noise = rng.exponentials(seeds, positions, rng.TARGET, self.vocab)  # [B, K+1, V]
        q = None
        if any(dense) and self.q_pool is not None:
            q = self.q_pool[q_slots, :k]  # [B, K, V]
        tokens, accepted = self.rejection(VerifyInput(
            target_probs=probs,
            target_argmax=rows.argmax(dim=-1),
            draft_ids=draft_ids,
            draft_probs=q,
            dense_q=ints[2 * b : 3 * b].bool(),
            num_drafts=num_drafts,
            greedy=greedy,
            # Greedy rows never draw: skip the hashing launches on all-greedy steps.
            uniforms=rng.uniforms(seeds, positions[:, :k], rng.ACCEPT) if probs is not None else draft_ids,
            noise=noise,
        ))
        drafts = chain(tokens, accepted) if chain is not None else None  # [B, k'] queued behind the sampler
        lp = self._logprobs(reqs, rows, tokens)
        self.launched.set()
        next_drafts = None
        if drafts is None:
            host_tokens, host_acc = tokens.tolist(), accepted.tolist()  # the step's one host read
        else:
            host = torch.cat([tokens, accepted.unsqueeze(1), drafts], dim=1).tolist()  # the step's one host read
            host_tokens, host_acc = [r[: k + 1] for r in host], [r[k + 1] for r in host]
            next_drafts = [r[k + 2 :] for r in host]
        emitted = [t[: n + 1] for t, n in zip(host_tokens, host_acc, strict=True)]
        logprobs = [None if x is None else x[: n + 1] for x, n in zip(lp, host_acc, strict=True)]
        return Verified(emitted, host_acc, logprobs, next_drafts)

    def _sample_plain(self, reqs: list[Request], rows: torch.Tensor) -> Verified:
        """A step with no drafts is plain decoding: no rejection sampler, and on all-greedy steps
        nothing but an argmax. Sampled rows race with the noise the rejection sampler would use for
        a bonus token at the same position, so a seeded request's output does not depend on which
        of the two paths a step took."""
        logits = rows[:, 0]  # [B, V]
        if all(r.params.greedy for r in reqs):
            tokens = logits.argmax(dim=-1)  # [B]
        else:
            dev = self.device
            wp = WarpParams.build([(r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p)
                                   for r in reqs], dev)
            ints = h2d([[r.seed for r in reqs], [r.num_tokens for r in reqs], [r.params.greedy for r in reqs]],
                       torch.int64, dev)  # [3, B]: seeds, positions, greedy
            noise = rng.exponentials(ints[0], ints[1].unsqueeze(-1), rng.TARGET, self.vocab)[:, 0]  # [B, V]
            tokens = sample_rows(warp(logits, wp), logits, ints[2].bool(), noise)  # [B]
        lp = self._logprobs(reqs, rows, tokens.unsqueeze(-1))
        self.launched.set()
        host_tokens = tokens.tolist()  # the step's one host read
        logprobs = [None if x is None else x[:1] for x in lp]
        return Verified([[t] for t in host_tokens], [0] * len(reqs), logprobs)

    def _suppress_early_stops(self, entries: list[Scheduled], rows: torch.Tensor) -> torch.Tensor:
        """Below min_tokens, EOS and stop ids are impossible in the target distribution itself."""
        cells = []
        for b, e in enumerate(entries):
            p, r = e.request.params, e.request
            if p.min_tokens <= len(r.output_ids):
                continue
            banned = ([] if p.ignore_eos else list(r.eos_ids)) + list(p.stop_token_ids or [])
            for j in range(e.num_drafts + 1):
                if len(r.output_ids) + j < p.min_tokens:
                    cells.extend((b, j, t) for t in banned if t < self.vocab)
        if not cells:
            return rows
        rows = rows.clone()
        b, j, t = zip(*cells, strict=True)
        rows[list(b), list(j), list(t)] = float("-inf")
        return rows

    def _logprobs(self, reqs: list[Request], rows: torch.Tensor, tokens: torch.Tensor) -> list:
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        result: list = [None] * len(reqs)
        if not want:
            return result
        top_n = max(reqs[i].params.logprobs or 0 for i in want)
        sub = rows[want]  # [W, K+1, V]
        chosen, vals, ids = token_logprobs(sub.view(-1, self.vocab), tokens[want].view(-1), top_n)
        shape = (len(want), sub.shape[1])
        chosen, vals, ids = chosen.view(shape).tolist(), vals.view(*shape, -1).tolist(), ids.view(*shape, -1).tolist()
        for w, i in enumerate(want):
            n = reqs[i].params.logprobs or 0
            result[i] = [(chosen[w][j], list(zip(ids[w][j][:n], vals[w][j][:n], strict=True)))
                         for j in range(shape[1])]
        return result

    # -- proposing ------------------------------------------------------------------------------
    def _propose(self, entries: list[Scheduled], verified: Verified,
                 hidden: torch.Tensor | None = None) -> list[EntryResult]:
        results: list[EntryResult] = []
        items: list[ProposeItem] = []
        owners: list[int] = []
        # Each entry's rows of the flat streams [T, layers * hidden] (views).
        streams = hidden.split([e.num_tokens + e.num_drafts for e in entries]) if hidden is not None else None
        v = 0
        for i, e in enumerate(entries):
            r = e.request
            if not e.verifies:
                results.append(EntryResult([], 0, list(r.draft_ids), r.draft_computed))
                items.append(ProposeItem(r, [], 0, e.start + e.num_tokens, r.draft_computed,
                                         streams[i] if streams else None, e.start))
                owners.append(i)
                continue
            new, acc = verified.tokens[v], verified.accepted[v]
            flags = [j < acc for j in range(len(new))]
            computed = e.start + e.num_tokens + acc
            results.append(EntryResult(new, acc, [], min(r.draft_computed, computed), flags, verified.logprobs[v]))
            if verified.drafts is not None:  # proposed behind the verify: caught up to `computed`
                results[-1].draft_computed = computed
                results[-1].draft_ids = [] if _will_stop(r, new) else verified.drafts[v][: e.k_next]
                v += 1
                continue
            v += 1
            # A head that reads hidden states catches up even when it drafts nothing this step (k
            # chosen per step): those states exist only now.
            if (e.k_next > 0 or (streams and r.spec_k > 0)) and not _will_stop(r, new):
                items.append(ProposeItem(r, [*r.prompt_ids, *r.output_ids, *new], e.k_next, computed,
                                         min(r.draft_computed, computed),
                                         streams[i] if streams else None, e.start))
                owners.append(i)
        if self.proposer is None:
            return results
        if not self.proposer.keeps_cache:
            # Host-side proposers (n-gram) have no cache to catch up, only drafts to make.
            pairs = [(o, it) for o, it in zip(owners, items, strict=True) if it.k > 0]
            owners, items = [o for o, _ in pairs], [it for _, it in pairs]
        for owner, proposal in zip(owners, self.proposer.propose(items) if items else [], strict=True):
            res = results[owner]
            res.draft_computed = proposal.draft_computed
            if entries[owner].verifies:
                res.draft_ids = proposal.draft_ids
        return results


def _will_stop(r: Request, new: list[int]) -> bool:
    p = r.params
    if len(r.output_ids) + len(new) >= p.max_tokens:
        return True
    return len(r.output_ids) + len(new) >= p.min_tokens and any(r.stops_on(t) for t in new)

"""The full step: one target forward over every scheduled token (prefill chunks, decode tokens, the
last token + cached drafts of each verifying request) -> verification (sample/verify.py: rejection
sampling, one host read of the emitted tokens) -> the next drafts. An EAGLE head's chain is queued
behind the sampler and comes back in that read; other proposers run after it. Every step no other
runner takes runs here (prompt chunks, mixed batches, log-probabilities, the CPU without pipelining),
and the other runners use its forward and its proposing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamsd.model.kv_cache import BatchLayout, h2d
from streamsd.model.stream_store import keep_streams
from streamsd.request import Request
from streamsd.sample.verify import Chain, Verified
from streamsd.sched.plan import EntryResult, Scheduled
from streamsd.spec_decode.proposer import ProposeItem
from streamsd.worker.steps.prompt_scores import PromptRows, Scored

if TYPE_CHECKING:
    from streamsd.worker.worker import Worker


class FullStep:
    def __init__(self, worker: Worker):
        self.w = worker

    def run(self, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]:
        self.w.lookahead.drop()
        return self.step(entries)

    def step(self, entries: list[Scheduled]) -> list[EntryResult]:
        logits, hidden, scored = self.forward_scored(entries)  # [rows, V], [tokens, layers * hidden] | None
        if self.w.stream_sink is not None:
            assert hidden is not None  # recording's proposer asks for streams (Worker.recording_streams)
            self.w.stream_sink(entries, hidden)
        verified = self.w.verifier.verify([e for e in entries if e.verifies], logits, self.chain(entries, hidden),
                                        self.graph_verified(entries, logits))
        return self.propose(entries, verified, scored)

    def graph_verified(self, entries: list[Scheduled], logits: torch.Tensor, queued: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The greedy verification the step's graph computed with these logits (sample/greedy.py),
        when the entries are exactly its sequences: each one pending token and its drafts, in order.
        `queued`: a step queued ahead (worker/lookahead.py), whose entries verify by construction; their host
        starts are lower bounds, so `verifies` cannot tell (it read False, and every queued greedy
        verify ran the rejection sampler's argmax path besides the graph's own)."""
        if self.w.graphs is None or not all((queued or e.verifies) and e.num_tokens == 1 for e in entries):
            return None
        return self.w.graphs.greedy_result(logits, len(entries))

    def chain(self, entries: list[Scheduled], hidden: torch.Tensor | None) -> Chain | None:
        """An EAGLE head's catch-up and drafts (or any proposer's that drafts on the device: the
        synthetic one) queued straight behind the verify (no host read in between, one read for
        both): when every entry verifies its last token and its drafts, so the head catches up on all
        of each one's rows (spec_decode/eagle/graphs.py says why that is safe)."""
        if self.w.proposer is None or not self.w.chains_on_device or self.w.tree is not None or not entries \
                or (hidden is None and self.w.hidden_layers):
            return None
        if not any(e.num_drafts for e in entries) or any(not e.verifies or e.num_tokens != 1 for e in entries):
            return None  # a plain step (the verifier samples, no rejection) or prompt chunks: propose after
        if self.w.store is not None and any(e.request.draft_computed < e.start for e in entries):
            return None  # a head behind (it skipped plain steps) catches up from the store, after the read
        reqs, starts, ks = [e.request for e in entries], [e.start for e in entries], [e.k_next for e in entries]
        counts = [1 + e.num_drafts for e in entries]
        chain = self.w.proposer.chain
        return lambda tokens, accepted: chain(reqs, starts, counts, ks, tokens, accepted, hidden)

    def forward(self, entries: list[Scheduled], trees: list[tuple[list[int], list[int]] | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """trees: per entry, its draft tree's window (tree_verify.entry_tree), when the step verifies trees.
        For steps of one pending token each (which score no prompt)."""
        logits, hidden, _ = self.forward_scored(entries, trees)
        return logits, hidden

    def forward_scored(self, entries: list[Scheduled], trees: list[tuple[list[int], list[int]] | None] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, list[Scored | None] | None]:
        """`forward`, and per entry the logprobs of the prompt tokens it scores (prompt_scores.py), or
        None when no entry scores its prompt."""
        ids: list[int] = []
        rows: list[int] = []
        starts, counts, tables = [], [], []
        scoring = PromptRows()
        for at, e in enumerate(entries):
            r = e.request
            toks = [r.token_at(i) for i in range(e.start, e.start + e.num_tokens)] + r.draft_ids[: e.num_drafts]
            if e.verifies:
                first = len(ids) + e.num_tokens - 1
                rows.extend(range(first, first + 1 + e.num_drafts))
            scoring.add(at, e, len(ids))
            ids.extend(toks)
            starts.append(e.start)
            counts.append(len(toks))
            tables.append(r.blocks)
        # An EAGLE head reads the target's residual streams at every token this step computes (unless
        # the plan wants none: its head recomputes them when it drafts again).
        layers = self.w.forward_layers
        if self.w.store is not None and not layers:
            self.w.skipped_streams(entries)
        # A graph serves the step only if it captures the proposer's streams (none, or the head's).
        fits = self.w.graphs is not None and self.w.graphs.hidden_layers == self.w.hidden_layers
        key = self.w.graphs.key_for(counts, tables, len(rows)) \
            if self.w.graphs is not None and fits and trees is None and not scoring.rows else None
        if self.w.graphs is not None and key is not None:
            if not layers:
                return self.w.graphs.run(key, ids, starts, counts, tables, rows, streams=False), None, None
            return *self.w.graphs.run_hidden(key, ids, starts, counts, tables, rows), None  # views: read before the next replay
        layout = BatchLayout.build(starts, counts, tables, self.w.cache.block_size, self.w.device, trees)
        # A scored prompt's rows come after the verified ones: [rows + scored rows, V].
        out = self.w.target(h2d(ids, torch.int64, self.w.device), layout, self.w.cache,
                          h2d(rows + scoring.rows, torch.int64, self.w.device), hidden_layers=layers,
                          hidden_rows=torch.arange(len(ids), device=self.w.device) if layers else None)
        scored = scoring.score(out.logits[len(rows) :], len(entries)) if scoring.rows else None
        # [T, layers * hidden] | None; a graph's replay writes the store inside
        return out.logits[: len(rows)], keep_streams(out.hidden, layout.slot_mapping, self.w.store), scored

    def propose(self, entries: list[Scheduled], verified: Verified, scored: list[Scored | None] | None = None
                ) -> list[EntryResult]:
        results: list[EntryResult] = []
        items: list[ProposeItem] = []
        owners: list[int] = []
        # A head that reads the store catches every verifying request up whenever the proposer runs
        # anyway (one call for all), and none in a step where nobody drafts: the genuine plain step.
        # Only requests whose streams the store holds ride along: one that skipped them would have
        # them recomputed by a target pass over every position it skipped, a cost the step's plan
        # priced for the requests that draft alone; it pays that when it drafts again.
        catch_up = self.w.store is not None and any(e.k_next > 0 for e in entries)
        v = 0
        for i, e in enumerate(entries):
            r = e.request
            if not e.verifies:
                results.append(EntryResult([], 0, list(r.draft_ids), r.draft_computed))
                items.append(ProposeItem(r, [], 0, e.start + e.num_tokens, r.draft_computed))
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
            rides = catch_up and r.spec_k > 0 and r.streams_missing_from is None
            if (e.k_next > 0 or rides) and not _will_stop(r, new):
                items.append(ProposeItem(r, [*r.prompt_ids, *r.output_ids, *new], e.k_next, computed,
                                         min(r.draft_computed, computed)))
                owners.append(i)
        for res, prompt in zip(results, scored or (), strict=False):
            res.prompt_logprobs = prompt
        if self.w.proposer is None or not self.w.streams_written:
            # A step that kept no streams (plain decoding only: StepPlan.wants_streams) drafts nothing;
            # its head catches up once it drafts again, from the streams recomputed then.
            return _within_grammar(entries, results)
        self.w.restore_streams([(entries[o], it) for o, it in zip(owners, items, strict=True)])
        if not self.w.proposer.keeps_cache:
            # Host-side proposers (n-gram) have no cache to catch up, only drafts to make.
            pairs = [(o, it) for o, it in zip(owners, items, strict=True) if it.k > 0]
            owners, items = [o for o, _ in pairs], [it for _, it in pairs]
        for owner, proposal in zip(owners, self.w.proposer.propose(items) if items else [], strict=True):
            res = results[owner]
            res.draft_computed = proposal.draft_computed
            if entries[owner].verifies:
                res.draft_ids = proposal.draft_ids
                res.draft_parents = proposal.draft_parents
        return _within_grammar(entries, results)


def _within_grammar(entries: list[Scheduled], results: list[EntryResult]) -> list[EntryResult]:
    """A constrained request's drafts end at the first token its grammar forbids after the tokens this
    step emits (sample/grammar.py, `Matcher.allowed`): p gives it 0, so the drafts after it could
    never be accepted. A one-hot draft goes too (its rejection would sample p itself, as the row's
    plain sample does); a draft with a dense q stays: its certain rejection samples the residual
    (p - q)+, which exactness needs, not p."""
    for e, res in zip(entries, results, strict=True):
        r = e.request
        if r.matcher is None or not res.draft_ids or res.draft_parents:
            continue
        keep = r.matcher.allowed([*r.output_ids, *res.new_tokens], res.draft_ids)
        dense = not r.greedy_draft and r.q_slot is not None
        res.draft_ids = res.draft_ids[: keep + 1 if dense else keep]
    return results


def _will_stop(r: Request, new: list[int]) -> bool:
    p = r.params
    if len(r.output_ids) + len(new) >= p.max_tokens:
        return True
    return len(r.output_ids) + len(new) >= p.min_tokens and any(r.stops_on(t) for t in new)

"""The GPU worker: owns the models, the caches and the q pool; one `step(plan)` per engine step.

One target forward over every scheduled token (prefill chunks, decode tokens, the last token +
cached drafts of each verifying request) -> verification (sample/verify.py: rejection sampling, one host
read of the emitted tokens) -> the next drafts. An EAGLE head's are queued behind the sampler and
come back in that read; other proposers run after it. Plain decode steps, and speculative steps
whose proposer drafts on the device, are pipelined (worker/lookahead.py): the next one is queued before
this one is read. An EAGLE engine's plain steps are the plain engine's: the target's streams go to
the stream store (model/stream_store.py) and the head catches up from there once a request drafts
again. Runs on one dedicated thread; never touches asyncio.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from streamsd.config import TreeShape
from streamsd.model.graphs import GraphRunner
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore, keep_streams
from streamsd.request import Request
from streamsd.sample.verify import Chain, Verified, Verifier
from streamsd.sched.plan import EntryResult, Scheduled, StepPlan
from streamsd.spec_decode.eagle.proposer import EagleProposer
from streamsd.spec_decode.proposer import Proposal, ProposeItem, Proposer
from streamsd.worker import pipelined
from streamsd.worker import tree_runner as tree_step
from streamsd.worker.lookahead import Lookahead, Readback
from streamsd.worker.tree_graphs import TreeGraphs, tree_graphs_for

#: Receives a step's entries and the target's streams at every token it computed.
StreamSink = Callable[[list[Scheduled], torch.Tensor], None]


class _StreamsOnly(Proposer):
    """Drafts nothing; declares the layers whose streams a recorder wants, so that every forward
    returns them and no step is pipelined (no store keeps them there)."""

    def __init__(self, layers: tuple[int, ...]):
        self.hidden_layers = layers

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        return []


class Worker:
    def __init__(self, target: Transformer, cache: PagedKVCache, proposer: Proposer | None,
                 q_pool: torch.Tensor | None, device: torch.device, pipeline: bool | None = None,
                 tree: TreeShape | None = None):
        self.target = target
        self.tree = tree  # drafts are trees of this shape (an EAGLE head's): worker/tree_runner.py
        self.tree_graphs: TreeGraphs | None = None  # their steps as CUDA graphs (enable_cuda)
        self.cache = cache
        self.proposer = proposer
        self.device = device
        self.vocab = target.args.vocab_size
        # CUDA graphs for decode/verify steps (enable_cuda).
        self.graphs: GraphRunner | None = None
        # Set once a step's GPU work is queued, just before its host read: the engine then does the
        # previous step's text work while the GPU runs (see EngineCore.run).
        self.launched = threading.Event()
        self._stream_sink: StreamSink | None = None  # recording_streams
        self.verifier = Verifier(q_pool, self.vocab, device, self.launched)  # q_pool: [slots, K, V] or None
        # Pipelined plain steps: on by default where the device runs ahead of the host (CUDA).
        self.lookahead = Lookahead(cache.block_size, device.type == "cuda" if pipeline is None else pipeline)
        self.readback = Readback(device)

    @contextmanager
    def recording_streams(self, layers: tuple[int, ...], sink: StreamSink) -> Iterator[None]:
        """Meanwhile, every step hands `sink` the target's residual streams entering `layers` at every
        token it computes, [T, layers * hidden] in the step's entry order, and drafts nothing: the
        target's own answers with their streams, for training a draft head (train/data.py). Every
        step takes the full path, where the forward is this worker's own (a step queued ahead would
        run its forward elsewhere); graphs, where there are any, capture those streams too."""
        saved = self.proposer, self.graphs
        self.proposer = _StreamsOnly(layers)
        if self.graphs is not None:
            g = self.graphs
            self.graphs = GraphRunner(g.model, g.cache, g.scratch, g.cfg, g.device, hidden_layers=layers)
        self._stream_sink = sink
        try:
            yield
        finally:
            self.proposer, self.graphs = saved
            self._stream_sink = None

    def enable_cuda(self, *, scratch_block: int, max_len: int, k: int, graphs: bool, tree_max_batch: int) -> None:
        """Move onto the CUDA kernels and, with `graphs`, CUDA graphs (worker/cuda.py), before any step."""
        from streamsd.worker.cuda import set_up

        self.graphs = set_up(self, scratch_block=scratch_block, max_len=max_len, k=k, graphs=graphs)
        if self.tree is not None and graphs and isinstance(self.proposer, EagleProposer):
            self.tree_graphs = tree_graphs_for(self, self.proposer, scratch_block, max_len, tree_max_batch)

    @property
    def store(self) -> StreamStore | None:
        """The target's streams per KV slot, kept for an EAGLE head (None for other proposers)."""
        return self.proposer.store if self.proposer is not None else None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose streams the proposer drafts from: every forward returns them."""
        return self.proposer.hidden_layers if self.proposer is not None else ()

    @property
    def chains_on_device(self) -> bool:
        return self.proposer is not None and self.proposer.chains_on_device

    def step(self, plan: StepPlan) -> list[EntryResult]:
        try:
            # A proposer that reads every step's streams with no store to keep them (the training
            # data recorder, train/data.py) sees them only on the full path.
            streams_kept = self.store is not None or not self.hidden_layers
            if Lookahead.serves(plan.entries) and streams_kept:
                return pipelined.plain_step(self, plan.entries, plan.queue_next)
            if self.tree is not None:
                return tree_step.tree_step(self, plan.entries, plan.queue_next)
            if ((Lookahead.chains(plan.entries) or self.lookahead.follows(plan.entries))
                    and self.chains_on_device):
                return pipelined.chained_step(self, plan.entries, plan.queue_next)
            self.lookahead.drop()
            return self._step(plan.entries)
        except BaseException:
            self.lookahead.drop()
            raise

    def _step(self, entries: list[Scheduled]) -> list[EntryResult]:
        logits, hidden = self._forward(entries)  # [rows, V], [tokens, layers * hidden] | None
        if self._stream_sink is not None:
            self._stream_sink(entries, hidden)
        verified = self.verifier.verify([e for e in entries if e.verifies], logits, self._chain(entries, hidden),
                                        self._graph_verified(entries, logits))
        return self._propose(entries, verified)

    def _graph_verified(self, entries: list[Scheduled], logits: torch.Tensor, queued: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The greedy verification the step's graph computed with these logits (sample/greedy.py),
        when the entries are exactly its sequences: each one pending token and its drafts, in order.
        `queued`: a step queued ahead (worker/lookahead.py), whose entries verify by construction; their host
        starts are lower bounds, so `verifies` cannot tell (it read False, and every queued greedy
        verify ran the rejection sampler's argmax path besides the graph's own)."""
        if self.graphs is None or not all((queued or e.verifies) and e.num_tokens == 1 for e in entries):
            return None
        return self.graphs.greedy_result(logits, len(entries))

    def _chain(self, entries: list[Scheduled], hidden: torch.Tensor | None) -> Chain | None:
        """An EAGLE head's catch-up and drafts (or any proposer's that drafts on the device: the
        synthetic one) queued straight behind the verify (no host read in between, one read for
        both): when every entry verifies its last token and its drafts, so the head catches up on all
        of each one's rows (spec_decode/eagle/graphs.py says why that is safe)."""
        if self.proposer is None or not self.chains_on_device or self.tree is not None or not entries \
                or (hidden is None and self.hidden_layers):
            return None
        if not any(e.num_drafts for e in entries) or any(not e.verifies or e.num_tokens != 1 for e in entries):
            return None  # a plain step (the verifier samples, no rejection) or prompt chunks: propose after
        if self.store is not None and any(e.request.draft_computed < e.start for e in entries):
            return None  # a head behind (it skipped plain steps) catches up from the store, after the read
        reqs, starts, ks = [e.request for e in entries], [e.start for e in entries], [e.k_next for e in entries]
        counts = [1 + e.num_drafts for e in entries]
        chain = self.proposer.chain
        return lambda tokens, accepted: chain(reqs, starts, counts, ks, tokens, accepted, hidden)

    # -- target forward -------------------------------------------------------------------------
    def _forward(self, entries: list[Scheduled], trees: list[tuple[list[int], list[int]] | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """trees: per entry, its draft tree's window (tree_verify.entry_tree), when the step verifies trees."""
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
        layers = self.hidden_layers
        # A graph serves the step only if it captures exactly these streams (none, or the head's).
        fits = self.graphs is not None and self.graphs.hidden_layers == layers
        key = self.graphs.key_for(counts, tables, len(rows)) if self.graphs is not None and fits and trees is None \
            else None
        if self.graphs is not None and key is not None:
            if not layers:
                return self.graphs.run(key, ids, starts, counts, tables, rows), None
            return self.graphs.run_hidden(key, ids, starts, counts, tables, rows)  # views: read before the next replay
        layout = BatchLayout.build(starts, counts, tables, self.cache.block_size, self.device, trees)
        out = self.target(h2d(ids, torch.int64, self.device), layout, self.cache,
                          h2d(rows, torch.int64, self.device), hidden_layers=layers,
                          hidden_rows=torch.arange(len(ids), device=self.device) if layers else None)
        # [T, layers * hidden] | None; a graph's replay writes the store inside
        return out.logits, keep_streams(out.hidden, layout.slot_mapping, self.store)

    # -- proposing ------------------------------------------------------------------------------
    def _propose(self, entries: list[Scheduled], verified: Verified) -> list[EntryResult]:
        results: list[EntryResult] = []
        items: list[ProposeItem] = []
        owners: list[int] = []
        # A head that reads the store catches every verifying request up whenever the proposer runs
        # anyway (one call for all), and none in a step where nobody drafts: the genuine plain step.
        catch_up = self.store is not None and any(e.k_next > 0 for e in entries)
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
            if (e.k_next > 0 or (catch_up and r.spec_k > 0)) and not _will_stop(r, new):
                items.append(ProposeItem(r, [*r.prompt_ids, *r.output_ids, *new], e.k_next, computed,
                                         min(r.draft_computed, computed)))
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
                res.draft_parents = proposal.draft_parents
        return results


def _will_stop(r: Request, new: list[int]) -> bool:
    p = r.params
    if len(r.output_ids) + len(new) >= p.max_tokens:
        return True
    return len(r.output_ids) + len(new) >= p.min_tokens and any(r.stops_on(t) for t in new)

"""The GPU worker: owns the models, the caches, the q pool and the queue of steps run ahead; one
`step(plan)` per engine step, by the runner of its kind (worker/steps/):

- plain (steps/plain.py): every request decodes one token; the next plain step is queued on the
  device before this one is read (worker/lookahead.py);
- chain (steps/chain.py): a speculative step whose proposer drafts on the device behind the verify
  (an EAGLE head, the synthetic proposer), queued ahead the same way;
- tree (steps/tree.py): an EAGLE head's draft trees, one CUDA graph replay a step where it can;
- full (steps/full.py): every other step: forward -> verification (sample/verify.py) -> proposer.

An EAGLE engine's plain steps are the plain engine's: the target's streams go to the stream store
(model/stream_store.py) and the head catches up from there once a request drafts again; once the
batch has decoded plain for a while (StepPlan.wants_streams) they stop, and the head's catch-up
first recomputes the streams they left out (worker/stream_catchup.py). Runs on one dedicated
thread; never touches asyncio.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import torch

from streamsd.config import TreeShape
from streamsd.model.graphs import GraphRunner
from streamsd.model.kv_cache import PagedKVCache
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore
from streamsd.sample.verify import Verifier
from streamsd.sched.plan import EntryResult, Scheduled, StepPlan
from streamsd.spec_decode.eagle.proposer import EagleProposer
from streamsd.spec_decode.proposer import Proposal, ProposeItem, Proposer
from streamsd.worker.lookahead import Lookahead, Readback
from streamsd.worker.steps.chain import ChainStep
from streamsd.worker.steps.full import FullStep
from streamsd.worker.steps.plain import PlainStep
from streamsd.worker.steps.tree import TreeStep
from streamsd.worker.stream_catchup import Span, recompute_streams
from streamsd.worker.tree_graphs import TreeGraphs, tree_graphs_for

if TYPE_CHECKING:
    from streamsd.kernels.warmup import WarmUp

#: Receives a step's entries and the target's streams at every token it computed.
StreamSink = Callable[[list[Scheduled], torch.Tensor], None]


class StepRunner(Protocol):
    def run(self, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]: ...


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
                 tree: TreeShape | None = None, scratch_block: int | None = None, exact: bool = False):
        self.target = target
        # The block no request owns (the cache's last): where recomputing streams writes its K/V.
        self.scratch_block = cache.num_blocks - 1 if scratch_block is None else scratch_block
        # The plan of the step now running wants the head's streams written (StepPlan.wants_streams),
        # and whether its forward wrote them (a step queued ahead wrote them or not as its own plan said).
        self.streams_wanted = True
        self.streams_written = True
        self.tree = tree  # drafts are trees of this shape (an EAGLE head's): worker/steps/tree.py
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
        self.stream_sink: StreamSink | None = None  # recording_streams
        # q_pool: [slots, K, V] or None; the exact mode verifies sampled drafts against plain sampling's tokens.
        self.verifier = Verifier(q_pool, self.vocab, device, self.launched, coupled=exact)
        # Pipelined plain steps: on by default where the device runs ahead of the host (CUDA).
        self.lookahead = Lookahead(cache.block_size, device.type == "cuda" if pipeline is None else pipeline)
        self.readback = Readback(device)
        # One runner per step kind (worker/steps/): the full step, and those queued one ahead.
        self.full = FullStep(self)
        self.plain = PlainStep(self, self.full)
        self.chains = ChainStep(self, self.full)
        self.trees = TreeStep(self, self.full)

    def use_proposer(self, proposer: Proposer) -> None:
        """Draft with `proposer` from the next step on (benchmarks: the synthetic proposer, whose
        oracle is this engine's own plain answers, so it can only be made once the engine runs)."""
        self.proposer = proposer

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
        self.stream_sink = sink
        try:
            yield
        finally:
            self.proposer, self.graphs = saved
            self.stream_sink = None

    def enable_cuda(self, *, scratch_block: int, max_len: int, k: int, graphs: bool, tree_max_batch: int,
                    exact: bool = False) -> WarmUp:
        """Move onto the CUDA kernels and, with `graphs`, CUDA graphs (worker/cuda.py), before any step;
        `exact`: the target's batch-invariant ones. Returns the kernels' warm-up, begun: finish it
        (after capturing the graphs) before the first step."""
        from streamsd.worker.cuda import set_up

        self.graphs, warm = set_up(self, scratch_block=scratch_block, max_len=max_len, k=k, graphs=graphs,
                                   exact=exact)
        if self.tree is not None and graphs and isinstance(self.proposer, EagleProposer):
            self.tree_graphs = tree_graphs_for(self, self.proposer, scratch_block, max_len, tree_max_batch)
        return warm

    @property
    def store(self) -> StreamStore | None:
        """The target's streams per KV slot, kept for an EAGLE head (None for other proposers)."""
        return self.proposer.store if self.proposer is not None else None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose streams the proposer drafts from: every forward returns them."""
        return self.proposer.hidden_layers if self.proposer is not None else ()

    @property
    def forward_layers(self) -> tuple[int, ...]:
        """The layers whose streams this step's forwards capture: the proposer's, but none where a
        store would keep them and the plan wants none."""
        return self.hidden_layers if self.streams_wanted or self.store is None else ()

    def skipped_streams(self, entries: list[Scheduled]) -> None:
        """This step's forward computed `entries` without writing their streams to the store."""
        self.streams_written = False
        for e in entries:
            r = e.request
            r.streams_missing_from = e.start if r.streams_missing_from is None else min(r.streams_missing_from, e.start)

    def restore_streams(self, work: list[tuple[Scheduled, ProposeItem]]) -> None:
        """Before the head catches each item up to its `upto`: the streams the store lacks there,
        recomputed (worker/stream_catchup.py). Positions this step's forward wrote are not recomputed."""
        store = self.store
        if store is None:
            return
        spans = []
        for e, it in work:
            r = it.request
            missing = r.streams_missing_from
            if missing is None or it.upto <= it.draft_computed:
                continue
            end = e.start if self.streams_written else it.upto
            start = max(missing, it.draft_computed)
            if start < end:
                spans.append(Span(it.tokens or r.all_ids, r.blocks, start, end))
            r.streams_missing_from = None
        if spans:
            recompute_streams(self.target, self.cache, store, self.scratch_block, spans, self.device)

    @property
    def chains_on_device(self) -> bool:
        return self.proposer is not None and self.proposer.chains_on_device

    def step(self, plan: StepPlan) -> list[EntryResult]:
        self.streams_wanted, self.streams_written = plan.wants_streams, True
        try:
            return self._runner_for(plan.entries).run(plan.entries, self.lookahead.take_queue_next())
        except BaseException:
            self.lookahead.drop()
            raise

    def _runner_for(self, entries: list[Scheduled]) -> StepRunner:
        # A proposer that reads every step's streams with no store to keep them (the training data
        # recorder) sees them only on the full path, where the forward is this worker's own.
        streams_kept = self.store is not None or not self.hidden_layers
        if Lookahead.serves(entries) and streams_kept:
            return self.plain
        if self.tree is not None:
            return self.trees
        if (Lookahead.chains(entries) or self.lookahead.follows(entries)) and self.chains_on_device:
            return self.chains
        return self.full

"""A speculative step whose proposer drafts on the device behind the verify (an EAGLE head's chain,
the synthetic proposer's gather), pipelined: it starts its one host read, queues the next verify
(and its drafts) from its results still on the device (worker/lookahead.py), then waits for the read."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamsd.model.device_layout import DeviceStarts
from streamsd.model.kv_cache import BatchLayout, h2d
from streamsd.model.stream_store import keep_streams
from streamsd.sample.verify import unpack
from streamsd.sched.plan import EntryResult, Scheduled
from streamsd.spec_decode.proposer import pair_slot
from streamsd.worker.lookahead import Lookahead

if TYPE_CHECKING:
    from streamsd.worker.steps.full import FullStep
    from streamsd.worker.worker import Worker


class ChainStep:
    def __init__(self, worker: Worker, full: FullStep):
        self.w = worker
        self.full = full  # its forward and its proposing

    def run(self, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]:
        """A speculative step whose drafts its proposer makes on the device behind the verify (`chain`),
        taken from the step queued ahead when it fits, and the next one queued before this one is read.
        Entries that only follow the queued step (`Lookahead.follows`) take its full path if it is gone."""
        w = self.w
        taken = w.lookahead.take(entries)
        if taken is None and not Lookahead.chains(entries):
            return self.full.step(entries)
        if taken is None:
            logits, hidden = self.full.forward(entries)  # [rows, V], [tokens, layers * hidden]
            launched = w.verifier.launch(entries, logits, self.full.chain(entries, hidden),
                                         greedy=self.full.graph_verified(entries, logits))
            if launched.drafts is None:  # no graph fits this batch: propose after the read
                return self.full.propose(entries, w.verifier.read(launched))
            tokens, accepted, drafts = launched.tokens, launched.accepted, launched.drafts
        else:
            queued, picked = taken
            index = None if len(picked) == len(queued.requests) else h2d(picked, torch.int64, w.device)
            assert queued.accepted is not None and queued.drafts is not None
            tokens, accepted, drafts = (t if index is None else t.index_select(0, index)
                                        for t in (queued.tokens, queued.accepted, queued.drafts))
            for e in entries:  # its drafts' q went to the pair row
                if e.request.q_slot is not None and w.verifier.q_pool is not None:
                    e.request.q_slot = pair_slot(e.request.q_slot, w.verifier.q_pool.shape[0])
        width = tokens.shape[1]
        w.readback.start(torch.cat([tokens, accepted.unsqueeze(1), drafts], dim=1))  # [B, K+2+k]
        queued_rows = self._queue_chained(entries, tokens, accepted, drafts) if queue_next else []
        w.launched.set()
        verified = unpack(w.readback.wait(), width, [None] * len(entries))
        w.lookahead.place([entries[i].start + 1 + verified.accepted[i] for i in queued_rows])
        return self.full.propose(entries, verified)

    def _queue_chained(self, entries: list[Scheduled], tokens: torch.Tensor, accepted: torch.Tensor,
                       drafts: torch.Tensor) -> list[int]:
        """Queues the verify (and the head's chain) after this one when every entry may continue:
        its ids are the bonus token and the drafts, its start is start + accepted + 1, all on the
        device (worker/lookahead.py). tokens [B, K+1], accepted [B], drafts [B, k]. Returns the rows queued."""
        w = self.w
        keep = w.lookahead.next_chained(entries)
        if not keep:
            return []
        dev, k = w.device, entries[0].k_next
        nxt = [Scheduled(e.request, e.start + 1, 1, k, k) for e in entries]  # their starts: lower bounds
        starts = torch.empty(len(entries), dtype=torch.int64, device=dev)  # [B] start + 1 + accepted, filled below
        src = DeviceStarts(starts, h2d([e.start for e in entries], torch.int64, dev), accepted, tokens, drafts[:, :k])
        out = self._forward_at(nxt, src)
        if out is None:
            return []
        logits, hidden = out
        n = len(nxt)
        positions = None  # the noise positions [n, k+1], after the pending one: only sampled rows draw
        if not all(e.request.params.greedy for e in nxt):
            positions = (starts + 1).unsqueeze(1) + torch.arange(k + 1, device=dev)
        assert w.proposer is not None and w.chains_on_device
        chain = w.proposer.chain
        reqs = [e.request for e in nxt]
        launched = w.verifier.launch(
            nxt, logits, lambda t, a: chain(reqs, [e.start for e in nxt], [k + 1] * n, [k] * n, t, a, hidden,
                                            device_starts=starts),
            positions=positions, draft_ids=drafts[:, :k],
            greedy=self.full.graph_verified(nxt, logits, queued=True))
        if launched.drafts is None:
            return []
        w.lookahead.queue_chained(nxt, k, launched.tokens, launched.accepted, launched.drafts.clone())
        return keep

    def _forward_at(self, entries: list[Scheduled], src: DeviceStarts
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The target's logits (and the streams a head reads) of a verify whose ids and starts come
        from the verify before, on the device (each entry's host start only a lower bound), or None
        where it cannot be queued (CUDA without a graph for it)."""
        w = self.w
        counts = [1 + e.num_drafts for e in entries]
        tables = [e.request.blocks for e in entries]
        layers = w.hidden_layers
        rows = list(range(sum(counts)))
        starts = [e.start for e in entries]
        if w.graphs is not None and w.graphs.hidden_layers == layers:
            key = w.graphs.key_for(counts, tables)
            if key is not None and layers:
                return w.graphs.run_hidden(key, None, starts, counts, tables, rows, device_starts=src)
            if key is not None:
                return w.graphs.run(key, None, starts, counts, tables, rows, device_starts=src), None
        if w.device.type == "cuda":
            return None
        ids = src.resolve()  # on the CPU nothing runs ahead: the starts are at hand
        assert ids is not None
        layout = BatchLayout.build(src.starts.tolist(), counts, tables, w.cache.block_size, w.device)
        out = w.target(ids, layout, w.cache, torch.tensor(rows), hidden_layers=layers,
                       hidden_rows=torch.arange(len(rows)) if layers else None)
        return out.logits, keep_streams(out.hidden, layout.slot_mapping, w.store)  # [T, layers * hidden] | None

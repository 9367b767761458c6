"""A plain decode step, pipelined: every entry samples one token after its one pending token. The
step starts its one host read, queues the next plain step on the device from the tokens it just
sampled (worker/lookahead.py says when, and why it is safe), and only then waits for the read."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamsd.model.graphs import forward_logits
from streamsd.model.kv_cache import h2d
from streamsd.sample.verify import Verified
from streamsd.sched.plan import EntryResult, Scheduled

if TYPE_CHECKING:
    from streamsd.worker.steps.full import FullStep
    from streamsd.worker.worker import Worker


class PlainStep:
    def __init__(self, worker: Worker, full: FullStep):
        self.w = worker
        self.full = full  # its forward and its proposing

    def run(self, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]:
        """A plain decode step, taken from the step queued ahead when it fits, and the next one
        queued before this one is read (unless not `queue_next`)."""
        w = self.w
        taken = w.lookahead.take(entries)
        if taken is None:
            tokens = w.verifier.sample_plain(entries, self.full.forward(entries)[0])  # [B]
        else:
            queued, picked = taken
            same = len(picked) == len(queued.requests)
            tokens = queued.tokens if same else queued.tokens[h2d(picked, torch.int64, w.device)]  # [B]
            if not queued.streams:
                w.skipped_streams(entries)
        w.readback.start(tokens)
        if queue_next:
            self._queue_plain(entries, tokens)
        w.launched.set()
        verified = Verified([[t] for t in w.readback.wait()], [0] * len(entries), [None] * len(entries))
        return self.full.propose(entries, verified)

    def _queue_plain(self, entries: list[Scheduled], tokens: torch.Tensor) -> None:
        """Queues the step after this plain one for every entry that may continue, from the tokens
        [B] this step sampled on the device (worker/lookahead.py)."""
        w = self.w
        keep = w.lookahead.next_rows(entries)
        if not keep:
            return
        nxt = [Scheduled(entries[i].request, entries[i].start + 1, 1, 0, 0) for i in keep]
        ids = tokens if len(keep) == len(entries) else tokens[h2d(keep, torch.int64, w.device)]  # [B']
        n = len(nxt)
        store = w.store if w.forward_layers else None  # none where the plan wants no streams
        logits = forward_logits(w.target, w.graphs, w.cache, ids, [e.start for e in nxt], [1] * n,
                                [e.request.blocks for e in nxt], list(range(n)), w.device, store)  # [B', V]
        w.lookahead.queue(nxt, w.verifier.sample_plain(nxt, logits, ahead=1), streams=store is not None or w.store is None)



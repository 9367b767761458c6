"""Steps queued one ahead (worker/lookahead.py says when, and why it is safe): a plain decode step and a
speculative step whose proposer drafts on the device (an EAGLE head's chain, the synthetic
proposer's gather) each start their one host read, queue the next step from their results still on
the device, and only then wait for the read. The worker calls these for the steps `Lookahead.serves`
(plain) and `Lookahead.chains` (chained) accept; every other step takes its full path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamsd.model.device_layout import DeviceStarts
from streamsd.model.graphs import forward_logits
from streamsd.model.kv_cache import BatchLayout, h2d
from streamsd.model.stream_store import keep_streams
from streamsd.sample.verify import Verified, unpack
from streamsd.sched.plan import EntryResult, Scheduled
from streamsd.spec_decode.proposer import pair_slot
from streamsd.worker.lookahead import Lookahead

if TYPE_CHECKING:
    from streamsd.worker.worker import Worker


def plain_step(w: Worker, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]:
    """A plain decode step, taken from the step queued ahead when it fits, and the next one
    queued before this one is read (unless not `queue_next`)."""
    taken = w.lookahead.take(entries)
    if taken is None:
        tokens = w.verifier.sample_plain(entries, w._forward(entries)[0])  # [B]
    else:
        queued, picked = taken
        same = len(picked) == len(queued.requests)
        tokens = queued.tokens if same else queued.tokens[h2d(picked, torch.int64, w.device)]  # [B]
    w.readback.start(tokens)
    if queue_next:
        _queue_plain(w, entries, tokens)
    w.launched.set()
    verified = Verified([[t] for t in w.readback.wait()], [0] * len(entries), [None] * len(entries))
    return w._propose(entries, verified)


def _queue_plain(w: Worker, entries: list[Scheduled], tokens: torch.Tensor) -> None:
    """Queues the step after this plain one for every entry that may continue, from the tokens
    [B] this step sampled on the device (worker/lookahead.py)."""
    keep = w.lookahead.next_rows(entries)
    if not keep:
        return
    nxt = [Scheduled(entries[i].request, entries[i].start + 1, 1, 0, 0) for i in keep]
    ids = tokens if len(keep) == len(entries) else tokens[h2d(keep, torch.int64, w.device)]  # [B']
    n = len(nxt)
    logits = forward_logits(w.target, w.graphs, w.cache, ids, [e.start for e in nxt], [1] * n,
                            [e.request.blocks for e in nxt], list(range(n)), w.device, w.store)  # [B', V]
    w.lookahead.queue(nxt, w.verifier.sample_plain(nxt, logits, ahead=1))


def chained_step(w: Worker, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]:
    """A speculative step whose drafts its proposer makes on the device behind the verify (`chain`),
    taken from the step queued ahead when it fits, and the next one queued before this one is read.
    Entries that only follow the queued step (`Lookahead.follows`) take its full path if it is gone."""
    taken = w.lookahead.take(entries)
    if taken is None and not Lookahead.chains(entries):
        return w._step(entries)
    if taken is None:
        logits, hidden = w._forward(entries)  # [rows, V], [tokens, layers * hidden]
        launched = w.verifier.launch(entries, logits, w._chain(entries, hidden),
                                     greedy=w._graph_verified(entries, logits))
        if launched.drafts is None:  # no graph fits this batch: propose after the read
            return w._propose(entries, w.verifier.read(launched))
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
    queued_rows = _queue_chained(w, entries, tokens, accepted, drafts) if queue_next else []
    w.launched.set()
    verified = unpack(w.readback.wait(), width, [None] * len(entries))
    w.lookahead.place([entries[i].start + 1 + verified.accepted[i] for i in queued_rows])
    return w._propose(entries, verified)


def _queue_chained(w: Worker, entries: list[Scheduled], tokens: torch.Tensor, accepted: torch.Tensor,
                   drafts: torch.Tensor) -> list[int]:
    """Queues the verify (and the head's chain) after this one when every entry may continue:
    its ids are the bonus token and the drafts, its start is start + accepted + 1, all on the
    device (worker/lookahead.py). tokens [B, K+1], accepted [B], drafts [B, k]. Returns the rows queued."""
    keep = w.lookahead.next_chained(entries)
    if not keep:
        return []
    dev, k = w.device, entries[0].k_next
    nxt = [Scheduled(e.request, e.start + 1, 1, k, k) for e in entries]  # their starts: lower bounds
    starts = torch.empty(len(entries), dtype=torch.int64, device=dev)  # [B] start + 1 + accepted, filled below
    src = DeviceStarts(starts, h2d([e.start for e in entries], torch.int64, dev), accepted, tokens, drafts[:, :k])
    out = _forward_at(w, nxt, src)
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
        greedy=w._graph_verified(nxt, logits, queued=True))
    if launched.drafts is None:
        return []
    w.lookahead.queue_chained(nxt, k, launched.tokens, launched.accepted, launched.drafts.clone())
    return keep


def _forward_at(w: Worker, entries: list[Scheduled], src: DeviceStarts
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The target's logits (and the streams a head reads) of a verify whose ids and starts come
    from the verify before, on the device (each entry's host start only a lower bound), or None
    where it cannot be queued (CUDA without a graph for it)."""
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

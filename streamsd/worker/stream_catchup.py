"""Recomputing the target's streams that plain steps left out of an EAGLE head's stream store.

A batch that decodes plain for a while stops writing the streams its head reads (StepPlan.wants_streams):
on a GPU those writes were 10-13 % of a plain step at batch 64. When a request drafts again its head
needs the streams of every position it skipped (model/stream_store.py), so the target runs once more
over those positions, with their own block tables for attention, but every K/V write goes to the
scratch block no request owns (the one CUDA-graph padding writes to) and only the streams land in the
store, at the positions' real slots. Attention then reads each position's K/V, its own included, as
the plain steps wrote it: the target's cache is untouched, so rewritten K/V of other bits (another
kernel, another batch shape) can never change what the target computes next.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore, keep_streams

#: The most positions one recomputing forward covers (longer catch-ups take several).
MAX_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class Span:
    """Positions start .. end - 1 of one request: their tokens and its block table."""

    tokens: list[int]  # the request's tokens, from position 0 on (at least up to end)
    table: list[int]
    start: int
    end: int


def recompute_streams(target: Transformer, cache: PagedKVCache, store: StreamStore, scratch_block: int,
                      spans: list[Span], device: torch.device, max_tokens: int = MAX_TOKENS) -> None:
    """Writes the streams of every span's positions into `store` at their KV slots; the target's
    K/V writes go to `scratch_block`. Every position below a span's end must hold its K/V already."""
    batch: list[Span] = []
    size = 0
    for span in _pieces(spans, max_tokens):
        if batch and size + span.end - span.start > max_tokens:
            _forward(target, cache, store, scratch_block, batch, device)
            batch, size = [], 0
        batch.append(span)
        size += span.end - span.start
    if batch:
        _forward(target, cache, store, scratch_block, batch, device)


def _pieces(spans: list[Span], max_tokens: int) -> list[Span]:
    """The spans cut to at most max_tokens positions each (attention reads the cache, not the batch,
    so a later piece sees the earlier ones' K/V as well)."""
    out = []
    for s in spans:
        for lo in range(s.start, s.end, max_tokens):
            out.append(replace(s, start=lo, end=min(lo + max_tokens, s.end)))
    return out


def _forward(target: Transformer, cache: PagedKVCache, store: StreamStore, scratch_block: int, spans: list[Span],
             device: torch.device) -> None:
    bs = cache.block_size
    starts, counts = [s.start for s in spans], [s.end - s.start for s in spans]
    layout = BatchLayout.build(starts, counts, [s.table for s in spans], bs, device)
    t = sum(counts)
    # The K/V writes into the scratch block (several tokens share a slot there: nothing reads it).
    scratch = torch.arange(t, device=device) % bs + scratch_block * bs
    ids = h2d([tok for s in spans for tok in s.tokens[s.start : s.end]], torch.int64, device)
    out = target(ids, replace(layout, slot_mapping=scratch), cache, torch.empty(0, dtype=torch.int64, device=device),
                 hidden_layers=store.layers, hidden_rows=torch.arange(t, device=device))
    keep_streams(out.hidden, layout.slot_mapping, store)

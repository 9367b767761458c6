"""Choosing draft tokens by the draft policy, shared by the proposers that run a model.

Below a request's greedy threshold its draft is the argmax (one-hot q); above it, a sample from the
warped draft distribution at the request's own parameters, with noise keyed by (seed, position,
DRAFT), and that q goes to the q pool for the rejection sampler.
"""

from __future__ import annotations

import torch

from streamsd.model.kv_cache import h2d
from streamsd.request import Request
from streamsd.sample import rng
from streamsd.sample.greedy import row_argmax
from streamsd.sample.sampler import sample_rows
from streamsd.sample.warp import WarpParams, warp
from streamsd.spec_decode.proposer import ProposeItem


class DraftPicker:
    """Draft position j's tokens for the active rows of one propose call. The per-request tensors
    of sampled drafts are made on first need: an all-greedy call copies nothing to the device."""

    def __init__(self, items: list[ProposeItem], q_pool: torch.Tensor, vocab: int):
        self.items = items
        self.reqs = [it.request for it in items]
        self.q_pool = q_pool  # [slots, K, V]
        self.vocab = vocab
        self._rows: tuple[WarpParams, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def pick(self, logits: torch.Tensor, active: list[int], idx: torch.Tensor | slice, j: int) -> torch.Tensor:
        """logits [A, V] of the rows `active` (`idx` selects them on the device) -> tokens [A]."""
        if all(self.reqs[i].greedy_draft for i in active):  # host-side: no sync on a device mask
            return row_argmax(logits)
        wp, greedy, seeds, base = self._per_request(logits.device)
        sub = WarpParams(wp.temperature[idx], wp.top_k[idx], wp.top_p[idx], wp.min_p[idx], wp.needs_sort)
        tokens, q = draw_drafts(logits, sub, greedy[idx], seeds[idx], base[idx] + j)  # [A], [A, V]
        store_dense_q(self.q_pool, [self.reqs[i] for i in active], j, q)
        return tokens

    def _per_request(self, dev: torch.device) -> tuple[WarpParams, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._rows is None:
            reqs = self.reqs
            self._rows = (
                WarpParams.build([(r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p)
                                  for r in reqs], dev),
                h2d([r.greedy_draft for r in reqs], torch.bool, dev),  # [Bd]
                h2d([r.seed for r in reqs], torch.int64, dev),  # [Bd]
                h2d([len(it.tokens) for it in self.items], torch.int64, dev),  # [Bd] position of draft 0
            )
        return self._rows


def draw_drafts(logits: torch.Tensor, wp: WarpParams, greedy: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft per row: logits [A, V], per-row warp, greedy [A], seeds [A], positions [A] ->
    (tokens [A], q [A, V]). Greedy rows take the argmax; the others race over their warped q with
    noise keyed by (seed, position, DRAFT). Host-free, so a CUDA graph can capture it."""
    q = warp(logits, wp)  # [A, V]
    noise = rng.exponentials(seeds, positions.unsqueeze(-1), rng.DRAFT, q.shape[-1])[:, 0]  # [A, V]
    return sample_rows(q, logits, greedy, noise), q


def store_dense_q(q_pool: torch.Tensor, reqs: list[Request], j: int, q: torch.Tensor) -> None:
    """Keep draft position j's q [A, V] of the sampling requests in the pool, in one indexed write."""
    rows = [a for a, r in enumerate(reqs) if r.q_slot is not None and not r.greedy_draft]
    if rows:
        slots = h2d([reqs[a].q_slot for a in rows], torch.int64, q.device)  # [D]
        q_pool[slots, j] = q[h2d(rows, torch.int64, q.device)]

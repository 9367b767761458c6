"""The proposer interface: after verification, guess the next k tokens of each request.

A proposer returns draft ids per request and, for requests that sample their drafts, writes the
warped draft distribution q of every draft into the worker's q pool at the request's slot; all
other drafts are one-hot (greedy drafts, n-gram lookups), which the rejection sampler knows from
the request's `greedy_draft` flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from streamsd.request import Request

if TYPE_CHECKING:
    from streamsd.model.graphs import GraphConfig, GraphRunner
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.llama import Transformer
    from streamsd.model.stream_store import StreamStore


@dataclass(slots=True)
class ProposeItem:
    request: Request
    tokens: list[int]  # every known token of the request after this step
    k: int  # drafts wanted; 0 = only keep the proposer's own state (cache) up to `upto`
    upto: int  # tokens the target has computed; a draft model may catch its cache up to here
    draft_computed: int  # tokens the proposer's cache validly holds now


@dataclass(slots=True)
class Proposal:
    draft_ids: list[int]
    draft_computed: int
    draft_parents: list[int] = field(default_factory=list)  # a draft tree's parents (spec_decode/tree.py); [] a chain


def pair_slot(slot: int, pool_rows: int) -> int:
    """A request's other q-pool row: a verify queued ahead drafts there, and the request moves over
    when it is taken (a dropped one leaves the row the next verify reads untouched). The pool has two
    rows a slot and a spare: [0, n) | [n, 2n) | 2n."""
    half = (pool_rows - 1) // 2
    return slot + half if slot < half else slot - half


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A proposer's own transformer, for the worker to time and to capture graphs of."""

    model: Transformer
    cache: PagedKVCache
    graphs: GraphRunner | None


class Proposer:
    """What every proposer is and declares. The worker, the builder and the profiler read these
    declarations; nothing asks an object what it happens to have. A subclass sets the class
    attributes that differ and overrides the hooks it implements.
    """

    #: Drafts may be sampled with a dense q (needs q pool slots); False: every draft is one-hot.
    dense: bool = False
    #: Keeps a KV cache that must follow the target's prefill chunks.
    keeps_cache: bool = False
    #: Tokens past a position that its KV slot in the proposer's cache also depends on (an EAGLE head's
    #: slot t holds token t + 1): a cached prefix block's key includes them (sched/prefix_cache.py).
    kv_next_tokens: int = 0
    #: The target layers whose residual streams it drafts from (an EAGLE head); () needs none.
    hidden_layers: tuple[int, ...] = ()
    #: Drafts its next chain on the device behind a verify, with no host read in between (`chain`).
    chains_on_device: bool = False
    #: May propose fewer drafts than asked (a lookup that finds no match): a draft it did not propose
    #: yields no token, so the adaptive policy counts the shortfall as a rejection where the drafts ran out.
    may_propose_fewer: bool = False
    #: How conditional acceptance rises with draft depth, per acceptance class (measured for a head).
    depth_steps: tuple[tuple[str, tuple[float, ...]], ...] = ()
    #: The target's streams per KV slot, kept for the proposer to catch up from (model/stream_store.py).
    store: StreamStore | None = None

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        raise NotImplementedError

    def chain(self, reqs: list[Request], starts: list[int], counts: list[int], ks: list[int], tokens: torch.Tensor,
              accepted: torch.Tensor, streams: torch.Tensor | None,
              device_starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """The next drafts [B, max k] on the device, queued behind a verify whose accepted counts [B]
        are still there; None when it cannot (the caller then proposes after its read). Only called
        when `chains_on_device`."""
        raise NotImplementedError

    def draft_model(self) -> DraftModel | None:
        """Its own transformer, if it runs one (timed by the profiler, graphed on CUDA)."""
        return None

    def enable_cuda(self, graphs: GraphConfig | None, scratch_block: int) -> None:
        """Move onto the CUDA kernels the target now uses, and make CUDA graphs of `graphs`' shape
        (None: stay eager). Called once, after the target's own set-up."""

    def capture_graphs(self, max_batch: int) -> None:
        """Capture every graph a call over at most `max_batch` requests replays."""

    def catch_up_pass(self, n: int, table: list[int]) -> torch.Tensor:
        """One eager catch-up over the first n positions of a sequence whose blocks are `table`, for
        the profiler to time. Only a proposer with a `store` catches up from it."""
        raise NotImplementedError

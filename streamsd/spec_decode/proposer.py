"""The proposer interface: after verification, guess the next k tokens of each request.

A proposer returns draft ids per request and, for requests that sample their drafts, writes the
warped draft distribution q of every draft into the worker's q pool at the request's slot; all
other drafts are one-hot (greedy drafts, n-gram lookups), which the rejection sampler knows from
the request's `greedy_draft` flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from streamsd.request import Request


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


class Proposer(Protocol):
    #: True when drafts may be sampled with a dense q (needs q pool slots).
    dense: bool
    #: True when the proposer keeps a KV cache that must follow the target's prefill chunks.
    keeps_cache: bool

    def propose(self, items: list[ProposeItem]) -> list[Proposal]: ...

"""Plain decode steps, pipelined: the next step is queued on the device before this one is read.

In a plain decode step (every request computes its one pending token; no drafts to verify, none to
propose) the host knows the next step's inputs in advance except the token ids: positions move on
by one, the block tables stay (the scheduler keeps the block of every known token), seeds and
sampling parameters are the requests'. The ids are the tokens this step sampled, on the device. So
step N+1 is queued right behind step N and the host reads N while the GPU runs N+1: the engine's
host work between two steps (applying N, detokenising, scheduling N+1) hides behind the GPU's.

The next plan takes the queued step when its entries are the queued ones, or a subset in the same
order (requests that finished at step N drop out; their rows were computed for nothing), at the same
positions and blocks. A queued speculative step also serves a plan that proposes fewer drafts after
it, or none (its own drafts are cut): `Lookahead.follow` pins the scheduler's next plan to it when the
policy leaves speculation or drafts shallower, since the queued step is GPU time already spent —
dropping it had cost a whole step per switch. Any other plan (a request joins, a prompt chunk) drops it.
The scheduler knows none of this: it plans in tokens, takes the pins, and holds the KV margin the
queued steps write (`kv_margin`) as a token count the builder gives it. A dropped
step's KV writes are harmless: each wrote a request's pending token at its position, in a block the
request held, which the replacing step writes again; or the block was freed meanwhile, and its next
owner writes a position before it reads it, in queued order (one stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamsd.request import Request, Status
from streamsd.sample.verify import below_min_tokens
from streamsd.sched.plan import Pin, Scheduled


@dataclass(slots=True)
class Queued:
    """A step queued ahead: what it computes, and its results, still on the device."""

    requests: list[Request]
    starts: list[int]  # the position each row computes (a chained step's: filled in once the host knows)
    first_block: list[int]  # the index of each row's first block the step writes to
    blocks: list[list[int]]  # those blocks (the ones before are fixed while a request runs)
    k: int  # drafts verified per row (0: a plain step)
    tokens: torch.Tensor  # [B] sampled (plain), or [B, k+1] emitted, -1 past each row's
    accepted: torch.Tensor | None = None  # [B] (chained)
    drafts: torch.Tensor | None = None  # [B, k] the next drafts (chained)
    key: tuple[int, int] | None = None  # a tree step's graph (worker/tree_graphs.py): `tokens` is its whole result
    streams: bool = True  # its forward wrote an EAGLE head's streams (a plain step's plan may want none)


class Lookahead:
    def __init__(self, block_size: int, enabled: bool):
        self.block_size = block_size
        self.enabled = enabled
        self.queued: Queued | None = None
        # Speculative steps too (the runtime gave the q pool a second half, see `pair_slot`).
        self.chained = False
        # Set where chained steps verify past max_tokens (SchedulerConfig.drafts_past_max_tokens): the
        # context length a queued step may not pass. None: a row is queued only while max_tokens leaves
        # room for both steps' k + 1 tokens.
        self.past_max_tokens_within: int | None = None
        self.taken = 0  # steps served by a queued step
        self.dropped = 0  # queued steps thrown away
        # The next step may queue one behind it (`follow` decides, the worker's next step reads it).
        self.queue_next = True

    def queue_chains(self, max_model_len: int) -> None:
        """Queue speculative steps ahead too, for a proposer that drafts on the device (the q pool
        then has a second half: `pair_slot`); a queued step verifies past max_tokens but never past
        `max_model_len` (SchedulerConfig.drafts_past_max_tokens)."""
        self.chained = True
        self.past_max_tokens_within = max_model_len

    @property
    def queues_speculative(self) -> bool:
        """Speculative steps are queued ahead too (a chained proposer on a pipelined worker)."""
        return self.enabled and self.chained

    @staticmethod
    def serves(entries: list[Scheduled]) -> bool:
        """A plain decode step: each entry samples one token after its one pending token, nothing
        asks for its logits' log-probabilities."""
        return bool(entries) and all(
            e.num_tokens == 1 and e.num_drafts == 0 and e.verifies and e.request.params.logprobs is None
            for e in entries)

    @staticmethod
    def chains(entries: list[Scheduled]) -> bool:
        """A speculative step a chained proposer (EAGLE, synthetic) can run queued ahead: every entry verifies
        its one pending token and k drafts and proposes k again (one k for all), no log-probabilities,
        no penalties (the step queued behind it would count tokens the host does not know yet)."""
        if not entries:
            return False
        k = entries[0].num_drafts
        return k > 0 and all(e.num_tokens == 1 and e.num_drafts == k and e.k_next == k and e.verifies
                             and e.request.params.logprobs is None and not e.request.params.penalised
                             for e in entries)

    def take(self, entries: list[Scheduled]) -> tuple[Queued, list[int]] | None:
        """The queued step and the rows of it these entries are, when it computed exactly their
        tokens; else None (a queued step is dropped either way: it serves one plan at most)."""
        q, self.queued = self.queued, None
        if q is None:
            return None
        rows: list[int] = []
        j = 0
        for e in entries:
            while j < len(q.requests) and q.requests[j] is not e.request:
                j += 1
            if j == len(q.requests) or not self._same(q, j, e):
                self.dropped += 1
                return None
            rows.append(j)
            j += 1
        self.taken += 1
        return q, rows

    @staticmethod
    def _same(q: Queued, j: int, e: Scheduled) -> bool:
        first, blocks = q.first_block[j], q.blocks[j]
        # k_next below a speculative step's k: the drafts it made are cut (or unused).
        return (q.starts[j] == e.start and e.num_drafts == q.k and e.k_next <= q.k
                and e.request.blocks[first : first + len(blocks)] == blocks)

    def follow(self, k_of: Callable[[Request], int]) -> dict[int, Pin]:
        """The scheduler's pins for its next plan (`Scheduler.schedule`), given the k it gives each
        request: where that k changes what the queued step computes, the step is taken anyway: its
        GPU time is spent (dropping it cost a whole step per switch on an H200). Leaving
        speculation or drafting shallower, its requests verify the drafts it verifies and propose
        what the k says; entering speculation, they take the plain step and propose nothing, and
        nothing is queued behind it (`queue_next`), so that the next step can start drafting.
        Deeper drafts than it verifies cannot follow it: it is dropped. Returns (drafts to verify,
        to propose) by id(request) where they differ from the k. Called while the worker is idle."""
        q, self.queue_next = self.queued, True
        if q is None:
            return {}
        wants = [(r, k_of(r)) for r in q.requests if r.status is Status.RUNNING]
        if q.k == 0:
            entering = {id(r): (0, 0) for r, k in wants if k > 0}
            self.queue_next = not entering
            return entering
        return {id(r): (q.k, k) for r, k in wants if k < q.k}

    def take_queue_next(self) -> bool:
        """Whether the step about to run may queue one behind it (once: the next plan decides anew)."""
        allowed, self.queue_next = self.queue_next, True
        return allowed

    def follows(self, entries: list[Scheduled]) -> bool:
        """A speculative step is queued and these entries verify its drafts, proposing fewer after
        them (`chains` covers the same number): the worker's chained path takes it."""
        q = self.queued
        return (q is not None and q.k > 0 and bool(entries)
                and all(e.num_tokens == 1 and e.num_drafts == q.k and e.k_next < q.k and e.verifies
                        and e.request.params.logprobs is None for e in entries))

    def forget_finished(self) -> None:
        """Drops a queued step whose requests have all finished (rows queued near their ends, which the
        last of them did not need): no plan would take it."""
        q = self.queued
        if q is not None and all(r.finished for r in q.requests):
            self.drop()

    def drop(self) -> None:
        if self.queued is not None:
            self.queued = None
            self.dropped += 1

    def next_rows(self, entries: list[Scheduled]) -> list[int]:
        """The entries of a plain step whose next step can be queued now: those still running after
        it unless a stop token ends them, with their next position's block already held. None when
        the next step will not be plain (drafts proposed now), when a request is penalised (its next
        step's penalties count the token this one samples, which the host does not know yet) or the
        lookahead is off."""
        if not self.enabled or any(e.k_next or e.request.params.penalised for e in entries):
            return []
        bs = self.block_size
        return [i for i, e in enumerate(entries)
                if len(e.request.output_ids) + 1 < e.request.params.max_tokens
                and (e.start + 1) // bs < len(e.request.blocks)]

    def next_chained(self, entries: list[Scheduled]) -> list[int]:
        """All entries of a chained step (`chains`) when each one's next step can be queued now: far
        enough from max_tokens that it verifies its k drafts whatever this step emits (up to k + 1;
        proposing fewer after them near the end, the scheduler's next plan still takes it), or, where
        drafts run past max_tokens, from the end of the context (a row that ends meanwhile is left
        out of the next plan, which still takes the rest); past
        min_tokens (no stops to suppress), with the blocks it writes already held (the scheduler
        reserves them: `kv_margin`); else none."""
        k = entries[0].k_next
        if not self.queues_speculative or k == 0 or any(e.k_next != k for e in entries):
            return []
        reach, bs, limit = chained_reach(k), self.block_size, self.past_max_tokens_within
        rows = [i for i, e in enumerate(entries)
                if (len(e.request.output_ids) + 2 * (k + 1) <= e.request.params.max_tokens if limit is None
                    else e.start + reach <= limit)
                and not below_min_tokens(e.request)
                and len(e.request.blocks) * bs >= e.start + reach]
        # A row left out would most likely be in the next plan, which would then drop the queued step.
        return rows if len(rows) == len(entries) else []

    def queue(self, entries: list[Scheduled], tokens: torch.Tensor, streams: bool = True) -> None:
        """Records the plain step just queued (`entries`: each a position past this step's) and its tokens [B];
        `streams`: whether its forward wrote the head's streams."""
        bs = self.block_size
        self.queued = Queued([e.request for e in entries], [e.start for e in entries],
                             [e.start // bs for e in entries], [[e.request.blocks[e.start // bs]] for e in entries],
                             0, tokens, streams=streams)

    def queue_chained(self, entries: list[Scheduled], k: int, tokens: torch.Tensor, accepted: torch.Tensor,
                      drafts: torch.Tensor) -> None:
        """Records the chained step just queued for `entries` (each start a lower bound; the real ones
        follow: `place`)."""
        bs, reach = self.block_size, chained_reach(k)
        first = [e.start // bs for e in entries]
        blocks = [e.request.blocks[f : -(-(e.start + reach) // bs)] for e, f in zip(entries, first, strict=True)]
        self.queued = Queued([e.request for e in entries], [], first, blocks, k, tokens, accepted, drafts)

    def queue_tree(self, entries: list[Scheduled], k: int, result: torch.Tensor, key: tuple[int, int],
                   reach: int) -> None:
        """Records the tree step just queued (worker/steps/tree.py) for `entries`: its graph's result, its
        rows' starts still to come (`place`), the blocks it may write up to `reach` past them."""
        bs = self.block_size
        first = [e.start // bs for e in entries]
        blocks = [e.request.blocks[f : -(-(e.start + reach) // bs)] for e, f in zip(entries, first, strict=True)]
        self.queued = Queued([e.request for e in entries], [], first, blocks, k, result, key=key)

    def place(self, starts: list[int]) -> None:
        """The chained step queued last starts its rows here (known once this step is read)."""
        if self.queued is not None and not self.queued.starts:
            self.queued.starts = starts


def chained_reach(k: int) -> int:
    """Positions past a chained step's start that the step queued behind it may write: its verify
    (start + 1 + accepted <= start + k + 1, then k drafts) and its head's chain (k - 1 slots more),
    with room to spare; the scheduler holds them (`kv_margin`)."""
    return 3 * k + 3


@dataclass(frozen=True, slots=True)
class KVMargin:
    """Tokens of KV a request that drafts needs beyond what the scheduler's plan writes, while
    speculative steps of up to k drafts are queued ahead (SchedulerConfig.drafting_reserve and
    drafting_keep)."""

    reserve: int  # past a step that proposes drafts: the verify queued behind it writes k + 1 more
    # Past the request's known tokens after each step: what a step queued ahead may write, 3 (k + 1)
    # past the last step's start (`chained_reach`), num_tokens being 2 past it or more. A step whose
    # blocks changed is dropped; with 2 (k + 1) the trim freed the last of them when nothing was
    # accepted at k >= 2 (on an H200 at B = 64, k = 2 dropped 10 of 21 queued steps, k = 1 none).
    keep: int


def kv_margin(k: int) -> KVMargin:
    """The KV margin speculative steps of up to k drafts queued ahead write (KVMargin)."""
    return KVMargin(k + 1, chained_reach(k))


class Readback:
    """The step's one host read, started before the next step is queued and waited for after, so
    that it waits for this step's work only (a plain `.tolist()` would wait for the queued one too)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None  # pinned: a device-to-host copy into it does not block
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._view: torch.Tensor | None = None  # the values' place in it (or the values, on a CPU)

    def start(self, values: torch.Tensor) -> None:
        """Queues the copy of values (int64, any shape)."""
        if self._event is None:
            self._view = values
            return
        n = values.numel()
        if self._host is None or self._host.shape[0] < n:
            self._host = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        self._view = self._host[:n].view(values.shape)
        self._view.copy_(values, non_blocking=True)
        self._event.record()

    def wait(self) -> list:
        assert self._view is not None
        if self._event is not None:
            self._event.synchronize()
        return self._view.tolist()

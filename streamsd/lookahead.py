"""Plain decode steps, pipelined: the next step is queued on the device before this one is read.

In a plain decode step (every request computes its one pending token; no drafts to verify, none to
propose) the host knows the next step's inputs in advance except the token ids: positions move on
by one, the block tables stay (the scheduler keeps the block of every known token), seeds and
sampling parameters are the requests'. The ids are the tokens this step sampled, on the device. So
step N+1 is queued right behind step N and the host reads N while the GPU runs N+1: the engine's
host work between two steps (applying N, detokenising, scheduling N+1) hides behind the GPU's.

The next plan takes the queued step when its entries are the queued ones, or a subset in the same
order (requests that finished at step N drop out; their rows were computed for nothing), at the same
positions and blocks. Any other plan (a request joins, drafts, a prompt chunk) drops it. A dropped
step's KV writes are harmless: each wrote a request's pending token at its position, in a block the
request held, which the replacing step writes again; or the block was freed meanwhile, and its next
owner writes a position before it reads it, in queued order (one stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamsd.request import Request
from streamsd.step import Scheduled


@dataclass(slots=True)
class Queued:
    """A step queued ahead: what it computes, and its sampled tokens, still on the device."""

    requests: list[Request]
    starts: list[int]  # the position each row computes
    blocks: list[int]  # the cache block each row's K/V went to
    tokens: torch.Tensor  # [B] sampled, unread


class Lookahead:
    def __init__(self, block_size: int, enabled: bool):
        self.block_size = block_size
        self.enabled = enabled
        self.queued: Queued | None = None
        self.taken = 0  # steps served by a queued step
        self.dropped = 0  # queued steps thrown away

    @staticmethod
    def serves(entries: list[Scheduled]) -> bool:
        """A plain decode step: each entry samples one token after its one pending token, nothing
        asks for its logits' log-probabilities."""
        return bool(entries) and all(
            e.num_tokens == 1 and e.num_drafts == 0 and e.verifies and e.request.params.logprobs is None
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
            r = e.request
            if j == len(q.requests) or q.starts[j] != e.start or r.blocks[e.start // self.block_size] != q.blocks[j]:
                self.dropped += 1
                return None
            rows.append(j)
            j += 1
        self.taken += 1
        return q, rows

    def drop(self) -> None:
        if self.queued is not None:
            self.queued = None
            self.dropped += 1

    def next_rows(self, entries: list[Scheduled]) -> list[int]:
        """The entries of a plain step whose next step can be queued now: those still running after
        it unless a stop token ends them, with their next position's block already held. None when
        the next step will not be plain (drafts proposed now) or the lookahead is off."""
        if not self.enabled or any(e.k_next for e in entries):
            return []
        bs = self.block_size
        return [i for i, e in enumerate(entries)
                if len(e.request.output_ids) + 1 < e.request.params.max_tokens
                and (e.start + 1) // bs < len(e.request.blocks)]

    def queue(self, entries: list[Scheduled], tokens: torch.Tensor) -> None:
        """Records the step just queued (`entries`: each a position past this step's) and its tokens [B]."""
        bs = self.block_size
        self.queued = Queued([e.request for e in entries], [e.start for e in entries],
                             [e.request.blocks[e.start // bs] for e in entries], tokens)


class Readback:
    """The step's one host read, started before the next step is queued and waited for after, so
    that it waits for this step's work only (a plain `.tolist()` would wait for the queued one too)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None  # pinned: a device-to-host copy into it does not block
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._n = 0

    def start(self, tokens: torch.Tensor) -> None:
        """Queues the copy of tokens [B] (int64)."""
        self._n = tokens.shape[0]
        if self._event is None:
            self._host = tokens
            return
        if self._host is None or self._host.shape[0] < self._n:
            self._host = torch.empty(max(self._n, 256), dtype=torch.int64, pin_memory=True)
        self._host[: self._n].copy_(tokens, non_blocking=True)
        self._event.record()

    def wait(self) -> list[int]:
        assert self._host is not None
        if self._event is not None:
            self._event.synchronize()
        return self._host[: self._n].tolist()

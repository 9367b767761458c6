"""Prefix caching: a request starts after the full blocks of its tokens that another request (or
its own run before a preemption) already computed, holding them by reference (sched/block_pool.py).

What a block's KV depends on, and so what its key holds:
- the target's: every token up to the block's end (the parent chain and the block's own tokens);
- a draft model's (same block ids, its own cache): the same tokens, but the draft writes its
  positions only when it catches up, so a block is registered only once the draft has them too
  (`draft_kv`); a request that takes it then starts its draft after it as well;
- an EAGLE head's: its slot t holds (target stream h_t, token t + 1), so a block's last slot also
  depends on the first token after it: `next_tokens` such tokens join the key. The target's
  streams kept per slot (model/stream_store.py) are written with the target's KV: valid with it.
An n-gram proposer keeps nothing but tokens. Rejected drafts never reach a registered block:
registration stops at `computed` (accepted tokens only), past which the worker may still write.

A request that scores its prompt (`Request.scores_prompt`) takes no hits: a cached block's logits
are gone, so its prompt is computed whole; its blocks are registered as any others.

A hit never covers the last known token: its logits are needed (and the block holding it is the
one written next), so a prompt whose every full block is cached recomputes its last block.
"""

from __future__ import annotations

from collections.abc import Iterator

from streamsd.request import Request
from streamsd.sched.block_pool import ROOT, BlockPool


class PrefixCache:
    def __init__(self, pool: BlockPool, *, enabled: bool, draft_kv: bool = False, next_tokens: int = 0,
                 salt: tuple[int, ...] = ()):
        self.pool = pool
        self.bs = pool.block_size
        self.enabled = enabled
        self.draft_kv = draft_kv
        self.next_tokens = next_tokens
        self.salt = salt  # whatever else changes every block's KV (e.g. an adapter's id)

    def _max_blocks(self, r: Request) -> int:
        n = r.num_tokens
        return max(min((n - 1) // self.bs, (n - self.next_tokens) // self.bs), 0)

    def _keys(self, ids: list[int], start: int, stop: int) -> Iterator[tuple[list[int], tuple[int, ...]]]:
        """Blocks start..stop-1's keys, made as a lookup asks for them: it stops at the first miss, so a
        waiting request's peek (every step) costs its cached blocks and one more, not its whole prompt."""
        bs, nt = self.bs, self.next_tokens
        for b in range(start, stop):
            yield ids[b * bs : (b + 1) * bs], (*self.salt, *ids[(b + 1) * bs : (b + 1) * bs + nt])

    def peek(self, r: Request) -> int:
        """Tokens of `r` a claim would find cached now (nothing is held)."""
        if not self.enabled or r.blocks or r.scores_prompt:
            return r.computed
        return len(self.pool.lookup(self._keys(r.all_ids, 0, self._max_blocks(r)))) * self.bs

    def claim(self, r: Request) -> int:
        """At admission of a request that holds no KV: takes the cached blocks of its longest cached
        prefix and counts them computed, for the target and the drafter. Returns the tokens taken."""
        if not self.enabled or r.blocks or r.scores_prompt:
            return 0
        entries = self.pool.lookup(self._keys(r.all_ids, 0, self._max_blocks(r)))
        if not entries:
            return 0
        r.blocks = self.pool.acquire(entries)
        r.computed = r.draft_computed = len(entries) * self.bs
        r.prefix_blocks, r.prefix_parent = len(entries), entries[-1].uid
        return r.computed

    def admitted(self, r: Request, hit: int) -> None:
        """Counts a first admission's lookup (a preempted request's return is not a new query)."""
        if r.num_preemptions == 0:
            self.pool.queries += len(r.prompt_ids)
            self.pool.hits += hit
            r.cached_tokens = hit

    def register(self, r: Request) -> None:
        """After a step: caches the request's blocks that just became full of final KV."""
        if not self.enabled:
            return
        done = min(r.computed, r.draft_computed) if self.draft_kv else r.computed
        stop = min(done // self.bs, (r.num_tokens - self.next_tokens) // self.bs)
        if stop <= r.prefix_blocks:
            return
        ids = r.all_ids
        parent = r.prefix_parent
        for b, (tokens, extra) in enumerate(self._keys(ids, r.prefix_blocks, stop), start=r.prefix_blocks):
            parent = self.pool.register(parent, r.blocks[b], tokens, extra)
        r.prefix_blocks, r.prefix_parent = stop, parent

    @staticmethod
    def forget(r: Request) -> None:
        """The request holds no blocks any more (preempted, finished)."""
        r.prefix_blocks, r.prefix_parent = 0, ROOT

"""Prefix caching: a request starts after the full blocks of its tokens that another request (or
its own run before a preemption) already computed, holding them by reference (sched/block_pool.py).

What a block's KV depends on, and so what its key holds:
- the target's: every token up to the block's end (the parent chain and the block's own tokens);
- a draft model's (same block ids, its own cache): the same tokens;
- an EAGLE head's: its slot t holds (target stream h_t, token t + 1), so a block's last slot also
  depends on the first token after it: `next_tokens` such tokens join the key.
A block is registered as soon as the target's KV in it is final. A drafter writes its positions only
when it catches up, which it does only when it drafts: a request decoding plain (speculation off for
it, a batch too large to draft, a tree engine between trees) leaves its blocks without the drafter's
KV, and an EAGLE head's store without the target's streams where a plain stretch kept none. Each
entry records both (`Entry.draft_kv`, `Entry.streams`; this cache's `draft_kv` and `streams` say
whether the drafter keeps KV and a store at all), and a request that takes the block starts its
drafter at the first block that lacks them: the target's KV is taken whole, the drafter catches up (and the streams are
recomputed, worker/stream_catchup.py) only if the request drafts. A holder whose drafter catches up
over a shared block marks its entry, so later requests skip that catch-up.
An n-gram proposer keeps nothing but tokens. Rejected drafts never reach a registered block:
registration stops at `computed` (accepted tokens only), past which the worker may still write.

A request that scores its prompt (`Request.scores_prompt`) takes no hits: a cached block's logits
are gone, so its prompt is computed whole; its blocks are registered as any others.

A hit never covers the last known token: its logits are needed (and the block holding it is the
one written next), so a prompt whose every full block is cached recomputes its last block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from streamsd.request import Request
from streamsd.sched.block_pool import ROOT, BlockPool, Entry


class PrefixCache:
    def __init__(self, pool: BlockPool, *, enabled: bool, draft_kv: bool = False, streams: bool = False,
                 next_tokens: int = 0, salt: tuple[int, ...] = ()):
        self.pool = pool
        self.bs = pool.block_size
        self.enabled = enabled
        self.draft_kv = draft_kv
        self.streams = streams
        self.next_tokens = next_tokens
        self.salt = salt  # whatever else changes every block's KV (e.g. an adapter's id)
        # The entries found last (`_find`), the token ids they cover, and the pool's evictions then.
        self._memo: list[Entry] = []
        self._memo_ids: list[int] = []
        self._memo_evictions = 0

    def _max_blocks(self, r: Request) -> int:
        n = r.num_tokens
        return max(min((n - 1) // self.bs, (n - self.next_tokens) // self.bs), 0)

    def _keys(self, ids: Sequence[int], start: int, stop: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Blocks start..stop-1's keys (tokens, extra) over the token ids `ids`, made as they are read: a
        lookup stops at its first miss."""
        bs, nt, salt = self.bs, self.next_tokens, self.salt
        for a in range(start * bs, stop * bs, bs):
            yield tuple(ids[a : a + bs]), salt + tuple(ids[a + bs : a + bs + nt])

    def _find(self, r: Request) -> list[Entry]:
        """The cached entries of the longest cached prefix of `r`'s full blocks.

        Requests in a row often share a long prefix (a system prompt, a chat's earlier turns). The
        entries found last, with the tokens they cover, are kept: the blocks of `r` whose tokens (and
        next tokens) equal those are the same keys, so the same entries, as long as no entry has been
        evicted since. One comparison of the token lists (a few bisections where they part) replaces
        a dictionary lookup per block; the walk goes on block by block only past them."""
        m = self._max_blocks(r)
        ids = r.all_ids
        found = self._recent(ids, m)
        if len(found) < m:
            parent = found[-1].uid if found else ROOT
            found = found + self.pool.lookup(self._keys(ids, len(found), m), parent)
        if found:
            end = len(found) * self.bs + self.next_tokens
            self._memo, self._memo_ids, self._memo_evictions = found, ids[:end], self.pool.evictions
        return found

    def _recent(self, ids: list[int], m: int) -> list[Entry]:
        """Of the entries found last, those of the leading blocks (at most m) whose tokens `ids` repeat."""
        if not self._memo or self._memo_evictions != self.pool.evictions:
            return []
        bs, nt, memo = self.bs, self.next_tokens, self._memo_ids

        def same(blocks: int) -> bool:
            return ids[: blocks * bs + nt] == memo[: blocks * bs + nt]

        n = min(len(self._memo), m)
        if not same(n):
            # Where they part is usually near the end (the requests' own last blocks): step down from
            # there in growing strides, then bisect.
            high, stride = n, 1  # the first `high` blocks do not all match
            low = max(high - stride, 0)
            while low > 0 and not same(low):
                high, stride = low, stride * 2
                low = max(high - stride, 0)
            while high - low > 1:  # the first `low` blocks match (none at 0)
                mid = (low + high) // 2
                low, high = (mid, high) if same(mid) else (low, mid)
            n = low
        return self._memo[:n]

    def peek(self, r: Request) -> int:
        """Tokens of `r` a claim would find cached now (nothing is held)."""
        if not self.enabled or r.blocks or r.scores_prompt:
            return r.computed
        return len(self._find(r)) * self.bs

    def claim(self, r: Request) -> int:
        """At admission of a request that holds no KV: takes the cached blocks of its longest cached
        prefix and counts them computed, for the target and the drafter. Returns the tokens taken."""
        if not self.enabled or r.blocks or r.scores_prompt:
            return 0
        entries = self._find(r)
        if not entries:
            return 0
        r.blocks = self.pool.acquire(entries)
        ready = _leading([e.draft_kv for e in entries])
        r.computed, r.draft_computed = len(entries) * self.bs, ready * self.bs
        with_streams = _leading([e.streams for e in entries])
        if self.streams and with_streams < len(entries):
            missing = with_streams * self.bs
            r.streams_missing_from = missing if r.streams_missing_from is None else min(r.streams_missing_from, missing)
        r.prefix_blocks, r.prefix_parent, r.prefix_ready = len(entries), entries[-1].uid, ready
        return r.computed

    def admitted(self, r: Request, hit: int) -> None:
        """Counts a first admission's lookup (a preempted request's return is not a new query)."""
        if r.num_preemptions == 0:
            self.pool.queries += len(r.prompt_ids)
            self.pool.hits += hit
            r.cached_tokens = hit

    def register(self, r: Request) -> None:
        """After a step: caches the request's blocks that just became full of final target KV, and
        marks the cached ones its drafter has now caught up over."""
        if not self.enabled:
            return
        stop = min(r.computed // self.bs, (r.num_tokens - self.next_tokens) // self.bs)
        if stop > r.prefix_blocks:
            parent = r.prefix_parent
            drafted = r.draft_computed // self.bs if self.draft_kv else stop
            # Blocks whose streams the store holds: all of them unless a plain stretch kept none from
            # some position on, and any block the head has caught up over (it read them there).
            missing = r.streams_missing_from
            streamed = stop if not self.streams or missing is None else max(drafted, missing // self.bs)
            for b, (tokens, extra) in enumerate(self._keys(r.all_ids, r.prefix_blocks, stop), start=r.prefix_blocks):
                parent = self.pool.register(parent, r.blocks[b], tokens, extra, draft_kv=b < drafted,
                                            streams=b < streamed)
            r.prefix_blocks, r.prefix_parent = stop, parent
        if self.draft_kv:
            self._mark_drafted(r)

    def _mark_drafted(self, r: Request) -> None:
        """The cached blocks of `r` its drafter now holds (and so the streams it read): marked on their
        entries. Each of a request's blocks is visited once."""
        upto = min(r.prefix_blocks, r.draft_computed // self.bs)
        for b in range(r.prefix_ready, upto):
            self.pool.mark_drafted(r.blocks[b])
        r.prefix_ready = max(r.prefix_ready, upto)

    @staticmethod
    def forget(r: Request) -> None:
        """The request holds no blocks any more (preempted, finished)."""
        r.prefix_blocks, r.prefix_parent, r.prefix_ready = 0, ROOT, 0


def _leading(flags: list[bool]) -> int:
    """How many of `flags` are true before the first false one."""
    return flags.index(False) if False in flags else len(flags)

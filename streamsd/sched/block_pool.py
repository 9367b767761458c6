"""The paged KV pool's block ids: free, held by requests (reference counted), and the prefix cache.

A block full of a request's accepted tokens is registered under its key: (the key's entry of the
block before it, the block's token ids, and `extra`, anything else its KV depends on). Entries are
numbered once and never reused, so a key names one exact token prefix: a lookup needs no hash
comparison and no collision check (the dict compares the keys themselves). A later request whose
tokens start with the same blocks takes them by reference instead of computing them again.

A cached block's target KV is never written: it is registered once every position in it holds an
accepted token whose target KV is final, and a request that takes it starts computing after it. A
drafter that keeps its own KV in the same blocks (a draft model, an EAGLE head with its streams) may
not have computed the block yet: the entry says so (`draft_kv`, `streams`), and a request taking it
catches its drafter up over it, writing only the drafter's KV there (what a drafter holds changes
drafts, never what the target computes). When its last holder lets it go it stays cached,
evictable, least recently released first; it is evicted only when a request needs a block and no
free one is left. Torch-free: the scheduler owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from operator import attrgetter

ROOT = 0  # the entry "before" a prompt's first block

Key = tuple[int, tuple[int, ...], tuple[int, ...]]


@dataclass(slots=True)
class Entry:
    uid: int  # names this entry as the parent of the next block's key
    key: Key
    block: int
    draft_kv: bool = True  # the drafter's KV of the block is there (always, for a drafter that keeps none)
    streams: bool = True  # the target's streams of the block are in an EAGLE head's store


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False):
        self.total = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._table: dict[Key, Entry] = {}
        self._entry_of: dict[int, Entry] = {}  # block -> its cache entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self._uids = count(1)
        self.evictions = 0  # entries dropped from the cache so far: unchanged, every entry seen is still cached
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, found cached

    # -- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a request can take now: free, or cached and held by nobody (evicted on taking)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused(self) -> int:
        """Blocks holding nothing at all (not even a cached prefix)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._entry_of)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._entry_of

    def entry_of(self, block: int) -> Entry | None:
        return self._entry_of.get(block)

    def mark_drafted(self, block: int) -> None:
        """The drafter's KV and the target's streams of a cached block are there now (a holder's drafter
        caught up over it). A block cached under another block's entry is left alone."""
        entry = self._entry_of.get(block)
        if entry is not None:
            entry.draft_kv = entry.streams = True

    # -- holding blocks ----------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """n private blocks (free ones first, then the least recently released cached ones)."""
        assert n <= self.num_free
        cut = max(len(self._free) - n, 0)
        taken = self._free[cut:]
        del self._free[cut:]
        while len(taken) < n:
            block, _ = self._evictable.popitem(last=False)
            entry = self._entry_of.pop(block)
            del self._table[entry.key]
            self.evictions += 1
            taken.append(block)
        for b in taken:
            self._refs[b] = 1
        return taken

    def give(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each block. A cached block nobody holds stays cached, evictable; the
        last blocks of a prefix are evicted before its first ones (released in reverse order)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] > 0:
                continue
            if b in self._entry_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    # -- the prefix cache --------------------------------------------------------------------
    def key(self, parent: int, tokens: Sequence[int], extra: tuple[int, ...] = ()) -> Key:
        return (parent, tuple(tokens), extra)

    def lookup(self, keys_of: Iterable[tuple[Sequence[int], tuple[int, ...]]], parent: int = ROOT) -> list[Entry]:
        """The cached entries of the longest prefix of these blocks ((tokens, extra) each), in order;
        `parent`: the entry of the block before the first (ROOT: they start a prompt)."""
        found: list[Entry] = []
        table = self._table
        for tokens, extra in keys_of:
            entry = table.get((parent, tuple(tokens), extra))
            if entry is None:
                break
            found.append(entry)
            parent = entry.uid
        return found

    def acquire(self, entries: Sequence[Entry]) -> list[int]:
        """Holds the cached blocks of `entries` (one more reference each); their block ids."""
        blocks = list(map(attrgetter("block"), entries))
        refs = self._refs
        for b in blocks:
            if not refs[b]:
                del self._evictable[b]
            refs[b] += 1
        return blocks

    def register(self, parent: int, block: int, tokens: Sequence[int], extra: tuple[int, ...] = (), *,
                 draft_kv: bool = True, streams: bool = True) -> int:
        """Caches a held block full of final target KV under its key; returns the entry's uid (the
        next block's parent). If the same prefix is cached already, in another block, this block stays
        private and that entry's uid is returned: the chain goes on through it."""
        key = self.key(parent, tokens, extra)
        entry = self._table.get(key)
        if entry is not None:
            return entry.uid
        assert block not in self._entry_of, "a cached block is registered once"
        entry = Entry(next(self._uids), key, block, draft_kv, streams)
        self._table[key] = entry
        self._entry_of[block] = entry
        return entry.uid

    def reset_cache(self) -> None:
        """Forgets every cached prefix (held blocks stay held, now private)."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self.evictions += len(self._table)
        self._table.clear()
        self._entry_of.clear()

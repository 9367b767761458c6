"""The block pool and prefix cache on their own: reference counts, keys, LRU eviction, no torch."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from streamsd.config import SchedulerConfig
from streamsd.request import FinishReason, Request, SamplingParams
from streamsd.sched.block_pool import ROOT, BlockPool
from streamsd.sched.prefix_cache import PrefixCache
from streamsd.sched.scheduler import Scheduler


def test_the_scheduler_and_its_block_pool_import_no_torch() -> None:
    code = "import sys, streamsd.sched.scheduler, streamsd.sched.prefix_cache; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _chain(pool: BlockPool, blocks: list[int], tokens: list[list[int]]) -> None:
    parent = ROOT
    for b, t in zip(blocks, tokens, strict=True):
        parent = pool.register(parent, b, t)


def test_cached_blocks_are_shared_by_reference_and_evicted_only_when_unreferenced_lru_first() -> None:
    pool = BlockPool(4, block_size=2)
    a = pool.take(2)
    _chain(pool, a, [[1, 2], [3, 4]])
    hit = pool.lookup([([1, 2], ()), ([3, 4], ()), ([5, 6], ())])
    assert [e.block for e in hit] == a
    assert pool.acquire(hit) == a and [pool.refs(b) for b in a] == [2, 2]
    pool.give(a)
    assert [pool.refs(b) for b in a] == [1, 1] and pool.num_free == 2
    pool.give(a)  # unreferenced: cached and evictable, the deeper block first
    assert pool.num_free == 4 and pool.num_unused == 2 and pool.num_cached == 2
    taken = pool.take(3)
    assert a[1] in taken and a[0] not in taken and pool.num_cached == 1
    assert [e.block for e in pool.lookup([([1, 2], ()), ([3, 4], ())])] == [a[0]]
    pool.give(taken)
    assert pool.num_free == 4


def test_a_key_is_one_exact_prefix_and_a_duplicate_block_stays_private() -> None:
    pool = BlockPool(6, block_size=2)
    a, b = pool.take(2), pool.take(2)
    _chain(pool, a, [[1, 2], [3, 4]])
    _chain(pool, b, [[9, 9], [3, 4]])  # the same second block after another first block: another prefix
    assert [e.block for e in pool.lookup([([9, 9], ()), ([3, 4], ())])] == b
    assert pool.lookup([([1, 2], (7,))]) == []  # extra key tokens (an EAGLE head's next token) must match
    c = pool.take(1)
    assert pool.register(ROOT, c[0], [1, 2]) == pool.lookup([([1, 2], ())])[0].uid  # already cached elsewhere
    assert not pool.is_cached(c[0])
    pool.give(c)
    assert pool.num_unused == 2


def test_a_hit_never_covers_the_last_token_and_starts_the_drafter_where_its_kv_ends() -> None:
    pool = BlockPool(8, block_size=4)
    cache = PrefixCache(pool, enabled=True, draft_kv=True, streams=True)
    params = SamplingParams(max_tokens=4)
    owner = Request("o", list(range(12)), params, 0, 0.0)
    owner.blocks = pool.take(3)
    owner.computed, owner.draft_computed = 11, 2
    owner.streams_missing_from = 6  # a plain stretch kept no streams from position 6 on
    cache.register(owner)
    assert owner.prefix_blocks == 2  # the target's KV decides; the third block is not full of it
    first, second = (pool.entry_of(b) for b in owner.blocks[:2])
    assert first is not None and second is not None
    assert (first.draft_kv, first.streams, second.draft_kv, second.streams) == (False, True, False, False)

    taker = Request("t", list(range(12)) + [99], params, 0, 0.0)
    assert cache.peek(taker) == 8 and cache.claim(taker) == 8
    assert taker.computed == 8 and taker.draft_computed == 0 and taker.streams_missing_from == 4
    assert pool.refs(owner.blocks[0]) == 2

    owner.draft_computed = 8  # the owner's drafter caught up over both: the entries say so now
    cache.register(owner)
    assert first.draft_kv and first.streams and second.draft_kv and second.streams
    same = Request("s", list(range(8)), params, 0, 0.0)  # a full hit would cover its last token
    assert cache.claim(same) == 4 and same.computed == same.draft_computed == 4 and same.streams_missing_from is None


def test_with_the_cache_off_every_block_comes_back_free() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=8, max_model_len=128, enable_prefix_caching=False))
    for i in range(2):
        s.add(Request(str(i), list(range(40)), SamplingParams(max_tokens=4), 0, 0.0))
    plan, _ = s.schedule()
    assert len(plan.entries) == 2
    for r in list(s.running):
        s.finish(r, FinishReason.ABORT)
    assert s.blocks.num_unused == s.blocks.total and s.blocks.num_cached == 0


@pytest.mark.parametrize("next_tokens", [0, 1])
def test_a_lookup_through_the_prefix_found_last_finds_what_a_walk_from_the_root_finds(next_tokens: int) -> None:
    """Requests share stems and part anywhere (mid-block, in a block's next token), and a small pool
    evicts: every peek and claim finds exactly the blocks a lookup of every key from the root finds."""
    rng = random.Random(next_tokens)
    bs, salt = 4, (5,)
    pool = BlockPool(24, block_size=bs, caching=True)
    cache = PrefixCache(pool, enabled=True, next_tokens=next_tokens, salt=salt)
    stems = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]  # three token values: near-copies
    held: list[Request] = []
    for i in range(400):
        stem = rng.choice(stems)
        ids = stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        r = Request(str(i), ids, SamplingParams(max_tokens=1), 0, 0.0)
        n = len(ids)
        full = max(min((n - 1) // bs, (n - next_tokens) // bs), 0)
        keys = [(ids[a : a + bs], salt + tuple(ids[a + bs : a + bs + next_tokens])) for a in range(0, full * bs, bs)]
        expected = [e.block for e in pool.lookup(keys)]
        assert cache.peek(r) == len(expected) * bs, i
        assert cache.claim(r) == len(expected) * bs and r.blocks == expected, i
        need = -(-n // bs) - len(r.blocks)
        while need > pool.num_free:
            gone = held.pop(0)
            pool.give(gone.blocks)
        r.blocks += pool.take(need)
        r.computed = n
        cache.register(r)
        held.append(r)
        if rng.random() < 0.5:
            gone = held.pop(rng.randrange(len(held)))
            pool.give(gone.blocks)
    assert pool.evictions > 0

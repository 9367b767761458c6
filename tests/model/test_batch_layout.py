"""BatchLayout.build against the per-token definition of a flat batch: where each row goes (its KV
slot through its block table), at which position it sits (a draft tree's rows at their depth) and
what its sequence attends to."""

from __future__ import annotations

import random

import pytest
import torch

from streamsd.model.kv_cache import BatchLayout


def _reference(starts, counts, tables, bs, trees):
    positions, slots, bits, q_starts = [], [], [], []
    for i, (start, count, table) in enumerate(zip(starts, counts, tables, strict=True)):
        q_starts.append(len(positions))
        tree = trees[i] if trees is not None else None
        pre = count - len(tree[0]) if tree is not None else count
        for j, pos in enumerate(range(start, start + count)):
            positions.append(pos if tree is None or j < pre else start + pre + tree[0][j - pre])
            slots.append(table[pos // bs] * bs + pos % bs)
            bits.append(0 if tree is None or j < pre else tree[1][j - pre])
    width = max((len(t) for t in tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    tree_start = [s + c - len(t[0]) if t is not None else -1 for s, c, t in zip(starts, counts, trees, strict=True)] \
        if trees is not None else None
    return positions, slots, q_starts, padded, bits if trees is not None else None, tree_start


@pytest.mark.parametrize("seed", range(40))
def test_build_places_every_row_as_the_per_token_definition(seed):
    rng = random.Random(seed)
    n, bs = rng.randrange(0, 6), rng.choice([4, 16])
    starts = [rng.randrange(0, 60) for _ in range(n)]
    counts = [rng.randrange(1, 12) for _ in range(n)]
    # tables may hold blocks past the context (reserved for drafts)
    tables = [rng.sample(range(1000), -(-(s + c) // bs) + rng.randrange(0, 3)) for s, c in zip(starts, counts, strict=True)]
    trees = None
    if n and seed % 2:
        trees = []
        for c in counts:
            if rng.random() < 0.3:
                trees.append(None)
                continue
            w = rng.randrange(0, c + 1)
            trees.append(([rng.randrange(0, 4) for _ in range(w)], [rng.randrange(0, 2**62) for _ in range(w)]))
    layout = BatchLayout.build(starts, counts, tables, bs, torch.device("cpu"), trees)
    positions, slots, q_starts, padded, bits, tree_start = _reference(starts, counts, tables, bs, trees)
    assert layout.positions.dtype == layout.slot_mapping.dtype == torch.int64
    assert layout.positions.tolist() == positions
    assert layout.slot_mapping.tolist() == slots
    assert layout.query_starts == q_starts and layout.query_lens == counts
    assert layout.context_lens == [s + c for s, c in zip(starts, counts, strict=True)] == layout.context_lens_t.tolist()
    assert layout.query_starts_t.tolist() == q_starts + [len(positions)]
    assert layout.block_table.dtype == torch.int32 and layout.block_table.tolist() == padded
    assert (layout.tree_bits.tolist() if layout.tree_bits is not None else None) == bits
    assert (layout.tree_start.tolist() if layout.tree_start is not None else None) == tree_start

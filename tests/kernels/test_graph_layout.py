"""The step layouts CUDA graphs replay (model/graph_layout.py, model/graphs.py): packed buffers of a
verify step, a lone prompt chunk and a packed prompt step give the eager forward's logits and K/V.
On CUDA through captured graphs; on a CPU the same buffers run through the interpreted kernels."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV  # isort: skip (first: it sets the interpreter up)
import streamsd.kernels.attention.paged as pa
from streamsd.model.kv_cache import BatchLayout
from tests.kernels.kernel_helpers import rel_error


def test_padded_graph_step_matches_eager_forward(tiny_model_dir):
    """A verify-shaped step packed for a (bucket 4, width 4) graph: real rows equal the eager
    forward's, padding writes only the scratch block. On CUDA through a captured graph; on a CPU
    the same packed buffers run through the interpreted kernel, without capture."""
    from streamsd.model.graph_layout import pack_step, static_layout
    from streamsd.model.graphs import GraphConfig, GraphRunner
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.loader import load_model

    model, _ = load_model(str(tiny_model_dir), DEV, torch.float32)
    scratch, bs = 12, 16
    cache = PagedKVCache(model.args, scratch + 1, bs, torch.float32, DEV)
    lens, tables = [20, 40, 9], [[3, 0], [5, 1, 7], [2]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in lens]
    flat = [t for p in prompts for t in p]
    model(torch.tensor(flat, device=DEV), BatchLayout.build([0, 0, 0], lens, tables, bs, DEV), cache,
          torch.arange(len(flat), device=DEV))  # prefill through the reference attention
    counts = [1, 3, 2]  # a decode token and two verify windows of different lengths
    ids = torch.randint(3, model.args.vocab_size, (sum(counts),), generator=g).tolist()
    rows = list(range(sum(counts)))
    before = cache.data.clone()
    ref = model(torch.tensor(ids, device=DEV), BatchLayout.build(lens, counts, tables, bs, DEV), cache,
                torch.tensor(rows, device=DEV)).logits  # [T, V]
    written = cache.data.clone()
    cache.data.copy_(before)
    model.attend = pa.paged_attention
    if CUDA:
        runner = GraphRunner(model, cache, scratch, GraphConfig(max_blocks=8, query_widths=(1, 4)), DEV)
        key = runner.key_for(counts, tables)
        assert key == (4, 4)
        out = runner.run(key, ids, lens, counts, tables, rows).clone()
        assert runner.replays == 1
    else:
        host, table = pack_step(ids, lens, counts, tables, 4, 4, scratch, bs)
        block_table = torch.full((4, 8), scratch, dtype=torch.int32)
        block_table[: table.shape[0], : table.shape[1]] = torch.from_numpy(table)
        ids_t, layout = static_layout(torch.from_numpy(host), block_table, 4, 4, scratch)
        out = model(ids_t, layout, cache, torch.arange(16)).logits[: len(rows)]
    assert rel_error(out, ref) < 1e-4
    assert torch.allclose(cache.data[:, :, :scratch], written[:, :, :scratch], atol=1e-5)


@pytest.mark.parametrize("start,count", [(0, 20), (20, 25), (0, 32)])  # a prompt, a chunk after a prefix, a full width
def test_prompt_graph_matches_eager_prefill(tiny_model_dir, start, count):
    """A lone prompt chunk padded into a prompt graph (bucket 1, width 32): its one logits row and
    the K/V it writes equal the eager forward's; padding rows write only the scratch block. On CUDA
    through a captured graph (its second replay too); on a CPU the same packed buffer and tiles run
    through the interpreted kernels, without capture."""
    from dataclasses import replace

    from streamsd.model.graph_layout import pack_step, prompt_tile_count, prompt_tiles, static_layout
    from streamsd.model.graphs import GraphConfig, GraphRunner
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.loader import load_model

    model, _ = load_model(str(tiny_model_dir), DEV, torch.float32)
    model.attend = pa.paged_attention
    scratch, bs, table = 12, 16, [3, 0, 7, 5]
    cache = PagedKVCache(model.args, scratch + 1, bs, torch.float32, DEV)
    g = torch.Generator().manual_seed(2)
    if start:  # the cached prefix the chunk attends to
        prefix = torch.randint(3, model.args.vocab_size, (start,), generator=g).to(DEV)
        model(prefix, BatchLayout.build([0], [start], [table], bs, DEV), cache, torch.arange(start, device=DEV))
    ids = torch.randint(3, model.args.vocab_size, (count,), generator=g).tolist()
    before = cache.data.clone()
    ref = model(torch.tensor(ids, device=DEV), BatchLayout.build([start], [count], [table], bs, DEV), cache,
                torch.tensor([count - 1], device=DEV)).logits  # [1, V]
    written = cache.data.clone()
    cache.data.copy_(before)
    if CUDA:
        runner = GraphRunner(model, cache, scratch, GraphConfig(max_blocks=8, query_widths=(1, 4),
                                                                prompt_widths=(32, 64)), DEV)
        key = runner.key_for([count], [table], 1)
        assert key == (1, 32) and runner.key_for([count], [table]) is None  # opt-in: callers that say their rows
        assert runner.key_for([count, 1], [table, [2]], 1) is None  # one sequence only
        for _ in range(2):
            cache.data.copy_(before)
            out = runner.run(key, ids, [start], [count], [table], [count - 1]).clone()
            assert rel_error(out, ref) < 1e-4
    else:
        n_tiles = prompt_tile_count(32, model.args.num_heads, model.args.num_kv_heads)
        host, live = pack_step(ids, [start], [count], [table], 1, 32, scratch, bs)
        block_table = torch.full((1, 8), scratch, dtype=torch.int32)
        block_table[:, : live.shape[1]] = torch.from_numpy(live)
        ids_t, layout = static_layout(torch.from_numpy(host), block_table, 1, 32, scratch)
        tiles = torch.from_numpy(prompt_tiles(start, count, 32, n_tiles)).to(torch.int32)
        out = model(ids_t, replace(layout, prompt_tiles=tiles), cache, torch.tensor([count - 1])).logits
        assert rel_error(out, ref) < 1e-4
    assert torch.allclose(cache.data[:, :, :scratch], written[:, :, :scratch], atol=1e-5)


def test_packed_prompt_graph_matches_eager_mixed_step(tiny_model_dir):
    """A prompt step of a loaded server, packed into a prompt graph of 8 sequences and 64 token
    slots: a chunk after a cached prefix, a fresh prompt and two decode rows. Each sequence's last
    row of logits and the K/V the step writes equal the eager forward's; padding writes only the
    scratch block. On CUDA through a captured graph (replayed twice); on a CPU the same packed
    buffer and tiles run through the interpreted kernels, without capture."""
    from dataclasses import replace

    from streamsd.kernels.attention.prefill import tokens_per_tile
    from streamsd.model.graph_layout import (
        pack_step,
        packed_prompt_tail,
        packed_prompt_tiles,
        packed_size,
        static_layout,
    )
    from streamsd.model.graphs import GraphConfig, GraphRunner
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.loader import load_model

    model, _ = load_model(str(tiny_model_dir), DEV, torch.float32)
    model.attend = pa.paged_attention
    scratch, bs = 12, 16
    cache = PagedKVCache(model.args, scratch + 1, bs, torch.float32, DEV)
    g = torch.Generator().manual_seed(3)
    tables = [[3, 0, 7], [5], [2, 8], [1]]
    before_lens = [20, 0, 17, 9]  # cached prefix, fresh prompt, two decoding requests
    counts = [25, 11, 1, 1]
    for table, n in zip(tables, before_lens, strict=True):
        if n:
            prefix = torch.randint(3, model.args.vocab_size, (n,), generator=g).to(DEV)
            model(prefix, BatchLayout.build([0], [n], [table], bs, DEV), cache, torch.arange(n, device=DEV))
    ids = torch.randint(3, model.args.vocab_size, (sum(counts),), generator=g).tolist()
    rows = [24, 35, 36, 37]  # every sequence's last token
    before = cache.data.clone()
    ref = model(torch.tensor(ids, device=DEV), BatchLayout.build(before_lens, counts, tables, bs, DEV), cache,
                torch.tensor(rows, device=DEV)).logits  # [4, V]
    written = cache.data.clone()
    if CUDA:
        runner = GraphRunner(model, cache, scratch, GraphConfig(max_blocks=8, query_widths=(1, 4),
                                                                prompt_widths=(32, 64), prompt_seqs=8), DEV)
        key = runner.key_for(counts, tables, len(rows))
        assert key == (8, 64)  # 38 tokens: the 64-slot graph, 8 sequences
        assert runner.key_for([25] * 9, [[1]] * 9, 9) is None  # more sequences than it holds
        for _ in range(2):
            cache.data.copy_(before)
            out = runner.run(key, ids, before_lens, counts, tables, rows).clone()
            assert rel_error(out, ref) < 1e-4
    else:
        cache.data.copy_(before)
        per = tokens_per_tile(model.args.num_heads, model.args.num_kv_heads)
        n_tiles = packed_prompt_tiles(64, 8, per)
        host, live = pack_step(ids, before_lens, counts, tables, 8, 64, scratch, bs, slots=64)
        host = packed_prompt_tail(host, before_lens, counts, rows, 8, per, n_tiles, model.args.num_kv_heads, 132)
        block_table = torch.full((8, 8), scratch, dtype=torch.int32)
        block_table[: live.shape[0], : live.shape[1]] = torch.from_numpy(live)
        packed = torch.from_numpy(host)
        ids_t, layout = static_layout(packed, block_table, 8, 64, scratch, slots=64)
        n = packed_size(8, 64, 64)
        tiles = packed[n + 8 :].to(torch.int32)
        out = model(ids_t, replace(layout, prompt_tiles=tiles), cache, packed[n : n + 8]).logits[: len(rows)]
        assert rel_error(out, ref) < 1e-4
    assert torch.allclose(cache.data[:, :, :scratch], written[:, :, :scratch], atol=1e-5)


@pytest.mark.parametrize("seed", range(20))
def test_packed_prompt_tiles_cover_every_token_once_within_their_bound(seed):
    """Random steps of at most 8 sequences in 64 slots: the tiles cover each sequence's tokens once,
    in order, at their positions, and never need more than packed_prompt_tiles of them."""
    import random

    import numpy as np

    from streamsd.model.graph_layout import packed_prompt_tail, packed_prompt_tiles

    rng = random.Random(seed)
    seqs, per = rng.randint(1, 8), rng.choice([1, 5, 21, 32])
    counts = [1] * seqs
    for _ in range(rng.randint(0, 64 - seqs)):
        counts[rng.randrange(seqs)] += 1
    starts = [rng.randint(0, 100) for _ in counts]
    n_tiles = packed_prompt_tiles(64, 8, per)
    sms = rng.choice([1, 16, 132])  # 1: no tile splits its keys; 132: the few tiles of a short step do
    tail = packed_prompt_tail(np.zeros(0, dtype=np.int64), starts, counts, list(range(seqs)), 8, per, n_tiles,
                              rng.choice([1, 3]), sms)
    assert tail[:seqs].tolist() == list(range(seqs)) and not tail[seqs:8].any()  # rows, then row 0
    tiles = tail[8:].reshape(n_tiles, 6)
    seen = []
    for seq, row0, ntok, pos0, split, splits in tiles.tolist():
        if split == 0:  # a tile's splits follow each other, each the same rows
            seen += [(seq, row0 + i, pos0 + i) for i in range(ntok)]
        assert ntok or (seq, row0, pos0, split, splits) == (0, 0, 0, 0, 0)
        assert ntok == 0 or 0 <= split < splits
    assert seen == [(s, sum(counts[:s]) + i, starts[s] + i) for s in range(seqs) for i in range(counts[s])]


def test_prompt_tiles_cover_the_chunk_and_nothing_past_it():
    from streamsd.model.graph_layout import prompt_tiles

    tiles = prompt_tiles(40, 50, 64, 4).reshape(4, 6)  # 16 rows a tile
    assert tiles[:, 1].tolist() == [0, 16, 32, 48] and tiles[:, 2].tolist() == [16, 16, 16, 2]
    assert tiles[:, 3].tolist() == [40, 56, 72, 88]
    assert tiles[:, 4].tolist() == [0] * 4 and tiles[:, 5].tolist() == [1] * 4  # unsplit
    empty = prompt_tiles(40, 10, 64, 4).reshape(4, 6)
    assert empty[:, 2].tolist() == [10, 0, 0, 0] and empty[1:, 3].tolist() == [0, 0, 0]  # sees no keys

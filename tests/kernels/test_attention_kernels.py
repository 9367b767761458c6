"""The attention kernels (kernels/attention/) against the torch oracle: decode, prompts, tree windows."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV  # isort: skip (first: it sets the interpreter up)
import streamsd.kernels.attention.paged as pa
import streamsd.model.attention as ta
from streamsd.kernels.attention.prefill import (
    MAX_SPLITS,
    prefill_attention,
    prefill_tiles,
    split_tiles,
    tiles_tensor,
    tokens_per_tile,
)
from streamsd.model.kv_cache import BatchLayout
from tests.kernels.kernel_helpers import DTYPES, rel_error

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def _random_batch(counts: list[int], ctx_extra: list[int], kv_heads: int, heads: int, dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    bs = 16
    need = sum(-(-(c + e) // bs) for c, e in zip(counts, ctx_extra, strict=True))
    nb = need + 3
    k_cache = torch.randn(nb, bs, kv_heads, dim, generator=g).to(DEV, dtype)  # [NB, BS, KVH, D]
    v_cache = torch.randn(nb, bs, kv_heads, dim, generator=g).to(DEV, dtype)
    perm = torch.randperm(nb, generator=g).tolist()  # scattered blocks, as the pool hands them out
    tables, used = [], 0
    for c, e in zip(counts, ctx_extra, strict=True):
        n = -(-(c + e) // bs)
        tables.append(perm[used : used + n])
        used += n
    layout = BatchLayout.build(ctx_extra, counts, tables, bs, DEV)
    q = torch.randn(sum(counts), heads, dim, generator=g).to(DEV, dtype)  # [T, H, D]
    return q, k_cache, v_cache, layout


CASES = [  # (query lens, cached tokens before them, kv heads, heads, head dim)
    ([1], [0], 1, 1, 32),
    ([1, 5, 3, 16], [0, 37, 100, 5], 2, 8, 32),  # GQA 4, verify windows, one at the kernel's limit
    ([5, 5, 5], [200, 17, 64], 3, 9, 64),  # SmolLM2-like GQA 3
    ([2, 1], [1, 300], 2, 2, 16),  # no grouping
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_matches_reference(dtype, case, splits):
    counts, extra, kvh, heads, dim = CASES[case]
    for seed in range(2 if CUDA else 1):  # fresh inputs per check
        q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, dtype, seed + 10 * case)
        ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
        out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
        pa.decode_attention(q, kc, vc, layout.block_table, layout.context_lens_t, layout.query_starts_t,
                           dim**-0.5, max(counts), out=out, splits=splits)
        assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.skipif(not CUDA, reason="needs CUDA: a cache of more than 2**31 elements")
@pytest.mark.parametrize(("counts", "extra"), [([1, 5], [40, 3]), ([40, 2], [20, 90])])
def test_attention_reads_blocks_past_int32_offsets(counts, extra):
    """A tiny model's KV cache on a large GPU holds millions of blocks (its size comes from free
    memory): block index x block stride passes 2**31 elements. The same keys placed at the end of
    such a cache must give the same attention, through the decode and the prompt kernels."""
    kvh, heads, dim, bs = 2, 4, 64, 16
    q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, torch.bfloat16, 7)
    offset = 2**31 // (bs * kvh * dim)  # the first block whose offset needs more than int32
    big_k = torch.zeros(offset + kc.shape[0], bs, kvh, dim, dtype=kc.dtype, device=DEV)  # [NB, BS, KVH, D]
    big_v = torch.zeros_like(big_k)
    big_k[offset:], big_v[offset:] = kc, vc
    moved = BatchLayout.build(extra, counts, [[b + offset for b in t] for t in layout.block_tables], bs, DEV)
    ref = pa.paged_attention(q, kc, vc, layout, dim**-0.5)
    assert torch.equal(pa.paged_attention(q, big_k, big_v, moved, dim**-0.5), ref)


PREFILL_CASES = [  # (query lens, cached tokens before them, kv heads, heads, head dim)
    ([40, 3, 20, 1], [0, 50, 33, 7], 2, 4, 32),  # whole prompt and continued chunks beside verify windows
    ([17, 70], [0, 0], 3, 9, 64),  # SmolLM2-like GQA 3: 21 tokens a tile, a tile's rows not all used
    ([33], [95], 1, 1, 16),  # no grouping: 64 tokens a tile; a chunk after a long cached prefix
    ([130, 2, 65], [5, 0, 64], 2, 16, 32),  # GQA 8: 8 tokens a tile, many tiles a chunk
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prompt_chunks_and_verify_windows_in_one_step_match_reference(dtype, case):
    """paged_attention: queries of up to 16 tokens through the decode kernel, longer ones (prompt
    chunks, whole or after a cached prefix) through the prefill kernel, in the same step."""
    counts, extra, kvh, heads, dim = PREFILL_CASES[case]
    q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, dtype, 3 + case)
    ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
    assert rel_error(pa.paged_attention(q, kc, vc, layout, dim**-0.5), ref) < TOL[dtype]


TREE_CASES = [  # per sequence: (tokens before the window, cached before them, tree parents or None), kv, heads, dim
    ([(0, 40, [-1, -1, 0, 0, 1, 2, 4]), (0, 7, None), (0, 100, [-1] * 3)], 2, 8, 32),
    ([(0, 17, [-1, -1, -1, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8] + [0] * 10 + [-1] * 8)], 3, 9, 64),  # a 31-node tree
    ([(5, 20, [-1, 0, -1]), (30, 0, None), (0, 3, [-1])], 1, 4, 16),  # a recomputed request before its window
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(TREE_CASES)))
@pytest.mark.parametrize(("splits", "per"), [(1, None), (4, None), (1, 16), (4, 16)])
def test_tree_windows_match_reference(dtype, case, splits, per):
    """Draft-tree windows (spec_decode/tree.py) beside causal queries in one step, through paged_attention: each
    window row sees the context and its own path, rows before a window attend causally. per: rows of the
    query tile a program takes (None: all), so a window's rows are split among programs."""
    from streamsd.sample.tree_verify import host_tree

    seqs, kvh, heads, dim = TREE_CASES[case]
    counts = [pre + (1 + len(p) if p is not None else 1) for pre, _, p in seqs]
    q, kc, vc, base = _random_batch(counts, [c for _, c, _ in seqs], kvh, heads, dim, dtype, 40 + case)
    trees = [host_tree(p) if p is not None else None for _, _, p in seqs]
    layout = BatchLayout.build([c for _, c, _ in seqs], counts, base.block_tables, 16, DEV, trees)
    ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
    out = torch.full_like(q, float("nan"))
    pa.decode_attention(q, kc, vc, layout.block_table, layout.context_lens_t, layout.query_starts_t, dim**-0.5,
                       max(counts), out=out, splits=splits, tree_bits=layout.tree_bits, tree_start=layout.tree_start,
                       rows_per_program=per)
    assert rel_error(out, ref) < TOL[dtype]
    assert rel_error(pa.paged_attention(q, kc, vc, layout, dim**-0.5), ref) < TOL[dtype]


def test_prefill_tiles_cover_each_long_query_once():
    tiles = prefill_tiles([0, 40, 43], [40, 3, 20], [40, 53, 53], 16, 16)
    assert tiles == [(0, 0, 16, 0, 0, 1), (0, 16, 16, 16, 0, 1), (0, 32, 8, 32, 0, 1), (2, 43, 16, 33, 0, 1),
                     (2, 59, 4, 49, 0, 1)]


SPLIT_CASES = [  # (query lens, cached tokens before them, kv heads, heads, head dim): chunks after long prefixes
    ([11], [2025], 3, 9, 64),  # a request sharing a long system prompt: one tile, its keys split 16 ways
    ([5, 40, 2], [700, 300, 0], 2, 8, 32),  # tiles of several lengths: split unevenly, one not at all
    ([21], [130], 1, 4, 16),  # a split past some rows' positions (rows see no key there)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
@pytest.mark.parametrize("graph", [False, True])
def test_split_prompt_tiles_match_reference(dtype, case, graph):
    """Prompt tiles whose keys split_tiles spreads over several programs (few tiles for the SMs), merged
    by the second kernel, give the reference's attention: from an eager step's list (merged only where
    one is split) and from a tensor of them, as a prompt graph holds (merged on the device, padded with
    empty tiles)."""
    counts, extra, kvh, heads, dim = SPLIT_CASES[case]
    q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, dtype, 60 + case)
    ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
    found = prefill_tiles(layout.query_starts, layout.query_lens, layout.context_lens, 0, tokens_per_tile(heads, kvh))
    tiles = split_tiles(found, kvh, 132)
    assert len(tiles) > len(found) and {t[:4] for t in tiles} == {t[:4] for t in found}
    out = torch.full_like(q, float("nan"))
    if graph:
        padded = tiles + [(0, 0, 0, 0, 0, 0)] * 3
        prefill_attention(q, kc, vc, layout.block_table, tiles_tensor(padded, q.device), dim**-0.5, out)
    else:
        prefill_attention(q, kc, vc, layout.block_table, tiles, dim**-0.5, out)
        # The eager step's route: long queries' tiles split by the device's SMs (4 under the interpreter).
        assert rel_error(pa.paged_attention(q, kc, vc, layout, dim**-0.5), ref) < TOL[dtype]
    assert rel_error(out, ref) < TOL[dtype]


def test_split_tiles_fill_the_sms_within_the_room_and_the_keys():
    one = [(0, 0, 11, 2025, 0, 1)]
    assert split_tiles(one, 3, 132) == [(0, 0, 11, 2025, i, MAX_SPLITS) for i in range(MAX_SPLITS)]
    assert len(split_tiles(one, 3, 132, capacity=5)) == 5  # a prompt graph's buffer holds 5 tiles
    assert split_tiles([(0, 0, 11, 100, 0, 1)], 3, 132) == [(0, 0, 11, 100, 0, 1)]  # keys for one split
    wave = [(s, s * 9, 9, 2020, 0, 1) for s in range(31)]  # 31 requests' tiles, 93 programs for 132 SMs
    split = split_tiles(wave, 3, 132)
    assert len(split) == 93 and [t[4:] for t in split[:4]] == [(0, 3), (1, 3), (2, 3), (0, 3)]  # 279 programs
    assert len(split_tiles(wave, 3, 132, capacity=88)) == 62  # a 512-slot prompt graph's 88 tiles: in 2 each
    long_prompt = [(0, r, 21, r, 0, 1) for r in range(0, 2016, 21)]  # 96 tiles x 3 kv heads: the SMs are full
    assert split_tiles(long_prompt, 3, 132) == long_prompt


def test_pick_splits_fills_the_chip_and_stays_a_power_of_two():
    assert pa.pick_splits(1, 8, 256, 16, 132) == 16
    assert pa.pick_splits(64, 8, 256, 16, 132) == 1
    assert pa.pick_splits(1, 8, 2, 16, 132) == 1  # one tile of keys: nothing to split
    assert pa.pick_splits(4, 8, 32, 16, 132) == 8

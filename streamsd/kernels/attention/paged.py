"""Paged attention for the decode / verify shape, in Triton, plus `paged_attention`, the CUDA `AttentionFn`.

One program per (sequence, kv head, split): the program holds the 1..QMAX query tokens of its
sequence times the GROUP query heads that share the kv head as one [BLOCK_M, D] tile, so each K/V
tile is read once for the whole group (GQA) and multiplied on the tensor cores. It walks only the
live blocks (context_lens), TILE tokens at a time through the block table, with an online softmax.
Query i of a sequence sits at position ctx - qlen + i and sees keys up to there (causal inside
the verify window). With SPLITS > 1 each sequence's tiles are shared among SPLITS programs
(flash-decoding) and a second kernel merges their partial softmaxes: at batch 1 the grid would
otherwise hold only num_kv_heads programs for a chip of 132 multiprocessors. A draft tree's window
(up to 64 tokens x GROUP rows) is further split by rows: each program takes 16 rows of the tile and
walks its keys alone, a shorter chain a tile than the whole tile's, and the K/V reads repeat from L2.

Everything the kernel reads is a device tensor of the BatchLayout, so it can be captured in a
CUDA graph; the only static bound is the block table's width. Sequences whose query is longer than
QMAX (prompt chunks) are skipped by the kernel and go through prefill_attention.py's, all in one
launch.

`paged_attention` is model/attention.py's `paged_attention` (the reference, the CPU path), with the
same arguments; tests/kernels/test_attention_kernels.py `test_paged_attention_matches_reference`,
`test_prompt_chunks_and_verify_windows_in_one_step_match_reference` and `test_tree_windows_match_reference`
compare them (`decode_attention` is its decode/verify launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.attention.prefill import (
    prefill_attention,
    prefill_tiles,
    split_tiles,
    tile_partials,
    tiles_tensor,
    tokens_per_tile,
)
from streamsd.kernels.attention.tile import attend_tile
from streamsd.kernels.device import sm_count
from streamsd.model.kv_cache import BatchLayout

KERNEL_MAX_QUERY = 16  # longest query (1 + k) the kernel takes; longer ones are prefill_attention's
TREE_MAX_QUERY = 64  # ... in a step that verifies draft trees (a root and up to 62 nodes per window)
TREE_MAX_SPLITS = 4
ROWS_PER_TREE_PROGRAM = 16  # tl.dot's least
MERGE_ROWS = 32  # rows of a tile each merging program takes: a tree window's tile is split among several
TILE_TOKENS = 64  # keys per inner iteration (4 pages of 16)
LOG2E = 1.4426950408889634


# The block table's width changes with the longest context of an eager step: not a variant per width.
@triton.jit(do_not_specialize=["s_bt"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    bt_ptr, ctx_ptr, qs_ptr, tb_ptr, tw_ptr, scale_log2,
    sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, s_bt,
    GROUP: tl.constexpr, QMAX: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, TREE: tl.constexpr,
    ROWS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2) // (BLOCK_M // ROWS)
    first = tl.program_id(2) % (BLOCK_M // ROWS) * ROWS  # the program's rows of the [BLOCK_M, D] tile
    q0 = tl.load(qs_ptr + seq)
    qlen = tl.load(qs_ptr + seq + 1) - q0
    ctx = tl.load(ctx_ptr + seq)
    # Prompt chunks are the prefill kernel's; rows past the query walk no keys.
    ctx = tl.where((qlen <= QMAX) & (first // GROUP < qlen), ctx, 0)
    rows = first + tl.arange(0, ROWS)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (tok < qlen) & (tok < QMAX)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q0 + tok)[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [ROWS, D]
    qpos = ctx - qlen + tok  # [ROWS]
    bits = tl.zeros([ROWS], tl.int64)
    win = -1
    if TREE:  # draft-tree windows: each row's visible window keys (spec_decode/tree.py)
        bits = tl.load(tb_ptr + q0 + tok, mask=row_ok, other=0)
        win = tl.load(tw_ptr + seq)
    n_tiles = tl.cdiv(ctx, TILE)
    per_split = tl.cdiv(n_tiles, SPLITS)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    # A finite floor instead of -inf keeps fully masked rows (possible inside one split) NaN-free.
    m = tl.full([ROWS], -1.0e30, tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    offs = tl.arange(0, TILE)
    for t in range(t_lo, t_hi):
        m, l_sum, acc = attend_tile(q, qpos, m, l_sum, acc, t * TILE + offs, ctx, bt_ptr + seq * s_bt, k_ptr, v_ptr,
                                    kvh, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, d, scale_log2, PAGE, IEEE, bits, win, TREE)
    if SPLITS == 1:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + (q0 + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (seq * tl.num_programs(1) + kvh) * SPLITS + split
        tl.store(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * HEAD_DIM + d[None, :], acc)
        tl.store(part_ml_ptr + (part * 2) * BLOCK_M + rows, m)
        tl.store(part_ml_ptr + (part * 2 + 1) * BLOCK_M + rows, l_sum)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, ctx_ptr, qs_ptr, so_t, so_h,
    GROUP: tl.constexpr, QMAX: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr, ROWS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q0 = tl.load(qs_ptr + seq)
    qlen = tl.load(qs_ptr + seq + 1) - q0
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # this program's rows of the tile
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    # A prompt chunk (qlen > QMAX) writes nothing here. Folded into the bound, not and-ed as a scalar
    # into the row mask: Triton 3.9's interpreter makes tensor & scalar-bool an int32 mask, which stores reject.
    row_ok = (tok < tl.where(qlen <= QMAX, qlen, 0)) & (tok < QMAX)
    d = tl.arange(0, HEAD_DIM)
    base = (seq * tl.num_programs(1) + kvh) * SPLITS
    m_max = tl.full([ROWS], -1.0e30, tl.float32)
    for s in tl.static_range(SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + ((base + s) * 2) * BLOCK_M + rows))
    denom = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for s in tl.static_range(SPLITS):
        w = tl.exp2(tl.load(part_ml_ptr + ((base + s) * 2) * BLOCK_M + rows) - m_max)  # [BLOCK_M]
        denom += w * tl.load(part_ml_ptr + ((base + s) * 2 + 1) * BLOCK_M + rows)
        acc += w[:, None] * tl.load(part_acc_ptr + ((base + s) * BLOCK_M + rows)[:, None] * HEAD_DIM + d[None, :])
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + (q0 + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def pick_splits(num_seqs: int, kv_heads: int, max_blocks: int, page: int, sm_count: int) -> int:
    """Enough programs to cover the chip twice, no more splits than tiles, a power of two <= 16."""
    want = max(1, -(-2 * sm_count // max(num_seqs * kv_heads, 1)))
    tiles = max(1, -(-max_blocks * page // TILE_TOKENS))
    splits = 1
    while splits * 2 <= min(want, tiles, 16):
        splits *= 2
    return splits


def decode_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [S, max_blocks] int32/int64
    context_lens: torch.Tensor,  # [S]
    query_starts: torch.Tensor,  # [S + 1]
    scale: float,
    max_query: int,
    out: torch.Tensor | None = None,  # [T, H, D]; rows of skipped (long) sequences are left as they are
    splits: int | None = None,
    tree_bits: torch.Tensor | None = None,  # [T] int64 (kv_cache.BatchLayout.tree_bits)
    tree_start: torch.Tensor | None = None,  # [S] int64
    num_warps: int | None = None,
    rows_per_program: int | None = None,
) -> torch.Tensor:
    """Attention of every sequence whose query length <= max_query (<= 16, or with draft trees <= 64);
    returns out [T, H, D]."""
    t, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    group = heads // kv_heads
    tree = tree_bits is not None and tree_start is not None
    qmax = triton.next_power_of_2(max(1, min(max_query, TREE_MAX_QUERY if tree else KERNEL_MAX_QUERY)))
    block_m = max(16, triton.next_power_of_2(qmax * group))
    out = torch.empty_like(q) if out is None else out
    if splits is None:
        splits = pick_splits(num_seqs, kv_heads, block_table.shape[1], page, sm_count(q.device))
        if tree and block_m > 32:
            # A tree window's tile is up to 8x a decode token's: splitting a short context 16 ways left
            # most splits empty, and merging them cost more than the attention (an H200, batch 1).
            splits = min(splits, TREE_MAX_SPLITS)
    if rows_per_program is None:
        # A tree window's rows in programs of 16, each its own chain of tiles: at batch 1 on an H200, a
        # 25-row window at 4 splits took 5.9 against 7.6 us a launch (all 128 rows a program, 8 warps) at a
        # 256-token context, 7.0 against 9.8 at 512 (both on an H200).
        rows_per_program = ROWS_PER_TREE_PROGRAM if tree else block_m
    rows = min(rows_per_program, block_m)
    if num_warps is None:
        num_warps = 8 if rows >= 128 else 4  # a [128, D] tile: 7.6 against 8.2 us with 4 warps (same probe)
    assert rows >= 16 and block_m % rows == 0, "tl.dot takes 16 rows or more"
    if splits > 1:
        part_acc = torch.empty(num_seqs * kv_heads * splits * block_m * dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs * kv_heads * splits * 2 * block_m, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    meta = dict(GROUP=group, QMAX=qmax, BLOCK_M=block_m, HEAD_DIM=dim)
    _paged_attn_kernel[(num_seqs, kv_heads, splits * (block_m // rows))](
        q, k_cache, v_cache, out, part_acc, part_ml, block_table, context_lens, query_starts,
        tree_bits if tree else context_lens, tree_start if tree else context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        PAGE=page, TILE=TILE_TOKENS, SPLITS=splits, IEEE=q.dtype == torch.float32, TREE=tree, ROWS=rows, **meta,
        num_warps=num_warps, num_stages=2,
    )
    if splits > 1:
        merged = min(block_m, MERGE_ROWS)
        _merge_splits_kernel[(num_seqs, kv_heads, block_m // merged)](
            part_acc, part_ml, out, context_lens, query_starts, out.stride(0), out.stride(1), SPLITS=splits,
            ROWS=merged, **meta, num_warps=4,
        )
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout,
                   scale: float) -> torch.Tensor:
    """The GPU `AttentionFn`: short queries through this kernel, prompt chunks through the prefill
    kernel, one launch each.

    Routing reads only the host list of query lengths, which a CUDA-graph capture fixes per bucket;
    it is worked out by the step's first layer and kept in the layout for the others.
    """
    out = torch.empty_like(q)  # [T, H, D]
    key = ("paged_attention", q.shape[1], k_cache.shape[2])  # the tiles depend on the GQA group
    route = layout.derived.get(key)
    limit = TREE_MAX_QUERY if layout.has_trees else KERNEL_MAX_QUERY
    if route is None and layout.prompt_tiles is not None:
        route = layout.derived[key] = (0, layout.prompt_tiles, None)
    if route is None:
        short = [n for n in layout.query_lens if 0 < n <= limit]
        tiles, partials = None, None
        if len(short) < len(layout.query_lens):
            kv_heads = k_cache.shape[2]
            found = split_tiles(prefill_tiles(layout.query_starts, layout.query_lens, layout.context_lens, limit,
                                              tokens_per_tile(q.shape[1], kv_heads)),
                                kv_heads, sm_count(q.device))
            tiles = tiles_tensor(found, q.device)
            partials = tile_partials(found, kv_heads, q.shape[2], q.device)
        route = layout.derived[key] = (max(short, default=0), tiles, partials)
    longest_short, tiles, partials = route
    if longest_short:
        decode_attention(q, k_cache, v_cache, layout.block_table, layout.context_lens_t, layout.query_starts_t,
                        scale, longest_short, out=out, tree_bits=layout.tree_bits, tree_start=layout.tree_start)
    if tiles is not None:
        prefill_attention(q, k_cache, v_cache, layout.block_table, tiles, scale, out, partials)
    return out

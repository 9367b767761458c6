"""Paged attention for prompt chunks, in Triton: every long query of a step in one launch.

The decode/verify kernel (paged.py's `decode_attention`) holds a whole query of 1..16 tokens per program.
Prompt chunks are longer, so their queries are cut into tiles of BLOCK_M // GROUP tokens; one
program takes one tile times the GROUP query heads that share a kv head (each K/V tile is read
once for the group, as in the decode kernel) and walks the keys up to its last token's position
through the block table, with an online softmax. Token i of a chunk sits at position
ctx - qlen + i and sees keys up to there, so chunks that follow a cached prefix work the same as
fresh prompts.

A chunk of a few tokens after a long cached prefix (a request sharing a system prompt, a chat's next
turn) is one tile, and its few programs walk thousands of keys one tile after the other: on an H100 a
single request's 11 new tokens after 2,025 cached ones took 53 us a layer for 3 programs, 69 % of its
prompt step. So a step of few tiles splits each tile's keys among programs (flash-decoding, as
paged.py does for decode rows): a tile is (sequence, first row, tokens, first position, split,
splits), the `splits` entries of one tile are consecutive, each walks its share of the key tiles into
fp32 partials, and a second kernel merges them in the first one's row. `split_tiles` decides, from the
step's tiles, the kv heads and the SMs; a tile of `splits` 1 writes its rows itself, as before. The
same request on an H200, its tile split 16 ways: 5.8 us a layer, and 12.9 for the merge (which walks
the 16 partials in turn); a wave of 31 such requests, each split in 3: 27.6 and 3.0 us.

It replaces one gather + SDPA per chunk and layer (~10 launches and their Python each, so a step
that admitted 32 prompts spent ~0.4 s on the 8B shape in attention bookkeeping alone). The tile
list is built on the host from the step's layout, by the eager step or into a prompt graph's
buffer (model/graphs.py), once per step for every layer.

Its reference is model/attention.py's `paged_attention` for the same chunks;
tests/kernels/test_attention_kernels.py `test_prompt_chunks_and_verify_windows_in_one_step_match_reference`
and `test_split_prompt_tiles_match_reference` compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.attention.tile import attend_tile
from streamsd.model.graph_layout import TILE_INTS
from streamsd.model.kv_cache import h2d

BLOCK_M = 64  # query rows per program: tokens × the GROUP heads of one kv head
TILE_N = 64  # keys per inner iteration
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 2 * TILE_N  # a split walks at least this many keys: shorter ones cost more to merge
LOG2E = 1.4426950408889634


# The block table's width changes with the longest context of a step: not a variant per width.
@triton.jit(do_not_specialize=["s_bt"])
def _prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, bt_ptr, tiles_ptr, scale_log2,
    sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, s_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TILE_N: tl.constexpr, IEEE: tl.constexpr, INTS: tl.constexpr,
):
    """Program (tile, kv head): its tile's rows against its split's share of the key tiles; the whole
    attention where the tile is not split, else fp32 partials (acc, max, sum) for _merge_tiles_kernel."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * INTS)
    row0 = tl.load(tiles_ptr + tile * INTS + 1)  # first query row (token index into q)
    ntok = tl.load(tiles_ptr + tile * INTS + 2)  # tokens in this tile
    pos0 = tl.load(tiles_ptr + tile * INTS + 3)  # position of its first token
    split = tl.load(tiles_ptr + tile * INTS + 4)
    splits = tl.load(tiles_ptr + tile * INTS + 5)
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < ntok
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (row0 + tok)[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    qpos = pos0 + tok  # [BLOCK_M]
    end = pos0 + ntok  # keys the tile's last token sees
    per = tl.cdiv(tl.cdiv(end, TILE_N), tl.maximum(splits, 1))  # key tiles a split walks
    # A finite floor, not -inf: a split past a row's position leaves the row's max there, NaN-free.
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs = tl.arange(0, TILE_N)
    for start in range(split * per * TILE_N, tl.minimum((split + 1) * per * TILE_N, end), TILE_N):
        m, l_sum, acc = attend_tile(q, qpos, m, l_sum, acc, start + offs, end, bt_ptr + seq * s_bt, k_ptr, v_ptr, kvh,
                                    sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, d, scale_log2, PAGE, IEEE, qpos, -1, False)
    if splits == 1:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + (row0 + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = tile * tl.num_programs(1) + kvh
        tl.store(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * HEAD_DIM + d[None, :], acc)
        tl.store(part_ml_ptr + (part * 2) * BLOCK_M + rows, m)
        tl.store(part_ml_ptr + (part * 2 + 1) * BLOCK_M + rows, l_sum)


@triton.jit
def _merge_tiles_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, tiles_ptr, so_t, so_h,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, INTS: tl.constexpr,
):
    """Program (tile, kv head): where the tile is the first of several splits, its rows from their partials."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(tiles_ptr + tile * INTS + 1)
    ntok = tl.load(tiles_ptr + tile * INTS + 2)
    split = tl.load(tiles_ptr + tile * INTS + 4)
    splits = tl.load(tiles_ptr + tile * INTS + 5)
    if split == 0 and splits > 1:
        rows = tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        d = tl.arange(0, HEAD_DIM)
        kv_heads = tl.num_programs(1)
        m_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
        for s in range(0, splits):
            part = (tile + s) * kv_heads + kvh
            m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (part * 2) * BLOCK_M + rows))
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for s in range(0, splits):
            part = (tile + s) * kv_heads + kvh
            w = tl.exp2(tl.load(part_ml_ptr + (part * 2) * BLOCK_M + rows) - m_max)  # [BLOCK_M]
            denom += w * tl.load(part_ml_ptr + (part * 2 + 1) * BLOCK_M + rows)
            acc += w[:, None] * tl.load(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * HEAD_DIM + d[None, :])
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + (row0 + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(tok < ntok)[:, None])


Tile = tuple[int, int, int, int, int, int]


def prefill_tiles(query_starts: list[int], query_lens: list[int], context_lens: list[int], min_query: int,
                  tokens_per_tile: int) -> list[Tile]:
    """(sequence, first row, tokens, first position, 0, 1) of every tile of the queries longer than
    ``min_query``: none split yet (`split_tiles`)."""
    tiles = []
    for seq, (q0, qlen, ctx) in enumerate(zip(query_starts, query_lens, context_lens, strict=True)):
        if qlen <= min_query:
            continue
        for off in range(0, qlen, tokens_per_tile):
            tiles.append((seq, q0 + off, min(tokens_per_tile, qlen - off), ctx - qlen + off, 0, 1))
    return tiles


def split_tiles(tiles: list[Tile], kv_heads: int, sms: int, capacity: int | None = None) -> list[Tile]:
    """`tiles` with their keys split where the step's programs (tiles x kv heads) would leave the chip
    idle: each tile into enough splits that the programs cover the SMs twice, at most MAX_SPLITS, each
    walking at least MIN_SPLIT_KEYS keys, within `capacity` tiles in all (a prompt graph's buffer)."""
    want = -(-2 * sms // max(len(tiles) * kv_heads, 1))
    if want < 2 or not tiles:
        return tiles
    room = (capacity if capacity is not None else len(tiles) * MAX_SPLITS) // len(tiles)
    out: list[Tile] = []
    for seq, row0, ntok, pos0, _, _ in tiles:
        n = max(1, min(want, MAX_SPLITS, room, -(-(pos0 + ntok) // MIN_SPLIT_KEYS)))
        out += [(seq, row0, ntok, pos0, i, n) for i in range(n)]
    return out


def tile_partials(tiles: list[Tile] | torch.Tensor, kv_heads: int, dim: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for the tiles' fp32 partials: acc [parts, BLOCK_M, D] and (max, sum) [parts, 2, BLOCK_M], a part per
    tile and kv head. A list's tiles get room only where one of them is split; none is empty, and a step given
    empty room launches no merge. A prompt graph's tile tensor changes on the device, so all of its tiles get
    room. Made once per step and reused by every layer (they run in turn on one stream)."""
    if isinstance(tiles, torch.Tensor):
        n_tiles = tiles.numel() // TILE_INTS
    else:
        n_tiles = len(tiles) if any(t[5] > 1 for t in tiles) else 0
    parts = n_tiles * kv_heads
    return (torch.empty(parts * BLOCK_M * dim, dtype=torch.float32, device=device),
            torch.empty(parts * 2 * BLOCK_M, dtype=torch.float32, device=device))


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [S, max_blocks]
    tiles: list[Tile] | torch.Tensor,  # from prefill_tiles (split_tiles), or tiles_tensor of them
    scale: float,
    out: torch.Tensor,  # [T, H, D]; rows of the tiles' tokens are written
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,  # tile_partials' room; empty: no tile is split
) -> torch.Tensor:
    tiles_t = tiles if isinstance(tiles, torch.Tensor) else tiles_tensor(tiles, q.device)  # [n_tiles * TILE_INTS]
    n_tiles = tiles_t.numel() // TILE_INTS
    if not n_tiles:
        return out
    heads, dim = q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    part_acc, part_ml = partials if partials is not None else tile_partials(tiles, kv_heads, dim, q.device)
    meta = dict(GROUP=group, BLOCK_M=BLOCK_M, HEAD_DIM=dim, INTS=TILE_INTS)
    _prefill_attn_kernel[(n_tiles, kv_heads)](
        q, k_cache, v_cache, out, part_acc, part_ml, block_table, tiles_t, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        PAGE=page, TILE_N=TILE_N, IEEE=q.dtype == torch.float32, **meta, num_warps=4, num_stages=2,
    )
    if part_ml.numel():
        _merge_tiles_kernel[(n_tiles, kv_heads)](part_acc, part_ml, out, tiles_t, out.stride(0), out.stride(1),
                                                **meta, num_warps=4)
    return out


def tiles_tensor(tiles: list[Tile], device: torch.device) -> torch.Tensor:
    """The kernel's tile list, [n_tiles * TILE_INTS] int32 on `device`: made once per step, read by every layer."""
    return h2d([x for t in tiles for x in t], torch.int32, device)


def tokens_per_tile(heads: int, kv_heads: int) -> int:
    return max(1, BLOCK_M // (heads // kv_heads))

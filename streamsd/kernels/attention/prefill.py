"""Paged attention for prompt chunks, in Triton: every long query of a step in one launch.

The decode/verify kernel (paged.py's `decode_attention`) holds a whole query of 1..16 tokens per program.
Prompt chunks are longer, so their queries are cut into tiles of BLOCK_M // GROUP tokens; one
program takes one tile times the GROUP query heads that share a kv head (each K/V tile is read
once for the group, as in the decode kernel) and walks the keys up to its last token's position
through the block table, with an online softmax. Token i of a chunk sits at position
ctx - qlen + i and sees keys up to there, so chunks that follow a cached prefix work the same as
fresh prompts.

It replaces one gather + SDPA per chunk and layer (~10 launches and their Python each, so a step
that admitted 32 prompts spent ~0.4 s on the 8B shape in attention bookkeeping alone). The tile
list is built on the host from the step's layout: prefill steps run eagerly, never in a graph.

Its reference is model/attention.py's `paged_attention` for the same chunks;
tests/kernels/test_attention_kernels.py `test_prompt_chunks_and_verify_windows_in_one_step_match_reference`
compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.attention.tile import attend_tile
from streamsd.model.kv_cache import h2d

BLOCK_M = 64  # query rows per program: tokens × the GROUP heads of one kv head
TILE_N = 64  # keys per inner iteration
LOG2E = 1.4426950408889634


# The block table's width changes with the longest context of a step: not a variant per width.
@triton.jit(do_not_specialize=["s_bt"])
def _prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, tiles_ptr, scale_log2,
    sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, s_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    TILE_N: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 4)
    row0 = tl.load(tiles_ptr + tile * 4 + 1)  # first query row (token index into q)
    ntok = tl.load(tiles_ptr + tile * 4 + 2)  # tokens in this tile
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)  # position of its first token
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < ntok
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (row0 + tok)[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    qpos = pos0 + tok  # [BLOCK_M]
    end = pos0 + ntok  # keys the tile's last token sees
    # Key 0 is visible to every row, so the first tile makes every row's maximum finite.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs = tl.arange(0, TILE_N)
    for start in range(0, end, TILE_N):
        m, l_sum, acc = attend_tile(q, qpos, m, l_sum, acc, start + offs, end, bt_ptr + seq * s_bt, k_ptr, v_ptr, kvh,
                                    sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, d, scale_log2, PAGE, IEEE, qpos, -1, False)
    out = acc / l_sum[:, None]
    tl.store(out_ptr + (row0 + tok)[:, None] * so_t + head[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tiles(query_starts: list[int], query_lens: list[int], context_lens: list[int], min_query: int,
                  tokens_per_tile: int) -> list[tuple[int, int, int, int]]:
    """(sequence, first row, tokens, first position) of every tile of the queries longer than
    ``min_query``."""
    tiles = []
    for seq, (q0, qlen, ctx) in enumerate(zip(query_starts, query_lens, context_lens, strict=True)):
        if qlen <= min_query:
            continue
        for off in range(0, qlen, tokens_per_tile):
            tiles.append((seq, q0 + off, min(tokens_per_tile, qlen - off), ctx - qlen + off))
    return tiles


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [S, max_blocks]
    tiles: list[tuple[int, int, int, int]] | torch.Tensor,  # from prefill_tiles, or tiles_tensor of them
    scale: float,
    out: torch.Tensor,  # [T, H, D]; rows of the tiles' tokens are written
) -> torch.Tensor:
    tiles_t = tiles if isinstance(tiles, torch.Tensor) else tiles_tensor(tiles, q.device)  # [n_tiles * 4]
    if not tiles_t.numel():
        return out
    heads, dim = q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    _prefill_attn_kernel[(tiles_t.numel() // 4, kv_heads)](
        q, k_cache, v_cache, out, block_table, tiles_t, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=group, BLOCK_M=BLOCK_M, HEAD_DIM=dim, PAGE=page, TILE_N=TILE_N, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out


def tiles_tensor(tiles: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
    """The kernel's tile list, [n_tiles * 4] int32 on `device`: made once per step, read by every layer."""
    return h2d([x for t in tiles for x in t], torch.int32, device)


def tokens_per_tile(heads: int, kv_heads: int) -> int:
    return max(1, BLOCK_M // (heads // kv_heads))

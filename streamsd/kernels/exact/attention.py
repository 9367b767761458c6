"""Batch-invariant paged attention, in Triton: the exact mode's one path for every query row.

The default CUDA attention runs decode and verify rows through paged.py's kernel, whose split of the
keys among programs (flash-decoding) depends on the number of sequences, and prompt chunks through
prefill.py's, with another tiling: a token's output bits then depend on the batch and on whether it
was decoded, verified or prefilled. Here every row of every sequence goes one way. A program takes
TOKENS tokens of one sequence's query times the GROUP heads of one kv head as a fixed [BLOCK_M, D]
tile (the prompt kernel's, so a prompt graph's tiles are this kernel's too) and walks the keys from
position 0 in TILE_N blocks, one online-softmax step each, in order, with no split. A row's
numbers are then the same whoever shares its tile: the tile's products are per row, and the blocks
past a row's own position (walked for its tile's later tokens) are fully masked for it, which
leaves its running max, sum and accumulator as they were (alpha = 1, p = 0).

Draft trees (TREE): a window row sees the keys before the window and its ancestors' rows, scattered
over the window; the same token decoded in a chain sees the same keys at consecutive positions, and
the tile's sums add its lanes in lane order. So a tree launch takes one token per program (TOKENS = 1:
the tile keeps its shape with GROUP live rows, and a row's bits depend on neither its tile mates nor
its row) and walks the token's *logical* positions, the ones its keys would have in the chain: key
p < win is at p, key win + r is the window row of the r-th bit the token's mask sets. Each block's
lanes read those keys' physical slots, so the key at logical position p sits at lane p % TILE_N of
block p // TILE_N, as in the chain; lanes past the token's own position read nothing and are masked,
as a chain's past its position are (p = 0, alpha = 1: no bit moves). Rows outside a window map
logical to physical one to one. The chain variant is the same code without that mapping.

Nothing but the grid comes from the host: (sequence, tile of its query, kv head), each program reading
its sequence's query start and context (and window start and its token's mask) from the layout's
device tensors, so a CUDA graph captured at one width replays any shorter queries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.attention.prefill import BLOCK_M, tokens_per_tile
from streamsd.kernels.attention.tile import attend_tile
from streamsd.model.kv_cache import BatchLayout

TILE_N = 64  # keys per inner iteration
LOG2E = 1.4426950408889634


# The block table's width changes per eager step, and a graph's context and query starts are views into
# its packed buffer at any offset: neither is worth a variant.
@triton.jit(do_not_specialize=["s_bt"],
            do_not_specialize_on_alignment=["ctx_ptr", "qs_ptr", "bits_ptr", "win_ptr"])
def _exact_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, ctx_ptr, qs_ptr, bits_ptr, win_ptr, scale_log2,
    sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_t, so_h, s_bt,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, TILE_N: tl.constexpr, IEEE: tl.constexpr, TREE: tl.constexpr,
):
    seq = tl.program_id(0)
    off = tl.program_id(1) * TOKENS  # first token of this tile in the sequence's query
    kvh = tl.program_id(2)
    q0 = tl.load(qs_ptr + seq)
    qlen = tl.load(qs_ptr + seq + 1) - q0
    ctx = tl.load(ctx_ptr + seq)
    ntok = tl.minimum(tl.maximum(qlen - off, 0), TOKENS)
    pos0 = ctx - qlen + off  # position of the tile's first token
    end = tl.where(ntok > 0, pos0 + ntok, 0)  # keys the tile's last token sees; none for an empty tile
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < ntok
    d = tl.arange(0, HEAD_DIM)
    row = (q0 + off + tok).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=row_ok[:, None], other=0.0)
    qpos = pos0 + tok  # [BLOCK_M]
    # Key 0 is visible to every live row, so its first block makes each live row's maximum finite.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs = tl.arange(0, TILE_N)
    if TREE:  # TOKENS == 1: the program's one token, pos0
        win = tl.load(win_ptr + seq)  # the window's first position, -1 without one
        bits = tl.load(bits_ptr + q0 + off, mask=ntok > 0, other=0)  # its window rows (int64 mask)
        in_win = (win >= 0) & (pos0 >= win) & (ntok > 0)
        c = tl.arange(0, 64).to(tl.int64)
        is_set = (bits >> c) & 1  # [64]
        rank = tl.cumsum(is_set, 0) - is_set  # [64] each set bit's rank among the set ones
        lend = tl.where(in_win, win + tl.sum(is_set, 0), end)  # its logical keys (the chain's count)
        # Past every key it reads (< ctx): the dead lanes' position, and the live ones' bound.
        dead = ctx
        sees = tl.zeros([BLOCK_M], tl.int32) + ctx  # [BLOCK_M] every live lane is visible
        for start in range(0, lend, TILE_N):
            lpos = start + offs  # [TILE_N] logical positions
            r = (lpos - win).to(tl.int64)  # [TILE_N] rank among the window rows seen
            hit = (is_set[None, :] != 0) & (rank[None, :] == r[:, None])  # [TILE_N, 64]
            slot = tl.sum(tl.where(hit, c[None, :], 0), 1)  # [TILE_N] the rank-r row's window index
            phys = tl.where(in_win & (lpos >= win), win + slot, lpos)  # [TILE_N]
            kpos = tl.where(lpos < lend, phys, dead)  # [TILE_N] past its own position: dead, as in a chain
            m, l_sum, acc = attend_tile(q, sees, m, l_sum, acc, kpos, dead, bt_ptr + seq * s_bt, k_ptr, v_ptr, kvh,
                                        sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, d, scale_log2, PAGE, IEEE, sees, -1,
                                        False)
    else:
        for start in range(0, end, TILE_N):
            m, l_sum, acc = attend_tile(q, qpos, m, l_sum, acc, start + offs, end, bt_ptr + seq * s_bt, k_ptr,
                                        v_ptr, kvh, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, d, scale_log2, PAGE, IEEE,
                                        qpos, -1, False)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + row[:, None] * so_t + head[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def exact_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [S, max_blocks]
    context_lens: torch.Tensor,  # [S]
    query_starts: torch.Tensor,  # [S + 1]
    scale: float,
    max_query: int,  # the longest query of the step (or of the graph's width): sets the grid
    out: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,  # [T] int64 each window row's visible rows (BatchLayout)
    tree_start: torch.Tensor | None = None,  # [S] int64 each window's first position, -1 for none
) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    tree = tree_bits is not None
    tokens = 1 if tree else tokens_per_tile(heads, kv_heads)
    out = torch.empty_like(q) if out is None else out
    num_seqs = context_lens.shape[0]
    if not num_seqs or max_query <= 0:
        return out
    bits = tree_bits if tree_bits is not None else context_lens  # read only by the TREE variant
    win = tree_start if tree_start is not None else context_lens
    _exact_attn_kernel[(num_seqs, triton.cdiv(max_query, tokens), kv_heads)](
        q, k_cache, v_cache, out, block_table, context_lens, query_starts, bits, win, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=heads // kv_heads, TOKENS=tokens, BLOCK_M=BLOCK_M, HEAD_DIM=dim, PAGE=page, TILE_N=TILE_N,
        IEEE=q.dtype == torch.float32, TREE=tree, num_warps=4, num_stages=2,
    )
    return out


def exact_cuda_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout,
                         scale: float) -> torch.Tensor:
    """The exact mode's `AttentionFn`: decode, verify, draft-tree and prompt rows in one launch of one kernel.
    The grid reads only the host list of query lengths (a CUDA graph's capture fixes it at its width)."""
    return exact_paged_attention(q, k_cache, v_cache, layout.block_table, layout.context_lens_t,
                                 layout.query_starts_t, scale, max(layout.query_lens, default=0),
                                 tree_bits=layout.tree_bits, tree_start=layout.tree_start)

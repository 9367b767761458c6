"""One level of a draft tree's growth in one Triton launch (spec_decode/eagle/tree.expand_level is the oracle).

Between two head forwards the growth ranked the level's candidates, gathered the expanded nodes'
tokens, scores, masks and features, and laid out their window: ~30 small torch kernels a level,
each a few microseconds of a batch-1 tree step on an H200 plus the gap before the next. Here one
program per request writes the level's candidates into the tree's buffers (path score, token,
parent), picks its `M` likeliest (the lowest index first among equal scores) and writes each
one's token, score, candidate index, feature row, mask, RoPE position and window slot.

`expand_level` here and in spec_decode/eagle/tree.py: tests/kernels/test_tree_kernels.py
`test_tree_growth_levels_equal_the_torch_oracle` compares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from streamsd.model.tree_layout import Candidates, Frontier


@triton.jit(do_not_specialize=["offset", "total", "level", "table_stride"])
def _expand_kernel(s_ptr, t_ptr, base_score_ptr, base_index_ptr, base_bits_ptr, pending_ptr, table_ptr, table_stride,
                   all_s_ptr, all_t_ptr, all_p_ptr, total, offset, f_tok_ptr, f_score_ptr, f_index_ptr, f_row_ptr,
                   f_bits_ptr, pos_ptr, slot_ptr, ctx_ptr, level,
                   P: tl.constexpr, C: tl.constexpr, M: tl.constexpr, K: tl.constexpr, BS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K)
    live = j < P * C
    par = j // C
    src = (b * P + par) * C + j % C
    score = tl.load(s_ptr + src, mask=live, other=float("-inf")).to(tl.float32) \
        + tl.load(base_score_ptr + b * P + par, mask=live, other=0.0)
    tok = tl.load(t_ptr + src, mask=live, other=0)
    tl.store(all_s_ptr + b * total + offset + j, score, mask=live)
    tl.store(all_t_ptr + b * total + offset + j, tok, mask=live)
    tl.store(all_p_ptr + b * total + offset + j, tl.load(base_index_ptr + b * P + par, mask=live, other=0), mask=live)
    if M > 0:
        pending = tl.load(pending_ptr + b)
        # A graph's padding rows score garbage, NaN included, and NaN loses every comparison: the argmax
        # could then land past the live candidates, and the feature row it names past the level's.
        x = tl.where(live & (score == score), score, float("-inf"))
        for r in tl.static_range(M):
            best = tl.max(x, 0)
            at = tl.minimum(tl.argmax(x, 0), P * C - 1)  # the first maximum: the lowest index
            p_local = at // C
            out = b * M + r
            tl.store(f_tok_ptr + out, tl.sum(tl.where(j == at, tok, 0), 0))
            tl.store(f_score_ptr + out, best)
            tl.store(f_index_ptr + out, (offset + at).to(tl.int64))
            tl.store(f_row_ptr + out, b * P + p_local)
            own = tl.full([], 1, tl.int64) << ((level - 1) * M + r)
            tl.store(f_bits_ptr + out, tl.load(base_bits_ptr + b * P + p_local) | own)
            tl.store(pos_ptr + out, pending + level - 1)
            at_pos = pending + (level - 1) * M + r
            block = tl.load(table_ptr + b * table_stride + at_pos // BS).to(tl.int64)
            tl.store(slot_ptr + out, block * BS + at_pos % BS)
            x = tl.where(j == at, float("-inf"), x)
        tl.store(ctx_ptr + b, (pending + level * M).to(tl.int32))


def expand_level(s: torch.Tensor, t: torch.Tensor, base: Frontier, offset: int, cands: Candidates, m: int,
                 level: int, pending: torch.Tensor, block_table: torch.Tensor, block_size: int) -> Frontier | None:
    """spec_decode/eagle/tree.expand_level in one launch."""
    b, p = base.scores.shape
    c = s.shape[1]
    dev = s.device
    fr = base.empty(b, m, dev) if m else None
    some = fr if fr is not None else base  # where M = 0 the kernel writes no frontier: any pointers do
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    _expand_kernel[(b,)](s.contiguous(), t.contiguous(), base.scores, base.index, base.bits, pending, table,
                         table.stride(0), cands.scores, cands.tokens, cands.parents, cands.scores.shape[1], offset,
                         some.tokens, some.scores, some.index, some.rows, some.bits, some.positions, some.slots,
                         some.context_lens, level, P=p, C=c, M=m, K=triton.next_power_of_2(p * c), BS=block_size,
                         num_warps=1)
    return fr

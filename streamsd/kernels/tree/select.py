"""The selection of a grown tree's nodes in one launch (worker/tree_graphs.py; spec_decode/tree.py's torch function
is the oracle, and the CPU path). (The head's catch-up layout after a walk, a dozen small torch kernels
once, is written by kernels/tree/bookkeeping.py's walk.)

- `select`: the n likeliest candidates of a grown tree as a tree (spec_decode/tree.select: a stable sort, a
  scatter and four gathers). A program per request and block of candidates ranks each against every
  other (a stable descending sort is the count of the better ones, ties broken by index), and ranks each
  one's parent the same way, which is its node index once kept.

`select` here and in spec_decode/tree.py: tests/kernels/test_tree_kernels.py
`test_tree_step_kernels_equal_the_torch_oracles` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.model.tree_layout import NONE, ROOT


@triton.jit
def _no_nan(x):
    # NaN ranks last, as -inf: every comparison with a NaN is false, so NaNs would tie for the same
    # ranks and leave nodes unwritten (a padding row's scores, from the never-written streams it reads).
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def _select_kernel(scores_ptr, tokens_ptr, parents_ptr, out_tok_ptr, out_par_ptr, c, n,
                   BLOCK: tl.constexpr, NB: tl.constexpr, ROOT_ID: tl.constexpr, NONE_ID: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    base = b * c
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # this program's block of candidates, ranked against all
    live_i = i < c
    s_i = _no_nan(tl.load(scores_ptr + base + i, mask=live_i, other=0.0))
    up = tl.load(parents_ptr + base + i, mask=live_i, other=-1)
    s_up = _no_nan(tl.load(scores_ptr + base + tl.maximum(up, 0), mask=live_i, other=0.0))
    rank = tl.zeros([BLOCK], tl.int32)
    up_rank = tl.zeros([BLOCK], tl.int32)
    for jb in tl.static_range(NB):
        j = jb * BLOCK + tl.arange(0, BLOCK)
        live_j = j < c
        s_j = _no_nan(tl.load(scores_ptr + base + j, mask=live_j, other=0.0))
        sj, jj, lj = s_j[None, :], j[None, :], live_j[None, :]
        before = lj & ((sj > s_i[:, None]) | ((sj == s_i[:, None]) & (jj < i[:, None])))  # [BLOCK, BLOCK]
        before_up = lj & ((sj > s_up[:, None]) | ((sj == s_up[:, None]) & (jj < up[:, None])))
        rank += tl.sum(before.to(tl.int32), 1)
        up_rank += tl.sum(before_up.to(tl.int32), 1)
    kept = live_i & (rank < n)
    tok = tl.load(tokens_ptr + base + i, mask=live_i, other=0)
    tl.store(out_tok_ptr + b * n + rank, tok, mask=kept)
    node_parent = tl.where(up >= 0, tl.where(up_rank < n, up_rank, NONE_ID), ROOT_ID)
    tl.store(out_par_ptr + b * n + rank, node_parent.to(tl.int64), mask=kept)


def select(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """spec_decode/tree.select's (tokens, parents as node indices) [B, n] in one launch. A NaN score ranks last
    (so every node is written), and a kept node whose parent is not kept (possible only then) gets NONE."""
    b, c = scores.shape
    out_tok = torch.empty(b, n, dtype=torch.int64, device=scores.device)
    out_par = torch.empty(b, n, dtype=torch.int64, device=scores.device)
    # A program per (request, block of 32 candidates): one program ranking all 114 of a 4,6,6,24 tree
    # took 10 us of a step on an H200, a chain of 4 blocks of comparisons.
    block = min(32, triton.next_power_of_2(c))
    nb = triton.cdiv(c, block)
    _select_kernel[(b, nb)](scores.contiguous(), tokens.contiguous(), parents.contiguous(), out_tok, out_par, c, n,
                            BLOCK=block, NB=nb, ROOT_ID=ROOT, NONE_ID=NONE, num_warps=2)
    return out_tok, out_par

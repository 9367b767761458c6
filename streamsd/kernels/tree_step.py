"""The rest of a tree step's bookkeeping in one launch each (tree_graphs.py; spec/tree.py's torch
functions are the oracles, and the CPU path).

- `catch_up`: after the walk, the head's catch-up over each request's root and D accepted slots: its
  ids (the emitted tokens, padding as 0), positions, KV slots and context, and the pending position:
  a dozen small torch kernels before (aranges, a division and a gather for the slots, casts).
- `select`: the n likeliest candidates of a grown tree as a tree (spec/tree.select: a stable sort, a
  scatter and four gathers). One program per request ranks every candidate against every other (a
  stable descending sort is the count of the better ones, ties broken by index), and ranks each one's
  parent the same way, which is its node index once kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.spec.tree import NONE, ROOT


@triton.jit
def _catch_up_kernel(roots_ptr, accepted_ptr, emitted_ptr, bt_ptr, s_bt, ids_ptr, pos_ptr, slot_ptr, ctx_ptr,
                     pending_ptr, C: tl.constexpr, CP: tl.constexpr, PAGE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, CP)
    live = j < C
    root = tl.load(roots_ptr + b)
    pos = root + j
    block = tl.load(bt_ptr + b * s_bt + pos // PAGE, mask=live, other=0).to(tl.int64)
    tl.store(ids_ptr + b * C + j, tl.maximum(tl.load(emitted_ptr + b * C + j, mask=live, other=0), 0), mask=live)
    tl.store(pos_ptr + b * C + j, pos, mask=live)
    tl.store(slot_ptr + b * C + j, block * PAGE + pos % PAGE, mask=live)
    tl.store(ctx_ptr + b, (root + C).to(tl.int32))
    tl.store(pending_ptr + b, root + tl.load(accepted_ptr + b) + 1)


def catch_up(roots: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor, block_table: torch.Tensor,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """spec/tree.catch_up in one launch."""
    b, c = emitted.shape
    longs = [torch.empty(b * c, dtype=torch.int64, device=roots.device) for _ in range(3)]
    ctx = torch.empty(b, dtype=torch.int32, device=roots.device)
    pending = torch.empty_like(roots)
    _catch_up_kernel[(b,)](roots, accepted, emitted.contiguous(), block_table, block_table.stride(0), *longs, ctx,
                           pending, C=c, CP=triton.next_power_of_2(c), PAGE=block_size, num_warps=1)
    return longs[0], longs[1], longs[2], ctx, pending


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
    for ib in tl.static_range(NB):
        i = ib * BLOCK + tl.arange(0, BLOCK)
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
    """spec/tree.select's (tokens, parents as node indices) [B, n] in one launch. A NaN score ranks last
    (so every node is written), and a kept node whose parent is not kept (possible only then) gets NONE."""
    b, c = scores.shape
    out_tok = torch.empty(b, n, dtype=torch.int64, device=scores.device)
    out_par = torch.empty(b, n, dtype=torch.int64, device=scores.device)
    block = min(64, triton.next_power_of_2(c))
    _select_kernel[(b,)](scores.contiguous(), tokens.contiguous(), parents.contiguous(), out_tok, out_par, c, n,
                         BLOCK=block, NB=triton.cdiv(c, block), ROOT_ID=ROOT, NONE_ID=NONE,
                         num_warps=4)
    return out_tok, out_par

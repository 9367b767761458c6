"""An EAGLE head growing a draft tree (EAGLE-2's dynamic tree), one head forward per level.

From the head's output at a request's last caught-up slot, the root's `branch` likeliest tokens
are level 1. Each further level takes the `frontier` likeliest nodes of the last one (by path
probability: the product of the head's probabilities along the path) through the head's layer, fed
with their token and their parent's output as EAGLE's chain does, and keeps each one's `branch`
likeliest children. The `nodes` likeliest of all are the tree the target verifies (tree.select).

The head's KV for a node it expands goes to its window: position P + (level - 1) * frontier + r
for the r-th expanded node of its level, P being the pending token's position (the head's context
ends at slot P - 1). A node attends to the context and to its own ancestors' window slots only
(BatchLayout.tree_bits), and sits at RoPE position P + level - 1, where a chain would put it. Those
slots hold guesses, never kept: the next catch-up overwrites them.

A sampled request's children are ranked by its target's own race (`Race`): the race at position m
takes argmax(p / E) over the noise E keyed (seed, m), so the head runs that race over its own
probabilities q at the children's position, ranking by log q - log E, and the winner is the
target's token wherever q's race agrees with p's; the next best fill in. That covers the target's
sample far better than q's likeliest tokens at T = 1, and costs no
exactness: the walk (spec_decode/tree.py) keeps what the target draws whatever the tree holds.

Fixed shapes throughout and no host read, so a CUDA graph captures a whole growth. Between two head
forwards a level's bookkeeping (`expand_level`: rank its candidates, lay out the next frontier) is
one Triton launch on CUDA (kernels/tree/grow.py) and these torch ops on the CPU, its oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from streamsd.config import TreeShape
from streamsd.model.kv_cache import BatchLayout, uniform_starts
from streamsd.model.tree_layout import Candidates, Frontier, Race
from streamsd.sample import rng
from streamsd.spec_decode.eagle.head import EagleHead
from streamsd.spec_decode.tree import positions_to_slots, select


class HeadLayer(Protocol):
    """The head layer over ids [T] (its K/V written at the layout's slots) -> its output [T, H]; token t's
    hidden input is feats[rows[t]] (rows None: feats[t])."""

    def __call__(self, ids: torch.Tensor, feats: torch.Tensor, layout: BatchLayout,
                 rows: torch.Tensor | None = None) -> torch.Tensor: ...


def race_logits(logits: torch.Tensor, race: Race, keys: torch.Tensor) -> torch.Tensor:
    """logits [B * R, V] (R rows a request) -> what ranks their children [B * R, V]: greedy rows as they
    are, others at their temperature plus the Gumbel noise -log E, E the Exp(1) noise the target races
    at each request's children's position keys [B]. The warp's cut-offs (top-k, top-p, min-p) stay
    out: a token they cut is never the target's, so ranking it costs a node, not exactness."""
    b = race.seeds.shape[0]
    reps = logits.shape[0] // b
    noise = rng.exponentials(race.seeds, keys.unsqueeze(1), rng.TARGET, logits.shape[-1])[:, 0]  # [B, V]
    raced_rows = (race.greedy == 0) & (race.temperature > 0)  # [B] (a graph's padding rows: temperature 0)
    temp = torch.where(raced_rows, race.temperature, 1.0).view(b, 1, 1)
    x = logits.float().reshape(b, reps, -1)  # [B, R, V]
    return torch.where(raced_rows.view(b, 1, 1), x / temp - torch.log(noise).unsqueeze(1), x).view_as(logits)


@dataclass(slots=True)
class GrowConsts:
    """What every growth of B trees of one shape starts from. Made once, outside a CUDA graph: made
    inside, each replay would rebuild it (a launch each)."""

    root: Frontier
    starts: torch.Tensor  # [B + 1] int32 every level's query starts
    levels: torch.Tensor  # [D, 1] int64: 1 .. D

    @staticmethod
    def build(b: int, shape: TreeShape, device: torch.device) -> GrowConsts:
        return GrowConsts(Frontier.root(b, device), uniform_starts(b, shape.frontier, device),
                          torch.arange(1, shape.depth + 1, device=device).unsqueeze(1))


def grow(head: EagleHead, layer: HeadLayer, h0: torch.Tensor, pending: torch.Tensor, block_table: torch.Tensor,
         block_size: int, shape: TreeShape, race: Race | None = None,
         consts: GrowConsts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree per request from h0 [B, H], the head's output at its last caught-up slot; pending [B]:
    each request's pending position P, block_table [B, W] its blocks (the window's slots must be in
    them); race: the requests' target races (None: all greedy). Returns (tokens, parents) [B, nodes],
    best first."""
    b = h0.shape[0]
    m, c = shape.frontier, shape.branch
    if h0.is_cuda:  # one launch a level (kernels/tree/grow.py), one for the selection (kernels/tree/select.py)
        from streamsd.kernels.tree.grow import expand_level as expand
        from streamsd.kernels.tree.select import select as pick
    else:
        expand = expand_level

        def pick(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            return select(scores, tokens, parents, n)[:2]
    consts = consts or GrowConsts.build(b, shape, h0.device)
    cands = Candidates.empty(b, c + (shape.depth - 1) * m * c, h0.device)
    # The position each level's children are decided at, P + depth: only a race reads it.
    keys = None if race is None else pending + consts.levels  # [D, B]
    s, t = _children(head, h0, c, race, keys, 0)  # [B, C] the root's children
    base, src, offset = consts.root, h0, 0
    starts = consts.starts  # [B + 1]
    for level in range(1, shape.depth):
        fr = expand(s, t, base, offset, cands, m, level, pending, block_table, block_size)
        assert fr is not None
        offset += base.scores.shape[1] * c
        layout = BatchLayout.uniform(m, fr.positions, fr.slots, block_table, fr.context_lens, fr.bits.view(-1),
                                     pending, starts).for_host(block_size)
        out = layer(fr.tokens.view(-1), src, layout, fr.rows)  # [B * M, H]
        s, t = _children(head, out, c, race, keys, level)  # [B * M, C]
        base, src = fr, out
    expand(s, t, base, offset, cands, 0, shape.depth, pending, block_table, block_size)  # the last level's
    return pick(cands.scores, cands.tokens, cands.parents, shape.nodes)


def expand_level(s: torch.Tensor, t: torch.Tensor, base: Frontier, offset: int, cands: Candidates, m: int,
                 level: int, pending: torch.Tensor, block_table: torch.Tensor, block_size: int) -> Frontier | None:
    """One level: the children s, t [B * P, C] (log-probabilities, ids) of the P nodes `base` expanded
    per request become candidates offset .. offset + P * C (path score: the parent's plus the
    child's); then, unless m = 0 (the last level), the m likeliest of them are the next frontier, whose
    window positions follow the level before's: P + (level - 1) * m + r for the r-th."""
    b, p = base.scores.shape
    c = s.shape[1]
    dev = s.device
    score = (base.scores.unsqueeze(-1) + s.view(b, p, c)).reshape(b, p * c)  # [B, P * C]
    tok = t.reshape(b, p * c)
    cands.scores[:, offset : offset + p * c] = score
    cands.tokens[:, offset : offset + p * c] = tok
    cands.parents[:, offset : offset + p * c] = base.index.repeat_interleave(c, dim=1)
    if not m:
        return None
    f = score.topk(m, dim=1).indices  # [B, M] the level's likeliest
    local = f // c  # [B, M] each one's parent among the P
    r = torch.arange(m, device=dev)
    at = pending.unsqueeze(1) + (level - 1) * m + r  # [B, M] window positions
    return Frontier(tok.gather(1, f), score.gather(1, f), offset + f,
                    (torch.arange(b, device=dev).unsqueeze(1) * p + local).view(-1),
                    base.bits.gather(1, local) | (torch.ones_like(r) << ((level - 1) * m + r)),
                    (pending + level - 1).repeat_interleave(m), positions_to_slots(at, block_table, block_size).view(-1),
                    (pending + level * m).to(torch.int32))


def _children(head: EagleHead, out: torch.Tensor, c: int, race: Race | None, keys: torch.Tensor | None,
              level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `c` best next tokens after the head's outputs out [B * R, H] at `level` and their
    log-probabilities [B * R, C] under what ranks them: the head's logits, raced at positions
    keys[level] [B] for sampled requests."""
    at = None if keys is None else keys[level]  # [B]
    if out.is_cuda and head.int8_logits is not None:  # the norm, the lm_head and the top-k: one pass, two launches
        from streamsd.kernels.tree.head_topk import head_topk

        return head_topk(out, head.int8_logits, c, race, at)
    # On CUDA the top-k kernel reads the lm_head's bf16 as float32 itself: no [B * R, V] copy to make it so.
    logits = head.target_logits(out, upcast=not out.is_cuda)  # [B * R, V]
    if logits.is_cuda:  # two launches, the race's noise inside, not a softmax and a radix top-k (kernels/sample/topk.py)
        from streamsd.kernels.sample import topk as kernel

        return kernel.topk_logprobs(logits, c, race, at)
    return topk_logprobs(logits, c, race, at)


def topk_logprobs(logits: torch.Tensor, k: int, race: Race | None = None, keys: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> the k best log-probabilities of each row and their ids [N, k], best first; with a
    race, sampled requests' rows ranked by their raced logits at keys [B] (`race_logits`)."""
    if race is not None:
        assert keys is not None
        logits = race_logits(logits, race, keys)
    values, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return values, ids

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

Fixed shapes throughout and no host read, so a CUDA graph captures a whole growth; eagerly (the
CPU) it is the same code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from streamsd.config import TreeShape
from streamsd.model.kv_cache import BatchLayout
from streamsd.spec.eagle_head import EagleHead
from streamsd.spec.tree import ROOT, positions_to_slots, select

# (ids [T], feats [T, H], layout) -> the head layer's output [T, H], its K/V written
HeadLayer = Callable[[torch.Tensor, torch.Tensor, BatchLayout], torch.Tensor]


def grow(head: EagleHead, layer: HeadLayer, h0: torch.Tensor, pending: torch.Tensor, block_table: torch.Tensor,
         block_size: int, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree per request from h0 [B, H], the head's output at its last caught-up slot; pending [B]:
    each request's pending position P, block_table [B, W] its blocks (the window's slots must be in
    them). Returns (tokens, parents) [B, nodes], best first."""
    b, hidden = h0.shape
    m, c = shape.frontier, shape.branch
    score, tok = _children(head, h0, c)  # [B, C] level 1
    scores, toks, parents = [score], [tok], [torch.full_like(tok, ROOT)]
    feats = h0.unsqueeze(1).expand(b, c, hidden)  # [B, C, H] each candidate's parent output
    bits = torch.zeros_like(tok)  # [B, C] the window slots of each candidate's ancestors
    offset = 0  # global index of the current level's first candidate
    for level in range(1, shape.depth):
        f = score.topk(m, dim=1).indices  # [B, M] the level's likeliest, expanded
        f_tok, f_score = tok.gather(1, f), score.gather(1, f)  # [B, M]
        f_feat = feats.gather(1, f.unsqueeze(-1).expand(b, m, hidden))  # [B, M, H]
        own = torch.ones(m, dtype=torch.int64, device=f.device) << ((level - 1) * m + torch.arange(m, device=f.device))
        f_bits = bits.gather(1, f) | own  # [B, M]
        layout = level_layout(pending, block_table, block_size, level, m, f_bits)
        out = layer(f_tok.reshape(-1), f_feat.reshape(-1, hidden), layout).view(b, m, hidden)  # [B, M, H]
        s, t = _children(head, out.view(-1, hidden), c)  # [B * M, C]
        score = (f_score.unsqueeze(-1) + s.view(b, m, c)).view(b, m * c)  # [B, M * C]
        tok = t.view(b, m * c)
        parents.append((offset + f).repeat_interleave(c, dim=1))  # [B, M * C] global candidate index
        offset += scores[-1].shape[1]
        scores.append(score)
        toks.append(tok)
        feats = out.repeat_interleave(c, dim=1)  # [B, M * C, H]
        bits = f_bits.repeat_interleave(c, dim=1)  # [B, M * C]
    tokens, node_parents, _ = select(torch.cat(scores, 1), torch.cat(toks, 1), torch.cat(parents, 1), shape.nodes)
    return tokens, node_parents


def _children(head: EagleHead, out: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's `c` likeliest next tokens after outputs out [R, H]: (log-probabilities, ids) [R, C]."""
    logits = head.target_logits(out)  # [R, V]
    if logits.is_cuda:  # two launches, not a softmax and a radix top-k (kernels/topk.py)
        from streamsd.kernels.topk import topk_logprobs

        return topk_logprobs(logits, c)
    values, ids = torch.log_softmax(logits, dim=-1).topk(c, dim=-1)
    return values, ids


def level_layout(pending: torch.Tensor, block_table: torch.Tensor, block_size: int, level: int, m: int,
                 bits: torch.Tensor) -> BatchLayout:
    """The layout of one expansion: m nodes of `level` per request, bits [B, M] their window masks."""
    at = pending.unsqueeze(1) + (level - 1) * m + torch.arange(m, device=pending.device)  # [B, M] window positions
    return BatchLayout.uniform(m, (pending + level - 1).repeat_interleave(m),
                               positions_to_slots(at, block_table, block_size).view(-1), block_table,
                               pending + level * m, bits.reshape(-1), pending).for_host(block_size)

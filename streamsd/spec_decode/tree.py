"""Draft trees: the shape of one, its attention masks, and how a verify walks it.

A request's tree is N draft nodes in an order where each parent comes before its children: node i
holds a token and `parents[i]`, the index of its parent node, or ROOT for a child of the pending
token (the root, which the target already knows). A chain of k drafts is the tree whose parents are
ROOT, 0, 1, ..., k - 2. A verify computes the root and every node in one pass: row 0 is the root,
row 1 + i node i, each at position start + its depth (the root's is 0) and attending to the context
and to its own ancestors only (`window_bits`); its KV goes to slot start + row, so the window is
contiguous in the request's blocks whatever the tree's shape.

Walking it is sampling from the target, position by position: at each row the target's token is
drawn as a plain step would draw it there (the argmax, or the race against the noise keyed by the
request's seed and that position); where a child of the row holds that token, the walk moves into
the child, else it stops and emits it. Every emitted token is therefore exactly the target's, and
with the same noise the same as plain decoding's: lossless by construction, for any way of choosing
the children (distinct tokens per parent). The accepted nodes then move to slots start + 1 ..
start + a (`path_moves`): the cache holds accepted tokens only, at their positions.

Everything here is fixed-shape tensor work with no host read, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch

from streamsd.model.tree_layout import NONE, ROOT

MAX_NODES = 62  # the root and its nodes share one int64 bitmask per row (bit 63 stays clear)


def depths(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] -> each node's depth [B, N] (a child of the root: 1; padding: 1)."""
    depth = torch.ones_like(parents)  # [B, N]
    up = parents.clamp(min=0)  # [B, N]
    has_parent = parents >= 0
    for _ in range(max_depth - 1):  # parents precede children: max_depth rounds settle every path
        depth = torch.where(has_parent, depth.gather(1, up) + 1, 1)
    return depth


def ancestor_bits(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] -> [B, N] int64: bit j set when node j is the node itself or one of its
    ancestors (bits over node indices; the root has none)."""
    n = parents.shape[1]
    own = torch.ones_like(parents) << torch.arange(n, device=parents.device)  # [B, N]
    bits = own
    up = parents.clamp(min=0)
    has_parent = parents >= 0
    for _ in range(max_depth - 1):
        bits = own | torch.where(has_parent, bits.gather(1, up), 0)
    return bits


def window_bits(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """The verify window's attention masks: [B, N] parents -> [B, N + 1] int64, row r's bit c set
    when window row c (0 the root, 1 + j node j) is row r itself or an ancestor of it."""
    nodes = ancestor_bits(parents, max_depth)  # [B, N] over node indices
    rooted = torch.where(parents == NONE, nodes << 1, (nodes << 1) | 1)  # [B, N]: the root under every real node
    return torch.cat([torch.ones_like(rooted[:, :1]), rooted], dim=1)  # [B, N + 1]


def walk(target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verified tree's outcome.

    target [B, N + 1]: the target's token at each window row (root, then node i at 1 + i);
    tokens, parents [B, N]: the tree. Returns (emitted [B, D + 1]: the accepted nodes' tokens, then
    the target's token after the last of them, then -1; accepted [B]; path [B, D]: the accepted node
    at each depth, -1 past the last), D = max_depth.
    """
    b, n = tokens.shape
    dev = tokens.device
    parent_row = (parents + 1).clamp(min=0)  # [B, N] the window row whose token a node must equal
    match = (tokens == target.gather(1, parent_row)) & (parents != NONE)  # [B, N]
    missing = (~match).long() << torch.arange(n, device=dev)  # [B, N]
    missing_bits = missing.sum(dim=1, keepdim=True)  # [B, 1] distinct bits: the sum is their union
    ok = (ancestor_bits(parents, max_depth) & missing_bits) == 0  # [B, N]: the whole path matches
    depth = depths(parents, max_depth)  # [B, N]
    level = torch.arange(1, max_depth + 1, device=dev)  # [D]
    at = ok.unsqueeze(1) & (depth.unsqueeze(1) == level.view(1, -1, 1))  # [B, D, N]
    found = at.any(dim=2)  # [B, D]: siblings hold distinct tokens, so at most one node per depth
    path = torch.where(found, at.long().argmax(dim=2), -1)  # [B, D]
    accepted = found.long().sum(dim=1)  # [B]
    last_row = torch.where(accepted > 0, path.gather(1, (accepted - 1).clamp(min=0).unsqueeze(1)).squeeze(1) + 1, 0)
    drafted = tokens.gather(1, path.clamp(min=0))  # [B, D]
    bonus = target.gather(1, last_row.unsqueeze(1))  # [B, 1]
    col = torch.arange(max_depth + 1, device=dev)  # [D + 1]
    a = accepted.unsqueeze(1)
    emitted = torch.where(col < a, torch.nn.functional.pad(drafted, (0, 1)), torch.where(col == a, bonus, -1))
    return emitted, accepted, path


def path_moves(starts: torch.Tensor, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions to move KV between after a walk: the node accepted at depth d sits at window row
    1 + path[d - 1], i.e. position start + 1 + path[d - 1], and belongs at start + d. starts [B],
    path [B, D] -> (src, dst) positions [B, D]; past the accepted nodes the root onto itself (a no-op
    move inside the window, which no real move reads or writes)."""
    d = torch.arange(1, path.shape[1] + 1, device=path.device)  # [D]
    s = starts.unsqueeze(1)  # [B, 1]
    dst = torch.where(path >= 0, s + d, s)  # [B, D]
    src = torch.where(path >= 0, s + 1 + path, s)
    return src, dst


def positions_to_slots(positions: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [B, P] of each row's sequence -> flat KV slots [B, P] through block_table [B, W]."""
    block = block_table.gather(1, positions // block_size).long()
    return block * block_size + positions % block_size


def catch_up(roots: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor, block_table: torch.Tensor,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the head's catch-up after a walk computes: roots [B], accepted [B], emitted [B, C] (-1 past
    the accepted), block_table [B, W] -> its ids (padding as 0), positions and KV slots [B * C] (C slots
    from the root), context lengths [B] int32, and each request's pending position [B]."""
    c = emitted.shape[1]
    at = roots.unsqueeze(1) + torch.arange(c, device=roots.device)  # [B, C]
    slots = positions_to_slots(at, block_table, block_size)  # [B, C]
    return (emitted.clamp(min=0).view(-1), at.view(-1), slots.view(-1), (roots + c).to(torch.int32),
            roots + accepted + 1)


def select(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The n likeliest candidates of a grown tree, as a tree.

    scores [B, C] (a candidate's path log-probability), tokens [B, C], parents [B, C] (the parent's
    candidate index, or ROOT), with every parent at a lower index than its children. A child's score
    is at most its parent's and a stable sort keeps a tie in index order, so the n best are closed
    under ancestors and sorted best first they list every parent before its children. Returns
    (tokens, parents as node indices, scores), each [B, n], best first: any prefix is itself the
    likeliest tree of its size.
    """
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n]
    local = torch.full_like(parents, NONE)  # [B, C]: candidate -> its node index (NONE: not kept)
    local.scatter_(1, order, torch.arange(n, device=scores.device).expand_as(order))
    up = parents.gather(1, order)  # [B, n] the kept candidates' parents, as candidate indices
    node_parents = torch.where(up >= 0, local.gather(1, up.clamp(min=0)), ROOT)
    return tokens.gather(1, order), node_parents, scores.gather(1, order)

"""Paged attention, pure torch: the CPU path and the oracle of the Triton kernel.

Each sequence attends with its query tokens (a prefill chunk, one decode token, or 1 + k verify
tokens) over every cached position up to its own; query i of a sequence sits at position
context_len - query_len + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamsd.model.kv_cache import BatchLayout


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout, scale: float
) -> torch.Tensor:
    """q [T, H, D]; caches [NB, BS, KVH, D] -> out [T, H, D]."""
    out = torch.empty_like(q)
    kvh, dim = k_cache.shape[2], k_cache.shape[3]
    per_seq = _per_sequence(layout, k_cache.shape[1], q.shape[1] // kvh, q.device)
    for start, qlen, ctx, (blocks, mask) in zip(layout.query_starts, layout.query_lens, layout.context_lens, per_seq,
                                                strict=True):
        if qlen == 0:
            continue
        k = k_cache.index_select(0, blocks).reshape(-1, kvh, dim)[:ctx].transpose(0, 1)  # [KVH, ctx, D]
        v = v_cache.index_select(0, blocks).reshape(-1, kvh, dim)[:ctx].transpose(0, 1)  # [KVH, ctx, D]
        qs = q[start : start + qlen].transpose(0, 1)  # [H, qlen, D]
        if qlen == ctx and mask is None:
            o = F.scaled_dot_product_attention(qs, k.to(qs.dtype), v.to(qs.dtype), is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            o = _attend_grouped(qs, k.to(qs.dtype), v.to(qs.dtype), mask, scale)
        out[start : start + qlen] = o.transpose(0, 1)
    return out


def _per_sequence(layout: BatchLayout, block_size: int, group: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each sequence's blocks up to its context (an index tensor) and its window mask, built once per
    step and read by every layer: built per call they were 960 small tensors a step at 32 requests on
    this CPU, and the masks 5 ms of a 180 ms verify step. A mask is [G*qlen, ctx] bool: query i of a
    window of qlen at the end of ctx sees positions <= ctx - qlen + i, stacked for the G query heads of
    a kv head (None for one query: no mask, SDPA's fused path). Sequences of one shape share it.
    A sequence verifying a draft tree gets its own mask from its tokens' window bits."""
    key = ("reference", block_size, group)
    cached = layout.derived.get(key)
    if cached is None:
        masks: dict[tuple[int, int], torch.Tensor] = {}
        cached = layout.derived[key] = []
        trees = _tree_masks(layout, device) if layout.tree_bits is not None else {}
        for s, (table, qlen, ctx) in enumerate(zip(layout.block_tables, layout.query_lens, layout.context_lens,
                                                    strict=True)):
            blocks = torch.tensor(table[: -(-ctx // block_size)], dtype=torch.int64, device=device)
            mask = None
            if s in trees:
                mask = trees[s].repeat(group, 1)
            elif 1 < qlen < ctx:
                mask = masks.get((ctx, qlen))
                if mask is None:
                    q_pos = torch.arange(ctx - qlen, ctx, device=device).unsqueeze(-1)  # [qlen, 1]
                    mask = masks[(ctx, qlen)] = (torch.arange(ctx, device=device).unsqueeze(0) <= q_pos).repeat(group, 1)
            cached.append((blocks, mask))
    return cached


def _tree_masks(layout: BatchLayout, device: torch.device) -> dict[int, torch.Tensor]:
    """[qlen, ctx] bool masks of the sequences with a tree window (kv_cache.BatchLayout.tree_bits)."""
    assert layout.tree_bits is not None and layout.tree_start is not None
    bits, starts = layout.tree_bits.cpu(), layout.tree_start.tolist()
    out = {}
    for s, (q0, qlen, ctx, win) in enumerate(zip(layout.query_starts, layout.query_lens, layout.context_lens, starts,
                                                  strict=True)):
        if win < 0 or qlen == 0:
            continue
        keys = torch.arange(ctx)  # [ctx]
        offset = (keys - win).clamp(min=0, max=62)  # [ctx]
        seen = (bits[q0 : q0 + qlen].unsqueeze(1) >> offset) & 1  # [qlen, ctx]
        qpos = torch.arange(ctx - qlen, ctx).unsqueeze(1)  # [qlen, 1]: rows before the window are causal
        out[s] = torch.where(qpos >= win, (keys < win) | (seen == 1), keys <= qpos).to(device)
    return out


def _attend_grouped(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """A decode token or verify window after cached context: qs [H, qlen, D], k/v [KVH, ctx, D], its
    window mask [G*qlen, ctx] (None for one token) -> [H, qlen, D].

    The G = H / KVH query heads that share a kv head are stacked as G * qlen rows of one attention
    call per kv head, so K and V are never repeated and, for a single decode token, no mask is
    needed: on the CPU that takes SDPA's fused path instead of its math fallback (~60 against
    ~150 us a layer at SmolLM2's shapes).
    """
    heads, qlen, dim = qs.shape
    kvh = k.shape[0]
    qg = qs.reshape(kvh, heads // kvh * qlen, dim)  # [KVH, G*qlen, D]: head h = kv head h // G, rows in head order
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [KVH, G*qlen, D]
    return o.view(heads, qlen, dim)

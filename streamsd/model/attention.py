"""Paged attention, pure torch: the CPU path and the oracle of the Triton kernel.

Each sequence attends with its query tokens (a prefill chunk, one decode token, or 1 + k verify
tokens) over every cached position up to its own; query i of a sequence sits at position
context_len - query_len + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamsd.model.kv_cache import BatchLayout


def paged_attention_reference(
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
        if qlen == ctx:
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
    a kv head (None for one query: no mask, SDPA's fused path). Sequences of one shape share it."""
    key = ("reference", block_size, group)
    cached = layout.derived.get(key)
    if cached is None:
        masks: dict[tuple[int, int], torch.Tensor] = {}
        cached = layout.derived[key] = []
        for table, qlen, ctx in zip(layout.block_tables, layout.query_lens, layout.context_lens, strict=True):
            blocks = torch.tensor(table[: -(-ctx // block_size)], dtype=torch.int64, device=device)
            mask = None
            if 1 < qlen < ctx:
                mask = masks.get((ctx, qlen))
                if mask is None:
                    q_pos = torch.arange(ctx - qlen, ctx, device=device).unsqueeze(-1)  # [qlen, 1]
                    mask = masks[(ctx, qlen)] = (torch.arange(ctx, device=device).unsqueeze(0) <= q_pos).repeat(group, 1)
            cached.append((blocks, mask))
    return cached


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

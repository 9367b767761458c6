"""The exact mode's CPU forward: the reference model (llama.py) with every row's result independent of
how many rows share the step and where the row sits.

Measured on this build's CPU GEMM (MKL through F.linear, float32): a row's bits at M = 1 differ from the
same row's at M >= 2, and may differ again between other M, because the library picks its kernel and
blocking by the shape. A call of one fixed shape, though, gives a row the same bits at any of its
positions whatever the other rows hold. So every linear here runs in blocks of ROWS rows (the last one
padded with zeros), each its own call. Attention runs per query token, its GROUP heads against the keys
up to its own position, so a decode token, a verify window's token and a prompt chunk's token make the
same call. RMSNorm and softmax reduce each row alone at these widths (one row per reduction, under
torch's grain size), and the rest is elementwise.

A draft tree's window row sees the keys before the window and its ancestors' rows, scattered over the
window; its call gathers them, in order, into the contiguous keys the same token has decoded in a chain
(kernels/exact/attention.py walks them the same way), so the call and its inputs are the chain's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import ForwardOutput, Transformer, apply_rope, store_streams

# Rows per GEMM call. SmolLM2's lm_head (49152 x 576, float32, one thread of a 2-core EPYC): a lone row took
# 30 ms through F.linear, 64 ms as a call of 8 rows, 114 ms of 16; 64 rows took 213, 500 and 341 ms. A CPU
# serves mostly batch 1, and only a step's logits rows reach the lm_head, so 8.
ROWS = 8


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], as calls of ROWS rows each: a row's bits do not depend on M."""
    m = x.shape[0]
    pad = -m % ROWS
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    # A fresh block per call: the same shape, strides and alignment every time.
    return torch.cat([F.linear(blk.clone(), weight, bias) for blk in xp.split(ROWS)])[:m]


def exact_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout,
                              scale: float) -> torch.Tensor:
    """q [T, H, D]; caches [NB, BS, KVH, D] -> [T, H, D], one SDPA call per query token."""
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    bits = layout.tree_bits.tolist() if layout.tree_bits is not None else None
    wins = layout.tree_start.tolist() if layout.tree_start is not None else None
    for s, (start, qlen, ctx, table) in enumerate(zip(layout.query_starts, layout.query_lens, layout.context_lens,
                                                      layout.block_tables, strict=True)):
        if qlen == 0:
            continue
        blocks = torch.tensor(table[: -(-ctx // bs)], dtype=torch.int64, device=q.device)
        k = k_cache.index_select(0, blocks).reshape(-1, kvh, dim)[:ctx].transpose(0, 1).to(q.dtype)  # [KVH, ctx, D]
        v = v_cache.index_select(0, blocks).reshape(-1, kvh, dim)[:ctx].transpose(0, 1).to(q.dtype)
        win = wins[s] if wins is not None else -1
        for i in range(qlen):
            pos = ctx - qlen + i
            qi = q[start + i].reshape(kvh, heads // kvh, dim)  # [KVH, G, D]: the G heads of each kv head
            if 0 <= win <= pos:  # a window row: the keys before the window, then its rows in order
                assert bits is not None
                rows = [win + c for c in range(64) if bits[start + i] >> c & 1]  # its window rows, in order
                seen = torch.cat([torch.arange(win), torch.tensor(rows)]).to(q.device)  # [n] keys, chain order
                ks, vs = k.index_select(1, seen), v.index_select(1, seen)  # [KVH, n, D], contiguous
            else:  # keys up to the token's own position
                ks, vs = k[:, : pos + 1].contiguous(), v[:, : pos + 1].contiguous()
            out[start + i] = F.scaled_dot_product_attention(qi, ks, vs, scale=scale).reshape(heads, dim)
    return out


def enable_exact_reference(model: Transformer) -> None:
    """Route the model's every forward through `exact_reference_forward` (the CPU's exact mode)."""

    def exact(input_ids: torch.Tensor, layout: BatchLayout, cache: PagedKVCache, logits_rows: torch.Tensor,
              hidden_layers: tuple[int, ...] = (), hidden_rows: torch.Tensor | None = None, every_row: bool = False,
              float_logits: bool = True, streams_into: torch.Tensor | None = None) -> ForwardOutput:
        return exact_reference_forward(model, input_ids, layout, cache, logits_rows, hidden_layers, hidden_rows,
                                       every_row, streams_into)

    model.fast = exact


@torch.inference_mode()
def exact_reference_forward(model: Transformer, input_ids: torch.Tensor, layout: BatchLayout, cache: PagedKVCache,
                            logits_rows: torch.Tensor, hidden_layers: tuple[int, ...] = (),
                            hidden_rows: torch.Tensor | None = None, every_row: bool = False,
                            streams_into: torch.Tensor | None = None) -> ForwardOutput:
    """Transformer.forward's reference semantics (every_row: all rows, in order), row-invariant; float32 logits."""
    t = input_ids.shape[0]
    if every_row:
        logits_rows = hidden_rows = torch.arange(t, device=input_ids.device)
    hidden_rows = logits_rows if hidden_rows is None else hidden_rows
    cos = model.rope_cos.index_select(0, layout.positions)  # [T, D]
    sin = model.rope_sin.index_select(0, layout.positions)
    h = model.model.embed_tokens(input_ids)  # [T, hidden]
    captured: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.decoder_layers()):
        if i in hidden_layers:
            captured.append(h.index_select(0, hidden_rows))
        at, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(h)
        q = apply_rope(blocked_linear(x, at.q_proj.weight, at.q_proj.bias).view(t, at.heads, at.head_dim), cos, sin)
        k = apply_rope(blocked_linear(x, at.k_proj.weight, at.k_proj.bias).view(t, at.kv_heads, at.head_dim), cos, sin)
        v = blocked_linear(x, at.v_proj.weight, at.v_proj.bias).view(t, at.kv_heads, at.head_dim)
        k_cache, v_cache = cache.layer(i)
        PagedKVCache.write(k_cache, v_cache, k, v, layout.slot_mapping)
        o = exact_attention_reference(q, k_cache, v_cache, layout, at.scale)  # [T, H, D]
        h = h + blocked_linear(o.reshape(t, -1), at.o_proj.weight)
        x = layer.post_attention_layernorm(h)
        gated = F.silu(blocked_linear(x, mlp.gate_proj.weight)) * blocked_linear(x, mlp.up_proj.weight)
        h = h + blocked_linear(gated, mlp.down_proj.weight)
    if model.args.num_layers in hidden_layers:
        captured.append(h.index_select(0, hidden_rows))
    captured = store_streams(captured, streams_into, layout.slot_mapping)
    h = model.model.norm(h.index_select(0, logits_rows))  # [N, hidden]
    logits = blocked_linear(h, model.lm_head.weight).float()  # [N, V]
    return ForwardOutput(logits=logits, hidden=captured or None)

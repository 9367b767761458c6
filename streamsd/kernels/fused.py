"""Fused small ops of the decoder layer, in Triton: one launch where eager PyTorch takes 2 to 16.

At decode batch sizes a layer's GEMMs read megabytes while its elementwise ops touch kilobytes,
but each op is still a kernel launch of a few microseconds even inside a CUDA graph: ~40 of them
per layer cost the 8B model more than its weights' read time. Each kernel reproduces the
reference arithmetic (llama.py) step for step, including where it rounds to the model dtype, so
results match the eager forward up to float32 reassociation.

Reference: the eager layer of model/llama.py (`RMSNorm`, `apply_rope` and the cache write, the
MLP's silu(gate) * up), which model/fast_forward.py replaces; tests/kernels/test_model_kernels.py
`test_fast_forward_matches_reference_forward` compares the two forwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_row(h, w_ptr, cols, mask, n_cols, eps, DTYPE: tl.constexpr):
    """One row h [BLOCK] (masked past n_cols) -> rmsnorm(h) * w in DTYPE, rounded as the eager RMSNorm:
    to DTYPE before the weight, then after it."""
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, 0) / n_cols
    y = (hf * tl.math.rsqrt(var + eps)).to(DTYPE)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(DTYPE)


@triton.jit(do_not_specialize=["keep_stride", "keep_col"])
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, keep_ptr, slot_ptr, keep_stride,
                        keep_col, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, KEEP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:  # h = residual + x, rounded to the model dtype like the eager add
        h = (tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
             + h.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, h, mask=mask)
    if KEEP:  # the stream also into its columns of a stream store's row, the token's KV slot
        slot = tl.load(slot_ptr + row)
        tl.store(keep_ptr + slot * keep_stride + keep_col + cols, h.to(keep_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * n_cols + cols, rmsnorm_row(h, w_ptr, cols, mask, n_cols, eps, x_ptr.dtype.element_ty),
             mask=mask)  # out is x's dtype (empty_like)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                keep: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rmsnorm(residual + x) * weight, residual + x); residual None: no add.
    keep (store [S, C], slots [T], column): residual + x also into store[slots[t], column : column + H]."""
    x = x.contiguous()
    out = torch.empty_like(x)  # [T, H]
    res_out = torch.empty_like(x) if residual is not None else x  # [T, H]
    store, slots, col = keep if keep is not None else (x, x, 0)
    if x.shape[0]:
        _add_rmsnorm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out, res_out, x.shape[1], eps, store, slots,
            store.stride(0), col, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]),
            KEEP=keep is not None, num_warps=4,
        )
    return out, res_out


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                    s_qkv, s_rope, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1 query heads, then KVH key heads, then KVH value heads
    half = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(qkv_ptr + tok * s_qkv + head * HEAD_DIM + d)  # [D]
    slot = tl.load(slot_ptr + tok)
    if head >= HEADS + KV_HEADS:  # V: straight into the cache
        kvh = head - HEADS - KV_HEADS
        tl.store(v_cache_ptr + (slot * KV_HEADS + kvh) * HEAD_DIM + d, x.to(v_cache_ptr.dtype.element_ty))
    else:
        pos = tl.load(pos_ptr + tok)
        partner = tl.load(qkv_ptr + tok * s_qkv + head * HEAD_DIM + (d + half) % HEAD_DIM)  # rotate-half
        rotated = tl.where(d < half, -partner.to(tl.float32), partner.to(tl.float32))
        cos = tl.load(cos_ptr + pos * s_rope + d)
        sin = tl.load(sin_ptr + pos * s_rope + d)
        y = x.to(tl.float32) * cos + rotated * sin
        if head < HEADS:
            tl.store(q_out_ptr + (tok * HEADS + head) * HEAD_DIM + d, y.to(q_out_ptr.dtype.element_ty))
        else:
            kvh = head - HEADS
            # rounded to the activation dtype first, as the eager path writes k.to(cache dtype)
            k = y.to(qkv_ptr.dtype.element_ty)
            tl.store(k_cache_ptr + (slot * KV_HEADS + kvh) * HEAD_DIM + d, k.to(k_cache_ptr.dtype.element_ty))


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                   kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> rotated q [T, H, D]; rotated k and v written at slots [T] of the
    caches [NB, BS, KVH, D]. cos/sin are the full tables [P, D] (float32), indexed by positions [T]."""
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)  # [T, H, D]
    if t:
        _rope_kv_kernel[(t, heads + 2 * kv_heads)](
            qkv, cos, sin, positions, slots, q, k_cache, v_cache, qkv.stride(0), cos.stride(0),
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, num_warps=1,
        )
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu rounds to the dtype, then the product
    tl.store(out_ptr + row * n_cols + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    block = 1024
    if t:
        _silu_mul_kernel[(t, triton.cdiv(two_i // 2, block))](gate_up, out, two_i // 2, BLOCK=block, num_warps=4)
    return out

"""An EAGLE-3 head layer's input in one launch: what five small ops did before its first GEMM.

Each level of a draft tree fed the head layer `src.index_select(rows)` (its parents' outputs), then the
layer gathered the tokens' embeddings, normalised both (two RMSNorms), and concatenated them: five
launches of a few microseconds each, four levels a step. Here one program per row does all of it, with
the arithmetic of `EagleHead.run_layer` (kernels/fused.py's RMSNorm row).

Reference: `EagleHead.run_layer` (spec_decode/eagle/head.py); tests/kernels/test_model_kernels.py
`test_fast_eagle_head_matches_its_reference_layer` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.fused import rmsnorm_row


@triton.jit
def _head_input_kernel(ids_ptr, embed_ptr, s_embed, src_ptr, s_src, rows_ptr, w_in_ptr, w_hidden_ptr, x_ptr,
                       res_ptr, n_cols, eps, HAS_ROWS: tl.constexpr, NORMED_RESIDUAL: tl.constexpr,
                       BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    src_row = t
    if HAS_ROWS:
        src_row = tl.load(rows_ptr + t).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    emb = tl.load(embed_ptr + tok * s_embed + cols, mask=mask, other=0.0).to(dtype)
    h = tl.load(src_ptr + src_row * s_src + cols, mask=mask, other=0.0)
    normed = rmsnorm_row(h, w_hidden_ptr, cols, mask, n_cols, eps, dtype)
    tl.store(x_ptr + t * 2 * n_cols + cols, rmsnorm_row(emb, w_in_ptr, cols, mask, n_cols, eps, dtype), mask=mask)
    tl.store(x_ptr + t * 2 * n_cols + n_cols + cols, normed, mask=mask)
    tl.store(res_ptr + t * n_cols + cols, normed if NORMED_RESIDUAL else h.to(dtype), mask=mask)


def head_input(ids: torch.Tensor, embed: torch.Tensor, src: torch.Tensor, rows: torch.Tensor | None,
               w_in: torch.Tensor, w_hidden: torch.Tensor, eps: float,
               normed_residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T] the tokens, embed [V, H] their table, src [R, H] the hidden inputs (row rows[t] is token t's;
    rows None: row t) -> (x [T, 2H] = [rmsnorm(embedding) * w_in, rmsnorm(hidden) * w_hidden], the
    residual [T, H]: the normed hidden, or the hidden itself), in src's dtype."""
    t, n = ids.shape[0], src.shape[1]
    assert src.stride(1) == 1 and embed.stride(1) == 1
    x = torch.empty(t, 2 * n, dtype=src.dtype, device=src.device)  # [T, 2H]
    res = torch.empty(t, n, dtype=src.dtype, device=src.device)  # [T, H]
    if t:
        _head_input_kernel[(t,)](
            ids, embed, embed.stride(0), src, src.stride(0), rows if rows is not None else ids, w_in, w_hidden,
            x, res, n, eps, HAS_ROWS=rows is not None, NORMED_RESIDUAL=normed_residual,
            BLOCK=triton.next_power_of_2(n), num_warps=4,
        )
    return x, res

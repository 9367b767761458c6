"""A batch-invariant GEMM, y = x W^T (+ b), in Triton: the exact mode's every target linear on CUDA.

cuBLAS picks its tiles, its split-K and even its kernel by the shape, so a row's bits depend on how
many rows share the call. Here every shape runs the one compiled kernel: fixed BLOCK_M x BLOCK_N
output tiles, each reduced over K by a single program in one sequential loop of BLOCK_K steps (no
split-K, no stream-K). An output element is then the same chain of tensor-core products and fp32
adds wherever its row sits in whatever M; rows past M are masked loads that touch no other row. M is
kept out of Triton's specialisation (an M of 1, or one divisible by 16, would otherwise compile
another variant).

The tiles are a memory-bound compromise: at decode sizes (M <= 64) a 64-wide N tile gives the 4096-
or 14336-wide layers of an 8B model 64-224 programs, while prompt chunks pay re-reading W once per
64 rows. `streamsd bench offline --exact` measures the price.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


@triton.jit(do_not_specialize=["m"])
def _exact_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, sx_m, sw_n, sy_m,
                         HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = k0 + ks < k
        a = tl.load(x_ptr + rows[:, None] * sx_m + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + cols[None, :] * sw_n + (k0 + ks)[:, None], mask=col_ok[None, :] & k_ok[:, None],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * sy_m + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, each row's bits independent of M."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _exact_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3,
    )
    return y

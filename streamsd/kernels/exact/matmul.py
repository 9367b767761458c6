"""A batch-invariant GEMM, y = x W^T (+ b), in Triton: the exact mode's every target linear on CUDA.

cuBLAS picks its tiles, its split-K and even its kernel by the shape, so a row's bits depend on how
many rows share the call. Here every M of a weight runs one compiled kernel: fixed BLOCK_M x BLOCK_N
output tiles, each reduced over K by a single program in one sequential loop of BLOCK_K steps (no
split-K, no stream-K). An output element is then the same chain of tensor-core products and fp32
adds wherever its row sits in whatever M; rows past M are masked loads that touch no other row. M is
kept out of Triton's specialisation (an M of 1, or one divisible by 16, would otherwise compile
another variant).

The N tile is a property of the weight, never of M: at decode sizes (M <= 64) the GEMM is a read of W
spread over its programs, and a 64-wide tile gives an 8B model's 4096-wide layers 64 programs for 132
SMs (the down projection reads 117 MB through half the chip) and a 135M model's 576-wide ones 9. So
`block_n` takes the widest of 64, 32 and 16 whose grid fills the SMs once, from N and the device
alone; every M of that weight then runs the same tiles and the same reduction, which is all that
batch invariance needs. Prompt chunks pay re-reading W once per 64 rows. `streamsd bench offline
--exact` measures the price.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_K = 64
NUM_STAGES = 3
N_TILES = (64, 32, 16)  # widest first; tl.dot takes 16 columns or more


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


@functools.cache  # an eager step asks once per linear: the answer depends on N and the device alone
def block_n(n: int, device: torch.device) -> int:
    """The N tile of an [N, K] weight on `device`: the widest whose grid gives every SM a program."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return next((b for b in N_TILES if triton.cdiv(n, b) >= sms), N_TILES[-1])


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile_n: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, each row's bits independent of M
    (`tile_n`: the N tile, by default `block_n`'s for the weight; the same weight must keep one)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tile = tile_n or block_n(n, x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, tile))
    _exact_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=tile, BLOCK_K=BLOCK_K, num_warps=4, num_stages=NUM_STAGES,
    )
    return y

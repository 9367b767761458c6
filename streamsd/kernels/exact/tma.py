"""The exact GEMM past one M tile on Hopper: each K block of x and of W one tensor-memory-accelerator (TMA)
copy into shared memory.

Past one M tile the GEMM (a verify of a large batch, a prompt chunk) computes more than it reads, and the
pointer kernels of matmul.py feed the tensor cores through registers. The arithmetic here is theirs: each
output element's products in increasing k, 16 deep per tensor-core instruction, into an fp32 accumulator
from zero; a split weight's K ranges each so, added to the total in range order. Only the tiles and the
loads differ, which a row's bits never see. TMA reads past a tensor's edge as zeros and never writes past
it, so the edges need no masks.

- An unsplit weight (`persistent_linear`): one program an SM walks the output tiles, M fastest, so the
  programs running side by side read the same weight tiles.
- A split weight (`ordered_linear`): a program a tile, each summing the K ranges itself (a persistent
  walk was slower here: 314 against 384 us for an 8B down projection at 2,048 rows on an H100).

TMA wants every row of x, W and y to start on 16 bytes (`fits`); an operand that does not keeps the pointer
kernels. So do float32 weights (their tiles here would overflow the shared memory), and devices other than
Hopper: on Hopper both kernels' dots are the same warp-group instructions, and the bits were checked equal
there; a later architecture's tensor-core instructions have not been.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

BLOCK_K = 64


@triton.jit
def _bias(acc, b_ptr, off_n, n, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (+ b[off_n:off_n + BLOCK_N]), columns past n adding nothing."""
    if HAS_BIAS:
        cols = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _range_sum(x_desc, w_desc, off_m, off_n, k_start, k_end, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """x[off_m tile, k_start:k_end] @ W[off_n tile, k_start:k_end]^T from a zero accumulator, K block after K block."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([off_m, k0])  # [BLOCK_M, BLOCK_K]
        b = w_desc.load([off_n, k0])  # [BLOCK_N, BLOCK_K]
        if IEEE:
            acc = tl.dot(a, b.T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit(do_not_specialize=["m", "programs"])
def _persistent_kernel(x_desc, w_desc, y_desc, b_ptr, m, n, k, programs, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Program p: output tiles p, p + programs, ... (M fastest), each x [BLOCK_M, K] @ W [BLOCK_N, K]^T."""
    num_m = tl.cdiv(m, BLOCK_M)
    tiles = num_m * tl.cdiv(n, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, programs, flatten=True):
        off_m = (tile % num_m) * BLOCK_M
        off_n = (tile // num_m) * BLOCK_N
        acc = _range_sum(x_desc, w_desc, off_m, off_n, 0, k, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        y_desc.store([off_m, off_n], _bias(acc, b_ptr, off_n, n, HAS_BIAS, BLOCK_N).to(y_desc.dtype))


@triton.jit(do_not_specialize=["m"])
def _ordered_kernel(x_desc, w_desc, y_desc, b_ptr, m, n, k, k_range, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr):
    """Program (i, j) (M fastest): rows i, N tile j, K ranges [s k_range, (s + 1) k_range) each summed from
    zero and added to the total in range order. The total starts at -0.0, which adds to any x as x."""
    num_m = tl.cdiv(m, BLOCK_M)
    off_m = (tl.program_id(0) % num_m) * BLOCK_M
    off_n = (tl.program_id(0) // num_m) * BLOCK_N
    total = tl.full([BLOCK_M, BLOCK_N], -0.0, tl.float32)
    for s in range(SPLITS):
        total += _range_sum(x_desc, w_desc, off_m, off_n, s * k_range, tl.minimum(k, (s + 1) * k_range), IEEE,
                            BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    y_desc.store([off_m, off_n], _bias(total, b_ptr, off_n, n, HAS_BIAS, BLOCK_N).to(y_desc.dtype))


@functools.cache
def takes_tma(device: torch.device) -> bool:
    """Whether `device` takes these kernels: a Hopper GPU (CUDA compute capability 9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def fits(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can read: unit inner stride, its start and every row's on 16 bytes."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _descriptors(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rows: int,
                 cols: int) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    return (TensorDescriptor.from_tensor(x, [rows, BLOCK_K]), TensorDescriptor.from_tensor(weight, [cols, BLOCK_K]),
            TensorDescriptor.from_tensor(y, [rows, cols]))


def persistent_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                      rows: int, cols: int, warps: int, stages: int, programs: int) -> None:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) in y's dtype, on `rows` x `cols` output tiles
    walked by `programs` programs: the bits of matmul.exact_linear's pointer kernel for an unsplit weight,
    each row's independent of M. x, weight and y must `fit`."""
    m, k = x.shape
    _persistent_kernel[(programs,)](
        *_descriptors(x, weight, y, rows, cols), bias if bias is not None else weight, m, weight.shape[0], k,
        programs, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=rows, BLOCK_N=cols,
        BLOCK_K=BLOCK_K, STAGES=stages, num_warps=warps, num_stages=stages,
    )


def ordered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                   rows: int, cols: int, warps: int, stages: int, splits: int, k_range: int) -> None:
    """y = x @ weight^T (+ bias) for a weight split into `splits` K ranges of `k_range` (a multiple of
    BLOCK_K): the bits of matmul.exact_linear's split launch and the sum of its partials, without them."""
    m, k = x.shape
    n = weight.shape[0]
    _ordered_kernel[(triton.cdiv(m, rows) * triton.cdiv(n, cols),)](
        *_descriptors(x, weight, y, rows, cols), bias if bias is not None else weight, m, n, k, k_range,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SPLITS=splits, BLOCK_M=rows, BLOCK_N=cols,
        BLOCK_K=BLOCK_K, STAGES=stages, num_warps=warps, num_stages=stages,
    )

"""A batch-invariant GEMM, y = x W^T (+ b), in Triton: the exact mode's every target linear on CUDA.

cuBLAS picks its tiles, its split-K and even its kernel by the shape, so a row's bits depend on how
many rows share the call. Here each output tile is reduced over K in one sequential loop of K blocks,
or, for a long K, in a fixed number of such loops over fixed K ranges whose fp32 partials a second
kernel adds in order. An output element is then the same chain of tensor-core products and fp32 adds
wherever its row sits in whatever M; rows past M are masked loads that touch no other row. M is kept
out of Triton's specialisation (an M of 1, or one divisible by 16, would otherwise compile another
variant).

What a row's bits depend on is the order of its products and sums: tl.dot adds a tile's K block
into its fp32 accumulator 16 deep at a time (one tensor-core instruction per 16), in increasing k,
whatever the tile's width, height or K block; the tile shape only changes which elements share an
instruction. So the K ranges (`split_k`) are the weight's and never change; the tiles may follow M.
Across 8B shapes on an H100, tiles of 16-128 columns, 64 or 128 rows, 4 or 8 warps, K blocks of 64
or 128 gave every row the bits of that row alone.

At decode sizes (M <= 64) the GEMM is a read of W spread over its programs:
- `block_n` takes the widest N tile of 64, 32 and 16 whose grid fills the SMs once: a 64-wide tile gave
  an 8B model's 4096-wide layers 64 programs for 132 SMs;
- `split_k` cuts a K of three times N or more (an MLP's down projection: 14336 into 4096 on an 8B
  model) into 8 ranges, 64-wide tiles each: one program per tile read its 117 MB at under half
  cuBLAS's speed on an H200, 512 programs within a tenth of it;
- unsplit 16-bit weights stream through 128-deep K blocks four stages deep (a third less time than 64
  deep and three stages on an H200); split and float32 ones keep 64 and three.
Past one M tile (a verify of a large batch, a prompt chunk) the GEMM computes more than it reads:
- an unsplit 16-bit weight takes 128-wide N tiles in 64-deep K blocks (`wide_plan`), 64 rows a program
  while that leaves at most two programs an SM, else 128 (two warp groups). On an H100 at 320 rows
  (an 8B verify of 64 requests) q/k/v 51 -> 30 us, o 52 -> 30, gate/up 195 -> 160; at 2,048 rows
  o 226 -> 115;
- a split weight takes the same tiles where they are at least as many as the SMs, and each program sums
  the 8 K ranges itself, one after the other, each from zero and added to the total in range order
  (`ordered`): the bits of the partials summed by the second kernel, without writing them (8 x M x N
  fp32) and reading them back. On an H100 the 8B down projection at 320 / 1,000 / 2,048 rows: 130 ->
  120, 395 -> 276, 819 -> 550 us (cuBLAS 63, 149, 299). Its 96 tiles at 320 rows leave 36 of an H100's
  132 SMs idle, yet a program for each range of a tile (TMA loads, the last of a tile's programs adding
  the partials in order) took 122-161 us there against the in-program sum's 97 (with 4 ranges, 104-144
  against 91): writing and reading the partials costs more than the idle SMs;
- an unsplit float32 weight keeps its N tile, and a program takes a group of up to four adjacent
  tiles (at most 128 columns), each with its own accumulator and its own dot per K block, so the group
  shares x's loads; a 64-wide tile there also takes 128 rows of x (`block_m`). So does a split weight
  with fewer wide tiles than SMs; its ranges, as within one M tile, are programs of their own, summed
  in order by a second kernel.
A grid whose tiles cover N and K exactly loads without masks on them (`EVEN`); rows past M are always
masked. On Hopper, a 16-bit weight past those sizes takes tma.py's kernels instead (`tma_plan`):
the same sums loaded by TMA, in 5-42 % less time from 160 rows on an H100. `streamsd bench offline
--exact` measures the price.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from streamsd.kernels.device import sm_count
from streamsd.kernels.exact.tma import fits, ordered_linear, persistent_linear, takes_tma

BLOCK_M = 64
WIDE_M = 128  # the M tile of 64-wide N tiles past one BLOCK_M (block_m)
N_TILES = (64, 32, 16)  # widest first; tl.dot takes 16 columns or more
SPLITS = 8  # K ranges of a split weight
SPLIT_TILE = 64  # its N tile: 8 ranges give the programs already
GROUPS = (4, 2)  # N tiles a program may take past one M tile, widest first
GROUP_WIDTH = 128  # columns a group spans at most (its K blocks' weight tiles share the shared memory)
WIDE_TILE = 128  # an unsplit 16-bit weight's N tile past one BLOCK_M (wide_plan)
WIDE_BLOCK_K = 64
EAGER_TMA_WORK = 2**35  # M N K, ~70 GFLOP: ~100 us of an H100's tensor cores


@triton.jit
def _tile_step(acc, a, w_ptr, cols, ks, k0, k_end, n, sw_n, IEEE: tl.constexpr, EVEN: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] @ W[cols, k0:k0 + BLOCK_K]^T: one K block of one N tile."""
    if EVEN:  # the grid covers N and the K range exactly
        b = tl.load(w_ptr + cols[None, :] * sw_n + (k0 + ks)[:, None])  # [BLOCK_K, BLOCK_N]
    else:
        b = tl.load(w_ptr + cols[None, :] * sw_n + (k0 + ks)[:, None],
                    mask=(cols < n)[None, :] & (k0 + ks < k_end)[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile_store(y_ptr, acc, b_ptr, rows, cols, m, n, sy_m, HAS_BIAS: tl.constexpr):
    """y[rows, cols] = acc (+ b[cols]) in y's dtype, rows past m and columns past n masked."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * sy_m + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < m)[:, None] & (cols < n)[None, :])


@triton.jit
def _rows_block(x_ptr, rows, ks, k0, k_end, m, sx_m, EVEN: tl.constexpr):
    """x[rows, k0:k0 + BLOCK_K], rows past m (and, unless EVEN, columns past k_end) read as 0."""
    if EVEN:
        return tl.load(x_ptr + rows[:, None] * sx_m + (k0 + ks)[None, :], mask=(rows < m)[:, None], other=0.0)
    return tl.load(x_ptr + rows[:, None] * sx_m + (k0 + ks)[None, :],
                   mask=(rows < m)[:, None] & (k0 + ks < k_end)[None, :], other=0.0)


@triton.jit
def _range_sum(x_ptr, w_ptr, rows, cols, ks, k_start, k_end, m, n, sx_m, sw_n, IEEE: tl.constexpr,
               EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[rows, k_start:k_end] @ W[cols, k_start:k_end]^T from a zero accumulator, K block after K block."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = _rows_block(x_ptr, rows, ks, k0, k_end, m, sx_m, EVEN)  # [BLOCK_M, BLOCK_K]
        acc = _tile_step(acc, a, w_ptr, cols, ks, k0, k_end, n, sw_n, IEEE, EVEN)
    return acc


@triton.jit(do_not_specialize=["m"])
def _ordered_splits_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, k_range, sx_m, sw_n, sy_m,
                           HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (i, j): rows i, N tile j, every K range in turn, each summed from zero and added to the
    total in range order: the bits of a split launch's partials summed by _sum_splits_kernel, without the
    fp32 partials written and read back. Past one M tile the programs need no split of K to fill the SMs."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    total = _range_sum(x_ptr, w_ptr, rows, cols, ks, 0, tl.minimum(k, k_range), m, n, sx_m, sw_n,
                       IEEE, EVEN, BLOCK_M, BLOCK_N, BLOCK_K)  # [BLOCK_M, BLOCK_N]
    for s in range(1, SPLITS):
        total += _range_sum(x_ptr, w_ptr, rows, cols, ks, s * k_range, tl.minimum(k, (s + 1) * k_range), m, n,
                            sx_m, sw_n, IEEE, EVEN, BLOCK_M, BLOCK_N, BLOCK_K)
    _tile_store(y_ptr, total, b_ptr, rows, cols, m, n, sy_m, HAS_BIAS)


@triton.jit(do_not_specialize=["m"])
def _exact_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, k_range, sx_m, sw_n, sy_m, sy_split,
                         HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (i, j, s): rows i, the GROUP N tiles from j GROUP, K range s ([s k_range, (s + 1) k_range) of
    [0, k)) into y + s sy_split. One range: y is the output; several: they are fp32 partials
    (_sum_splits_kernel). Each tile of a group is its own accumulator and its own dot per K block, the same
    instructions in the same order as a program of one tile: the group only shares the load of x."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * GROUP * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(k, (pid_k + 1) * k_range)
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * k_range, k_end, BLOCK_K):
        a = _rows_block(x_ptr, rows, ks, k0, k_end, m, sx_m, EVEN)  # [BLOCK_M, BLOCK_K]
        acc0 = _tile_step(acc0, a, w_ptr, cols, ks, k0, k_end, n, sw_n, IEEE, EVEN)
        if GROUP > 1:
            acc1 = _tile_step(acc1, a, w_ptr, cols + BLOCK_N, ks, k0, k_end, n, sw_n, IEEE, EVEN)
        if GROUP > 2:
            acc2 = _tile_step(acc2, a, w_ptr, cols + 2 * BLOCK_N, ks, k0, k_end, n, sw_n, IEEE, EVEN)
            acc3 = _tile_step(acc3, a, w_ptr, cols + 3 * BLOCK_N, ks, k0, k_end, n, sw_n, IEEE, EVEN)
    y_ptr += pid_k * sy_split
    _tile_store(y_ptr, acc0, b_ptr, rows, cols, m, n, sy_m, HAS_BIAS)
    if GROUP > 1:
        _tile_store(y_ptr, acc1, b_ptr, rows, cols + BLOCK_N, m, n, sy_m, HAS_BIAS)
    if GROUP > 2:
        _tile_store(y_ptr, acc2, b_ptr, rows, cols + 2 * BLOCK_N, m, n, sy_m, HAS_BIAS)
        _tile_store(y_ptr, acc3, b_ptr, rows, cols + 3 * BLOCK_N, m, n, sy_m, HAS_BIAS)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, size, n, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y = part[0] + part[1] + ... (+ b), in that order: part [SPLITS, M, N] fp32, y [M, N]."""
    i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = i < size
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)  # [BLOCK]
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * size + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def block_n(n: int, device: torch.device) -> int:
    """The N tile of an unsplit [N, K] weight on `device`: the widest whose grid gives every SM a program."""
    return next((b for b in N_TILES if triton.cdiv(n, b) >= sm_count(device)), N_TILES[-1])


def split_k(n: int, k: int) -> int:
    """K ranges of an [N, K] weight: SPLITS for a K of 3 N or more, else 1."""
    return SPLITS if k >= 3 * n else 1


def block_m(m: int, tile: int) -> int:
    """The M tile of the grouped plan: BLOCK_M, or WIDE_M (two warp groups, 8 warps) for 64-wide N tiles
    past one BLOCK_M, which reads the weight's tiles half as often. On an H100, an 8B split down
    projection at 80 and 320 rows: 65 -> 55 and 129 -> 111 us."""
    return WIDE_M if m > BLOCK_M and tile >= 64 else BLOCK_M


def group_tiles(m: int, n: int, tile: int, splits: int, device: torch.device) -> int:
    """N tiles per program: one within one M tile; past it the most of GROUPS that spans at most
    GROUP_WIDTH columns and still gives every SM a program. It changes the schedule, never a bit."""
    if m <= BLOCK_M:
        return 1
    tiles = triton.cdiv(m, block_m(m, tile)) * splits
    return next((g for g in GROUPS if g * tile <= GROUP_WIDTH and tiles * triton.cdiv(n, g * tile) >= sm_count(device)), 1)


def k_plan(dtype: torch.dtype, splits: int, group: int = 1, rows: int = BLOCK_M) -> tuple[int, int]:
    """(BLOCK_K, pipeline stages) for `dtype`'s operands: 128 x 4 for an unsplit 16-bit weight, else 64 x 3
    (a split weight's ranges are short already; float32 blocks of 128 would not fit the shared memory).
    A group's wider weight tiles, or a WIDE_M tile of x (`rows`), take one stage less; the stages only
    prefetch, the sums are the same."""
    if dtype != torch.float32 and splits == 1:
        return 128, 4 if group == 1 and rows == BLOCK_M else 3
    return 64, 3


@dataclass(frozen=True, slots=True)
class Plan:
    """One launch's tiling. Only `splits` is part of a row's arithmetic (the weight's, at every M)."""

    rows: int  # BLOCK_M
    tile: int  # BLOCK_N
    group: int  # N tiles a program takes
    splits: int  # K ranges
    block_k: int
    stages: int
    ordered: bool = False  # a program sums every K range itself, in order (_ordered_splits_kernel)
    tma: bool = False  # TMA loads (tma.py): a persistent grid unsplit, a program a tile summing the ranges split

    @property
    def warps(self) -> int:
        return self.rows // 16


def wide_plan(m: int, n: int, device: torch.device, splits: int = 1, dtype: torch.dtype = torch.bfloat16,
              tile: int = WIDE_TILE) -> Plan:
    """A 16-bit or a split weight past one BLOCK_M: 128-wide N tiles, 64-deep K blocks; 64 rows (4 warps,
    4 stages) while the grid leaves at most two programs an SM, else 128 (8 warps, 3 stages). On an H100
    at 320 rows the 8B q/k/v (48 column tiles) took 64 rows, its gate/up (224) 128. A split weight's
    program sums its K ranges in order itself (`ordered`): its K blocks are the split's 64 deep already.
    float32 operands take 3 stages (a stage of 128 rows holds 64 KB of them)."""
    rows = BLOCK_M if triton.cdiv(m, BLOCK_M) * triton.cdiv(n, tile) <= 2 * sm_count(device) else WIDE_M
    stages = 4 if rows == BLOCK_M and dtype != torch.float32 else 3
    return Plan(rows, tile, 1, splits, WIDE_BLOCK_K, stages, ordered=splits > 1)


def tma_plan(m: int, n: int, device: torch.device, splits: int = 1) -> Plan:
    """A 16-bit weight where TMA can load it (tma.py), in 64-deep K blocks: an unsplit one past two M tiles (at 65
    to 128 rows the pointer kernels were as fast or faster), a split one past one. Unsplit: 128 x 256
    tiles (two warp groups) while they are at least two for every SM, else 64 x 256 (fewer, larger tiles
    leave SMs idle). Split: 128 x 256 tiles where they nearly fill the SMs once, else 128 x 128. Against
    the pointer kernels on an H100, graph-timed, 8B shapes at 320 rows: gate/up 160 -> 153 us (1,000 rows:
    447 -> 335), o 30 -> 25, q/k/v 34 -> 31; the split down projection at 320 / 1,000 / 2,048 rows
    116 -> 96, 275 -> 159, 548 -> 319 (cuBLAS 58, 152, 343)."""
    wide = triton.cdiv(m, 2 * BLOCK_M) * triton.cdiv(n, 2 * WIDE_TILE)
    if wide >= (2 * sm_count(device) if splits == 1 else sm_count(device) * 15 // 16):
        return Plan(2 * BLOCK_M, 2 * WIDE_TILE, 1, splits, WIDE_BLOCK_K, 3, ordered=splits > 1, tma=True)
    if splits == 1:
        return Plan(BLOCK_M, 2 * WIDE_TILE, 1, 1, WIDE_BLOCK_K, 4, tma=True)
    return Plan(2 * BLOCK_M, WIDE_TILE, 1, splits, WIDE_BLOCK_K, 4, ordered=True, tma=True)


def plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, tile_n: int | None = None,
         splits: int | None = None, group: int | None = None, tma: bool = True) -> Plan:
    """The tiling of x [m, k] @ W [n, k]^T. `tile_n`: the N tile (by default `block_n` within one M tile,
    WIDE_TILE or a split's SPLIT_TILE past it); `splits`: the K ranges (`split_k` by default; a weight must
    keep one); `group`: N tiles per program of the grouped plan, which it then takes past one M tile
    instead of `wide_plan`; `tma`: whether tma.py's kernels may run (`_tma_pays`), for `tma_plan` on a
    device that takes them."""
    splits = splits or split_k(n, k)
    if dtype != torch.float32 and tile_n is None and group is None and tma and takes_tma(device):
        if splits == 1 and m > 2 * BLOCK_M:
            return tma_plan(m, n, device)
        if splits > 1 and m > BLOCK_M and triton.cdiv(m, BLOCK_M) * triton.cdiv(n, WIDE_TILE) >= sm_count(device):
            return tma_plan(m, n, device, splits)
    if m > BLOCK_M and (dtype != torch.float32 or splits > 1) and group is None:
        wide = wide_plan(m, n, device, splits, dtype, tile_n or WIDE_TILE)
        # Ranges summed in one program leave SMs idle where its tiles are fewer than the SMs: an 8B down
        # projection at 80 rows (64 tiles) took 102 us so against 66 split over K, on an H100.
        if not wide.ordered or triton.cdiv(m, wide.rows) * triton.cdiv(n, wide.tile) >= sm_count(device):
            return wide
    tile = tile_n or (SPLIT_TILE if splits > 1 else block_n(n, device))
    group = group or group_tiles(m, n, tile, splits, device)
    rows = block_m(m, tile)
    block_k, stages = k_plan(dtype, splits, group, rows)
    return Plan(rows, tile, group, splits, block_k, stages)


def _tma_pays(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether tma.py's kernels may run: past one M tile (below it no plan takes them, and a decode step's
    launches skip these checks), TMA can load the operands, and the launch is captured into a CUDA graph or
    does enough work (EAGER_TMA_WORK) to hide the ~30 us more host time than the pointer kernels that a
    launch with tensor descriptors costs (on an H100 host: 67 against 39 us for an 8B gate/up)."""
    if not (x.shape[0] > BLOCK_M and takes_tma(x.device) and fits(x) and fits(weight) and fits(y)):
        return False
    return x.shape[0] * x.shape[1] * weight.shape[0] >= EAGER_TMA_WORK or torch.cuda.is_current_stream_capturing()


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile_n: int | None = None, splits: int | None = None, group: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, each row's bits independent of M.
    `tile_n`, `splits`, `group`: as `plan` takes them."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y
    p = plan(m, n, k, x.dtype, x.device, tile_n, splits, group, tma=_tma_pays(x, weight, y))
    k_range = triton.cdiv(triton.cdiv(k, p.block_k), p.splits) * p.block_k  # whole K blocks per range
    if p.tma and p.ordered:
        ordered_linear(x, weight, bias, y, p.rows, p.tile, p.warps, p.stages, p.splits, k_range)
        return y
    if p.tma:
        count = triton.cdiv(m, p.rows) * triton.cdiv(n, p.tile)
        persistent_linear(x, weight, bias, y, p.rows, p.tile, p.warps, p.stages, min(sm_count(x.device), count))
        return y
    if p.ordered:
        _ordered_splits_kernel[(triton.cdiv(m, p.rows), triton.cdiv(n, p.tile))](
            x, weight, bias if bias is not None else weight, y, m, n, k, k_range, x.stride(0), weight.stride(0), n,
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, EVEN=n % p.tile == 0 and k_range * p.splits == k, SPLITS=p.splits,
            BLOCK_M=p.rows, BLOCK_N=p.tile, BLOCK_K=p.block_k, num_warps=p.warps, num_stages=p.stages,
        )
        return y
    out = y if p.splits == 1 else torch.empty(p.splits, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
    grid = (triton.cdiv(m, p.rows), triton.cdiv(n, p.group * p.tile), p.splits)
    _exact_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, k_range,
        x.stride(0), weight.stride(0), n, m * n,
        HAS_BIAS=bias is not None and p.splits == 1, IEEE=x.dtype == torch.float32, GROUP=p.group,
        EVEN=n % (p.group * p.tile) == 0 and k_range * p.splits == k,
        BLOCK_M=p.rows, BLOCK_N=p.tile, BLOCK_K=p.block_k, num_warps=p.warps, num_stages=p.stages,
    )
    if p.splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else weight, y, m * n, n,
            HAS_BIAS=bias is not None, SPLITS=p.splits, BLOCK=block,
        )
    return y

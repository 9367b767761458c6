"""The exact GEMM's TMA kernels (kernels/exact/tma.py): the persistent grid (fewer programs than tiles) and
the in-program sum of a split weight's K ranges give a row the bits the pointer kernels give it alone, on
every tile shape their plan takes, with the edges of M, N and K inside tiles. On CUDA natively; on a CPU
under TRITON_INTERPRET=1 in float32."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV  # isort: skip (first: it sets the interpreter up)
from streamsd.kernels.exact.matmul import BLOCK_M, SPLITS, _tma_pays, exact_linear, plan, tma_plan
from streamsd.kernels.exact.tma import fits, ordered_linear, persistent_linear, takes_tma

# The plan gives these kernels 16-bit weights only: float32 tiles of these sizes overflow a GPU's shared
# memory. Under the interpreter (no such limit, no bf16 dots) float32 checks the same sums.
DTYPES = [torch.bfloat16] if CUDA else [torch.float32]
SHAPES = [(64, 256, 4, 4), (128, 256, 8, 3), (128, 128, 8, 4)]  # (rows, cols, warps, stages) of tma_plan's plans


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols", "warps", "stages"), SHAPES)
def test_persistent_linear_gives_a_row_the_bits_of_that_row_alone(dtype, rows, cols, warps, stages):
    g = torch.Generator().manual_seed(0)
    k, n = 200, 264  # neither a multiple of the tiles; rows of 16 bytes' multiples, as TMA needs
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    row = torch.randn(1, k, generator=g).to(DEV, dtype)
    alone = exact_linear(row, w, b)[0]  # the pointer kernel, one M tile
    for m in (1, BLOCK_M + 1, 3 * rows - 5):
        x = torch.randn(m, k, generator=g).to(DEV, dtype)
        for where in sorted({0, m // 2, m - 1}):
            x[where] = row[0]
            y = torch.empty(m, n, dtype=dtype, device=DEV)
            persistent_linear(x, w, b, y, rows, cols, warps, stages, programs=2)  # each program walks several tiles
            assert torch.equal(y[where], alone), (m, where)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols", "warps", "stages"), SHAPES[1:])
def test_ordered_linear_gives_a_row_the_bits_of_that_row_alone_split(dtype, rows, cols, warps, stages):
    """A weight split into 3 K ranges (the last one short): a row alone is the split launch and the sum of its
    partials."""
    g = torch.Generator().manual_seed(4)
    k, n, splits = 8 * 64 + 40, 264, 3
    k_range = -(-k // 64 // splits) * 64  # 192: ranges of 3, 3 and 2.6 K blocks
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    row = torch.randn(1, k, generator=g).to(DEV, dtype)
    alone = exact_linear(row, w, b, splits=splits)[0]
    m = 2 * rows + 3
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    x[m - 2] = row[0]
    y = torch.empty(m, n, dtype=dtype, device=DEV)
    ordered_linear(x, w, b, y, rows, cols, warps, stages, splits, k_range)
    assert torch.equal(y[m - 2], alone)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_persistent_linear_adds_no_bias_when_given_none():
    g = torch.Generator().manual_seed(1)
    dtype = DTYPES[0]
    w = torch.randint(-3, 4, (40, 32), generator=g).to(DEV, dtype)
    x = torch.randint(-3, 4, (70, 32), generator=g).to(DEV, dtype)
    y = torch.empty(70, 40, dtype=dtype, device=DEV)
    persistent_linear(x, w, None, y, 64, 256, 4, 4, programs=1)
    assert torch.equal(y, (x.double() @ w.double().T).to(dtype))  # small integers: exact in any order


def test_the_tma_plan_takes_the_widest_tiles_only_where_they_fill_the_sms():
    """Unsplit: 128 x 256 while they are two for every SM, else 64 x 256; split: 128 x 256 where they (nearly)
    fill the SMs once, else 128 x 128."""
    cpu = torch.device("cpu")  # taken as 4 SMs
    assert tma_plan(4 * 128, 2 * 256, cpu).rows == 128  # 4 x 2 tiles
    assert tma_plan(4 * 128, 256, cpu).rows == BLOCK_M
    assert tma_plan(BLOCK_M + 1, 3 * 256, cpu).rows == BLOCK_M  # 1 x 3
    for m in (BLOCK_M + 1, 4096):
        p = tma_plan(m, 4096, cpu)
        assert p.tma and not p.ordered and p.splits == 1 and p.tile == 256 and p.warps == p.rows // 16
    wide, narrow = tma_plan(4 * 128, 256, cpu, SPLITS), tma_plan(2 * 128, 256, cpu, SPLITS)
    assert (wide.rows, wide.tile, wide.ordered, wide.splits) == (128, 256, True, SPLITS)
    assert (narrow.rows, narrow.tile, narrow.ordered, narrow.block_k) == (128, 128, True, 64)


def test_the_plan_takes_the_tma_kernels_only_for_16_bit_weights_past_their_m_on_a_device_with_tma():
    cpu = torch.device("cpu")
    assert not takes_tma(cpu)
    assert not plan(BLOCK_M + 1, 4096, 4096, torch.bfloat16, cpu).tma
    if not (CUDA and takes_tma(DEV)):
        return
    assert plan(2 * BLOCK_M + 1, 4096, 4096, torch.bfloat16, DEV).tma
    assert not plan(2 * BLOCK_M, 4096, 4096, torch.bfloat16, DEV).tma  # unsplit: within two M tiles
    assert not plan(BLOCK_M + 1, 4096, 14336, torch.bfloat16, DEV).tma  # split, too few tiles: split over K instead
    assert plan(320, 4096, 14336, torch.bfloat16, DEV).ordered and plan(320, 4096, 14336, torch.bfloat16, DEV).tma
    assert not plan(2 * BLOCK_M + 1, 4096, 4096, torch.float32, DEV).tma
    assert not plan(2 * BLOCK_M + 1, 4096, 4096, torch.bfloat16, DEV, tma=False).tma


def test_fits_wants_rows_on_16_bytes():
    x = torch.zeros(4, 24, dtype=torch.bfloat16)
    assert fits(x)
    assert not fits(x[:, 1:])  # a start off 16 bytes and rows of 23
    assert not fits(torch.zeros(4, 12, dtype=torch.bfloat16))  # rows of 24 bytes
    assert not fits(x.t())


def test_tma_kernels_run_eagerly_only_for_work_that_hides_their_launch_and_always_in_a_graph():
    w = torch.zeros(256, 256, dtype=torch.bfloat16, device=DEV)
    x = torch.zeros(320, 256, dtype=torch.bfloat16, device=DEV)
    y = torch.empty(320, 256, dtype=torch.bfloat16, device=DEV)
    assert not _tma_pays(x, w, y)  # a CPU has no TMA; on a GPU the work is small
    if not (CUDA and takes_tma(DEV)):
        return
    assert not _tma_pays(x[:, 1:], w[:, 1:], y)  # rows of 255 values: not on 16 bytes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _tma_pays(x, w, y)
    assert captured
    big = torch.zeros(4096, 8192, dtype=torch.bfloat16, device=DEV)
    assert _tma_pays(big[:1024], big, torch.empty(1024, 4096, dtype=torch.bfloat16, device=DEV))

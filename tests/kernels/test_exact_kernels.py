"""The exact mode's Triton kernels (kernels/exact/): the GEMM and the attention give a row the same bits
whatever else shares the launch and wherever the row sits, and so does a whole model's forward through
them. On CUDA they run natively; on a CPU under TRITON_INTERPRET=1 on tiny float32 shapes."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV, DTYPES  # isort: skip (first: it sets the interpreter up)
from streamsd.kernels.exact.attention import exact_cuda_attention, exact_paged_attention
from streamsd.kernels.exact.matmul import (
    BLOCK_M,
    GROUPS,
    N_TILES,
    SPLITS,
    WIDE_M,
    WIDE_TILE,
    block_m,
    block_n,
    exact_linear,
    group_tiles,
    plan,
    split_k,
)
from streamsd.model.attention import paged_attention
from streamsd.model.kv_cache import BatchLayout

# A whole model's steps under the interpreter take about a minute on a small CPU; natively, a second.
SLOW_ON_CPU = pytest.mark.slow if not CUDA else pytest.mark.usefixtures()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tile_n", "splits"), [(t, 1) for t in N_TILES] + [(64, 3), (16, 2)])
def test_exact_linear_gives_a_row_the_same_bits_at_any_batch_and_place(dtype, tile_n, splits):
    """Unsplit and split over K (3 ranges of a 3-block K under float32's 64-deep blocks: one range empty)."""
    g = torch.Generator().manual_seed(0)
    k, n = 150, 72  # neither a multiple of the tiles: the masked edges too
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    row = torch.randn(1, k, generator=g).to(DEV, dtype)
    alone = exact_linear(row, w, b, tile_n, splits)[0]
    for m in (1, 5, 25, BLOCK_M, BLOCK_M + 3, WIDE_M + 5):  # past BLOCK_M a 64-wide tile takes WIDE_M rows
        for where in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g).to(DEV, dtype)
            x[where] = row[0]
            assert torch.equal(exact_linear(x, w, b, tile_n, splits)[where], alone), (m, where)
    x = torch.randn(BLOCK_M + 3, k, generator=g).to(DEV, dtype)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = exact_linear(x, w, b, tile_n, splits).double()
    assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tile_n", "splits"), [(16, 1), (32, 1), (64, 2)])
def test_exact_linear_gives_the_same_bits_whatever_group_of_tiles_a_program_takes(dtype, tile_n, splits):
    """Past one M tile a program takes up to four N tiles; every group gives every row the bits of a row alone."""
    g = torch.Generator().manual_seed(2)
    k, n, m = 150, 136, 2 * BLOCK_M + 5  # the last group only partly inside N
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    alone = torch.cat([exact_linear(x[i:i + 1], w, b, tile_n, splits) for i in (0, BLOCK_M + 1, m - 1)])
    for group in (1, *GROUPS):
        got = exact_linear(x, w, b, tile_n, splits, group)
        assert torch.equal(got[[0, BLOCK_M + 1, m - 1]], alone), group


def test_exact_linear_groups_tiles_only_past_one_m_tile_and_while_every_sm_has_a_program():
    cpu = torch.device("cpu")  # taken as 4 SMs
    assert group_tiles(BLOCK_M, 4096, 16, 1, cpu) == 1
    assert group_tiles(BLOCK_M + 1, 4096, 16, 1, cpu) == 4
    assert group_tiles(BLOCK_M + 1, 4096, 64, 1, cpu) == 2  # 128 columns at most
    assert group_tiles(BLOCK_M + 1, 128, 32, 1, cpu) == 2  # 2 M tiles x 2 groups fill 4 SMs; groups of 4 would not


def test_exact_linear_takes_wide_m_tiles_only_for_64_wide_n_tiles_past_one_m_tile():
    assert [block_m(m, 64) for m in (1, BLOCK_M, BLOCK_M + 1, 4 * WIDE_M)] == [BLOCK_M, BLOCK_M, WIDE_M, WIDE_M]
    assert [block_m(BLOCK_M + 1, t) for t in (32, 16)] == [BLOCK_M, BLOCK_M]


def test_exact_linear_tiles_16_bit_unsplit_weights_128_wide_past_one_m_tile():
    """The wide plan: 64 rows a program while the grid leaves at most two programs an SM, else 128; split,
    float32 and explicitly grouped weights keep the grouped plan; within one M tile nothing changes."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16  # the CPU is taken as 4 SMs: 8 programs at most
    assert plan(BLOCK_M, 512, 256, bf16, cpu) == plan(1, 512, 256, bf16, cpu)
    assert plan(1, 512, 256, bf16, cpu).tile == block_n(512, cpu)
    small, big = plan(BLOCK_M + 1, 512, 256, bf16, cpu), plan(2 * BLOCK_M + 1, 512, 256, bf16, cpu)
    assert (small.rows, small.tile, small.warps, small.group) == (BLOCK_M, WIDE_TILE, 4, 1)  # 2 x 4 programs
    assert (big.rows, big.tile, big.warps) == (WIDE_M, WIDE_TILE, 8)  # 3 x 4 at 64 rows would be 12
    assert plan(BLOCK_M + 1, 512, 256, torch.float32, cpu).tile == block_n(512, cpu)
    assert plan(BLOCK_M + 1, 512, 256, bf16, cpu, group=2).group == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_linear_sums_a_split_weights_ranges_in_one_program_past_one_m_tile(dtype):
    """Within one M tile a split weight's ranges are programs of their own, their fp32 partials summed by a
    second launch; past it each program sums the ranges itself, in the same order (`ordered`), on the wide
    plan's tiles, and writes no partials."""
    cpu = torch.device("cpu")  # taken as 4 SMs
    small, big = plan(BLOCK_M, 512, 2048, dtype, cpu), plan(BLOCK_M + 1, 512, 2048, dtype, cpu)
    assert (small.splits, small.ordered) == (SPLITS, False)
    assert (big.splits, big.ordered, big.tile, big.block_k) == (SPLITS, True, WIDE_TILE, small.block_k)
    assert not plan(BLOCK_M + 1, 512, 256, dtype, cpu).ordered  # unsplit
    few = plan(BLOCK_M + 1, 128, 2048, dtype, cpu)  # 2 wide tiles for 4 SMs: split over K instead
    assert (few.splits, few.ordered) == (SPLITS, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [3, 4])
def test_exact_linear_ordered_ranges_sum_every_product_once(dtype, splits):
    """Small integers make every sum exact whatever its order: the in-program ranges (the last one short,
    with 4 ranges of a 3-block K one empty) cover K once, add the bias once and mask N's edge."""
    g = torch.Generator().manual_seed(3)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if CUDA else 4
    k, n, m = 150, WIDE_TILE * -(-sms // 2) + 8, BLOCK_M + 7  # 2 rows of wide tiles, at least the SMs
    w = torch.randint(-3, 4, (n, k), generator=g).to(DEV, dtype)
    b = torch.randint(-9, 10, (n,), generator=g).to(DEV, dtype)
    x = torch.randint(-3, 4, (m, k), generator=g).to(DEV, dtype)
    assert plan(m, n, k, dtype, x.device, splits=splits).ordered
    want = (x.double() @ w.double().T + b.double()).to(dtype)
    assert torch.equal(exact_linear(x, w, b, splits=splits), want)


def test_exact_linear_splits_only_a_long_reduction():
    """An 8B layer's down projection (14336 into 4096) is split over K, its other linears and a 135M
    model's are not; the plan never looks at M."""
    assert split_k(4096, 14336) == SPLITS
    assert [split_k(n, k) for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (576, 1536), (128256, 4096)]] \
        == [1, 1, 1, 1, 1]


def test_exact_linear_tiles_n_by_the_weight_and_the_device_alone():
    """The N tile fills the SMs once where it can (an 8B layer's 4096 outputs on 132 SMs: 16-wide, 256
    programs), keeps 64 where that already does, and never looks at M."""
    cpu = torch.device("cpu")  # taken as 4 SMs
    assert block_n(4096, cpu) == 64 and block_n(72, cpu) == 16 and block_n(100, cpu) == 32
    if CUDA:
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        for n in (576, 4096, 6144, 28672, 128256):
            tile = block_n(n, DEV)
            assert tile in N_TILES and (-(-n // tile) >= sms or tile == N_TILES[-1]), (n, tile)


def _cache(kv_heads: int, dim: int, dtype: torch.dtype, blocks: int = 40, bs: int = 16):
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(DEV, dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(DEV, dtype)
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (9, 3)])
def test_exact_attention_gives_a_token_the_same_bits_decoded_verified_or_prefilled(dtype, heads, kv_heads):
    """The token at position 70 of one sequence (its keys in blocks 0..4) attends alone, as the last of a
    verify window, inside a prompt chunk, and beside other sequences at several places."""
    dim, bs = 32, 16
    k_cache, v_cache = _cache(kv_heads, dim, dtype)
    table = [3, 7, 1, 9, 12]
    q_tok = torch.randn(heads, dim, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    others = [([20, 21], 5), ([22, 23, 24], 40), ([25], 1), ([26, 27], 20), ([28], 16)]  # (table, context)

    def attend(seqs: list[tuple[list[int], int, int]], at: int) -> torch.Tensor:
        """seqs: (block table, tokens before the query, query length); our token is query row `at`'s last."""
        layout = BatchLayout.build([s for _, s, _ in seqs], [n for _, _, n in seqs], [t for t, _, _ in seqs], bs, DEV)
        q = torch.randn(sum(n for _, _, n in seqs), heads, dim, generator=torch.Generator().manual_seed(3))
        q = q.to(DEV, dtype)
        row = layout.query_starts[at] + layout.query_lens[at] - 1
        q[row] = q_tok
        out = exact_cuda_attention(q, k_cache, v_cache, layout, dim**-0.5)
        ref = paged_attention(q.double(), k_cache.double(), v_cache.double(), layout, dim**-0.5)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert float((out.double() - ref).norm() / ref.norm()) < tol
        return out[row]

    ours = ([*table], 70, 1)
    alone = attend([ours], 0)
    cases = {
        "verify window of 4": attend([([*table], 67, 4)], 0),
        "prompt chunk of 71": attend([([*table], 0, 71)], 0),
        "prompt chunk of 30": attend([([*table], 41, 30)], 0),
    }
    for where in range(len(others) + 1):
        seqs = [(t, c - 1, 1) if i % 2 else (t, 0, c) for i, (t, c) in enumerate(others)]
        seqs.insert(where, ours)
        cases[f"decode at {where} of {len(seqs)}"] = attend(seqs, where)
    seqs = [(t, 0, c) for t, c in others[:3]]
    seqs.insert(1, ([*table], 66, 5))
    cases["verify window among prompts"] = attend(seqs, 1)
    assert [name for name, t in cases.items() if not torch.equal(t, alone)] == []


def test_exact_attention_grid_wider_than_the_queries_writes_only_their_rows():
    """A CUDA graph's grid is set by its width: shorter queries replay it, the tiles past them stay idle."""
    dim, heads, kv_heads = 32, 4, 2
    k_cache, v_cache = _cache(kv_heads, dim, torch.float32)
    layout = BatchLayout.build([10, 0], [2, 3], [[1], [2]], 16, DEV)
    q = torch.randn(5, heads, dim).to(DEV)
    out = torch.full_like(q, float("nan"))
    exact_paged_attention(q, k_cache, v_cache, layout.block_table, layout.context_lens_t, layout.query_starts_t,
                          dim**-0.5, 200, out=out)
    ref = paged_attention(q, k_cache, v_cache, layout, dim**-0.5)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


@SLOW_ON_CPU
def test_exact_kernel_forward_gives_a_token_the_same_logits_however_its_step_is_made_up(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from streamsd.model.arch import ModelArgs
    from streamsd.model.fast_forward import enable_fast_forward
    from streamsd.model.llama import Transformer
    from tests.model.exact_cases import checked_row_logits, differing

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = Transformer.build(ModelArgs.from_config(hf.config.to_dict()), hf.state_dict(), DEV, torch.float32)
    sizes = (5, 25, 64) if CUDA else (5, 25)
    reference = checked_row_logits(model, DEV, torch.float32, batch_sizes=sizes)
    model.attend = exact_cuda_attention
    enable_fast_forward(model, exact=True)
    exact = checked_row_logits(model, DEV, torch.float32, batch_sizes=sizes)
    assert differing(exact) == []
    for name, t in exact.items():
        assert torch.allclose(t, reference[name], rtol=1e-4, atol=1e-4), name


LLAMA_8B_LINEARS = {  # (in, out) of each linear of a Llama-3.1-8B layer, and its lm_head
    "qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096), "lm_head": (4096, 128256),
}


@pytest.mark.skipif(not CUDA, reason="needs CUDA: 8B-shaped weights")
@pytest.mark.parametrize("name", list(LLAMA_8B_LINEARS))
def test_exact_linear_gives_8b_shaped_rows_the_same_bits_at_any_batch(name):
    k, n = LLAMA_8B_LINEARS[name]
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(n, k, generator=g, device=DEV) * k**-0.5).to(torch.bfloat16)
    row = torch.randn(1, k, generator=g, device=DEV).to(torch.bfloat16)
    alone = exact_linear(row, w)[0]
    for m in (1, 5, 25, 64, 80, 256, 320, 1000):  # past 64 rows the wide plan, 64 or 128 rows a program
        for where in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
            x[where] = row[0]
            assert torch.equal(exact_linear(x, w)[where], alone), (m, where)

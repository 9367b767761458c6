"""The exact attention's draft trees (kernels/exact/attention.py, TREE): a window row's output is the bits
the same token gets decoded alone at the end of a chain of the keys it sees (the keys before the window,
then its ancestors' rows in order), for any tree shape, window start and head layout, and beside
plain decode and prompt rows. The CPU's exact reference (model/exact_forward.py) is held to the same.
On a CPU the kernel runs under TRITON_INTERPRET=1, tree launch against chain launch of one kernel."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import DEV, DTYPES  # isort: skip (first: it sets the interpreter up)
from streamsd.kernels.exact.attention import exact_cuda_attention
from streamsd.model.attention import paged_attention
from streamsd.model.exact_forward import exact_attention_reference
from streamsd.model.kv_cache import BatchLayout
from streamsd.model.tree_layout import ROOT
from streamsd.sample.tree_verify import host_tree

BS, DIM, BLOCKS = 16, 32, 48
TREE_TABLE = list(range(20))  # the tree sequence's blocks (room for 320 positions)
CHAIN_TABLE = list(range(20, 40))  # a chain's copy of the keys one window row sees
OTHER_TABLES = ([40, 41, 42], [43, 44, 45, 46])  # a decode row's and a prompt chunk's

# (parents of the nodes, window start, tokens recomputed before the window): branching, one long
# path, windows across a 64-key block, a window from 0, a start that is a multiple of 64.
SHAPES = [
    ([ROOT, ROOT, 0, 0, 1, 2, 4, 6], 70, 0),
    ([ROOT, 0, 1, 2, 3, 4], 60, 0),
    ([ROOT, ROOT, ROOT, 0, 1, 2, 3, 3, 7, 8], 125, 2),
    ([ROOT, 0, 0, 1], 0, 0),
    ([ROOT, ROOT, 1, 2, 2], 128, 3),
]


def _cache(kv_heads: int, dtype: torch.dtype, device: torch.device = DEV) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(BLOCKS, BS, kv_heads, DIM, generator=g).to(device, dtype)  # [NB, BS, KVH, D]
    v_cache = torch.randn(BLOCKS, BS, kv_heads, DIM, generator=g).to(device, dtype)
    return k_cache, v_cache


def _tree_step(parents: list[int], win: int, pre: int, heads: int, dtype: torch.dtype, mixed: bool,
               device: torch.device = DEV) -> tuple[BatchLayout, torch.Tensor, int]:
    """The tree sequence's window (and `pre` tokens before it), with `mixed` a decode row and a prompt chunk
    of other sequences around it -> (layout, q [T, H, D], the window's first query row)."""
    tree = host_tree(parents)
    starts, counts, tables, trees = [win - pre], [pre + len(tree[0])], [TREE_TABLE], [tree]
    if mixed:
        starts, counts, tables, trees = [40, *starts, 9], [1, *counts, 30], [OTHER_TABLES[0], *tables,
                                                                              OTHER_TABLES[1]], [None, *trees, None]
    layout = BatchLayout.build(starts, counts, tables, BS, device, trees=trees)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(counts), heads, DIM, generator=g).to(device, dtype)  # [T, H, D]
    first = layout.query_starts[1 if mixed else 0] + pre
    return layout, q, first


def _chain_of(k_cache: torch.Tensor, v_cache: torch.Tensor, win: int, bits: int) -> int:
    """Copy the keys a window row with mask `bits` sees into CHAIN_TABLE's blocks, in their logical order;
    returns how many (the row's position in the chain is one less)."""
    phys = list(range(win)) + [win + c for c in range(64) if bits >> c & 1]
    for logical, p in enumerate(phys):
        src, dst = TREE_TABLE[p // BS], CHAIN_TABLE[logical // BS]
        k_cache[dst, logical % BS] = k_cache[src, p % BS]
        v_cache[dst, logical % BS] = v_cache[src, p % BS]
    return len(phys)


def _chain_alone(attend, q_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, win: int,
                 bits: int) -> torch.Tensor:
    """q_row [H, D] decoded alone at the end of its chain -> [H, D]."""
    n = _chain_of(k_cache, v_cache, win, bits)
    layout = BatchLayout.build([n - 1], [1], [CHAIN_TABLE], BS, q_row.device)
    return attend(q_row[None], k_cache, v_cache, layout, DIM**-0.5)[0]


def _check_tree_rows(attend, dtype: torch.dtype, heads: int, kv_heads: int, mixed: bool,
                     device: torch.device = DEV) -> None:
    for parents, win, pre in SHAPES:
        k_cache, v_cache = _cache(kv_heads, dtype, device)
        layout, q, first = _tree_step(parents, win, pre, heads, dtype, mixed, device)
        out = attend(q, k_cache, v_cache, layout, DIM**-0.5)  # [T, H, D]
        ref = paged_attention(q.double(), k_cache.double(), v_cache.double(), layout, DIM**-0.5)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert float((out.double() - ref).norm() / ref.norm()) < tol, (parents, win)
        bits = layout.tree_bits.tolist()
        for t in range(first, first + len(parents) + 1):
            chain = _chain_alone(attend, q[t], k_cache.clone(), v_cache.clone(), win, bits[t])
            assert torch.equal(out[t], chain), (parents, win, t - first)
        for t in range(first - pre, first):  # a recomputed token before the window: causal, as decoded
            layout1 = BatchLayout.build([win - (first - t)], [1], [TREE_TABLE], BS, device)
            assert torch.equal(out[t], attend(q[t][None], k_cache, v_cache, layout1, DIM**-0.5)[0]), (parents, t)
        if mixed:  # the decode row and the prompt chunk's rows, as without a tree in the step
            plain = BatchLayout.build([40, 9], [1, 30], list(OTHER_TABLES), BS, device)
            rows = torch.cat([q[:1], q[-30:]])
            alone = attend(rows, k_cache, v_cache, plain, DIM**-0.5)
            assert torch.equal(torch.cat([out[:1], out[-30:]]), alone), parents


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (9, 3)])
@pytest.mark.parametrize("mixed", [False, True])
def test_exact_tree_rows_get_their_chain_bits(dtype, heads, kv_heads, mixed):
    _check_tree_rows(exact_cuda_attention, dtype, heads, kv_heads, mixed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (9, 3)])
def test_exact_reference_tree_rows_get_their_chain_bits(dtype, heads, kv_heads):
    _check_tree_rows(exact_attention_reference, dtype, heads, kv_heads, True, torch.device("cpu"))


def test_exact_tree_kernel_is_the_reference_within_rounding():
    layout, q, _ = _tree_step(*SHAPES[0], 8, torch.float32, True)
    k_cache, v_cache = _cache(2, torch.float32)
    out = exact_cuda_attention(q, k_cache, v_cache, layout, DIM**-0.5)  # [T, H, D]
    cpu_layout, cpu_q, _ = _tree_step(*SHAPES[0], 8, torch.float32, True, torch.device("cpu"))
    k_cpu, v_cpu = _cache(2, torch.float32, torch.device("cpu"))
    ref = exact_attention_reference(cpu_q, k_cpu, v_cpu, cpu_layout, DIM**-0.5)
    assert torch.allclose(out.cpu(), ref, rtol=1e-5, atol=1e-6)

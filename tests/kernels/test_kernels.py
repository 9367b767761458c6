"""Triton kernels against their torch oracles: paged attention and the rejection sampler.

On CUDA the kernels run natively (bf16/fp16 within METHOD.md's relative errors, fp32 tighter). On
a CPU they run under TRITON_INTERPRET=1 on tiny float32 shapes; without triton the module skips.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, so before the imports below
triton = pytest.importorskip("triton", reason="triton is not installed")


def _interpreter_shim() -> None:
    """triton 3.6's interpreter loads scalars as 1-element arrays and int()s them for loop bounds,
    which NumPy 2 refuses; give its module an int() that accepts them. Test-only, CPU-only."""
    import builtins

    import numpy as np
    import triton.runtime.interpreter as interp

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, builtins.int)

    class _Int(builtins.int, metaclass=_Meta):
        def __new__(cls, x=0, *base):
            if isinstance(x, np.ndarray) and x.size == 1:
                x = x.reshape(())
            return builtins.int(x, *base)

    interp.int = _Int


if not CUDA:
    _interpreter_shim()

# Nothing on the CPU path imports the kernels, so this is their first import, under the interpreter.
import streamsd.kernels.attention.paged as pa  # noqa: E402
import streamsd.kernels.sample.rejection as rj  # noqa: E402
import streamsd.model.attention as ta  # noqa: E402
from streamsd.kernels.attention.prefill import prefill_attention, prefill_tiles, tokens_per_tile  # noqa: E402
from streamsd.model.kv_cache import BatchLayout  # noqa: E402
from streamsd.sample import rng  # noqa: E402
from streamsd.sample.rejection import VerifyInput, rejection_sample  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _assert_fast_matches_reference(results: list) -> None:
    """results: [(reference outputs, reference cache), (fast outputs, fast cache)], fused vs eager."""
    (ref, ref_cache), (out, out_cache) = results
    tol = 2e-2 if CUDA else 1e-5
    for a, b in zip(out, ref, strict=True):
        assert a.shape == b.shape and _rel(a, b) < tol
    assert _rel(out_cache, ref_cache) < tol


def _random_batch(counts: list[int], ctx_extra: list[int], kv_heads: int, heads: int, dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    bs = 16
    need = sum(-(-(c + e) // bs) for c, e in zip(counts, ctx_extra, strict=True))
    nb = need + 3
    k_cache = torch.randn(nb, bs, kv_heads, dim, generator=g).to(DEV, dtype)  # [NB, BS, KVH, D]
    v_cache = torch.randn(nb, bs, kv_heads, dim, generator=g).to(DEV, dtype)
    perm = torch.randperm(nb, generator=g).tolist()  # scattered blocks, as the pool hands them out
    tables, used = [], 0
    for c, e in zip(counts, ctx_extra, strict=True):
        n = -(-(c + e) // bs)
        tables.append(perm[used : used + n])
        used += n
    layout = BatchLayout.build(ctx_extra, counts, tables, bs, DEV)
    q = torch.randn(sum(counts), heads, dim, generator=g).to(DEV, dtype)  # [T, H, D]
    return q, k_cache, v_cache, layout


CASES = [  # (query lens, cached tokens before them, kv heads, heads, head dim)
    ([1], [0], 1, 1, 32),
    ([1, 5, 3, 16], [0, 37, 100, 5], 2, 8, 32),  # GQA 4, verify windows, one at the kernel's limit
    ([5, 5, 5], [200, 17, 64], 3, 9, 64),  # SmolLM2-like GQA 3
    ([2, 1], [1, 300], 2, 2, 16),  # no grouping
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_attention_matches_reference(dtype, case, splits):
    counts, extra, kvh, heads, dim = CASES[case]
    for seed in range(2 if CUDA else 1):  # fresh inputs per check
        q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, dtype, seed + 10 * case)
        ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
        out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
        pa.decode_attention(q, kc, vc, layout.block_table, layout.context_lens_t, layout.query_starts_t,
                           dim**-0.5, max(counts), out=out, splits=splits)
        assert _rel(out, ref) < TOL[dtype]


@pytest.mark.skipif(not CUDA, reason="needs CUDA: a cache of more than 2**31 elements")
@pytest.mark.parametrize(("counts", "extra"), [([1, 5], [40, 3]), ([40, 2], [20, 90])])
def test_attention_reads_blocks_past_int32_offsets(counts, extra):
    """A tiny model's KV cache on a large GPU holds millions of blocks (its size comes from free
    memory): block index x block stride passes 2**31 elements. The same keys placed at the end of
    such a cache must give the same attention, through the decode and the prompt kernels."""
    kvh, heads, dim, bs = 2, 4, 64, 16
    q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, torch.bfloat16, 7)
    offset = 2**31 // (bs * kvh * dim)  # the first block whose offset needs more than int32
    big_k = torch.zeros(offset + kc.shape[0], bs, kvh, dim, dtype=kc.dtype, device=DEV)  # [NB, BS, KVH, D]
    big_v = torch.zeros_like(big_k)
    big_k[offset:], big_v[offset:] = kc, vc
    moved = BatchLayout.build(extra, counts, [[b + offset for b in t] for t in layout.block_tables], bs, DEV)
    ref = pa.paged_attention(q, kc, vc, layout, dim**-0.5)
    assert torch.equal(pa.paged_attention(q, big_k, big_v, moved, dim**-0.5), ref)


PREFILL_CASES = [  # (query lens, cached tokens before them, kv heads, heads, head dim)
    ([40, 3, 20, 1], [0, 50, 33, 7], 2, 4, 32),  # whole prompt and continued chunks beside verify windows
    ([17, 70], [0, 0], 3, 9, 64),  # SmolLM2-like GQA 3: 21 tokens a tile, a tile's rows not all used
    ([33], [95], 1, 1, 16),  # no grouping: 64 tokens a tile; a chunk after a long cached prefix
    ([130, 2, 65], [5, 0, 64], 2, 16, 32),  # GQA 8: 8 tokens a tile, many tiles a chunk
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prompt_chunks_and_verify_windows_in_one_step_match_reference(dtype, case):
    """paged_attention: queries of up to 16 tokens through the decode kernel, longer ones (prompt
    chunks, whole or after a cached prefix) through the prefill kernel, in the same step."""
    counts, extra, kvh, heads, dim = PREFILL_CASES[case]
    q, kc, vc, layout = _random_batch(counts, extra, kvh, heads, dim, dtype, 3 + case)
    ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
    assert _rel(pa.paged_attention(q, kc, vc, layout, dim**-0.5), ref) < TOL[dtype]


TREE_CASES = [  # per sequence: (tokens before the window, cached before them, tree parents or None), kv, heads, dim
    ([(0, 40, [-1, -1, 0, 0, 1, 2, 4]), (0, 7, None), (0, 100, [-1] * 3)], 2, 8, 32),
    ([(0, 17, [-1, -1, -1, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8] + [0] * 10 + [-1] * 8)], 3, 9, 64),  # a 31-node tree
    ([(5, 20, [-1, 0, -1]), (30, 0, None), (0, 3, [-1])], 1, 4, 16),  # a recomputed request before its window
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(TREE_CASES)))
@pytest.mark.parametrize(("splits", "per"), [(1, None), (4, None), (1, 16), (4, 16)])
def test_tree_windows_match_reference(dtype, case, splits, per):
    """Draft-tree windows (spec_decode/tree.py) beside causal queries in one step, through paged_attention: each
    window row sees the context and its own path, rows before a window attend causally. per: rows of the
    query tile a program takes (None: all), so a window's rows are split among programs."""
    from streamsd.sample.tree_verify import host_tree

    seqs, kvh, heads, dim = TREE_CASES[case]
    counts = [pre + (1 + len(p) if p is not None else 1) for pre, _, p in seqs]
    q, kc, vc, base = _random_batch(counts, [c for _, c, _ in seqs], kvh, heads, dim, dtype, 40 + case)
    trees = [host_tree(p) if p is not None else None for _, _, p in seqs]
    layout = BatchLayout.build([c for _, c, _ in seqs], counts, base.block_tables, 16, DEV, trees)
    ref = ta.paged_attention(q.double(), kc.double(), vc.double(), layout, dim**-0.5)
    out = torch.full_like(q, float("nan"))
    pa.decode_attention(q, kc, vc, layout.block_table, layout.context_lens_t, layout.query_starts_t, dim**-0.5,
                       max(counts), out=out, splits=splits, tree_bits=layout.tree_bits, tree_start=layout.tree_start,
                       rows_per_program=per)
    assert _rel(out, ref) < TOL[dtype]
    assert _rel(pa.paged_attention(q, kc, vc, layout, dim**-0.5), ref) < TOL[dtype]


def test_prefill_tiles_cover_each_long_query_once():
    tiles = prefill_tiles([0, 40, 43], [40, 3, 20], [40, 53, 53], 16, 16)
    assert tiles == [(0, 0, 16, 0), (0, 16, 16, 16), (0, 32, 8, 32), (2, 43, 16, 33), (2, 59, 4, 49)]


def test_pick_splits_fills_the_chip_and_stays_a_power_of_two():
    assert pa.pick_splits(1, 8, 256, 16, 132) == 16
    assert pa.pick_splits(64, 8, 256, 16, 132) == 1
    assert pa.pick_splits(1, 8, 2, 16, 132) == 1  # one tile of keys: nothing to split
    assert pa.pick_splits(4, 8, 32, 16, 132) == 8


# -- warping and plain sampling --------------------------------------------------------------------
def _warp_case(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3.0  # [N, V]
    logits[0, :7] = float("-inf")  # suppressed early stops
    temperature = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 1.0, 0.9, 2.0][:n])  # 0: a greedy row
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.2, 0.01, 0.0, 0.1][:n])
    return logits, temperature, min_p


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("vocab", [37, 5000])
def test_warp_kernel_matches_the_torch_warp(vocab, chunked):
    """kernels/sample/warp.py (one program a row) and kernels/sample/warp_chunked.py (a program per chunk of ids,
    for graphs) against sample/warp.py's torch ops: temperature (greedy rows at 1), min-p,
    renormalised; the same tokens cut, probabilities within float32 rounding; `reps` rows a request."""
    from streamsd.kernels.sample import warp as single
    from streamsd.kernels.sample import warp_chunked
    from streamsd.sample.warp import WarpParams, warp

    kernel = warp_chunked if chunked else single

    logits, temperature, min_p = _warp_case(8, vocab, vocab)
    wp = WarpParams(temperature, torch.zeros(8, dtype=torch.int64), torch.ones(8), min_p, False)
    want = warp(logits, wp)  # the CPU path: torch ops
    got = kernel.warp(logits.to(DEV), temperature.to(DEV), min_p.to(DEV)).cpu()
    assert torch.equal(got == 0, want == 0) and (want == 0).any()
    assert _rel(got, want) < 1e-5
    reps = kernel.warp(logits.to(DEV), temperature[::2].to(DEV), min_p[::2].to(DEV), reps=2).cpu()
    pairs = warp(logits, WarpParams(temperature[::2], wp.top_k[::2], wp.top_p[::2], min_p[::2], False), reps=2)
    assert _rel(reps, pairs) < 1e-5


def test_sample_kernel_keeps_a_row_of_nan_inside_the_vocabulary():
    """A graph's padding row holds garbage logits, NaN included. Raced, greedy or at temperature 0, its
    token must still be an id of the vocabulary: the next step embeds it (a NaN row's race once named
    the id one past the vocabulary, and the embedding's gather faulted on the H200)."""
    from streamsd.kernels.sample.warp import sample_keyed

    vocab = 384  # less than the kernel's block: the block's tail lies past the vocabulary
    logits = torch.randn(4, vocab)
    logits[:3] = float("nan")
    logits[3, 7] = float("nan")  # one NaN among real logits: it never wins
    greedy = torch.tensor([0, 1, 0, 0])
    temperature = torch.tensor([1.0, 0.0, 0.0, 1.0])
    ints = torch.cat([greedy, torch.tensor([3, 4, 5, 6]), torch.tensor([10, 11, 12, 13])]).to(DEV)
    for dtype in DTYPES:
        got = sample_keyed(logits.to(DEV, dtype), ints, temperature.to(DEV), torch.zeros(4, device=DEV),
                           rng.TARGET).cpu()
        assert ((got >= 0) & (got < vocab)).all() and got[3] != 7, got


def test_rejection_kernel_keeps_a_row_of_nan_inside_the_vocabulary():
    """The rejection kernel's bonus race over a row of NaN probabilities (garbage, or an overflowed
    model) still names an id of the vocabulary, with and without a rejected draft."""
    vocab, n = 384, 2
    probs = torch.softmax(torch.randn(n, 2, vocab, generator=torch.Generator().manual_seed(3)), -1).to(DEV)
    probs[0] = float("nan")  # [B, K + 1, V]: a row of NaN, and one NaN among real probabilities
    probs[1, :, 5] = float("nan")
    tokens, accepted = rj.rejection_sample(VerifyInput(
        target_probs=probs, target_argmax=torch.zeros(n, 2, dtype=torch.int64, device=DEV),
        draft_ids=torch.tensor([[9], [9]], device=DEV), draft_probs=None,
        dense_q=torch.zeros(n, dtype=torch.bool, device=DEV), num_drafts=torch.tensor([0, 1], device=DEV),
        greedy=torch.zeros(n, dtype=torch.bool, device=DEV), uniforms=torch.ones(n, 1, device=DEV),
        noise=torch.ones(n, 2, vocab, device=DEV)))
    picked = tokens.cpu().gather(1, accepted.cpu().unsqueeze(1))
    assert ((picked >= 0) & (picked < vocab)).all() and picked[1, 0] != 5, (tokens, accepted)


def test_sample_kernel_races_as_the_rejection_kernel_and_the_torch_path():
    """A plain sampled step's one launch (kernels/sample/warp.sample_keyed, sample/sampler.sample_keyed on
    CUDA) picks the token the rejection kernel emits for a row with no drafts, given the kernels' own
    probabilities and noise (so a seeded request's sample does not depend on the step's path), and the
    torch path's token; greedy rows take the raw argmax."""
    from streamsd.kernels.sample import warp as kernel
    from streamsd.sample.sampler import sample_rows
    from streamsd.sample.warp import WarpParams, warp

    n, vocab = 8, 3000
    for seed in range(3):
        logits, temperature, min_p = _warp_case(n, vocab, seed)
        logits[0, 100] = logits[0, 2600] = 50.0  # a greedy row's tie across chunks: the lower index wins
        g = torch.Generator().manual_seed(seed)
        seeds = torch.randint(-(2**40), 2**40, (n,), generator=g)
        pos = torch.randint(0, 5000, (n,), generator=g)
        greedy = temperature == 0
        ints = torch.cat([greedy.long(), seeds, pos]).to(DEV)
        got = kernel.sample_keyed(logits.to(DEV), ints, temperature.to(DEV), min_p.to(DEV), rng.TARGET).cpu()
        # the rejection kernel's bonus race over the warp kernel's probabilities and the noise kernel
        probs = kernel.warp(logits.to(DEV), temperature.to(DEV), min_p.to(DEV))  # [N, V]
        noise = rng.exponentials(seeds.to(DEV), pos.to(DEV).unsqueeze(1), rng.TARGET, vocab)  # [N, 1, V]
        tokens, accepted = rj.rejection_sample(VerifyInput(
            target_probs=probs.unsqueeze(1), target_argmax=logits.argmax(-1, keepdim=True).to(DEV),
            draft_ids=torch.zeros(n, 0, dtype=torch.int64, device=DEV), draft_probs=None,
            dense_q=torch.zeros(n, dtype=torch.bool, device=DEV), num_drafts=torch.zeros(n, dtype=torch.int64,
                                                                                         device=DEV),
            greedy=greedy.to(DEV), uniforms=torch.zeros(n, 0, device=DEV), noise=noise))
        assert torch.equal(got, tokens[:, 0].cpu()) and not accepted.any()
        wp = WarpParams(temperature, torch.zeros(n, dtype=torch.int64), torch.ones(n), min_p, False)
        cpu_noise = rng.exponentials(seeds, pos.unsqueeze(1), rng.TARGET, vocab)[:, 0]
        assert torch.equal(got, sample_rows(warp(logits, wp), logits, greedy, cpu_noise))
        assert torch.equal(got[greedy], logits[greedy].argmax(-1))


def test_row_argmax_finds_the_first_maximum_as_torch_does():
    """kernels/warp_chunked.row_argmax searches a row's chunks in parallel: the same index as torch.argmax,
    ties within and across chunks to the lowest, rows of -inf to 0, strided views and bf16 rows."""
    from streamsd.kernels.sample.warp_chunked import CHUNK, row_argmax

    g = torch.Generator().manual_seed(3)
    vocab = 2 * CHUNK + 123  # three chunks, the last one partial
    x = torch.randn(6, vocab, generator=g)
    x[1, 5] = x[1, 9] = 40.0  # a tie inside a chunk
    x[2, CHUNK + 1] = x[2, 2 * CHUNK + 3] = 40.0  # across chunks
    x[3] = float("-inf")
    x[4, :CHUNK] = float("-inf")  # a chunk with nothing in it
    x[5, -1] = 50.0  # the partial chunk's last id
    for rows in (x, x.to(torch.bfloat16), torch.cat([x, x], dim=1)[:, :vocab]):
        assert torch.equal(row_argmax(rows.to(DEV)).cpu(), rows.float().argmax(-1))
    # A CUDA graph's padding row can be NaN: its id is garbage nobody reads, but an embedding looks it up.
    nan = torch.full((2, vocab), float("nan"))
    nan[1, 7] = 3.0  # NaN beside a number: the number wins
    got = row_argmax(nan.to(DEV)).cpu()
    assert 0 <= got[0] < vocab and got[1] == 7, got


# -- rejection sampler ---------------------------------------------------------------------------
def _verify_input(b: int, k: int, v: int, greedy_frac: float, dense_frac: float, seed: int, *,
                  sampled: bool = True, with_q: bool = True, peaked: bool = False, equal_pq: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, v, generator=g) * (6.0 if peaked else 2.0)  # [B, K+1, V]
    p = torch.softmax(logits, -1)
    q = p[:, :k].clone() if equal_pq else torch.softmax(logits[:, :k] + torch.randn(b, k, v, generator=g), -1)
    argmax = logits.argmax(-1)  # [B, K+1]
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.6, argmax[:, :k], torch.randint(0, v, (b, k), generator=g))
    seeds = torch.randint(0, 2**62, (b,), generator=g)
    pos = torch.arange(k + 1).expand(b, k + 1) + torch.randint(0, 100, (b, 1), generator=g)  # [B, K+1]
    vi = VerifyInput(
        target_probs=p if sampled else None, target_argmax=argmax, draft_ids=drafts,
        draft_probs=q if with_q else None, dense_q=torch.rand(b, generator=g) < dense_frac,
        num_drafts=torch.randint(0, k + 1, (b,), generator=g), greedy=torch.rand(b, generator=g) < greedy_frac,
        uniforms=rng.uniforms(seeds, pos[:, :k], rng.ACCEPT),
        noise=rng.exponentials(seeds, pos, rng.TARGET, v) if sampled else None,
        seeds=seeds, positions=pos.contiguous(),
    )
    return VerifyInput(*(t.to(DEV) if isinstance(t, torch.Tensor) else t for t in (
        vi.target_probs, vi.target_argmax, vi.draft_ids, vi.draft_probs, vi.dense_q, vi.num_drafts, vi.greedy,
        vi.uniforms, vi.noise, vi.seeds, vi.positions)))


REJECTION_CASES = [  # (B, K, V, greedy fraction, dense fraction, options)
    (16, 4, 50, 0.3, 0.5, {}),
    (16, 4, 50, 0.0, 1.0, {"peaked": True}),
    (8, 3, 37, 1.0, 0.0, {"sampled": False, "with_q": False}),  # all greedy: no p, no noise
    (12, 2, 300, 0.2, 0.0, {"with_q": False}),  # one-hot q only
    (8, 1, 20, 0.0, 1.0, {"equal_pq": True}),  # p == q: empty residual, the fallback to p
    (5, 0, 20, 0.5, 0.5, {}),  # k = 0: plain sampling through the same path
]


@pytest.mark.parametrize("case", range(len(REJECTION_CASES)))
def test_rejection_kernel_matches_reference(case):
    b, k, v, greedy, dense, opts = REJECTION_CASES[case]
    if CUDA:
        b, v = b * 8, v * 400  # a vocabulary of several kernel chunks on the GPU
    for seed in range(3):
        vi = _verify_input(b, k, v, greedy, dense, seed + 100 * case, **opts)
        tokens_ref, acc_ref = rejection_sample(vi)
        tokens, acc = rj.rejection_sample(vi)
        assert torch.equal(acc, acc_ref)
        assert torch.equal(tokens, tokens_ref)


@pytest.mark.parametrize("case", [0, 1, 3, 4, 5])
def test_rejection_kernel_draws_its_own_keyed_numbers(case):
    """Given seeds and positions instead of uniforms and noise, the kernel hashes them itself
    (kernels/sample/rng.py's numbers) and decides as the reference does with rng.py's tensors."""
    from dataclasses import replace

    b, k, v, greedy, dense, opts = REJECTION_CASES[case]
    if CUDA:
        b, v = b * 8, v * 400
    for seed in range(3):
        vi = _verify_input(b, k, v, greedy, dense, seed + 100 * case, **opts)
        tokens_ref, acc_ref = rejection_sample(vi)
        tokens, acc = rj.rejection_sample(replace(vi, uniforms=None, noise=None))
        assert torch.equal(acc.cpu(), acc_ref.cpu()) and torch.equal(tokens.cpu(), tokens_ref.cpu())
        assert torch.equal(rejection_sample(replace(vi, uniforms=None, noise=None))[0].cpu(), tokens_ref.cpu())


def test_rejection_kernel_reads_strided_inputs_by_their_strides():
    """The worker hands the sampler views of one packed per-request buffer (one host-to-device copy);
    the kernel indexes raw pointers, so its wrapper must make every input contiguous. Regression: on
    the H200 `num_drafts` arrived as a column view, rows past the first read their neighbours' fields,
    and measured acceptance fell from 0.90 to 0.80 (outputs stayed exact: only acceptance suffered)."""
    b, k, v = (32, 4, 2000) if CUDA else (8, 3, 40)
    vi = _verify_input(b, k, v, 0.5, 0.5, 7)

    def strided(t: torch.Tensor | None) -> torch.Tensor | None:  # the same values, every other element
        if t is None:
            return None
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device) if t.dim() > 1 else \
            torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
        view = wide[..., ::2]
        view.copy_(t)
        assert not view.is_contiguous()
        return view

    sv = VerifyInput(*(strided(getattr(vi, f)) for f in (
        "target_probs", "target_argmax", "draft_ids", "draft_probs", "dense_q", "num_drafts", "greedy", "uniforms",
        "noise")))
    tokens_ref, acc_ref = rejection_sample(vi)
    tokens, acc = rj.rejection_sample(sv)
    assert torch.equal(acc, acc_ref) and torch.equal(tokens, tokens_ref)


# -- the whole engine on CUDA: graphs + kernels keep greedy speculation exact ----------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n", [6, 16])  # a padded bucket (8) and a full one (16)
def test_cuda_engine_greedy_spec_equals_plain_through_graphs(tiny_model_dir, close_draft_dir, n):
    from streamsd.engine.llm import LLM
    from streamsd.request import SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 11][: 2 + i % 6] * (i % 5 + 1) + [20 + i] for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    spec = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), device="cuda", dtype="float32",
               kv_cache_tokens=8192)
    a = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    b = [r.outputs[0].token_ids for r in spec.generate(prompts, params)]
    assert a == b
    worker = spec.core.rt.worker
    assert worker.graphs.replays > 0 and worker.proposer.graphs.replays > 0
    assert plain.core.rt.worker.graphs.replays > 0
    assert sum(r.spec_stats.accepted for r in spec.generate(prompts[:2], params)) > 0


def test_fast_forward_matches_reference_forward(tiny_model_dir):
    """Fused weights + Triton add-RMSNorm, RoPE/KV write and SiLU*mul give the eager forward's
    logits, captured residual streams (what an EAGLE head reads: the embedding, a middle layer's
    input, the final pre-norm stream) and cache contents, over a prefill (SDPA) and a
    verify-shaped step (the kernel); and streams written straight into a stream store."""
    from streamsd.engine.builder import load_model
    from streamsd.model.fast_forward import enable_fast_forward
    from streamsd.model.kv_cache import PagedKVCache

    dtype = torch.bfloat16 if CUDA else torch.float32
    model, _ = load_model(str(tiny_model_dir), DEV, dtype)
    bs = 16
    lens, tables = [20, 9], [[3, 0], [2]]
    g = torch.Generator().manual_seed(1)
    steps = [([0, 0], lens), (lens, [3, 1])]  # (starts, counts): a prefill, then a verify-shaped step
    ids = [torch.randint(3, model.args.vocab_size, (sum(c),), generator=g).to(DEV) for _, c in steps]
    results = []
    for fast in (False, True):
        cache = PagedKVCache(model.args, 5, bs, dtype, DEV)
        if fast:
            model.attend = pa.paged_attention
            enable_fast_forward(model)
        outs = []
        for (s, c), i in zip(steps, ids, strict=True):
            rows = torch.arange(sum(c), device=DEV)
            o = model(i, BatchLayout.build(s, c, tables, bs, DEV), cache, rows[-2:], hidden_layers=(0, 1, 2),
                      hidden_rows=rows.flip(0))  # streams at every row (reversed), logits at two
            assert o.hidden is not None and len(o.hidden) == 3
            outs.extend([o.logits, *o.hidden])
        # The verify step again, its streams of two inner layers straight into a stream store (the
        # fast path writes them from its add+RMSNorm): the store's rows at the step's slots are the
        # streams the step returns otherwise. (The step rewrites the same K/V.)
        layout = BatchLayout.build(*steps[1], tables, bs, DEV)
        rows = torch.arange(sum(steps[1][1]), device=DEV)
        assert model.args.num_layers == 2  # (1,): an inner layer's; (1, 2): the final stream's too, after the loop
        for layers in ((1,), (1, 2)):
            store = torch.zeros(5 * bs, len(layers) * model.args.hidden_size, dtype=dtype, device=DEV)
            direct = model(ids[1], layout, cache, rows, hidden_layers=layers, streams_into=store)
            returned = model(ids[1], layout, cache, rows, hidden_layers=layers, hidden_rows=rows)
            assert direct.hidden is None and returned.hidden is not None
            assert torch.equal(store[layout.slot_mapping], torch.cat(returned.hidden, dim=-1))
            assert store.count_nonzero() == store[layout.slot_mapping].count_nonzero() > 0
            outs.append(store)
        results.append((outs, cache.data.clone()))
    _assert_fast_matches_reference(results)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_returns_the_eager_hidden_streams(tiny_model_dir):
    """A runner that captures an EAGLE head's streams: its replay's logits and streams equal the
    eager (fast) forward's, for a verify-shaped step padded into a (bucket 4, width 4) graph."""
    from streamsd.engine.builder import load_model
    from streamsd.model.fast_forward import enable_fast_forward
    from streamsd.model.graphs import GraphConfig, GraphRunner
    from streamsd.model.kv_cache import PagedKVCache

    model, _ = load_model(str(tiny_model_dir), DEV, torch.float32)
    model.attend = pa.paged_attention
    enable_fast_forward(model)
    scratch, bs, layers = 12, 16, (0, 1, 2)
    cache = PagedKVCache(model.args, scratch + 1, bs, torch.float32, DEV)
    lens, tables = [20, 40, 9], [[3, 0], [5, 1, 7], [2]]
    g = torch.Generator().manual_seed(0)
    flat = torch.randint(3, model.args.vocab_size, (sum(lens),), generator=g).to(DEV)
    model(flat, BatchLayout.build([0, 0, 0], lens, tables, bs, DEV), cache, torch.arange(flat.numel(), device=DEV))
    counts = [1, 3, 2]
    ids = torch.randint(3, model.args.vocab_size, (sum(counts),), generator=g).tolist()
    rows = [0, 3, 5]  # the verify rows the worker asks for: not an arange, so the gather path runs too
    before = cache.data.clone()
    all_rows = torch.arange(sum(counts), device=DEV)
    ref = model(torch.tensor(ids, device=DEV), BatchLayout.build(lens, counts, tables, bs, DEV), cache,
                torch.tensor(rows, device=DEV), hidden_layers=layers, hidden_rows=all_rows)
    ref_hidden = torch.cat(ref.hidden, dim=-1)  # [T, 3 * hidden], as the full step's forward builds it
    cache.data.copy_(before)
    runner = GraphRunner(model, cache, scratch, GraphConfig(max_blocks=8, query_widths=(1, 4)), DEV,
                         hidden_layers=layers)
    key = runner.key_for(counts, tables)
    assert key == (4, 4)
    for _ in range(2):  # the capture's first replay, then a replay of the stored graph
        cache.data.copy_(before)
        logits, hidden = runner.run_hidden(key, ids, lens, counts, tables, rows)
        assert hidden.shape == ref_hidden.shape
        assert _rel(logits, ref.logits) < 1e-4 and _rel(hidden, ref_hidden) < 1e-4
    assert runner.replays == 2 and len(runner.graphs) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_warm_up_compiles_every_variant_a_step_can_reach(tiny_model_dir):
    """After the start-up warm-up, steps of any batch size, draft count, query width and block-table
    width compile nothing (a compile inside a step stalled it for a few hundred ms on the H200)."""
    import streamsd.kernels.sample.rng as krng
    from streamsd.engine.builder import load_model
    from streamsd.kernels.warmup import compiled_variants, warm_up
    from streamsd.sample.rejection import VerifyInput

    model, _ = load_model(str(tiny_model_dir), DEV, torch.bfloat16)
    a, vocab, bs, max_k = model.args, model.args.vocab_size, 16, 4
    warm_up([model], torch.bfloat16, bs, vocab, max_k, DEV)
    before = compiled_variants()
    g = torch.Generator().manual_seed(0)
    for b in (1, 3, 4, 7, 16):
        for k in range(1, max_k + 1):
            # per-request rows sliced out of one packed buffer, as Verifier.launch sends them
            ints = torch.randint(0, 2, (3 * b + b * (k + 1) + b * k,), generator=g).to(DEV)
            seeds, at = ints[b : 2 * b], 3 * b + b * (k + 1)
            positions, drafts, greedy = ints[3 * b : at].view(b, k + 1), ints[at:].view(b, k), ints[:b].bool()
            krng.exponentials(seeds, drafts, rng.TARGET, vocab)  # seeds, positions: packed slices
            krng.uniforms(seeds, drafts[:, : max(k - 1, 1)], rng.ACCEPT)
            for sampled, dense in ((False, False), (True, False), (True, True)):
                p = torch.softmax(torch.randn(b, k + 1, vocab, generator=g), -1).to(DEV) if sampled else None
                q = torch.softmax(torch.randn(b, k, vocab, generator=g), -1).to(DEV) if dense else None
                # the sampler hashes its own uniforms and noise from (seed, position)
                rj.rejection_sample(VerifyInput(
                    target_probs=p, target_argmax=torch.zeros(b, k + 1, dtype=torch.int64, device=DEV),
                    draft_ids=drafts, draft_probs=q, dense_q=ints[2 * b : 3 * b].bool(),
                    num_drafts=ints[2 * b : 3 * b], greedy=greedy if sampled else torch.ones_like(greedy),
                    uniforms=None, noise=None, seeds=seeds, positions=positions))
    cache = torch.zeros(64, bs, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16, device=DEV)
    for seqs, width, qlen in [(1, 1, 1), (3, 3, 2), (5, 17, 5), (40, 16, 3), (2, 33, 16), (9, 2, 7)]:
        q = torch.randn(seqs * qlen, a.num_heads, a.head_dim, dtype=torch.bfloat16, device=DEV)
        table = torch.randint(0, 64, (seqs, width), dtype=torch.int32, device=DEV)
        ctx = torch.full((seqs,), width * bs - 1, dtype=torch.int32, device=DEV)
        starts = torch.arange(0, seqs * qlen + 1, qlen, dtype=torch.int32, device=DEV)
        pa.decode_attention(q, cache, cache, table, ctx, starts, 0.1, qlen)
    for lens, width in [([17], 2), ([300, 40], 20), ([64, 5, 100], 7)]:  # prompt chunks of eager steps
        q = torch.randn(sum(lens), a.num_heads, a.head_dim, dtype=torch.bfloat16, device=DEV)
        table = torch.randint(0, 64, (len(lens), width), dtype=torch.int32, device=DEV)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        tiles = prefill_tiles(starts, lens, lens, pa.KERNEL_MAX_QUERY, tokens_per_tile(a.num_heads, a.num_kv_heads))
        prefill_attention(q, cache, cache, table, tiles, 0.1, torch.empty_like(q))
    from streamsd.kernels.model.device_layout import restart
    from streamsd.model.device_layout import DeviceStarts

    for b in (1, 3, 4, 7, 16):  # a verify queued ahead, into a graph's packed buffer (bucket x width)
        for k in range(1, max_k + 1):
            width, t_all = k + 1, b * (k + 1)
            packed = torch.zeros(3 * t_all + 2 * b + 1, dtype=torch.int64, device=DEV)
            rows = torch.zeros(4 * b + 1, dtype=torch.int64, device=DEV)  # views at odd offsets, as a chain graph's
            table = torch.zeros(b, 3 + b, dtype=torch.int32, device=DEV)
            prev, acc = rows[1 : 1 + b], rows[1 + b : 1 + 2 * b]
            tokens = torch.zeros(b, max_k + 1, dtype=torch.int64, device=DEV)
            drafts = torch.zeros(b, max_k, dtype=torch.int64, device=DEV)[:, :k]  # the chain's first k
            restart(packed, t_all, DeviceStarts(torch.empty(b, dtype=torch.int64, device=DEV), prev, acc, tokens,
                                                drafts), width, table, bs)
            restart(packed, t_all, DeviceStarts(rows[1 + 2 * b : 1 + 3 * b]), width, table, bs, base=rows[1 + 3 * b :])
    torch.cuda.synchronize()
    assert compiled_variants() == before


@pytest.mark.parametrize("kind,norm_first", [("eagle3", False), ("eagle3", True), ("eagle1", False)])
def test_fast_eagle_head_matches_its_reference_layer(tiny_model_dir, kind, norm_first):
    """The EAGLE head's layer on the fused kernels (spec_decode/eagle/fast.py) gives the autograd layer's
    output, head KV and draft logits, over a prompt chunk (the prefill kernel) and then a catch-up of
    a verify's rows and a one-token chain step (the decode kernel), for both EAGLE-3 residuals and EAGLE-1;
    the second step takes its hidden inputs by row index, as a tree level does."""
    from streamsd.engine.builder import load_model
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.spec_decode.eagle.checkpoint import new_head
    from streamsd.spec_decode.eagle.fast import fast_head

    dtype = torch.bfloat16 if CUDA else torch.float32
    target, _ = load_model(str(tiny_model_dir), DEV, dtype)
    torch.manual_seed(0)
    head = new_head(target, kind=kind, norm_before_residual=norm_first)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    head = head.to(dtype)
    bs, tables = 16, [[3, 0], [2]]
    steps = [([0, 0], [20, 9]), ([20, 9], [5, 1])]  # (starts, counts)
    g = torch.Generator().manual_seed(1)
    width = head.fc.in_features if kind == "eagle3" else target.args.hidden_size
    inputs = [(torch.randint(3, target.args.vocab_size, (sum(c),), generator=g).to(DEV),
               torch.randn(sum(c), width, generator=g).to(DEV, dtype)) for _, c in steps]
    scale = head.spec.args.head_dim ** -0.5
    results = []
    with torch.no_grad():  # the head's parameters train elsewhere; here they only infer
        for fast in (False, True):
            cache = PagedKVCache(head.spec.args, 5, bs, dtype, DEV)
            kv = cache.layer(0)
            runner = fast_head(head, pa.paged_attention) if fast else None
            outs = []
            for (s, c), (ids, streams) in zip(steps, inputs, strict=True):
                layout = BatchLayout.build(s, c, tables, bs, DEV)
                feats = head.features(streams)
                if runner is not None and s[0]:  # a tree level's form: each token's input picked by row
                    rows = torch.arange(feats.shape[0] - 1, -1, -1, device=DEV)
                    out = runner.run_layer(ids, feats.flip(0), layout, kv, rows)
                elif runner is not None:
                    out = runner.run_layer(ids, feats, layout, kv)
                else:
                    def attend(q, k, v, layout=layout, kv=kv):
                        PagedKVCache.write(kv[0], kv[1], k, v, layout.slot_mapping)
                        return ta.paged_attention(q, kv[0], kv[1], layout, scale)

                    out = head.run_layer(ids, feats, layout.positions, attend)
                outs.extend([out, head.draft_logits(out[-2:])])
            results.append((outs, cache.data.clone()))
    _assert_fast_matches_reference(results)
    assert (head.fast_norm is not None) == (kind == "eagle3")


def test_rng_kernels_give_the_torch_oracles_bits():
    """Exp(1) noise and acceptance uniforms from kernels/sample/rng.py equal sample/rng.py's torch hash (the
    oracle, and the CPU path): the uniforms bit for bit, the noise up to how -log rounds (the same 23-bit
    uniforms underneath: a hash off by one bit is a different number), over seeds past 2**32 and negative
    ones, every stream, ragged vocabularies."""
    import streamsd.kernels.sample.rng as krng
    from streamsd.sample import rng as trng

    g = torch.Generator().manual_seed(0)
    seeds = torch.tensor([0, 7, 2**40 + 3, -5, 123456789], dtype=torch.int64)
    positions = torch.randint(0, 100_000, (5, 3), generator=g, dtype=torch.int64)
    for stream in (trng.ACCEPT, trng.TARGET, trng.DRAFT):
        want_u = trng.uniforms(seeds, positions, stream)  # the torch path (CPU tensors)
        got_u = krng.uniforms(seeds.to(DEV), positions.to(DEV), stream).cpu()
        assert torch.equal(got_u, want_u)
        for vocab in (1, 37, 5000):
            want = trng.exponentials(seeds, positions, stream, vocab)
            got = krng.exponentials(seeds.to(DEV), positions.to(DEV), stream, vocab).cpu()
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["ids", "starts", "base"])
def test_restart_kernel_equals_the_torch_layout(mode):
    """kernels/model/device_layout.restart writes what model/device_layout.restart's torch path writes:
    positions, slots and context lengths of each row from its start (given, or the previous start + 1
    + accepted), the ids (bonus token at the accepted column, then the drafts), the base; nothing past
    the rows."""
    from streamsd.kernels.model import device_layout as kernel
    from streamsd.model.device_layout import DeviceStarts, restart

    g = torch.Generator().manual_seed(1)
    n, width, bs, t_all, k1 = 3, 4, 4, 16, 5
    table = torch.randint(0, 50, (4, 9), generator=g, dtype=torch.int32)
    prev = torch.tensor([3, 9, 0])
    accepted = torch.tensor([0, 3, 1])
    tokens = torch.randint(0, 99, (n, k1), generator=g)
    drafts = torch.randint(0, 99, (n, 6), generator=g)[:, : width - 1]  # a strided view, as the chain's
    outs = []
    for on_device in (False, True):
        dev = DEV if on_device else torch.device("cpu")
        packed = torch.full((3 * t_all + 9,), -7, dtype=torch.int64, device=dev)
        base = torch.full((4,), -7, dtype=torch.int64, device=dev)
        starts = torch.tensor([5, 11, 2], device=dev) if mode == "base" else torch.empty(n, dtype=torch.int64, device=dev)
        src = DeviceStarts(starts, None if mode == "base" else prev.to(dev), None if mode == "base" else accepted.to(dev),
                           tokens.to(dev) if mode == "ids" else None, drafts.to(dev) if mode == "ids" else None)
        if on_device:
            kernel.restart(packed, t_all, src, width, table.to(dev), bs, base=base if mode == "base" else None)
        else:
            restart(packed, t_all, src, width, table, bs, base=base if mode == "base" else None)
        outs.append((packed.cpu(), base.cpu(), starts.cpu()))
    (p0, b0, s0), (p1, b1, s1) = outs
    assert torch.equal(p0, p1) and torch.equal(b0, b1) and torch.equal(s0, s1)
    want_starts = prev + 1 + accepted if mode != "base" else torch.tensor([5, 11, 2])
    assert torch.equal(s0, want_starts)
    assert p0[t_all : t_all + width].tolist() == list(range(int(want_starts[0]), int(want_starts[0]) + width))
    if mode == "ids":
        assert p0[width] == tokens[1, 3] and p0[width + 1 : 2 * width].tolist() == drafts[1].tolist()
    assert (p0[n * width : t_all] == -7).all()  # rows past S untouched


@pytest.mark.parametrize("vocab,k", [(1000, 3), (49152, 6), (5000, 8)])
def test_topk_logprobs_equal_torchs_log_softmax_and_topk(vocab, k):
    from streamsd.kernels.sample import topk as kernel
    from streamsd.spec_decode.eagle.tree import topk_logprobs

    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 3).to(DEV)
    logits[1, 7] = float("-inf")  # impossible ids (outside a head's draft vocabulary)
    logits[2, 100:] = float("-inf")
    ref_v, ref_i = topk_logprobs(logits, k)
    v, i = kernel.topk_logprobs(logits, k)
    assert torch.equal(i, ref_i)
    assert torch.allclose(v, ref_v, atol=1e-5)
    # bf16 logits (a head's lm_head output, not upcast first) give what their float32 values give
    half = logits.to(torch.bfloat16)
    ref_v = topk_logprobs(half.float(), k)[0]
    v, i = kernel.topk_logprobs(half, k)
    assert torch.allclose(v, ref_v, atol=1e-5)  # ties are many in bf16: the ids, by the logits they pick
    assert torch.equal(half.float().gather(1, i), half.float().topk(k, dim=-1).values)


def test_raced_topk_equals_the_torch_race_and_its_noise_is_the_targets():
    """With a race, the first launch ranks sampled rows by their tempered logits plus the Gumbel noise of
    the target's race at each request's key (spec_decode/eagle/tree.topk_logprobs and race_logits, bit for bit the same noise);
    a greedy request's rows stay as they are, and so do a graph's padding rows (temperature 0). Two rows
    a request, four requests."""
    from streamsd.kernels.sample import topk as kernel
    from streamsd.model.tree_layout import Race
    from streamsd.spec_decode.eagle.tree import topk_logprobs

    g = torch.Generator().manual_seed(3)
    vocab, k, reps = 5000, 4, 2
    logits = (torch.randn(4 * reps, vocab, generator=g) * 2).to(DEV)
    race = Race(torch.tensor([0, 1, 0, 0]).to(DEV), torch.tensor([7, 8, 2**40 + 9, 0]).to(DEV),
                torch.tensor([1.0, 0.0, 0.6, 0.0]).to(DEV))
    keys = torch.tensor([31, 5, 1000, 3]).to(DEV)
    ref_v, ref_i = topk_logprobs(logits.cpu(), k, _cpu(race), keys.cpu())
    v, i = kernel.topk_logprobs(logits, k, race, keys)
    assert torch.equal(i.cpu(), ref_i)
    assert torch.allclose(v.cpu(), ref_v, atol=1e-4)
    plain_v, plain_i = kernel.topk_logprobs(logits, k)
    assert torch.equal(i[2:4], plain_i[2:4]) and torch.equal(i[6:], plain_i[6:])
    assert not torch.equal(i[:2], plain_i[:2]) and not torch.equal(i[4:6], plain_i[4:6])


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_int8_head_topk_equals_its_torch_oracle(draft_vocab):
    """kernels/tree/head_topk.py: the head's final norm, an int8 lm_head (a scale per id) and the k best
    log-probabilities in one pass give what torch gives over the dequantized rows: greedy rows and raced ones (the target's noise at each request's key, over target ids where
    the head has a draft vocabulary), a vocabulary and a width that are no multiple of the blocks, a
    padding row of NaN."""
    from streamsd.kernels.tree.head_topk import DraftLogits, head_topk
    from streamsd.model.tree_layout import Race
    from streamsd.spec_decode.eagle.tree import race_logits

    g = torch.Generator().manual_seed(5)
    vocab, hidden, k, eps = 1000, 96, 4, 1e-5
    d2t = None
    ids = torch.arange(vocab)
    if draft_vocab:  # 600 target ids, ascending: draft id d is target id d + d2t[d]
        ids = torch.randperm(vocab, generator=g)[:600].sort().values
        d2t = (ids - torch.arange(600)).to(DEV)
    w = torch.randn(ids.numel(), hidden, generator=g) * 0.05
    norm = 1 + 0.1 * torch.randn(hidden, generator=g)
    lm_head = w.to(DEV)
    head = DraftLogits.build(lm_head, norm.to(DEV), eps, d2t)
    assert torch.equal(lm_head.cpu(), w)  # the target's own lm_head (float32 here) is left as it was
    rows = head.dequantized().cpu()  # [V', H]
    err = (rows - w).abs()
    assert (err <= head.scale.cpu().unsqueeze(1) / 2 + 1e-6).all() and err.max() > 0
    out = torch.randn(8, hidden, generator=g).to(torch.bfloat16)
    race = Race(torch.tensor([0, 1, 0, 0]), torch.tensor([7, 8, 2**40 + 9, 0]), torch.tensor([1.0, 0.0, 0.6, 0.0]))
    keys = torch.tensor([31, 5, 1000, 3])

    def oracle(r: Race | None, keys: torch.Tensor = keys) -> tuple[torch.Tensor, torch.Tensor]:
        x = out.float()
        normed = (x * norm).to(torch.bfloat16).float() * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        logits = torch.full((8, vocab), float("-inf")).index_copy_(1, ids, normed @ rows.t())
        if r is not None:
            logits = race_logits(logits, r, keys)
        return torch.log_softmax(logits, -1).topk(k, -1)

    # 4 requests of 2 rows, then 1 of 8 (a block of rows of one request: one row of noise serves them all)
    one, one_key = Race(torch.tensor([0]), torch.tensor([2**33 + 5]), torch.tensor([0.8])), torch.tensor([78])
    for r, at in ((None, keys), (race, keys), (one, one_key)):
        on_dev = None if r is None else Race(r.greedy.to(DEV), r.seeds.to(DEV), r.temperature.to(DEV))
        v, i = head_topk(out.to(DEV), head, k, on_dev, at.to(DEV))
        ref_v, ref_i = oracle(r, at)
        assert torch.equal(i.cpu(), ref_i), (v[0], ref_v[0])
        assert torch.allclose(v.cpu(), ref_v, atol=2e-2)
    many = head_topk(out.repeat(5, 1).to(DEV), head, k)  # 40 rows: the tiling for more than one block of rows
    assert torch.equal(many[1].cpu(), oracle(None)[1].repeat(5, 1))
    # All k best of a row in one block of ids (the merge re-ranks the k blocks with the best bests)
    w[3 : 3 + k] = out[0].float() * torch.linspace(1.0, 0.5, k).unsqueeze(1) / out[0].float().norm()
    head = DraftLogits.build(w.to(DEV), norm.to(DEV), eps, d2t)
    rows = head.dequantized().cpu()
    v, i = head_topk(out.to(DEV), head, k)
    assert torch.equal(i.cpu(), oracle(None)[1]) and set(i[0].tolist()) == set(ids[3 : 3 + k].tolist())
    if not CUDA:  # NumPy's argmax refuses an all-NaN row; a graph's padding rows meet NaN on CUDA only
        return
    garbage = torch.full((3, hidden), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert ((head_topk(garbage, head, k)[1].cpu().unsqueeze(-1) == ids).any(-1)).all()  # ids of the vocabulary


def _cpu(race):
    from streamsd.model.tree_layout import Race

    return Race(race.greedy.cpu(), race.seeds.cpu(), race.temperature.cpu())


def test_tree_bookkeeping_kernels_equal_the_torch_oracles():
    """kernels/tree/bookkeeping.py against spec_decode/tree.py: the walk (and the head's catch-up laid out after it), the
    accepted nodes' moves (all read before any is written) and the next step's ids, positions, slots and masks, roots, tree and result."""
    from streamsd.kernels.tree import bookkeeping as kt
    from streamsd.sample.tree_verify import host_tree
    from streamsd.spec_decode import tree as st

    g = torch.Generator().manual_seed(5)
    b, n, d, bs = 3, 10, 4, 4
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1, 3, 3, 6, -2],
                            [-1, 0, 1, 2, -1, 4, 5, -2, -2, -2],
                            [-1, -1, 1, 1, 2, -1, 4, 5, 3, 0]])  # depth <= 4
    tokens = torch.randint(0, 6, (b, n), generator=g)
    for row in range(b):  # siblings hold distinct tokens
        for i in range(n):
            sib = [tokens[row, j].item() for j in range(i) if parents[row, j] == parents[row, i]]
            while tokens[row, i].item() in sib:
                tokens[row, i] = (tokens[row, i] + 1) % 50
    for trial in range(20):
        target = torch.randint(0, 6, (b, n + 1), generator=g)
        if trial % 2:  # a walk down a long path
            target[:, 0] = tokens[:, 0]
            target[:, 1] = torch.where(parents[:, 3] == 0, tokens[:, 3], target[:, 1])
        ref = st.walk(target, tokens, parents, d)
        *out, none = kt.walk(target.to(DEV), tokens.to(DEV), parents.to(DEV), d)
        assert none is None and all(torch.equal(x.cpu(), y) for x, y in zip(out, ref, strict=True)), trial
        # with the windows' roots and blocks, the head's catch-up after the walk in the same launch
        roots, table = torch.tensor([2, 13, 0]), torch.tensor([[3, 1, 4, 0, 9], [2, 6, 5, 7, 10], [8, 11, 12, 14, 15]],
                                                                dtype=torch.int32)
        *out, laid = kt.walk(target.to(DEV), tokens.to(DEV), parents.to(DEV), d, roots.to(DEV), table.to(DEV), bs)
        assert all(torch.equal(x.cpu(), y) for x, y in zip(out, ref, strict=True)), trial
        want = st.catch_up(roots, ref[1], ref[0], table, bs)
        assert all(x.dtype == y.dtype and torch.equal(x.cpu(), y) for x, y in zip(laid, want, strict=True)), trial
    # moves: one cache plane of 8 slots a block, path nodes anywhere in the window
    table = torch.tensor([[3, 1, 4, 0], [2, 6, 5, 7], [8, 9, 10, 11]], dtype=torch.int32)
    roots = torch.tensor([2, 5, 1])
    path = torch.tensor([[2, 5, -1, -1], [0, 1, 2, 3], [1, -1, -1, -1]])
    data = torch.randn(2, 12 * bs, 6, generator=g)
    ref = data.clone()
    src, dst = st.path_moves(roots, path)
    s_slot, d_slot = (st.positions_to_slots(x, table, bs).view(-1) for x in (src, dst))
    ref[:, d_slot] = ref[:, s_slot]
    moved = data.to(DEV)
    kt.move_path(moved, roots.to(DEV), path.to(DEV), table.to(DEV), bs)
    assert torch.equal(moved.cpu(), ref)
    # with a second store of other widths (the streams beside the KV cache) in the same launch
    streams = torch.randn(1, 12 * bs, 11, generator=g)
    ref_streams = streams.clone()
    ref_streams[:, d_slot] = ref_streams[:, s_slot]
    moved, moved_streams = data.to(DEV), streams.to(DEV)
    kt.move_path(moved, roots.to(DEV), path.to(DEV), table.to(DEV), bs, moved_streams)
    assert torch.equal(moved.cpu(), ref) and torch.equal(moved_streams.cpu(), ref_streams)
    # the next step: its window, roots and tree, and this step's result
    emitted = torch.tensor([[7, -1, -1, -1, -1], [4, 5, 8, -1, -1], [1, 2, 3, 4, 9]])
    accepted, pending = torch.tensor([0, 2, 4]), torch.tensor([3, 0, 6])
    first = emitted.gather(1, accepted.unsqueeze(1)).squeeze(1)  # the bonus tokens 7, 8, 9
    packed, bits = torch.zeros(3 * b * (n + 1) + 2 * b + 1, dtype=torch.int64).to(DEV), torch.zeros(b * (n + 1),
                                                                                                dtype=torch.int64).to(DEV)
    roots, tree = torch.zeros(b, dtype=torch.int64).to(DEV), torch.zeros(b, 2 * n, dtype=torch.int64).to(DEV)
    big = torch.tensor([list(range(12, 20)), list(range(20, 28)), list(range(28, 36))], dtype=torch.int32)
    result = kt.next_step(emitted.to(DEV), accepted.to(DEV), tokens.to(DEV), parents.to(DEV), pending.to(DEV),
                          big.to(DEV), bs, packed, bits, roots, tree, d)
    assert torch.equal(result.cpu(), torch.cat([emitted, accepted.unsqueeze(1), tokens, parents], dim=1))
    assert torch.equal(roots.cpu(), pending) and torch.equal(tree.cpu(), torch.cat([tokens, parents], dim=1))
    t = b * (n + 1)
    packed, bits = packed.cpu(), bits.cpu()
    for row in range(b):
        depth, mask = host_tree([p for p in parents[row].tolist() if p != -2])
        live = len(depth)
        w = slice(row * (n + 1), row * (n + 1) + live)
        assert packed[w].tolist() == [first[row].item(), *tokens[row, : live - 1].tolist()]
        assert packed[t:][w].tolist() == [pending[row].item() + x for x in depth]
        assert bits[w].tolist() == mask
        pos = pending[row] + torch.arange(n + 1)
        assert packed[2 * t + row * (n + 1) : 2 * t + (row + 1) * (n + 1)].tolist() == \
            st.positions_to_slots(pos.unsqueeze(0), big[row : row + 1], bs)[0].tolist()
        assert packed[3 * t + row] == pending[row] + n + 1
    assert torch.equal(bits.view(b, n + 1), st.window_bits(parents, d))


def test_tree_kv_moves_equal_the_torch_move_kv():
    """kernels/tree/bookkeeping.move_kv moves what sample/tree_verify.move_kv's torch path moves: every
    layer's K and V and the head's streams of the accepted nodes, from their window rows to their
    positions (all read before any is written); nothing else changes."""
    from streamsd.kernels.tree import bookkeeping as kernel
    from streamsd.model.arch import ModelArgs
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.stream_store import StreamStore
    from streamsd.sample.tree_verify import move_kv

    g = torch.Generator().manual_seed(7)
    bs = 4
    args = ModelArgs("llama", 10, 8, 16, 2, 2, 1, 4, 1e-5, 64, False, False, (), None)
    table = torch.tensor([[3, 1, 4, 0], [2, 6, 5, 7], [8, 9, 10, 11]], dtype=torch.int32)
    roots = torch.tensor([2, 5, 1])
    path = torch.tensor([[2, 5, -1, -1], [0, 1, 2, 3], [1, -1, -1, -1]])
    data, streams = torch.randn(2, 2, 12, bs, 1, 4, generator=g), torch.randn(12 * bs, 6, generator=g)
    moved = []
    for on_device in (False, True):
        dev = DEV if on_device else torch.device("cpu")
        cache, store = PagedKVCache(args, 12, bs, torch.float32, dev), StreamStore((0,), 6, 12 * bs, torch.float32, dev)
        cache.data.copy_(data)
        store.data.copy_(streams)
        move = kernel.move_kv if on_device else move_kv  # on a CPU move_kv takes its torch path
        move(cache, store, roots.to(dev), path.to(dev), table.to(dev), bs)
        moved.append((cache.data.cpu(), store.data.cpu()))
    (want_kv, want_streams), (got_kv, got_streams) = moved
    assert not torch.equal(want_kv, data) and not torch.equal(want_streams, streams)
    assert torch.equal(got_kv, want_kv) and torch.equal(got_streams, want_streams)


def test_tree_step_kernels_equal_the_torch_oracles():
    """kernels/tree/select.py against spec_decode/tree.py: the selection of a grown tree's best nodes over 114
    candidates (four blocks of the kernel's ranking) with many tied scores, whose ties the stable sort
    breaks by index."""
    from streamsd.kernels.tree import select as ks
    from streamsd.spec_decode import tree as st

    g = torch.Generator().manual_seed(11)
    b, c, n = 3, 114, 24
    parents = torch.full((b, c), st.ROOT)
    scores = torch.zeros(b, c)
    for row in range(b):
        scores[row, :6] = -torch.rand(6, generator=g)
        for i in range(6, c):
            parents[row, i] = torch.randint(0, i, (1,), generator=g)
            scores[row, i] = scores[row, parents[row, i]] - torch.rand(1, generator=g).item()
    scores = (scores * 4).round() / 4  # ties everywhere, a child never above its parent
    tokens = torch.randint(0, 1000, (b, c), generator=g)
    want_tok, want_par, _ = st.select(scores, tokens, parents, n)
    got_tok, got_par = ks.select(scores.to(DEV), tokens.to(DEV), parents.to(DEV), n)
    assert torch.equal(got_tok.cpu(), want_tok) and torch.equal(got_par.cpu(), want_par)
    # a real tree (every kept node's parent kept), deeper than one level, and ties among the kept
    assert (want_par != st.NONE).all() and (want_par >= 0).any()
    assert any(len(set(r.tolist())) < n for r in st.select(scores, tokens, parents, n)[2])
    # NaN scores (a padding row reads streams never written): every node still written, parents in range
    scores[1, ::3] = float("nan")
    scores[2] = float("nan")
    tokens[1] = torch.arange(c)  # distinct: n distinct tokens out = n nodes written
    tokens[2] = torch.arange(c)
    got_tok, got_par = (x.cpu() for x in ks.select(scores.to(DEV), tokens.to(DEV), parents.to(DEV), n))
    assert torch.equal(got_tok[0], want_tok[0]) and torch.equal(got_par[0], want_par[0])
    for row in (1, 2):
        assert len(set(got_tok[row].tolist())) == n and ((got_tok[row] >= 0) & (got_tok[row] < c)).all()
        assert ((got_par[row] >= st.NONE) & (got_par[row] < n)).all()


def test_tree_growth_levels_equal_the_torch_oracle():
    """kernels/tree/grow.py against spec/eagle_tree.expand_level over a whole growth (depth 4, frontier
    3, branch 4, two requests): the candidates written level by level, and each frontier's tokens,
    scores, candidate indices, feature rows, masks, positions, slots and context lengths."""
    from streamsd.kernels.tree import grow as kg
    from streamsd.spec_decode.eagle import tree as et

    g = torch.Generator().manual_seed(9)
    b, m, c, depth, bs = 2, 3, 4, 4, 4
    pending = torch.tensor([5, 13])
    table = torch.tensor([[3, 1, 4, 0, 9, 8], [2, 6, 5, 7, 10, 11]], dtype=torch.int32)
    total = c + (depth - 1) * m * c
    ref_c, out_c = et.Candidates.empty(b, total, torch.device("cpu")), et.Candidates.empty(b, total, DEV)
    ref_base, out_base = et.Frontier.root(b, torch.device("cpu")), et.Frontier.root(b, DEV)
    offset = 0
    for level in range(1, depth + 1):
        rows = b * ref_base.scores.shape[1]
        s = torch.log_softmax(torch.randn(rows, 50, generator=g), -1).topk(c, -1).values  # distinct scores
        t = torch.randint(0, 1000, (rows, c), generator=g)
        expand = m if level < depth else 0
        ref = et.expand_level(s, t, ref_base, offset, ref_c, expand, level, pending, table, bs)
        out = kg.expand_level(s.to(DEV), t.to(DEV), out_base, offset, out_c, expand, level, pending.to(DEV),
                              table.to(DEV), bs)
        offset += rows // b * c
        if ref is None:
            assert out is None
            break
        assert out is not None
        for name in ("tokens", "index", "rows", "bits", "positions", "slots", "context_lens"):
            assert torch.equal(getattr(out, name).cpu(), getattr(ref, name)), (level, name)
        assert torch.allclose(out.scores.cpu(), ref.scores), level
        ref_base, out_base = ref, out
    assert offset == total
    assert torch.equal(out_c.tokens.cpu(), ref_c.tokens) and torch.equal(out_c.parents.cpu(), ref_c.parents)
    assert torch.allclose(out_c.scores.cpu(), ref_c.scores)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's argmax is numpy's: NaN wins there")
def test_tree_growth_of_garbage_rows_stays_in_range():
    """A CUDA graph's padding rows grow trees from garbage: NaN scores must still name candidates and
    feature rows of their own level (a branch of 3 leaves dead lanes in the kernel's power-of-two
    vector, where an argmax over NaN landed on the H200 and index_select then faulted)."""
    from streamsd.kernels.tree import grow as kg
    from streamsd.spec_decode.eagle import tree as et

    b, m, c, depth, bs = 2, 3, 3, 3, 4
    pending = torch.tensor([5, 9], device=DEV)
    table = torch.arange(12, dtype=torch.int32, device=DEV).view(b, 6)
    total = c + (depth - 1) * m * c
    cands, base, offset = et.Candidates.empty(b, total, DEV), et.Frontier.root(b, DEV), 0
    for level in range(1, depth):
        p = base.scores.shape[1]
        s = torch.full((b * p, c), float("nan"), device=DEV)
        s[:p] = torch.tensor([-0.1, -1.0, -2.0], device=DEV)  # request 0 real, request 1 garbage
        t = torch.arange(b * p * c, device=DEV).view(b * p, c)
        fr = kg.expand_level(s, t, base, offset, cands, m, level, pending, table, bs)
        assert fr is not None
        rows, index = fr.rows.view(b, m).cpu(), fr.index.cpu()
        for r in range(b):
            assert ((rows[r] >= r * p) & (rows[r] < (r + 1) * p)).all(), (level, r, rows[r])
            assert ((index[r] >= offset) & (index[r] < offset + p * c)).all(), (level, r, index[r])
        offset += p * c
        base = fr

"""The sampling kernels (kernels/sample/) against their torch oracles: warp, rejection, rng, top-k."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV  # isort: skip (first: it sets the interpreter up)
import streamsd.kernels.sample.rejection as rj
from streamsd.sample import rng
from streamsd.sample.rejection import VerifyInput, rejection_sample
from tests.kernels.kernel_helpers import DTYPES, rel_error


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
    assert rel_error(got, want) < 1e-5
    reps = kernel.warp(logits.to(DEV), temperature[::2].to(DEV), min_p[::2].to(DEV), reps=2).cpu()
    pairs = warp(logits, WarpParams(temperature[::2], wp.top_k[::2], wp.top_p[::2], min_p[::2], False), reps=2)
    assert rel_error(reps, pairs) < 1e-5


def test_sample_kernel_keeps_a_row_of_nan_inside_the_vocabulary():
    """A graph's padding row holds garbage logits, NaN included. Raced, greedy or at temperature 0, its
    token must still be an id of the vocabulary: the next step embeds it (a NaN row's race once named
    the id one past the vocabulary, and the embedding's gather faulted on an H200)."""
    from streamsd.kernels.sample.warp import sample_keyed

    vocab = 384  # less than the kernel's block: the block's tail lies past the vocabulary
    logits = torch.randn(4, vocab)
    logits[:3] = float("nan")
    logits[3, 7] = float("nan")  # one NaN among real logits: it never wins
    greedy = torch.tensor([0, 1, 0, 0])
    temperature = torch.tensor([1.0, 0.0, 0.0, 1.0])
    ints = torch.cat([greedy, torch.tensor([3, 4, 5, 6]), torch.tensor([10, 11, 12, 13])]).to(DEV)
    zeros = torch.zeros(4, device=DEV)
    for dtype in DTYPES:
        for top_k, top_p in ((0, 1.0), (0, 0.9), (5, 0.8)):  # uncut, and raced over a cut
            got = sample_keyed(logits.to(DEV, dtype), ints, temperature.to(DEV), zeros, zeros.long() + top_k,
                               zeros + top_p, rng.TARGET).cpu()
            assert ((got >= 0) & (got < vocab)).all() and got[3] != 7, (top_k, top_p, got)


def test_the_cut_race_draws_the_sorting_paths_tokens():
    """A row cut by top-k and/or top-p (kernels/sample/cut.py: no sort, a race repeated over the tokens
    likelier than a winner the cut drops) against sample/warp.py's sort, cut and race with the same
    noise: the same token at every position, ties at the cut's edge kept together by both (logits on a
    grid of halves tie often), min-p beside the cut, a greedy row taking its argmax."""
    from streamsd.kernels.sample import warp as kernel
    from streamsd.sample.sampler import sample_rows
    from streamsd.sample.warp import WarpParams, warp

    rows = [(1.0, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 20, 0.8, 0.05), (1.0, 0, 0.95, 0.1), (0.5, 3, 0.5, 0.0),
            (1.0, 1, 1.0, 0.0), (2.0, 0, 0.3, 0.0), (1.0, 5000, 0.9, 0.0), (0.0, 0, 0.9, 0.0)]
    temperature, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*rows, strict=True))
    n, vocab = len(rows), 3000
    wp = WarpParams(temperature, top_k, top_p, min_p, True)
    greedy = temperature == 0
    g = torch.Generator().manual_seed(0)
    for draw in range(8):
        logits = torch.randn(n, vocab, generator=g) * 3.0
        if draw % 2:
            logits = (logits * 2.0).round() / 2.0  # [N, V] many equal logits
        seeds, pos = torch.randint(0, 2**40, (n,), generator=g), torch.randint(0, 5000, (n,), generator=g)
        ints = torch.cat([greedy.long(), seeds, pos]).to(DEV)
        got = kernel.sample_keyed(logits.to(DEV), ints, temperature.to(DEV), min_p.to(DEV), top_k.to(DEV),
                                  top_p.to(DEV), rng.TARGET).cpu()
        noise = rng.exponentials(seeds, pos.unsqueeze(1), rng.TARGET, vocab)[:, 0]
        want = sample_rows(warp(logits, wp), logits, greedy, noise)
        assert torch.equal(got, want), (draw, got, want)


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
        got = kernel.sample_keyed(logits.to(DEV), ints, temperature.to(DEV), min_p.to(DEV),
                                  torch.zeros(n, dtype=torch.int64, device=DEV), torch.ones(n, device=DEV),
                                  rng.TARGET).cpu()
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
    an H200 `num_drafts` arrived as a column view, rows past the first read their neighbours' fields,
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


def _cpu(race):
    from streamsd.model.tree_layout import Race

    return Race(race.greedy.cpu(), race.seeds.cpu(), race.temperature.cpu())

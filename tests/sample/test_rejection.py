"""The rejection sampler keeps the target's exact distribution: chi-square against p itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from streamsd.sample import rng
from streamsd.sample.rejection import VerifyInput, rejection_sample
from streamsd.sample.warp import WarpParams, warp

V = 12
N = 40000
K = 2


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against probs, pooling cells with tiny expectations."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "a token the target forbids was emitted"
    exp = exp[keep] * (obs[keep].sum() / exp[keep].sum())  # float32 probs: renormalise the rounding away
    return float(chisquare(obs[keep].numpy(), exp.numpy()).pvalue)


def _case(temperature: float, top_k: int, top_p: float, min_p: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, V, generator=g) * 2  # [K+1, V]
    draft_logits = target_logits[:K] + torch.randn(K, V, generator=g) * 1.5  # [K, V]
    wp = WarpParams.build([(temperature, top_k, top_p, min_p)] * (K + 1), torch.device("cpu"))
    p = warp(target_logits, wp)  # [K+1, V]
    q = warp(draft_logits, WarpParams.build([(temperature, top_k, top_p, min_p)] * K, torch.device("cpu")))
    return p, q


def _run(p: torch.Tensor, q: torch.Tensor, dense: bool, seed0: int):
    seeds = torch.arange(seed0, seed0 + N, dtype=torch.int64)  # [N]
    # Drafts drawn from q (dense) or fixed to the draft's argmax (one-hot, like greedy drafts).
    if dense:
        noise = rng.exponentials(seeds, torch.zeros(N, K, dtype=torch.int64) + torch.arange(K), rng.DRAFT, V)
        drafts = (q.unsqueeze(0) / noise).argmax(-1)  # [N, K]
    else:
        drafts = q.argmax(-1).expand(N, K)
    positions = torch.arange(K + 1).expand(N, K + 1)
    tokens, accepted = rejection_sample(VerifyInput(
        target_probs=p.expand(N, K + 1, V),
        target_argmax=p.argmax(-1).expand(N, K + 1),
        draft_ids=drafts,
        draft_probs=q.expand(N, K, V) if dense else None,
        dense_q=torch.full((N,), dense),
        num_drafts=torch.full((N,), K),
        greedy=torch.zeros(N, dtype=torch.bool),
        uniforms=rng.uniforms(seeds, positions[:, :K], rng.ACCEPT),
        noise=rng.exponentials(seeds, positions, rng.TARGET, V),
    ))
    return tokens, accepted


@pytest.mark.parametrize("dense", [True, False], ids=["dense-q", "one-hot-q"])
@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(0.5, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.5, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.2, 0, 0.8, 0.0),
     (0.8, 0, 1.0, 0.1), (1.5, 6, 0.9, 0.05)],
)
def test_emitted_tokens_follow_the_target_distribution(dense, temperature, top_k, top_p, min_p):
    p, q = _case(temperature, top_k, top_p, min_p, seed=int(temperature * 10) + top_k)
    tokens, accepted = _run(p, q, dense, seed0=1000 * top_k + 7)
    # Position 0 is always emitted; position 1 whenever draft 0 was accepted. In this setup the
    # target's distribution at each position does not depend on the prefix, so each is checked
    # against p at that position.
    first = torch.bincount(tokens[:, 0], minlength=V)
    assert chi_square_p(first, p[0]) > 1e-3
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=V)
    assert chi_square_p(second, p[1]) > 1e-3
    # Acceptance is neither trivial nor total, so both branches were exercised.
    rate = (accepted >= 1).float().mean().item()
    assert 0.02 < rate < 0.999


def test_acceptance_rate_matches_theory_for_dense_q():
    p, q = _case(1.0, 0, 1.0, 0.0, seed=3)
    _, accepted = _run(p, q, True, seed0=11)
    expected = torch.minimum(p[0], q[0]).sum().item()  # P(accept) = sum min(p, q)
    assert abs((accepted >= 1).float().mean().item() - expected) < 0.01


def test_greedy_rows_accept_only_argmax_and_emit_argmax():
    p = torch.softmax(torch.randn(3, V), -1)
    argmax = p.argmax(-1)  # [3]
    drafts = torch.stack([argmax[:2], torch.tensor([argmax[0], (argmax[1] + 1) % V])])  # [2, 2]
    tokens, accepted = rejection_sample(VerifyInput(
        target_probs=None, target_argmax=argmax.expand(2, 3), draft_ids=drafts, draft_probs=None,
        dense_q=torch.zeros(2, dtype=torch.bool), num_drafts=torch.tensor([2, 2]), greedy=torch.ones(2, dtype=torch.bool),
        uniforms=torch.rand(2, 2), noise=None,
    ))
    assert accepted.tolist() == [2, 1]
    assert tokens[0].tolist() == argmax.tolist()
    assert tokens[1].tolist() == [argmax[0].item(), argmax[1].item(), -1]


def test_rows_with_fewer_drafts_take_the_bonus_from_p_at_their_own_end():
    p, q = _case(1.0, 0, 1.0, 0.0, seed=5)
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64)
    positions = torch.arange(K + 1).expand(n, K + 1)
    tokens, accepted = rejection_sample(VerifyInput(
        target_probs=p.expand(n, K + 1, V), target_argmax=p.argmax(-1).expand(n, K + 1),
        draft_ids=torch.zeros(n, K, dtype=torch.int64), draft_probs=None, dense_q=torch.zeros(n, dtype=torch.bool),
        num_drafts=torch.zeros(n, dtype=torch.int64), greedy=torch.zeros(n, dtype=torch.bool),
        uniforms=rng.uniforms(seeds, positions[:, :K], rng.ACCEPT), noise=rng.exponentials(seeds, positions, rng.TARGET, V),
    ))
    assert (accepted == 0).all() and (tokens[:, 1:] == -1).all()
    assert chi_square_p(torch.bincount(tokens[:, 0], minlength=V), p[0]) > 1e-3


def test_counter_rng_is_uniform_and_keyed():
    seeds = torch.arange(50000, dtype=torch.int64)
    u = rng.uniforms(seeds, torch.zeros(50000, 1, dtype=torch.int64), rng.ACCEPT)[:, 0]
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chi_square_p(counts.long(), torch.full((20,), 0.05)) > 1e-3
    same = rng.uniforms(seeds[:5], torch.zeros(5, 1, dtype=torch.int64), rng.ACCEPT)[:, 0]
    assert torch.equal(same, u[:5])  # a row's numbers do not depend on the rest of the batch
    other = rng.uniforms(seeds[:5], torch.ones(5, 1, dtype=torch.int64), rng.ACCEPT)[:, 0]
    assert not torch.equal(same, other)


def test_plain_sampling_draws_the_token_a_zero_draft_verify_would():
    """The worker's k = 0 step skips the rejection sampler; a seeded request must not notice."""
    from streamsd.sample.sampler import sample_rows

    b, vocab = 64, 50
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(b, 1, vocab, generator=g) * 3  # [B, 1, V]
    greedy = torch.arange(b) % 4 == 0  # [B]
    wp = WarpParams.build([(0.8, 0, 0.95, 0.0)] * b, torch.device("cpu"))
    probs = warp(logits.view(b, vocab), wp)  # [B, V]
    seeds = torch.arange(b, dtype=torch.int64) * 7919 + 1  # [B]
    positions = torch.full((b, 1), 17, dtype=torch.int64)  # [B, 1]
    noise = rng.exponentials(seeds, positions, rng.TARGET, vocab)  # [B, 1, V]
    tokens, accepted = rejection_sample(VerifyInput(
        target_probs=probs.view(b, 1, vocab), target_argmax=logits.argmax(-1),
        draft_ids=torch.zeros(b, 0, dtype=torch.int64), draft_probs=None, dense_q=torch.zeros(b, dtype=torch.bool),
        num_drafts=torch.zeros(b, dtype=torch.int64), greedy=greedy, uniforms=torch.zeros(b, 0), noise=noise))
    plain = sample_rows(probs, logits[:, 0], greedy, noise[:, 0])  # [B]
    assert (accepted == 0).all()
    assert torch.equal(tokens[:, 0], plain)
    assert len(set(plain[~greedy].tolist())) > 3  # the sampled rows really sampled


@pytest.mark.parametrize("seed", range(4))
def test_greedy_verify_of_a_packed_step_equals_the_rejection_sampler(seed):
    """sample/greedy.py (captured in verify graphs) against the reference's greedy rows: ragged
    draft counts packed from the front, a graph wider than the longest query, padding sequences."""
    from streamsd.sample.greedy import greedy_verify

    g = torch.Generator().manual_seed(seed)
    vocab = 7  # few ids: drafts often agree with the argmax, ties in the logits are common
    for _ in range(50):
        counts = torch.randint(1, 6, (4,), generator=g).tolist()
        width, bucket = max(counts) + int(torch.randint(0, 2, (1,), generator=g)), 6
        logits = torch.randint(-2, 3, (bucket * width, vocab), generator=g).float()  # [T, V]
        argmax = logits.argmax(-1)  # [T]
        starts = [sum(counts[:s]) for s in range(len(counts) + 1)]
        ids = torch.randint(0, vocab, (bucket * width,), generator=g)  # [T]
        for s, c in enumerate(counts):  # most drafts are the target's own next token
            for j in range(1, c):
                if torch.rand(1, generator=g) < 0.7:
                    ids[starts[s] + j] = argmax[starts[s] + j - 1]
        query_starts = torch.tensor(starts + [starts[-1]] * (bucket - len(counts)))  # [S + 1]
        tokens, accepted = greedy_verify(logits, ids, query_starts, bucket, width)
        k, b = width - 1, len(counts)
        rows = torch.tensor([[starts[s] + min(j, c - 1) for j in range(k + 1)] for s, c in enumerate(counts)])
        drafts = torch.tensor([[int(ids[starts[s] + 1 + j]) if j < c - 1 else 0 for j in range(k)]
                               for s, c in enumerate(counts)]).view(b, k)
        want_tokens, want_accepted = rejection_sample(VerifyInput(
            None, argmax[rows], drafts, None, torch.zeros(b, dtype=torch.bool), torch.tensor(counts) - 1,
            torch.ones(b, dtype=torch.bool), torch.zeros(b, k), None))
        assert torch.equal(accepted[:b], want_accepted) and torch.equal(tokens[:b], want_tokens)


@pytest.mark.parametrize("dense", [True, False], ids=["dense-q", "one-hot-q"])
def test_keyed_noise_drawn_at_the_kept_tokens_alone_verifies_as_the_whole_rows(dense):
    """A verify with its noise keyed (seeds and positions, as the engine passes it) emits exactly what
    the same verify with that noise drawn over the whole vocabulary emits: rows cut by top-p race only
    their kept tokens, a greedy row beside them, some drafts rejected."""
    b, k, vocab = 6, 3, 4000
    g = torch.Generator().manual_seed(int(dense))
    rows = [(1.0, 0, 0.9, 0.0)] * 3 + [(0.7, 20, 0.95, 0.0), (0.0, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.05)]
    wp = WarpParams.build([r for r in rows for _ in range(k + 1)], torch.device("cpu"))
    logits = torch.randn(b * (k + 1), vocab, generator=g) * 3.0
    p = warp(logits, wp).view(b, k + 1, vocab)  # [B, K+1, V]
    q = warp(logits[: b * k].view(b, k + 1 - 1, vocab).reshape(-1, vocab) + torch.randn(b * k, vocab, generator=g),
             WarpParams.build([(1.0, 0, 0.9, 0.0)] * (b * k), torch.device("cpu"))).view(b, k, vocab)  # [B, K, V]
    greedy = torch.tensor([t == 0.0 for t, _, _, _ in rows])
    seeds, positions = torch.arange(b) * 7919 + 3, torch.arange(k + 1) + 50 + torch.arange(b).unsqueeze(-1) * 100
    drafts = (q / rng.exponentials(seeds, positions[:, :k], rng.DRAFT, vocab)).argmax(-1)  # [B, K]
    drafts[:3] = p[:3, :k].argmax(-1)  # likely ones: accepted with p(draft)
    base = VerifyInput(target_probs=p, target_argmax=logits.view(b, k + 1, vocab).argmax(-1), draft_ids=drafts,
                       draft_probs=q if dense else None, dense_q=torch.full((b,), dense), num_drafts=torch.full((b,), k),
                       greedy=greedy, uniforms=None, noise=None, seeds=seeds, positions=positions)
    keyed = rejection_sample(base)
    whole = rejection_sample(replace(base, uniforms=rng.uniforms(seeds, positions[:, :k], rng.ACCEPT),
                                     noise=rng.exponentials(seeds, positions, rng.TARGET, vocab)))
    assert torch.equal(keyed[0], whole[0]) and torch.equal(keyed[1], whole[1])
    assert int((p[~greedy] > 0).sum(-1).max()) <= vocab // 4  # the kept tokens alone raced
    assert 0 < int(keyed[1].sum()) < b * k  # some drafts accepted, some rejected

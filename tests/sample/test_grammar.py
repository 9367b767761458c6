"""Grammar masks (sample/grammar.py): each verify row masked by the grammar's state after the drafts
before it, drafts cut at the first forbidden token, and the rejection sampler's output against the
masked target distribution (chi-square), with dense and one-hot q."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from streamsd.model.tokenizer import Tokenizer as ServingTokenizer
from streamsd.request import Constraint, Request, SamplingParams
from streamsd.sample import rng
from streamsd.sample.grammar import Grammars, apply_masks, batch_masks
from streamsd.sample.rejection import VerifyInput, rejection_sample
from streamsd.sample.warp import WarpParams, warp
from streamsd.sched.plan import Scheduled
from tests.sample.test_rejection import chi_square_p

TOKENS = ["<eos>", "a", "b", "c", "d", "x", "y", "z", "0", "1", "2", "3"]
EOS = 0
V = len(TOKENS)
K = 2
# What may follow depends on the token before: after a, b or c three different sets; after d only the end.
PATTERN = "a[bcd]+|b[xyz0]+|c[0-3]+|d"
CONSTRAINT = Constraint("regex", PATTERN, "guided_regex")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    vocab = {t: i for i, t in enumerate(TOKENS)}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<eos>")),
                                 eos_token="<eos>")
    return Grammars(ServingTokenizer(hf.backend_tokenizer, {"eos_token": "<eos>"}, None, None, hf), V)


def _allowed(mask_row) -> set[int]:
    return {t for t in range(V) if int(mask_row[0]) >> t & 1}


def _entry(grammars: Grammars, output: list[int], drafts: list[int], **params) -> Scheduled:
    r = Request("r", [1], SamplingParams(constraint=CONSTRAINT, **params), seed=0, arrival=0.0,
                output_ids=list(output), draft_ids=list(drafts), eos_ids=frozenset({EOS}))
    r.matcher = grammars.matcher(CONSTRAINT, r.eos_ids)
    return Scheduled(r, r.num_tokens - 1, 1, len(drafts), 0)


def test_each_verify_row_is_masked_by_the_grammar_after_the_drafts_before_it(grammars):
    m = grammars.matcher(CONSTRAINT, frozenset({EOS}))
    a, b, c, d, x = (TOKENS.index(t) for t in "abcdx")
    masks = m.masks([], [b, x], 3)
    assert [_allowed(row) for row in masks] == [{a, b, c, d}, {5, 6, 7, 8}, {EOS, 5, 6, 7, 8}]
    assert _allowed(m.masks([], [d], 2)[1]) == {EOS}  # after d the structure is complete: only the end
    # Drafts are rolled back: the same request, asked again from its output, sees the same rows.
    assert _allowed(m.masks([b], [], 1)[0]) == {5, 6, 7, 8}
    assert _allowed(m.masks([b, x], [], 1)[0]) == {EOS, 5, 6, 7, 8}


def test_drafts_are_cut_at_the_first_token_the_grammar_forbids(grammars):
    m = grammars.matcher(CONSTRAINT, frozenset({EOS}))
    a, b, c, x = (TOKENS.index(t) for t in "abcx")
    assert m.allowed([], [a, b, c]) == 3
    assert m.allowed([], [a, x, b]) == 1
    assert m.allowed([], [x, a]) == 0
    assert m.allowed([], [TOKENS.index("d"), EOS, a]) == 2  # nothing after the end
    assert m.allowed([a], [b, EOS]) == 2  # from the output so far, which the matcher caught up with


def test_masks_filled_side_by_side_equal_each_request_alone(grammars):
    """The batch fills row j of every request at once: each request's rows are still its own matcher's
    after its own drafts, whatever the others' (refused mid-way, past the end, a finished structure, a
    stop, none), padding repeats its last row, and every matcher is left at its output."""
    a, b, c, d, x, y, one, two = (TOKENS.index(t) for t in "abcdxy12")
    cases = [([], [b, x, y]), ([], [a, x, b]), ([b], [x]), ([d], []), ([], [d, a]), ([c], [one, two, x]),
             ([d, EOS], []), ([], [])]
    width = 4
    entries = [_entry(grammars, out, drafts) for out, drafts in cases]
    for pick in (list(range(len(cases))), [1, 4, 6]):
        got = batch_masks(entries, pick, width)  # [P, W, words]
        assert got.shape[:2] == (len(pick), width)
        for p, i in enumerate(pick):
            out, drafts = cases[i]
            alone = grammars.matcher(CONSTRAINT, frozenset({EOS})).masks(out, drafts, len(drafts) + 1)
            assert np.array_equal(got[p, : len(drafts) + 1], alone), i
            for j in range(len(drafts) + 1, width):
                assert np.array_equal(got[p, j], alone[-1]), (i, j)
        assert np.array_equal(batch_masks(entries, pick, width), got)  # drafts rolled back: the same again


def test_masked_rows_are_minus_infinity_exactly_where_the_grammar_forbids(grammars):
    b, x = TOKENS.index("b"), TOKENS.index("x")
    e, free = _entry(grammars, [], [b, x]), _entry(grammars, [], [])
    rows = torch.randn(2, K + 1, V)
    out = apply_masks([e, free], rows, [0])
    for j, allowed in enumerate(_allowed(row) for row in e.request.matcher.masks([], [b, x], K + 1)):
        for t in range(V):
            assert (out[0, j, t] == rows[0, j, t]) if t in allowed else out[0, j, t] == float("-inf")
    assert torch.equal(out[1], rows[1])  # entries not picked are untouched


def _case(temperature: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(K + 1, V, generator=g) * 1.5  # [K+1, V] raw logits, the same whatever came before
    draft = target[:K] + torch.randn(K, V, generator=g)  # [K, V]: unmasked, so it proposes forbidden tokens too
    q = warp(draft, WarpParams.build([(temperature, 0, 1.0, 0.0)] * K, torch.device("cpu")))  # [K, V]
    return target, q


@pytest.mark.parametrize("dense", [True, False], ids=["dense-q", "one-hot-q"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emitted_tokens_follow_the_grammar_masked_target_distribution(grammars, dense, temperature):
    """Drafts from an unmasked q, cut at the first forbidden token as the worker cuts them (a dense q's
    forbidden draft kept: its rejection samples the residual); each verify
    row masked by the grammar after the drafts before it: the first token follows the masked p, and the
    second, given the first (an accepted draft), the p masked after that token."""
    n = 12000
    target, q = _case(temperature, seed=int(temperature * 10) + dense)
    one = WarpParams.build([(temperature, 0, 1.0, 0.0)], torch.device("cpu"))
    seeds = torch.arange(n, dtype=torch.int64) + 7 * dense
    if dense:
        noise = rng.exponentials(seeds, torch.arange(K).expand(n, K), rng.DRAFT, V)
        drafts = (q.unsqueeze(0) / noise).argmax(-1)  # [N, K]
    else:  # a greedy drafter's pick; the first one the grammar allows, so that verification happens
        first_ok = max("abcd", key=lambda t: float(q[0, TOKENS.index(t)]))
        drafts = torch.tensor([TOKENS.index(first_ok), int(q[1].argmax())]).expand(n, K)
    matcher = grammars.matcher(CONSTRAINT, frozenset({EOS}))
    cut = {}
    for d in set(map(tuple, drafts.tolist())):
        cut[d] = list(d[: matcher.allowed([], list(d)) + dense])
    entries = [_entry(grammars, [], cut[tuple(d)], temperature=temperature) for d in drafts.tolist()]
    num_drafts = torch.tensor([e.num_drafts for e in entries])
    assert 0 < num_drafts.float().mean() <= K
    rows = apply_masks(entries, target.expand(n, K + 1, V).contiguous(), list(range(n)))  # [N, K+1, V]
    p = warp(rows.view(-1, V), one, reps=n * (K + 1)).view(n, K + 1, V)
    positions = torch.arange(K + 1).expand(n, K + 1)
    tokens, accepted = rejection_sample(VerifyInput(
        target_probs=p, target_argmax=rows.argmax(-1), draft_ids=drafts,
        draft_probs=q.expand(n, K, V) if dense else None, dense_q=torch.full((n,), dense),
        num_drafts=num_drafts, greedy=torch.zeros(n, dtype=torch.bool),
        uniforms=rng.uniforms(seeds, positions[:, :K], rng.ACCEPT), noise=rng.exponentials(seeds, positions, rng.TARGET, V),
    ))

    def p_after(output: list[int]) -> torch.Tensor:
        """The masked, warped target at the position after `output` (row len(output)'s logits)."""
        mask = grammars.matcher(CONSTRAINT, frozenset({EOS})).masks(output, [], 1)
        x = target[len(output)].masked_fill(torch.tensor([t not in _allowed(mask[0]) for t in range(V)]),
                                            float("-inf"))
        return warp(x.view(1, V), one)[0]

    first = p_after([])
    assert chi_square_p(torch.bincount(tokens[:, 0], minlength=V), first) > 1e-3
    observed, expected = [], []
    second = accepted >= 1
    for a in tokens[second, 0].unique().tolist():
        rows_a = second & (tokens[:, 0] == a)
        observed.append(torch.bincount(tokens[rows_a, 1], minlength=V))
        expected.append(p_after([a]) * rows_a.sum())
    obs, exp = torch.cat(observed), torch.cat(expected)
    assert chi_square_p(obs, exp / exp.sum()) > 1e-3
    assert 0.02 < second.float().mean().item() < 0.999
    # The setting is one these checks tell apart: the mask moves p, and the first token moves the second's.
    assert (first - warp(target[:1], one)[0]).abs().sum() > 0.1
    assert (p_after([TOKENS.index("a")]) - p_after([TOKENS.index("b")])).abs().sum() > 0.5

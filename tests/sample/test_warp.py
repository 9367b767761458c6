"""sample/warp.py's cut: top-k and top-p are thresholds on the probabilities, so equal ones are kept or
cut together, whatever order a sort leaves them in."""

from __future__ import annotations

import pytest
import torch

from streamsd.sample.warp import WarpParams, warp

PROBS = [0.4, 0.2, 0.2, 0.1, 0.1]


@pytest.mark.parametrize(("top_k", "top_p", "kept"), [
    (0, 1.0, [0, 1, 2, 3, 4]),
    (1, 1.0, [0]),
    (2, 1.0, [0, 1, 2]),  # one token likelier than each 0.2: both kept, three in all
    (3, 1.0, [0, 1, 2]),
    (4, 1.0, [0, 1, 2, 3, 4]),  # three likelier than each 0.1
    (10, 1.0, [0, 1, 2, 3, 4]),  # more than the vocabulary
    (0, 0.5, [0, 1, 2]),  # 0.4 likelier than each 0.2: under 0.5, both kept
    (0, 0.35, [0]),
    (0, 0.9, [0, 1, 2, 3, 4]),  # 0.8 likelier than each 0.1
    (2, 0.6, [0, 1, 2]),  # top-p of the top-k mass 0.8: 0.4 likelier than each 0.2, under 0.48
    (2, 0.45, [0]),  # not under 0.36
])
def test_top_k_and_top_p_keep_or_cut_equal_probabilities_together(top_k, top_p, kept):
    logits = torch.tensor(PROBS).log().repeat(2, 1)  # [2, V]; the second row reversed: the sort's order differs
    logits[1] = logits[1].flip(0)
    probs = warp(logits, WarpParams.build([(1.0, top_k, top_p, 0.0)] * 2, torch.device("cpu")))  # [2, V]
    assert (probs[0] > 0).nonzero().view(-1).tolist() == kept
    assert (probs[1].flip(0) > 0).nonzero().view(-1).tolist() == kept
    want = torch.zeros(len(PROBS))
    want[kept] = torch.tensor(PROBS)[kept] / sum(PROBS[i] for i in kept)
    assert torch.allclose(probs[0], want, atol=1e-6)


def _cut_by_definition(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The cut straight from its definition, token by token: [V] bool, kept."""
    likelier = probs.unsqueeze(0) > probs.unsqueeze(1)  # [V, V]: row i, the tokens likelier than i
    count, above = likelier.sum(-1), (likelier * probs.unsqueeze(0)).sum(-1)  # [V], [V]
    in_k = count < top_k if top_k > 0 else torch.ones_like(count, dtype=torch.bool)
    mass_k = probs[in_k].sum()
    return in_k & ((top_p >= 1.0) | (above < top_p * mass_k) | (count == 0))


@pytest.mark.parametrize("vocab", [300, 6000])
def test_the_cut_found_among_the_likeliest_tokens_is_the_whole_rows(vocab):
    """Rows whose cut falls among their 256 likeliest tokens, among 4096, or only in the whole row
    (flat rows at a high temperature, top-p 0.99), with ties (logits on a grid) and top-k alone, top-p
    alone and both: the tokens kept are those the definition keeps."""
    g = torch.Generator().manual_seed(vocab)
    cases = [(t, k, p) for t in (0.3, 1.0, 4.0) for k, p in ((0, 0.9), (0, 0.99), (40, 1.0), (1, 1.0), (300, 0.8),
                                                            (200, 0.95))]
    logits = torch.randn(len(cases), vocab, generator=g) * 3.0
    logits[1::2] = (logits[1::2] * 2.0).round() / 2.0  # [N, V] many equal logits
    wp = WarpParams.build([(t, k, p, 0.0) for t, k, p in cases], torch.device("cpu"))
    probs = warp(logits, wp)  # [N, V]
    for row, (t, k, p) in enumerate(cases):
        q = torch.softmax(logits[row] / t, dim=-1)
        want = _cut_by_definition(q, k, p)
        assert torch.equal(probs[row] > 0, want), (t, k, p, int((probs[row] > 0).sum()), int(want.sum()))

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

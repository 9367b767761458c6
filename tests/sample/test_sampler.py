"""sample/sampler.py on a CPU: a cut row races only the tokens its cut keeps, and draws what the race
over its whole row draws."""

from __future__ import annotations

import torch

from streamsd.sample import rng
from streamsd.sample.sampler import sample_keyed, sample_rows
from streamsd.sample.warp import WarpParams, warp


def test_the_noise_at_some_ids_is_the_whole_rows_there():
    seeds, positions = torch.tensor([3, -(2**40), 2**45]), torch.tensor([0, 17, 4095])
    ids = torch.tensor([[0, 5, 999], [1, 2, 3], [998, 7, 500]])
    whole = rng.exponentials(seeds, positions.unsqueeze(-1), rng.TARGET, 1000)[:, 0]  # [3, 1000]
    assert torch.equal(rng.exponentials_at(seeds, positions, rng.TARGET, ids), whole.gather(-1, ids))


def test_a_cut_row_races_its_kept_tokens_and_draws_the_whole_rows_winner():
    """Rows cut by top-p, top-k and both (their kept tokens a small share of the vocabulary, so only
    theirs are raced), with ties on a grid of logits and a greedy row among them: the same tokens as
    the race over every token with the whole row's noise, over many positions."""
    n, vocab = 6, 4000
    rows = [(1.0, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 20, 0.8, 0.05), (0.0, 0, 0.9, 0.0), (2.0, 0, 0.3, 0.0),
            (0.5, 3, 0.95, 0.0)]
    wp = WarpParams.build(rows, torch.device("cpu"))
    greedy = torch.tensor([t == 0.0 for t, _, _, _ in rows])
    g = torch.Generator().manual_seed(0)
    raced_few = False
    for draw in range(12):
        logits = torch.randn(n, vocab, generator=g) * 3.0
        if draw % 2:
            logits = (logits * 2.0).round() / 2.0  # [N, V] many equal logits
        ints = torch.stack([greedy.long(), torch.randint(0, 2**40, (n,), generator=g), torch.full((n,), 10 + draw)])
        probs = warp(logits, wp)
        raced_few |= int((probs[~greedy] > 0).sum(-1).max()) <= vocab // 4
        noise = rng.exponentials(ints[1], ints[2].unsqueeze(-1), rng.TARGET, vocab)[:, 0]  # [N, V]
        assert torch.equal(sample_keyed(logits, wp, ints), sample_rows(probs, logits, greedy, noise)), draw
    assert raced_few

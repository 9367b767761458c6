"""Sampling one token per row from warped probabilities without a host synchronisation."""

from __future__ import annotations

import torch

from streamsd.sample import rng
from streamsd.sample.greedy import row_argmax
from streamsd.sample.warp import WarpParams, warp


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E), E ~ Exp(1), draws from p. [N, V], [N, V] -> [N]."""
    return row_argmax(probs / noise)


def sample_rows(probs: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Greedy rows take the raw argmax, others race. probs/logits/noise [N, V], greedy [N] -> [N]."""
    return torch.where(greedy, row_argmax(logits), race(probs, noise))


def sample_keyed(logits: torch.Tensor, wp: WarpParams, ints: torch.Tensor) -> torch.Tensor:
    """One token per row of logits [N, V] with early stops suppressed: the raw argmax for greedy rows,
    else the race of the warped probabilities against the noise keyed (seed, position, TARGET), which
    is what the rejection sampler races for a bonus token there. ints [3, N]: greedy | seed | position.
    On CUDA one launch, rows cut by top-k/top-p included (kernels/sample/warp.py); elsewhere rows cut to
    a small share of the vocabulary race their kept tokens alone (`_race_kept`) -> [N]."""
    if logits.is_cuda:
        from streamsd.kernels.sample import warp as kernel

        return kernel.sample_keyed(logits, ints.reshape(-1), wp.temperature, wp.min_p, wp.top_k, wp.top_p,
                                   rng.TARGET)
    probs, greedy = warp(logits, wp), ints[0].bool()  # [N, V], [N]
    if wp.needs_sort:
        kept = int((probs[~greedy] > 0).sum(dim=-1).max()) if not bool(greedy.all()) else 0
        if 0 < kept <= probs.shape[-1] // 4:
            return torch.where(greedy, row_argmax(logits), _race_kept(probs, ints, kept))
    noise = rng.exponentials(ints[1], ints[2].unsqueeze(-1), rng.TARGET, logits.shape[-1])[:, 0]  # [N, V]
    return sample_rows(probs, logits, greedy, noise)


def _race_kept(probs: torch.Tensor, ints: torch.Tensor, kept: int) -> torch.Tensor:
    """The race of each row's `kept` likeliest tokens: every token a row's cut keeps (a threshold on p),
    and tokens of p 0 past them. Only their noise is drawn (on a CPU the noise over 32 rows of 49152
    took longer than the rest of sampling). The same winner as over the whole row, ties to the lowest
    id. probs [N, V] -> [N]."""
    values, ids = probs.topk(kept, dim=-1)  # [N, K]
    ids, order = ids.sort(dim=-1)  # ascending, as the whole row's argmax meets them
    noise = rng.exponentials_at(ints[1], ints[2], rng.TARGET, ids)  # [N, K]
    return ids.gather(-1, row_argmax(values.gather(-1, order) / noise).unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the raw model distribution, as OpenAI reports them.

    logits [N, V], tokens [N] -> chosen [N], top values [N, top_n], top ids [N, top_n].
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logp.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [N]
    top_vals, top_ids = logp.topk(max(top_n, 1), dim=-1)  # [N, top_n]
    return chosen, top_vals[:, :top_n], top_ids[:, :top_n]

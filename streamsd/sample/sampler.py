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
    a small share of the vocabulary race their kept tokens alone (`race_kept`) -> [N]."""
    if logits.is_cuda:
        from streamsd.kernels.sample import warp as kernel

        return kernel.sample_keyed(logits, ints.reshape(-1), wp.temperature, wp.min_p, wp.top_k, wp.top_p,
                                   rng.TARGET)
    probs, greedy = warp(logits, wp), ints[0].bool()  # [N, V], [N]
    raced = race_kept(probs, greedy, ints[1], ints[2]) if wp.needs_sort else None
    if raced is not None:
        return torch.where(greedy, row_argmax(logits), raced)
    noise = rng.exponentials(ints[1], ints[2].unsqueeze(-1), rng.TARGET, logits.shape[-1])[:, 0]  # [N, V]
    return sample_rows(probs, logits, greedy, noise)


def race_kept(weights: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor | None:
    """argmax(w / E) per row, E the noise keyed (seed, position, TARGET), raced over the tokens of
    positive weight alone, noise drawn at them only: the whole row's winner, ties to the lowest id (ids
    raced ascending). On a CPU the noise over 32 rows of 49152 took longer than the rest of sampling,
    and a top-p cut keeps few tokens. None where a sampled row (`greedy` rows are not read) weighs more
    than a quarter of the vocabulary: race the whole rows then. None on CUDA too: there the keyed noise
    of whole rows is one kernel, and counting the kept tokens would wait for the device.
    weights [R, V], greedy, seeds and positions [R] -> [R]."""
    if weights.is_cuda:
        return None
    vocab = weights.shape[-1]
    kept = int((weights > 0).sum(dim=-1).masked_fill(greedy, 0).max()) if weights.shape[0] else 0
    if not 0 < kept <= vocab // 4:
        return None
    values, ids = weights.topk(kept, dim=-1)  # [R, C]
    ids, order = ids.sort(dim=-1)  # ascending, as the whole row's argmax meets them
    noise = rng.exponentials_at(seeds, positions, rng.TARGET, ids)  # [R, C]
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

"""Lossless verification of drafts: the torch reference rejection sampler.

Per row, either greedy (accept while the draft equals the target's argmax) or random: accept
draft j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from
norm(max(p_j - q_j, 0)); if every draft is accepted sample a bonus token from p at position k.
q is the draft's warped distribution (dense) or one-hot on the draft token (greedy drafts,
n-gram lookup), mixed per row. Sampling from a distribution is an exponential race,
argmax(w / E) with E ~ Exp(1), which needs no normalisation and no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from streamsd.sample import rng
from streamsd.sample.sampler import race_kept


@dataclass(frozen=True, slots=True)
class VerifyInput:
    target_probs: torch.Tensor | None  # [B, K+1, V] warped p at each verified position; None: all greedy
    target_argmax: torch.Tensor  # [B, K+1] argmax of the raw target logits
    draft_ids: torch.Tensor  # [B, K] int64 (padding beyond num_drafts is ignored)
    draft_probs: torch.Tensor | None  # [B, K, V] dense q; rows with dense_q False ignore it
    dense_q: torch.Tensor  # [B] bool
    num_drafts: torch.Tensor  # [B] int64, 0..K
    greedy: torch.Tensor  # [B] bool
    uniforms: torch.Tensor | None  # [B, K] U(0,1) for the accept tests
    noise: torch.Tensor | None  # [B, K+1, V] Exp(1) for recovered and bonus tokens; None: all greedy
    # Or neither: the keys they come from (rng.py: ACCEPT at positions [:, :K], TARGET at all K+1).
    seeds: torch.Tensor | None = None  # [B] int64
    positions: torch.Tensor | None = None  # [B, K+1] int64, each row's verified positions


def rejection_sample(v: VerifyInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K+1] with -1 after the last emitted one, num_accepted [B])."""
    batch, k1 = v.target_argmax.shape
    k = k1 - 1
    keyed = v.noise is None and v.seeds is not None and v.positions is not None  # `_race` draws the noise
    if keyed and v.target_probs is not None:
        assert v.seeds is not None and v.positions is not None
        v = replace(v, uniforms=rng.uniforms(v.seeds, v.positions[:, :k], rng.ACCEPT))
    pos = torch.arange(k1, device=v.draft_ids.device)  # [K+1]
    live = pos[:k].unsqueeze(0) < v.num_drafts.unsqueeze(-1)  # [B, K]
    draft = v.draft_ids.clamp(min=0)  # [B, K]
    ok = draft == v.target_argmax[:, :k]  # [B, K] greedy rows: accept while the argmax agrees
    corrected = v.target_argmax  # [B, K+1]
    if v.target_probs is not None and v.uniforms is not None and (keyed or v.noise is not None):
        random_ok, sampled = _random_rows(v, draft, live)
        ok = torch.where(v.greedy.unsqueeze(-1), ok, random_ok)
        corrected = torch.where(v.greedy.unsqueeze(-1), v.target_argmax, sampled)
    ok = ok & live
    num_accepted = ok.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]

    drafts_padded = torch.nn.functional.pad(v.draft_ids, (0, 1))  # [B, K+1]
    n = num_accepted.unsqueeze(-1)  # [B, 1]
    tokens = torch.where(pos < n, drafts_padded, torch.where(pos == n, corrected, torch.full_like(corrected, -1)))
    return tokens, num_accepted


def _random_rows(v: VerifyInput, draft: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept tests [B, K] and recovered/bonus samples [B, K+1] for sampled rows."""
    assert v.target_probs is not None and v.uniforms is not None
    p = v.target_probs  # [B, K+1, V]
    batch, k1, vocab = p.shape
    p_d = p[:, : k1 - 1].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    q = torch.nn.functional.one_hot(draft, vocab).to(p.dtype)  # [B, K, V]
    if v.draft_probs is not None:
        q = torch.where(v.dense_q.view(batch, 1, 1), v.draft_probs.to(p.dtype), q)
    q_d = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    accept = v.uniforms * q_d <= p_d  # [B, K]: u < p/q without dividing by q
    # Residual at each position: q counts only where a live draft was tested; past the last draft
    # (the bonus position) it is p itself.
    q_full = torch.nn.functional.pad(q * live.unsqueeze(-1), (0, 0, 0, 1))  # [B, K+1, V]
    residual = (p - q_full).clamp(min=0)  # [B, K+1, V]
    # p == q exactly leaves no residual mass; rejection then has probability 0, but keep the race
    # well defined by falling back to p.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) <= 0, p, residual)
    return accept, _race(v, residual)


def _race(v: VerifyInput, weights: torch.Tensor) -> torch.Tensor:
    """argmax(w / E) per row of weights [B, K+1, V], E the given noise or the keyed one, keyed over the
    tokens of positive weight alone where they are few (`sampler.race_kept`)."""
    if v.noise is not None:
        return (weights / v.noise).argmax(dim=-1)
    assert v.seeds is not None and v.positions is not None
    batch, k1, vocab = weights.shape
    raced = race_kept(weights.view(batch * k1, vocab), v.greedy.repeat_interleave(k1),
                      v.seeds.repeat_interleave(k1), v.positions.reshape(-1))
    if raced is not None:
        return raced.view(batch, k1)
    return (weights / rng.exponentials(v.seeds, v.positions, rng.TARGET, vocab)).argmax(dim=-1)

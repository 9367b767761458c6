"""The data a draft tree's steps share between the torch reference and the Triton kernels.

A tree's parent codes (`ROOT`, `NONE`), a growth's frontier and scored candidates
(spec_decode/eagle/tree.py grows them), and the inputs of the target's race that rank a sampled
request's children. Kept below spec_decode/ so that the kernels (kernels/tree/, kernels/sample/)
take the same objects as the torch functions they replace without importing a proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = -1  # parent of a node that hangs off the pending token
NONE = -2  # padding: a node that is no part of the tree (never accepted, sees only itself)


@dataclass(slots=True)
class Race:
    """What the target's race needs of B requests; their children are ranked by it (greedy ones: by q)."""

    greedy: torch.Tensor  # [B] int64 1: rank by the head's log-probabilities
    seeds: torch.Tensor  # [B] int64
    temperature: torch.Tensor  # [B] float32, > 0 where not greedy


@dataclass(slots=True)
class Candidates:
    """Every candidate a growth scored, level after level: [B, total] each."""

    scores: torch.Tensor  # float32 path log-probability
    tokens: torch.Tensor  # int64
    parents: torch.Tensor  # int64 the parent's candidate index, or ROOT

    @staticmethod
    def empty(b: int, total: int, device: torch.device) -> Candidates:
        return Candidates(torch.empty(b, total, device=device), torch.empty(b, total, dtype=torch.int64, device=device),
                          torch.empty(b, total, dtype=torch.int64, device=device))


@dataclass(slots=True)
class Frontier:
    """The nodes one level expands, M per request (the root alone before level 1)."""

    tokens: torch.Tensor  # [B, M] int64
    scores: torch.Tensor  # [B, M] float32 path log-probability
    index: torch.Tensor  # [B, M] int64 candidate index (ROOT: the root)
    rows: torch.Tensor  # [B * M] int64 the row of the last head output that is each one's parent's
    bits: torch.Tensor  # [B, M] int64 window slots of each one's ancestors and its own
    positions: torch.Tensor  # [B * M] int64 RoPE position
    slots: torch.Tensor  # [B * M] int64 KV slot of its window position
    context_lens: torch.Tensor  # [B] int32 what the level's attention sees: context and window so far

    @staticmethod
    def empty(b: int, m: int, device: torch.device) -> Frontier:
        def longs(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.int64, device=device)

        return Frontier(longs(b, m), torch.empty(b, m, device=device), longs(b, m), longs(b * m), longs(b, m),
                        longs(b * m), longs(b * m), torch.empty(b, dtype=torch.int32, device=device))

    @staticmethod
    def root(b: int, device: torch.device) -> Frontier:
        fr = Frontier.empty(b, 1, device)
        fr.scores.zero_()
        fr.index.fill_(ROOT)
        fr.bits.zero_()
        return fr

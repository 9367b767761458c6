"""Counter-based random numbers keyed by (request seed, token position, purpose).

Every random number a request consumes is a pure function of its seed and the absolute position
of the token it decides, so a seeded request produces the same output alone, in a batch of 64,
or after preemption — with no per-request generator objects, no Python loop over the batch and
no host synchronisation. Losslessness holds because the token at position m is decided only by
numbers keyed at positions <= m; numbers keyed at later positions stay independent of it.

The mixer is a 32-bit integer hash evaluated in int64 with multipliers below 2**31, so no
product can overflow and CPU and CUDA give bit-identical results.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x5BD1E995
_GOLDEN = 0x61C88647  # 2**32 / phi, below 2**31

ACCEPT = 1
TARGET = 2
DRAFT = 3


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One 32-bit key per (seed, position). seeds: [B] int64; positions: [B, P] int64 -> [B, P]."""
    lo = (seeds & _MASK32).unsqueeze(-1)  # [B, 1]
    hi = (seeds >> 32).unsqueeze(-1)  # [B, 1]
    h = _mix(lo ^ _mix(hi + stream * _GOLDEN))
    return _mix(h ^ _mix(positions + 0x9E37))  # [B, P]


def _to_unit(h: torch.Tensor) -> torch.Tensor:
    # 24 random bits, centred in their cell: uniform on (0, 1), never 0 or 1.
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """U(0,1) per (seed, position): [B], [B, P] -> [B, P] float32."""
    return _to_unit(_mix(row_keys(seeds, positions, stream) ^ 0x5F356495))


def exponentials(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise over the vocabulary per (seed, position): [B], [B, P] -> [B, P, V] float32."""
    keys = row_keys(seeds, positions, stream).unsqueeze(-1)  # [B, P, 1]
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)  # [V]
    h = _mix(keys ^ ((idx * _GOLDEN) & _MASK32))  # [B, P, V]
    return -torch.log(_to_unit(h))

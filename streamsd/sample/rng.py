"""Counter-based random numbers keyed by (request seed, token position, purpose).

Every random number a request consumes is a pure function of its seed and the absolute position
of the token it decides, so a seeded request produces the same output alone, in a batch of 64,
or after preemption — with no per-request generator objects, no Python loop over the batch and
no host synchronisation. Losslessness holds because the token at position m is decided only by
numbers keyed at positions <= m; numbers keyed at later positions stay independent of it.

The mixer is Chris Wellons' lowbias32 integer hash, evaluated in int64 with each 32-bit product
split into 16-bit halves so nothing can overflow: CPU and CUDA give bit-identical results.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x61C88647  # 2**32 / phi, below 2**31

ACCEPT = 1
TARGET = 2
DRAFT = 3


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for x < 2**32, with no intermediate above 2**48."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """One 32-bit key per (seed, position). seeds: [B] int64; positions: [B, P] int64 -> [B, P]."""
    lo = (seeds & _MASK32).unsqueeze(-1)  # [B, 1]
    hi = (seeds >> 32).unsqueeze(-1)  # [B, 1]
    h = _mix(lo ^ _mix(hi + stream * _GOLDEN))
    return _mix(h ^ _mix(positions + 0x9E37))  # [B, P]


def _to_unit(h: torch.Tensor) -> torch.Tensor:
    # 23 random bits, centred in their cell: uniform on (0, 1), never 0 or 1 — with 24 bits the
    # top cell's centre rounds to 1.0 in float32, and -log(1) = 0 turns the race into NaN.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """U(0,1) per (seed, position): [B], [B, P] -> [B, P] float32."""
    if positions.is_cuda:  # the same bits in one launch (kernels/sample/rng.py), not ~50
        from streamsd.kernels.sample import rng as kernel

        return kernel.uniforms(seeds, positions, stream)
    return _to_unit(_mix(row_keys(seeds, positions, stream) ^ 0x5F356495))


def exponentials(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise over the vocabulary per (seed, position): [B], [B, P] -> [B, P, V] float32."""
    if positions.is_cuda:  # the same bits in one launch (kernels/sample/rng.py), not ~70
        from streamsd.kernels.sample import rng as kernel

        return kernel.exponentials(seeds, positions, stream, vocab)
    keys = row_keys(seeds, positions, stream).unsqueeze(-1)  # [B, P, 1]
    return _noise(keys, torch.arange(vocab, device=seeds.device, dtype=torch.int64))  # [B, P, V]


def exponentials_at(seeds: torch.Tensor, positions: torch.Tensor, stream: int, ids: torch.Tensor) -> torch.Tensor:
    """`exponentials`' numbers at some ids of the vocabulary only: seeds and positions [B], ids [B, C]
    int64 -> [B, C] float32, each the number `exponentials` gives that id at that (seed, position)."""
    return _noise(row_keys(seeds, positions.unsqueeze(-1), stream), ids)  # keys [B, 1]


def _noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) per (key, id), broadcast: what the CUDA kernel's bits give."""
    return -torch.log(_to_unit(_mix(keys ^ ((ids * _GOLDEN) & _MASK32))))

"""The keyed random numbers of sample/rng.py in one Triton launch each, bit for bit.

In torch the lowbias32 hash is ~16 element-wise ops (32-bit products split into 16-bit halves so
int64 never overflows), and Exp(1) noise over the vocabulary mixes three hashes per row and one
per element: ~70 launches, each a few microseconds of GPU and ~10 us of host time eagerly. A sampled
verify step drew its noise and acceptance uniforms that way, and a sampled EAGLE draft chain put
~70 graph nodes per draft. Here the hash runs in native uint32 arithmetic (products wrap mod 2**32,
shifts are logical), which is the same function, so the bits equal the torch oracle's.

`uniforms` and `exponentials` here and in sample/rng.py: tests/kernels/test_sample_kernels.py
`test_rng_kernels_give_the_torch_oracles_bits` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix(x):
    """lowbias32 on uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _u32(x):
    """The low 32 bits of an int64 as uint32."""
    return (x & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _row_key(seed, pos, stream):
    """sample/rng.row_keys for one (seed, position); seed and pos int64."""
    lo = _u32(seed)
    hi = _mix(_u32((seed >> 32) + stream.to(tl.int64) * 0x61C88647))
    h = _mix(lo ^ hi)
    return _mix(h ^ _mix(_u32(pos + 0x9E37)))


@triton.jit
def _to_unit(h):
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


# Seeds and positions arrive as slices of packed buffers, aligned or not by the batch size: one binary
# for every batch, never a compile inside a step (see kernels/warmup.py).
_ANY = dict(do_not_specialize=["num_pos", "vocab", "total", "stream"],
            do_not_specialize_on_alignment=["seed_ptr", "pos_ptr"])


@triton.jit(**_ANY)
def _exponentials_kernel(seed_ptr, pos_ptr, out_ptr, num_pos, vocab, stream, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (request, position) pair
    key = _row_key(tl.load(seed_ptr + row // num_pos), tl.load(pos_ptr + row), stream)
    idx = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    h = _mix(key ^ _u32(idx * 0x61C88647))
    tl.store(out_ptr + row * vocab + idx, -tl.log(_to_unit(h)), mask=idx < vocab)


@triton.jit(**_ANY)
def _uniforms_kernel(seed_ptr, pos_ptr, out_ptr, num_pos, total, stream, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat (request, position)
    m = row < total
    seed = tl.load(seed_ptr + row // num_pos, mask=m, other=0)
    key = _row_key(seed, tl.load(pos_ptr + row, mask=m, other=0), stream)
    tl.store(out_ptr + row, _to_unit(_mix(key ^ tl.full(key.shape, 0x5F356495, tl.uint32))), mask=m)


def exponentials(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise: seeds [B] int64, positions [B, P] int64 -> [B, P, V] float32."""
    b, p = positions.shape
    out = torch.empty(b, p, vocab, dtype=torch.float32, device=positions.device)
    if b * p:
        block = min(4096, triton.next_power_of_2(vocab))
        _exponentials_kernel[(b * p, triton.cdiv(vocab, block))](
            seeds.contiguous(), positions.contiguous(), out, p, vocab, stream, BLOCK=block, num_warps=4)
    return out


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """U(0, 1): seeds [B] int64, positions [B, P] int64 -> [B, P] float32."""
    b, p = positions.shape
    out = torch.empty(b, p, dtype=torch.float32, device=positions.device)
    if b * p:
        _uniforms_kernel[(triton.cdiv(b * p, 128),)](
            seeds.contiguous(), positions.contiguous(), out, p, b * p, stream, BLOCK=128, num_warps=4)
    return out

"""Warping and plain sampling in one Triton launch each (the warp for temperature and min-p, its
top-k/top-p rows keep sample/warp.py's sort; the sampling for every row, a cut one racing over its cut
without a sort: kernels/sample/cut.py).

Eagerly, sample/warp.py is ~10 kernels (scale, softmax, max, min-p cut, renormalise) and a sampled
plain step adds the noise launch and ~5 more for the race and the greedy rows: each a few
microseconds of GPU and 20-40 us of host time, so at T=1 the host's sampling work cost more than a
small model's whole decode step. Here one program walks one row in four passes over the vocabulary:
the max of the scaled logits, the softmax denominator, the mass min-p keeps, then the output.

Both kernels share `_row_stats` and `_prob`, so a plain step's race sees bit for bit the
probabilities a verify's rejection sampler gets from `warp`, and its in-kernel noise is
kernels/sample/rng.py's: a seeded request samples the same token whichever path a step takes. A row
cut by top-k or top-p draws what sample/warp.py's sort, cut and race draw with that noise.

Inside a CUDA graph (an EAGLE head's sampled draft chain), up to MAX_ROWS rows are cut into chunks
instead (kernels/sample/warp_chunked.py): the same distribution, rounded differently, so the target's own
sampling — always eager, after its graph — never takes that path.

`warp` is sample/warp.py's `warp` for rows without top-k/top-p (given their temperature and min-p),
`sample_keyed` sample/sampler.py's `sample_keyed`; tests/kernels/test_sample_kernels.py
`test_warp_kernel_matches_the_torch_warp` and `test_sample_kernel_races_as_the_rejection_kernel_and_the_torch_path`
compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.sample import warp_chunked
from streamsd.kernels.sample.cut import _q, cut_race, mass_from
from streamsd.kernels.sample.rng import _mix, _row_key, _to_unit, _u32
from streamsd.kernels.sample.warp_chunked import MAX_ROWS, _param

# One program walks a row: at batch 1 its latency is the step's. Wider blocks and more warps keep more
# loads in flight (on an H100, 49152 bf16 logits: 61 us a row against 100 at 2048 and 8 warps).
BLOCK_V, WARPS = 8192, 16
# One binary per logits dtype: rows arrive as views at any offset (see kernels/warmup.py).
_ANY = dict(do_not_specialize=["vocab", "stride", "reps", "n", "stream"],
            do_not_specialize_on_alignment=["x_ptr", "temp_ptr", "min_p_ptr", "ints_ptr", "out_ptr", "top_k_ptr",
                                            "top_p_ptr"])


@triton.jit
def _softmax_stats(x_ptr, vocab, temp, BLOCK: tl.constexpr):
    """(max of the scaled logits, softmax denominator) of one row."""
    offs = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(x_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        run_max = tl.maximum(run_max, tl.math.div_rn(x, temp))
    top = tl.max(run_max, 0)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(x_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        run_sum += tl.exp(tl.math.div_rn(x, temp) - top)
    return top, tl.sum(run_sum, 0)


@triton.jit
def _row_stats(x_ptr, vocab, temp, min_p, BLOCK: tl.constexpr):
    """(max of the scaled logits, softmax denominator, min-p floor, mass above it) of one row."""
    top, total = _softmax_stats(x_ptr, vocab, temp, BLOCK)
    floor = min_p * tl.math.div_rn(1.0, total)  # min-p x the largest probability, exp(0) / total
    return top, total, floor, mass_from(x_ptr, vocab, temp, top, total, floor, BLOCK)


@triton.jit
def _prob(x, temp, top, total, floor, kept):
    """The warped probability of logits x [BLOCK] (float32) given its row's stats."""
    p = _q(x, temp, top, total)
    return tl.math.div_rn(tl.where(p >= floor, p, 0.0), kept)


@triton.jit(**_ANY)
def _warp_kernel(x_ptr, stride, temp_ptr, min_p_ptr, out_ptr, vocab, reps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp, min_p = _param(temp_ptr, min_p_ptr, row // reps)  # `reps` rows share a request's parameters
    x_row = x_ptr + row * stride
    top, total, floor, kept = _row_stats(x_row, vocab, temp, min_p, BLOCK)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        m = idx < vocab
        x = tl.load(x_row + idx, mask=m, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * vocab + idx, _prob(x, temp, top, total, floor, kept), mask=m)


@triton.jit(**_ANY)
def _sample_kernel(x_ptr, stride, ints_ptr, n, temp_ptr, min_p_ptr, top_k_ptr, top_p_ptr, out_ptr, vocab, stream,
                   BLOCK: tl.constexpr):
    """One token per row: the argmax of the raw logits for greedy rows, else the race of the warped
    probabilities against Exp(1) noise keyed by (seed, position, stream): argmax p / E, ties to the
    lowest index (as the rejection kernel's bonus race). A row cut by top-k or top-p races over its
    cut (kernels/sample/cut.py)."""
    row = tl.program_id(0).to(tl.int64)
    greedy = tl.load(ints_ptr + row) != 0
    key = _row_key(tl.load(ints_ptr + n + row), tl.load(ints_ptr + 2 * n + row), stream)
    temp, min_p = _param(temp_ptr, min_p_ptr, row)
    top_k, top_p = tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    x_row = x_ptr + row * stride
    if ((top_k > 0) | (top_p < 1.0)) & (greedy == 0):
        top, total = _softmax_stats(x_row, vocab, temp, BLOCK)
        best_i = cut_race(x_row, vocab, key, temp, top, total, min_p * tl.math.div_rn(1.0, total), top_k, top_p,
                          BLOCK)
    else:
        top, total, floor, kept = _row_stats(x_row, vocab, temp, min_p, BLOCK)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = row * 0
        for v0 in range(0, vocab, BLOCK):
            idx = v0 + tl.arange(0, BLOCK)
            m = idx < vocab
            x = tl.load(x_row + idx, mask=m, other=float("-inf")).to(tl.float32)
            if greedy:
                score = x
            else:
                noise = -tl.log(_to_unit(_mix(key ^ _u32(idx.to(tl.int64) * 0x61C88647))))
                score = tl.where(m, tl.math.div_rn(_prob(x, temp, top, total, floor, kept), noise), float("-inf"))
            # NaN (a graph padding row's garbage) equals nothing and lost to the ids past the vocabulary, whose
            # argmax then named one (the next step's embedding read out of bounds): it ranks as -inf, and a
            # row of nothing else gives id 0
            score = tl.where(score == score, score, float("-inf"))
            c = tl.max(score, 0)
            i = tl.argmax(score, 0) + v0
            best_i = tl.where(c > best, i, best_i)
            best = tl.maximum(c, best)
    tl.store(out_ptr + row, best_i.to(tl.int64))


def warp(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, reps: int = 1) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32; row i uses parameters i // reps (temperature [N / reps],
    0 = greedy, warped at 1; min_p [N / reps])."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, vocab = logits.shape
    if 0 < n <= MAX_ROWS and logits.is_cuda and torch.cuda.is_current_stream_capturing():  # launches free, SMs idle
        return warp_chunked.warp(logits, temperature, min_p, reps)
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n:
        _warp_kernel[(n,)](logits, logits.stride(0), temperature.contiguous(), min_p.contiguous(), out, vocab, reps,
                           BLOCK=BLOCK_V, num_warps=WARPS)
    return out


def sample_keyed(logits: torch.Tensor, ints: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor, stream: int) -> torch.Tensor:
    """logits [N, V], ints [3 * N] int64 (greedy | seed | position), temperature, min_p, top_p [N] float32,
    top_k [N] int64 (0: none) -> tokens [N] int64."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _sample_kernel[(n,)](logits, logits.stride(0), ints, n, temperature.contiguous(), min_p.contiguous(),
                             top_k.contiguous(), top_p.contiguous(), out, vocab, stream, BLOCK=BLOCK_V, num_warps=WARPS)
    return out

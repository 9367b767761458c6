"""Warping and plain sampling in a few Triton launches over the whole chip (temperature and min-p;
top-k/top-p rows keep sampling/warp.py's sort).

Eagerly, sampling/warp.py is ~10 kernels (scale, softmax, max, min-p cut, renormalise) and a sampled
plain step adds the noise launch and ~5 more for the race and the greedy rows: each a few
microseconds of GPU and 20-40 us of host time, so at T=1 the host's sampling work cost more than a
small model's whole decode step.

Each row is cut into chunks of CHUNK ids, one program a chunk, so a row is read in parallel: with
one program walking a row in four passes, a 49152-id row took 63 us to warp and 93 us to sample
(one SM busy, the rest idle) — at batch 1 on the H200 a tenth of a plain step, a sixth of an EAGLE
step at T=1. The launches: each chunk's max and softmax sum (``_chunk_stats_kernel``); each chunk's
mass above the min-p floor, once the row's stats are merged (``_chunk_kept_kernel``); then the
output (``_warp_out_kernel``) or each chunk's race (``_race_chunk_kernel``) and the merge of the
chunks' winners (``_merge_best_kernel``). The chunking depends on the vocabulary only, never on
the batch, so a row's numbers do not depend on what else the step holds.

Both paths merge the row's stats in ``_row_stats`` and warp in ``_prob``, so a plain step's race sees
bit for bit the probabilities a verify's rejection sampler gets from `warp_probs`, and its in-kernel
noise is kernels/rng.py's: a seeded request samples the same token whichever path a step takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.rng import _mix, _row_key, _to_unit, _u32

CHUNK = 2048  # ids per program
# One binary per logits dtype: rows arrive as views at any offset (see kernels/warmup.py).
_ANY = dict(do_not_specialize=["vocab", "stride", "reps", "n", "stream", "n_chunks"],
            do_not_specialize_on_alignment=["x_ptr", "temp_ptr", "min_p_ptr", "ints_ptr", "out_ptr"])


@triton.jit
def _param(temp_ptr, min_p_ptr, i):
    t = tl.load(temp_ptr + i)
    return tl.where(t > 0, t, 1.0), tl.load(min_p_ptr + i)  # greedy rows are warped at temperature 1


@triton.jit
def _chunk_ids(vocab, CHUNK: tl.constexpr):
    idx = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    return idx, idx < vocab


@triton.jit(**_ANY)
def _chunk_stats_kernel(x_ptr, stride, temp_ptr, min_p_ptr, stats_ptr, vocab, reps, n_chunks, CHUNK: tl.constexpr):
    """stats [N, 2, C]: each chunk's max of the scaled logits and its softmax sum below that max."""
    row = tl.program_id(0).to(tl.int64)
    temp, _ = _param(temp_ptr, min_p_ptr, row // reps)  # `reps` rows share a request's parameters
    idx, m = _chunk_ids(vocab, CHUNK)
    s = tl.math.div_rn(tl.load(x_ptr + row * stride + idx, mask=m, other=float("-inf")).to(tl.float32), temp)
    top = tl.max(s, 0)
    total = tl.sum(tl.where(s == float("-inf"), 0.0, tl.exp(s - top)), 0)  # a chunk of -inf sums to 0
    base = stats_ptr + row * 2 * n_chunks + tl.program_id(1)
    tl.store(base, top)
    tl.store(base + n_chunks, total)


@triton.jit
def _row_stats(stats_ptr, kept_ptr, row, n_chunks, min_p, CP: tl.constexpr, WITH_KEPT: tl.constexpr):
    """(max of the scaled logits, softmax denominator, min-p floor, mass above it) of one row, merged
    from its chunks' stats in a fixed order (the mass is 1 without min-p, and needs ``kept_ptr``)."""
    c = tl.arange(0, CP)
    ok = c < n_chunks
    tops = tl.load(stats_ptr + row * 2 * n_chunks + c, mask=ok, other=float("-inf"))
    sums = tl.load(stats_ptr + row * 2 * n_chunks + n_chunks + c, mask=ok, other=0.0)
    top = tl.max(tops, 0)
    total = tl.sum(tl.where(tops == float("-inf"), 0.0, sums * tl.exp(tops - top)), 0)
    floor = min_p * tl.math.div_rn(1.0, total)  # min-p x the largest probability, exp(0) / total
    kept = tl.full([], 1.0, tl.float32)
    if WITH_KEPT:
        kept = tl.where(min_p > 0, tl.sum(tl.load(kept_ptr + row * n_chunks + c, mask=ok, other=0.0), 0), 1.0)
    return top, total, floor, kept


@triton.jit
def _prob(s, top, total, floor, kept):
    """The warped probability of scaled logits s [CHUNK] (float32) given its row's stats."""
    p = tl.math.div_rn(tl.exp(s - top), total)
    return tl.math.div_rn(tl.where(p >= floor, p, 0.0), kept)


@triton.jit(**_ANY)
def _chunk_kept_kernel(x_ptr, stride, temp_ptr, min_p_ptr, stats_ptr, kept_ptr, vocab, reps, n_chunks,
                       CHUNK: tl.constexpr, CP: tl.constexpr):
    """kept [N, C]: each chunk's probability mass at or above the row's min-p floor (rows with min-p)."""
    row = tl.program_id(0).to(tl.int64)
    temp, min_p = _param(temp_ptr, min_p_ptr, row // reps)
    if min_p > 0:
        top, total, floor, _ = _row_stats(stats_ptr, kept_ptr, row, n_chunks, min_p, CP, False)
        idx, m = _chunk_ids(vocab, CHUNK)
        s = tl.math.div_rn(tl.load(x_ptr + row * stride + idx, mask=m, other=float("-inf")).to(tl.float32), temp)
        p = tl.math.div_rn(tl.exp(s - top), total)
        tl.store(kept_ptr + row * n_chunks + tl.program_id(1), tl.sum(tl.where(p >= floor, p, 0.0), 0))


@triton.jit(**_ANY)
def _warp_out_kernel(x_ptr, stride, temp_ptr, min_p_ptr, stats_ptr, kept_ptr, out_ptr, vocab, reps, n_chunks,
                     CHUNK: tl.constexpr, CP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp, min_p = _param(temp_ptr, min_p_ptr, row // reps)
    top, total, floor, kept = _row_stats(stats_ptr, kept_ptr, row, n_chunks, min_p, CP, True)
    idx, m = _chunk_ids(vocab, CHUNK)
    s = tl.math.div_rn(tl.load(x_ptr + row * stride + idx, mask=m, other=float("-inf")).to(tl.float32), temp)
    tl.store(out_ptr + row * vocab + idx, _prob(s, top, total, floor, kept), mask=m)


@triton.jit(**_ANY)
def _race_chunk_kernel(x_ptr, stride, ints_ptr, n, temp_ptr, min_p_ptr, stats_ptr, kept_ptr, best_ptr, vocab, stream,
                       n_chunks, CHUNK: tl.constexpr, CP: tl.constexpr):
    """best [N, 2, C]: each chunk's winner (score, id as float-free int via a second row): the argmax
    of the raw logits for greedy rows, else the race of the warped probabilities against Exp(1) noise
    keyed by (seed, position, stream): argmax p / E, ties to the lowest index."""
    row = tl.program_id(0).to(tl.int64)
    greedy = tl.load(ints_ptr + row) != 0
    idx, m = _chunk_ids(vocab, CHUNK)
    x = tl.load(x_ptr + row * stride + idx, mask=m, other=float("-inf")).to(tl.float32)
    if greedy:
        score = x
    else:
        temp, min_p = _param(temp_ptr, min_p_ptr, row)
        top, total, floor, kept = _row_stats(stats_ptr, kept_ptr, row, n_chunks, min_p, CP, True)
        key = _row_key(tl.load(ints_ptr + n + row), tl.load(ints_ptr + 2 * n + row), stream)
        noise = -tl.log(_to_unit(_mix(key ^ _u32(idx.to(tl.int64) * 0x61C88647))))
        score = tl.where(m, tl.math.div_rn(_prob(tl.math.div_rn(x, temp), top, total, floor, kept), noise), -1.0)
    _store_best(best_ptr, row, n_chunks, score, idx)


@triton.jit
def _store_best(best_ptr, row, n_chunks, score, idx):
    """A chunk's best score and its id (the lowest on ties) into best [N, 2, C] (the id as float64 bits:
    one buffer)."""
    base = best_ptr + row * 2 * n_chunks + tl.program_id(1)
    tl.store(base, tl.max(score, 0).to(tl.float64))
    tl.store(base + n_chunks, tl.min(tl.where(score == tl.max(score, 0), idx, 2147483647), 0).to(tl.float64))


@triton.jit(do_not_specialize=["n_chunks"])
def _merge_best_kernel(best_ptr, out_ptr, n_chunks, CP: tl.constexpr):
    """out [N] int64: the id of the best chunk winner, the lowest chunk on ties."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    ok = c < n_chunks
    scores = tl.load(best_ptr + row * 2 * n_chunks + c, mask=ok, other=float("-inf"))
    ids = tl.load(best_ptr + row * 2 * n_chunks + n_chunks + c, mask=ok, other=0.0)
    top = tl.max(scores, 0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (scores == top), ids, 1e18), 0).to(tl.int64))


@triton.jit(**_ANY)
def _argmax_chunk_kernel(x_ptr, stride, best_ptr, vocab, n_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx, m = _chunk_ids(vocab, CHUNK)
    _store_best(best_ptr, row, n_chunks, tl.load(x_ptr + row * stride + idx, mask=m, other=float("-inf")).to(
        tl.float32), idx)


def _grid(logits: torch.Tensor) -> tuple[int, int, int]:
    """(rows, chunks per row, the chunk count's power of two)."""
    n, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    return n, chunks, triton.next_power_of_2(chunks)


def _stats(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, reps: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    n, chunks, cp = _grid(logits)
    stats = torch.empty(n, 2, chunks, dtype=torch.float32, device=logits.device)  # [N, 2, C] max | sum
    kept = torch.empty(n, chunks, dtype=torch.float32, device=logits.device)  # [N, C]
    args = (logits, logits.stride(0), temperature, min_p, stats)
    _chunk_stats_kernel[(n, chunks)](*args, logits.shape[1], reps, chunks, CHUNK=CHUNK, num_warps=4)
    _chunk_kept_kernel[(n, chunks)](*args, kept, logits.shape[1], reps, chunks, CHUNK=CHUNK, CP=cp, num_warps=4)
    return stats, kept


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, reps: int = 1) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32; row i uses parameters i // reps (temperature [N / reps],
    0 = greedy, warped at 1; min_p [N / reps])."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    if n:
        temperature, min_p = temperature.contiguous(), min_p.contiguous()
        stats, kept = _stats(logits, temperature, min_p, reps)
        _, chunks, cp = _grid(logits)
        _warp_out_kernel[(n, chunks)](logits, logits.stride(0), temperature, min_p, stats, kept, out, vocab, reps,
                                      chunks, CHUNK=CHUNK, CP=cp, num_warps=4)
    return out


def sample_tokens(logits: torch.Tensor, ints: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                  stream: int) -> torch.Tensor:
    """logits [N, V], ints [3 * N] int64 (greedy | seed | position), temperature and min_p [N]
    float32 -> tokens [N] int64."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        temperature, min_p = temperature.contiguous(), min_p.contiguous()
        stats, kept = _stats(logits, temperature, min_p, 1)
        _, chunks, cp = _grid(logits)
        best = torch.empty(n, 2, chunks, dtype=torch.float64, device=logits.device)  # [N, 2, C] score | id
        _race_chunk_kernel[(n, chunks)](logits, logits.stride(0), ints, n, temperature, min_p, stats, kept, best,
                                        vocab, stream, chunks, CHUNK=CHUNK, CP=cp, num_warps=4)
        _merge_best_kernel[(n,)](best, out, chunks, CP=cp, num_warps=1)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64, the first maximum of each row (torch.argmax's answer), its chunks
    searched in parallel: torch's reduction took 13 us a 49152-id row on the H200."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, chunks, cp = _grid(logits)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        best = torch.empty(n, 2, chunks, dtype=torch.float64, device=logits.device)  # [N, 2, C]
        _argmax_chunk_kernel[(n, chunks)](logits, logits.stride(0), best, logits.shape[1], chunks, CHUNK=CHUNK,
                                          num_warps=4)
        _merge_best_kernel[(n,)](best, out, chunks, CP=cp, num_warps=1)
    return out

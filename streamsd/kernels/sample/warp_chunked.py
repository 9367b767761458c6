"""Warping and greedy argmax with each row cut into chunks of CHUNK ids, one program a
chunk: for steps captured in a CUDA graph, where a launch costs no host time.

One program walking a row (kernels/sample/warp.py) warps a 49152-id row in 63 us and samples it in 93 on
an H200 (one SM busy, the rest idle), and torch's argmax takes 13 us; an EAGLE head's sampled chain
at batch 1 warps and races four such rows a step. Here: each chunk's max and softmax sum
(``_chunk_stats_kernel``); each chunk's mass above the min-p floor once the row's stats are merged
(``_chunk_kept_kernel``); then the output (``_warp_out_kernel``). An argmax: each chunk's first
maximum, then the lowest id at the best of them (``_merge_best_kernel``), torch.argmax's answer.
Three launches instead of one: eagerly, at ~40 us of host time a launch, that cost more than it
saved on an H200 (a plain step sampling this way took 49 us longer at T = 1), so eager steps keep
one program a row. The chunking depends on the vocabulary only, never on the batch.

`warp` is sample/warp.py's `warp` (as kernels/sample/warp.py's), `row_argmax` sample/greedy.py's
`row_argmax`; tests/kernels/test_sample_kernels.py `test_warp_kernel_matches_the_torch_warp` (chunked) and
`test_row_argmax_finds_the_first_maximum_as_torch_does` compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # ids per program
# Rows up to which chunking pays: beyond, one program (or torch's reduction) a row already fills the
# chip, and chunks only add launches and partials.
MAX_ROWS = 64
# One binary per logits dtype: rows arrive as views at any offset (see kernels/warmup.py).
_ANY = dict(do_not_specialize=["vocab", "stride", "reps", "n_chunks"],
            do_not_specialize_on_alignment=["x_ptr", "temp_ptr", "min_p_ptr", "out_ptr"])


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
    """stats [N, 2, C]: each chunk's max of the scaled logits s, and its sum of exp(s - that max)."""
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


@triton.jit
def _store_best(best_ptr, row, n_chunks, score, idx):
    """A chunk's best score and its id (the lowest on ties) into best [N, 2, C]; the id as a float64
    (exact far past any vocabulary), so that one buffer holds both."""
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
    x = tl.load(x_ptr + row * stride + idx, mask=m, other=float("-inf")).to(tl.float32)
    # NaN (a graph padding row's garbage) equals nothing: a chunk of it would name an id past the vocabulary
    _store_best(best_ptr, row, n_chunks, tl.where(x == x, x, float("-inf")), idx)


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


def warp(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, reps: int = 1) -> torch.Tensor:
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


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64, the first maximum of each row (torch.argmax's answer)."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, chunks, cp = _grid(logits)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        best = torch.empty(n, 2, chunks, dtype=torch.float64, device=logits.device)  # [N, 2, C]
        _argmax_chunk_kernel[(n, chunks)](logits, logits.stride(0), best, logits.shape[1], chunks, CHUNK=CHUNK,
                                          num_warps=4)
        _merge_best_kernel[(n,)](best, out, chunks, CP=cp, num_warps=1)
    return out

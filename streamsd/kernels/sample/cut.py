"""The keyed race over a top-k/top-p cut without sorting the row: one program a row, inside the
plain sampling kernel (kernels/sample/warp.py's `_sample_kernel`).

The cut is sample/warp.py's, ties kept together: with q the row's softmax at its temperature, token i
survives top-k where fewer than k tokens have a larger q, top-p where the tokens with a larger q hold
less than top-p of the top-k mass, and min-p where q_i reaches min-p of the largest. Each is a
threshold on q, so the tokens kept are all those above some value t. The race draws argmax q_i / E_i
over them, E the row's keyed Exp(1) noise.

The race finds that winner without knowing t. It races every token first; the winner j either
survives the cut (one pass counts the tokens likelier than it and their mass), and then it is also the
winner among the survivors, or it does not, and then no token as unlikely as it survives: the race
runs again over the tokens likelier than j, with the same noise. Each round drops the previous
winner and everything below it; the likeliest token always survives, so the rounds end. At top-p 0.9
the first winner survives nine times in ten, so a row takes about five passes over its vocabulary
(two for the softmax, the race, the check, and rarely another round). Sorting the rows instead cost a
tree step of 16 requests at temperature 1 more than the rest of it (5.7 ms against 2.3 greedy on an
H100), and a plain step's sort was ~20 launches.

With both top-k and top-p the top-k mass needs the k-th largest q: a radix select over the bits of q
(positive floats order as their bits do), eight bits a pass, four passes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from streamsd.kernels.sample.rng import _mix, _to_unit, _u32


@triton.jit
def _q(x, temp, top, total):
    """A row's softmax at its temperature for logits x (float32), given its max and denominator."""
    return tl.math.div_rn(tl.exp(tl.math.div_rn(x, temp) - top), total)


@triton.jit
def mass_from(x_row, vocab, temp, top, total, floor, BLOCK: tl.constexpr):
    """The softmax mass of the row's tokens whose q reaches `floor`."""
    offs = tl.arange(0, BLOCK)
    run = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(x_row + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        p = _q(x, temp, top, total)
        run += tl.where(p >= floor, p, 0.0)
    return tl.sum(run, 0)


@triton.jit
def _above(x_row, vocab, temp, top, total, q, BLOCK: tl.constexpr):
    """(how many tokens have a softmax above q, their mass)."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(x_row + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        p = _q(x, temp, top, total)
        count += (p > q).to(tl.int32)
        mass += tl.where(p > q, p, 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0)


@triton.jit
def _radix_pass(x_row, vocab, temp, top, total, top_k, prefix, above, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
                BLOCK: tl.constexpr):
    """One pass of `_top_k_floor`: among the tokens whose bits above SHIFT + WIDTH are `prefix`, how many
    have each WIDTH bits from SHIFT; returns the prefix grown by the highest digit at which the tokens
    at or above it reach k, and how many tokens lie above that digit's values."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    outside = tl.full([], 0, tl.int32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + offs
        x = tl.load(x_row + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        bits = _q(x, temp, top, total).to(tl.int32, bitcast=True)
        inside = (idx < vocab) & ((bits >> (SHIFT + WIDTH)) == prefix)
        hist += tl.histogram(tl.where(inside, (bits >> SHIFT) & ((1 << WIDTH) - 1), 0), 256)
        outside += tl.sum((inside == 0).to(tl.int32), 0)
    hist -= tl.where(bins == 0, outside, 0)  # the tokens outside were counted as digit 0
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [256] inside, with this digit or a higher one
    digit = tl.maximum(tl.sum((above + at_or_above >= top_k).to(tl.int32), 0) - 1, 0)
    above += tl.sum(tl.where(bins == digit, at_or_above - hist, 0), 0)
    return (prefix << WIDTH) | digit, above


@triton.jit
def _top_k_floor(x_row, vocab, temp, top, total, top_k, BLOCK: tl.constexpr):
    """The k-th largest softmax value of the row (0 where the row has fewer than k tokens): a radix
    select over the bits of q (non-negative floats order as their bits do), from the top, eight bits
    a pass: bits 30-23, 22-15, 14-7, 6-0 (the sign bit is always 0)."""
    prefix = tl.full([], 0, tl.int32)  # the bits of the k-th value found so far
    above = tl.full([], 0, tl.int32)  # tokens whose q is above every value with that prefix
    prefix, above = _radix_pass(x_row, vocab, temp, top, total, top_k, prefix, above, 23, 8, BLOCK)
    prefix, above = _radix_pass(x_row, vocab, temp, top, total, top_k, prefix, above, 15, 8, BLOCK)
    prefix, above = _radix_pass(x_row, vocab, temp, top, total, top_k, prefix, above, 7, 8, BLOCK)
    prefix, above = _radix_pass(x_row, vocab, temp, top, total, top_k, prefix, above, 0, 7, BLOCK)
    return tl.where(top_k > vocab, 0.0, prefix.to(tl.float32, bitcast=True))  # fewer than k tokens: all


@triton.jit
def cut_race(x_row, vocab, key, temp, top, total, floor, top_k, top_p, BLOCK: tl.constexpr):
    """The token a sampled row draws over its cut (see the module doc); `floor`: min-p of its largest q.
    NaN logits never win; a row with nothing else names id 0."""
    offs = tl.arange(0, BLOCK)
    mass_k = tl.full([], 0.0, tl.float32)  # the top-k mass top-p is a share of
    if top_p < 1.0:
        k_floor = tl.full([], 0.0, tl.float32)
        if top_k > 0:
            k_floor = _top_k_floor(x_row, vocab, temp, top, total, top_k, BLOCK)
        mass_k = mass_from(x_row, vocab, temp, top, total, k_floor, BLOCK)
    pivot = tl.full([], -1.0, tl.float32)  # the round races the tokens whose q is above it
    best_i = tl.full([], 0, tl.int64)
    searching = tl.full([], 1, tl.int1)
    while searching:
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int64)
        for v0 in range(0, vocab, BLOCK):
            idx = v0 + offs
            m = idx < vocab
            x = tl.load(x_row + idx, mask=m, other=float("-inf")).to(tl.float32)
            p = _q(x, temp, top, total)
            noise = -tl.log(_to_unit(_mix(key ^ _u32(idx.to(tl.int64) * 0x61C88647))))
            score = tl.where(m & (p > pivot) & (p >= floor), tl.math.div_rn(p, noise), float("-inf"))
            score = tl.where(score == score, score, float("-inf"))
            c = tl.max(score, 0)
            i = tl.argmax(score, 0) + v0
            best_i = tl.where(c > best, i, best_i)
            best = tl.maximum(c, best)
        q = _q(tl.load(x_row + best_i).to(tl.float32), temp, top, total)
        count, mass = _above(x_row, vocab, temp, top, total, q, BLOCK)
        kept = ((top_k <= 0) | (count < top_k)) & ((top_p >= 1.0) | (mass < top_p * mass_k) | (count == 0))
        searching = (best > float("-inf")) & (kept == 0)
        pivot = q
    return best_i

"""The k likeliest tokens of each row and their log-probabilities, in two Triton launches.

A draft tree's growth (spec_decode/eagle/tree.py) asks this of every expanded node at every level: with
torch it is a log-softmax over the vocabulary and a radix top-k, ~8 kernels a call, ~50 us of a
batch-1 step on an H200 each time. Here a first launch takes each row in chunks of CHUNK ids, one
program a chunk: the chunk's max, its sum of exp(x - max), and its k best (ids ascending among
equal values). A second launch per row merges the chunks' sums into the log-normaliser and their
candidates into the row's k best, best first, the lowest id first among equal values.

With a race (model/tree_layout.Race) the first launch ranks a sampled request's row by its logits at
the request's temperature plus the Gumbel noise its target will race at the children's position
(kernels/sample/rng.py's bits, -log of the Exp(1) noise): the same numbers spec_decode/eagle/tree.race_logits
makes in torch, never written out.

`topk_logprobs` here and in spec_decode/eagle/tree.py (the reference): tests/kernels/test_sample_kernels.py
`test_topk_logprobs_equal_torchs_log_softmax_and_topk` and
`test_raced_topk_equals_the_torch_race_and_its_noise_is_the_targets` compare them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from streamsd.kernels.sample.rng import _mix, _row_key, _to_unit, _u32
from streamsd.sample import rng

if TYPE_CHECKING:
    from streamsd.model.tree_layout import Race

CHUNK = 2048


# The race's per-request operands are rows of [2, B] or [D, B] tensors in a tree graph (offset by 8 bytes
# at B = 1) and separate tensors in an eager growth: read once a program, so not a variant per alignment.
@triton.jit(do_not_specialize=["vocab", "stride", "reps", "stream"],
            do_not_specialize_on_alignment=["greedy_ptr", "seed_ptr", "key_ptr", "temp_ptr"])
def _chunk_topk_kernel(x_ptr, stride, vocab, stats_ptr, vals_ptr, ids_ptr, greedy_ptr, seed_ptr, key_ptr, temp_ptr,
                       reps, stream, K: tl.constexpr, CHUNK_V: tl.constexpr, RACE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    idx = chunk * CHUNK_V + tl.arange(0, CHUNK_V)
    x = tl.load(x_ptr + row * stride + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    if RACE:
        req = row // reps
        temp = tl.load(temp_ptr + req)
        if (tl.load(greedy_ptr + req) == 0) & (temp > 0):  # a graph's padding rows hold temperature 0
            key = _row_key(tl.load(seed_ptr + req), tl.load(key_ptr + req), stream)
            gumbel = -tl.log(-tl.log(_to_unit(_mix(key ^ _u32(idx.to(tl.int64) * 0x61C88647)))))
            x = x / temp + gumbel
    top = tl.max(x, 0)
    safe = tl.where(top > float("-inf"), top, 0.0)
    total = tl.sum(tl.exp(x - safe), 0)
    part = row * chunks + chunk
    tl.store(stats_ptr + part * 2, safe)
    tl.store(stats_ptr + part * 2 + 1, total)
    for j in tl.static_range(K):
        best = tl.max(x, 0)
        at = tl.argmax(x, 0)  # the first maximum: the lowest id
        tl.store(vals_ptr + part * K + j, best)
        # (a row of NaN, a graph padding row's garbage, argmaxes past the vocabulary: kept inside it)
        tl.store(ids_ptr + part * K + j, tl.minimum(chunk * CHUNK_V + at, vocab - 1).to(tl.int64))
        x = tl.where(tl.arange(0, CHUNK_V) == at, float("-inf"), x)


@triton.jit
def _log_normaliser(stats_ptr, row, chunks, CHUNKS: tl.constexpr):
    """A row's log of the sum of exp over the vocabulary, from its chunks' (max, sum of exp(x - max))."""
    c = tl.arange(0, CHUNKS)
    live = c < chunks
    m = tl.load(stats_ptr + (row * chunks + c) * 2, mask=live, other=float("-inf"))
    s = tl.load(stats_ptr + (row * chunks + c) * 2 + 1, mask=live, other=0.0)
    top = tl.max(m, 0)
    return top + tl.log(tl.sum(s * tl.exp(m - top), 0))


@triton.jit
def _merge_topk_kernel(stats_ptr, vals_ptr, ids_ptr, out_v_ptr, out_i_ptr, chunks,
                       K: tl.constexpr, CHUNKS: tl.constexpr, CANDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _log_normaliser(stats_ptr, row, chunks, CHUNKS)
    cand = tl.arange(0, CANDS)  # chunk-major: ids ascend with the position among equal values
    ok = cand < chunks * K
    v = tl.load(vals_ptr + row * chunks * K + cand, mask=ok, other=float("-inf"))
    i = tl.load(ids_ptr + row * chunks * K + cand, mask=ok, other=0)
    for j in tl.static_range(K):
        best = tl.max(v, 0)
        at = tl.argmax(v, 0)
        tl.store(out_v_ptr + row * K + j, best - lse)
        tl.store(out_i_ptr + row * K + j, tl.sum(tl.where(cand == at, i, 0), 0))
        v = tl.where(cand == at, float("-inf"), v)


def topk_logprobs(logits: torch.Tensor, k: int, race: Race | None = None, keys: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (log-probabilities [R, k] float32, ids [R, k] int64), best first. With a race
    over B requests (R = B * reps rows, request-major), keys [B] int64: each one's children's position."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    r, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    stats = torch.empty(r * chunks * 2, dtype=torch.float32, device=dev)
    vals = torch.empty(r * chunks * k, dtype=torch.float32, device=dev)
    ids = torch.empty(r * chunks * k, dtype=torch.int64, device=dev)
    out_v = torch.empty(r, k, dtype=torch.float32, device=dev)
    out_i = torch.empty(r, k, dtype=torch.int64, device=dev)
    if r:
        if race is None:
            flags, args = False, (ids, ids, ids, stats, 1, 0)  # unread
        else:
            assert keys is not None
            flags, args = True, (race.greedy, race.seeds, keys, race.temperature, r // race.seeds.shape[0], rng.TARGET)
        _chunk_topk_kernel[(r, chunks)](logits, logits.stride(0), vocab, stats, vals, ids, *args, K=k, CHUNK_V=CHUNK,
                                        RACE=flags, num_warps=8)
        _merge_topk_kernel[(r,)](stats, vals, ids, out_v, out_i, chunks, K=k,
                                 CHUNKS=triton.next_power_of_2(chunks), CANDS=triton.next_power_of_2(chunks * k),
                                 num_warps=4)
    return out_v, out_i

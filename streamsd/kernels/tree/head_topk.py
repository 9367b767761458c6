"""A draft head's final norm, its lm_head and the k best of its log-probabilities in two launches over an
int8 copy of the lm_head: kernels/sample/topk.py with the GEMM and the norm inside its first launch.

A tree level (spec_decode/eagle/tree.py) ranks each expanded node's children by the head's log-probabilities.
On SmolLM2-135M the lm_head is 49152 x 576: read in bf16 it cost 17 us a level on an H200, and a norm
and a chunked top-k came on top, four levels a step. Here one program takes a block of rows and a block
of vocabulary ids: it multiplies the rows, times the norm's weight, by the int8 rows of its ids (a scale
per id), scales each row by its 1 / rms, and keeps per row the block's best, its sum of exp(x - best),
and the block's values (float32, for the second launch). Half the bytes of the bf16 lm_head.

A value and its id are one int64: the value's bits, made to order as the value does, above the
complement of the id. One max then finds the best value and, among equal ones, the lowest id, where
kernels/sample/topk.py needs a max, an argmax and a gather each time.

The second launch, a program per row, finds the row's k best from the blocks' bests alone: a block
holding one of the k best has a best at least that good, and only k blocks can, so the k blocks with the
best bests hold all k. It ranks those k blocks' values again. Keeping only the bests in the first launch
made it 3.3-3.8 us shorter a level on an H200 than keeping each block's k best (k rounds of a max over
the block), at 1 and 6 rows.

The int8 rows only rank drafts: the target verifies whatever the tree holds, so the output stays exact;
a head's acceptance moves by what int8 rounding moves its ranking.

Reference: the head's norm and lm_head over the dequantized rows, then spec_decode/eagle/tree.py's
`topk_logprobs`; tests/kernels/test_tree_kernels.py `test_int8_head_topk_equals_its_torch_oracle` compares
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from streamsd.kernels.sample.rng import _mix, _row_key, _to_unit, _u32
from streamsd.kernels.sample.topk import _log_normaliser
from streamsd.sample import rng

if TYPE_CHECKING:
    from streamsd.model.tree_layout import Race

# (ids a program, hidden columns a load, warps, loads in flight) for one block of rows and for more:
# the fastest measured on an H200 at SmolLM2-135M's 49152 x 576, 1, 6 and 24 rows (18.2 us for 1 row,
# 18.6 for 6, 27.4 for 24, where bf16 took 27.7, 28.7, 33.4).
TILES_ONE_BLOCK = (64, 64, 4, 2)
TILES_MORE = (256, 32, 4, 2)
PAD = 256  # the int8 rows come in whole blocks of any BLOCK_V up to this: their loads need no mask
# Rows a program (tl.dot's least): more rows are more programs over the same weights, which L2 then holds,
# and one variant for every batch, so an eager step never compiles one that graph captures did not.
BLOCK_R = 16
_GONE: tl.constexpr = tl.constexpr(-(2**63))  # below every packed candidate: one already taken, or none


@dataclass(frozen=True, slots=True)
class DraftLogits:
    """What the fused launch reads of a head: its lm_head as int8 with a scale per id, its final norm's
    weight, and its draft ids' map."""

    weight: torch.Tensor  # [Vp, H] int8: id v's row of lm_head (Vp: V up to whole blocks)
    scale: torch.Tensor  # [V] float32: row v is weight[v] * scale[v]
    # [H] the final RMSNorm's weight (EAGLE-3; None: EAGLE-1's head output goes in as it is). Not folded into
    # the int8 rows: folded, the held-out tau at T = 0 fell by 1 %.
    norm: torch.Tensor | None
    eps: float
    d2t: torch.Tensor | None  # [V] int64: target id = draft id + d2t[draft id] (None: the same ids)

    @staticmethod
    def build(lm_head: torch.Tensor, norm: torch.Tensor | None, eps: float, d2t: torch.Tensor | None) -> DraftLogits:
        """lm_head [V, H] over the draft ids, norm [H] the final RMSNorm's weight (None: no norm).
        Symmetric per id: the largest magnitude of each id's row maps to 127."""
        v, h = lm_head.shape
        weight = torch.zeros(triton.cdiv(v, PAD) * PAD, h, dtype=torch.int8, device=lm_head.device)
        scale = torch.empty(v, dtype=torch.float32, device=lm_head.device)
        for start in range(0, v, 8192):  # a float32 copy of a slice at a time, not of the whole matrix
            part = lm_head[start : start + 8192].float()  # (the lm_head itself where it is float32: never written)
            s = part.abs().amax(1).clamp_min(1e-30) / 127  # [v']
            weight[start : start + part.shape[0]] = torch.round(part / s.unsqueeze(1)).clamp_(-127, 127)
            scale[start : start + part.shape[0]] = s
        return DraftLogits(weight, scale, norm, eps, d2t)

    def dequantized(self) -> torch.Tensor:
        """[V, H] float32: the lm_head as the kernel multiplies by it (its torch oracle)."""
        v = self.scale.shape[0]
        return self.weight[:v].float() * self.scale.unsqueeze(1)


@triton.jit
def _pack(x, tid):
    """float32 values and their int64 ids -> int64 that order as (value, then the lower id)."""
    bits = x.to(tl.int32, bitcast=True)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # a signed order that is the float order
    return (mono.to(tl.int64) << 32) | (0xFFFFFFFF - tid)


@triton.jit
def _unpack(p):
    """_pack's inverse: (float32 values, int64 ids)."""
    mono = (p >> 32).to(tl.int32)
    bits = tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 0xFFFFFFFF - (p & 0xFFFFFFFF)


# Rows, race operands and the vocabulary arrive at any alignment and count (see kernels/sample/topk.py).
@triton.jit(do_not_specialize=["rows", "stride", "vocab", "reps", "stream"],
            do_not_specialize_on_alignment=["x_ptr", "greedy_ptr", "seed_ptr", "key_ptr", "temp_ptr"])
def _head_topk_kernel(x_ptr, stride, rows, norm_ptr, eps, w_ptr, scale_ptr, d2t_ptr, vocab, stats_ptr, cand_ptr,
                      logits_ptr, greedy_ptr, seed_ptr, key_ptr, temp_ptr, reps, stream,
                      H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                      BLOCK_H: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr, D2T: tl.constexpr,
                      RACE: tl.constexpr, ONE_REQUEST: tl.constexpr, EXACT: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    live = r < rows
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV] draft ids
    inside = v < vocab
    r64 = r.to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):  # loads in flight ahead of the dots
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        x = tl.load(x_ptr + r64[:, None] * stride + h[None, :], mask=live[:, None] & hm[None, :], other=0.0)
        x = x.to(tl.bfloat16)
        w = tl.load(w_ptr + v.to(tl.int64)[:, None] * H + h[None, :], mask=hm[None, :], other=0)  # [BV, BH]
        if NORM:  # the RMSNorm's sum of squares on the way: its 1 / rms scales whole rows, so it comes last
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
            x = (xf * tl.load(norm_ptr + h, mask=hm, other=0.0).to(tl.float32)[None, :]).to(tl.bfloat16)
        if EXACT:  # Triton's interpreter (CPU tests): its bf16 dot is wrong, float32 "ieee" is exact
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)  # int8 is exact in bf16
    x = acc * tl.load(scale_ptr + v, mask=inside, other=0.0)[None, :]
    if NORM:
        x = x / tl.sqrt(sq / H + eps)[:, None]
    x = tl.where(inside[None, :], x, float("-inf"))  # [BR, BV]
    vv = tl.minimum(v, vocab - 1).to(tl.int64)  # (a row of NaN, a graph padding row's garbage: ids stay inside)
    ids = vv  # [BV] target ids
    if D2T:
        ids += tl.load(d2t_ptr + vv)
    if RACE:  # kernels/sample/topk.py's race, a row at a time there, the block's rows at once here
        req = r64 // reps
        temp = tl.load(temp_ptr + req, mask=live, other=0.0)
        raced = (tl.load(greedy_ptr + req, mask=live, other=1) == 0) & (temp > 0)  # [BR]
        if ONE_REQUEST:  # every row one request's (batch 1): one row of noise serves them all
            key1 = _row_key(tl.load(seed_ptr), tl.load(key_ptr), stream)
            noise = -tl.log(-tl.log(_to_unit(_mix(key1 ^ _u32(ids * 0x61C88647)))))  # [BV]
            gumbel = tl.broadcast_to(noise[None, :], [BLOCK_R, BLOCK_V])
        else:
            key = _row_key(tl.load(seed_ptr + req, mask=live, other=0), tl.load(key_ptr + req, mask=live, other=0),
                           stream)
            gumbel = -tl.log(-tl.log(_to_unit(_mix(key[:, None] ^ _u32(ids * 0x61C88647)[None, :]))))  # [BR, BV]
        x = tl.where(raced[:, None], x / tl.where(raced, temp, 1.0)[:, None] + gumbel, x)
    best = tl.max(_pack(x, ids[None, :]), 1)  # [BR] the block's best: its value above its (lowest) id
    part = r64 * chunks + chunk  # [BR]
    tl.store(cand_ptr + part, best, mask=live)
    top, _ = _unpack(best)
    safe = tl.where(top > float("-inf"), top, 0.0)
    tl.store(stats_ptr + part * 2, safe, mask=live)
    tl.store(stats_ptr + part * 2 + 1, tl.sum(tl.exp(x - safe[:, None]), 1), mask=live)
    tl.store(logits_ptr + r64[:, None] * (chunks * BLOCK_V) + v[None, :], x, mask=live[:, None])


@triton.jit
def _merge_blocks_kernel(stats_ptr, cand_ptr, logits_ptr, d2t_ptr, out_v_ptr, out_i_ptr, chunks, vocab,
                         K: tl.constexpr, KP: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr,
                         D2T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _log_normaliser(stats_ptr, row, chunks, CHUNKS)
    # A block that holds one of the row's k best holds a best of its own at least as good, and only k
    # blocks' bests can be: so the k best blocks by their bests hold them all.
    c = tl.arange(0, CHUNKS)
    p = tl.load(cand_ptr + row * chunks + c, mask=c < chunks, other=_GONE)  # [CHUNKS]
    slot = tl.arange(0, KP)
    chosen = tl.full([KP], -1, tl.int32)  # [KP] the blocks, best first (-1: none)
    for j in tl.static_range(K):
        best, at = tl.max(p, 0, return_indices=True)  # one reduction for both (the values are distinct)
        chosen = tl.where(slot == j, tl.where(best == _GONE, -1, at), chosen)
        p = tl.where(c == at, _GONE, p)
    v = chosen[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # [KP, BV] draft ids
    ok = (chosen[:, None] >= 0) & (v < vocab)
    x = tl.load(logits_ptr + row * chunks * BLOCK_V + v, mask=ok, other=float("-inf"))
    ids = tl.minimum(tl.maximum(v, 0), vocab - 1).to(tl.int64)  # [KP, BV] target ids
    if D2T:
        ids += tl.load(d2t_ptr + ids)
    q = tl.reshape(tl.where(ok, _pack(x, ids), _GONE), [KP * BLOCK_V])
    for j in tl.static_range(K):
        best = tl.max(q, 0)
        value, tid = _unpack(best)
        tl.store(out_v_ptr + row * K + j, value - lse)
        tl.store(out_i_ptr + row * K + j, tid)
        q = tl.where(q == best, _GONE, q)


def head_topk(out: torch.Tensor, head: DraftLogits, k: int, race: Race | None = None,
              keys: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's pre-norm outputs out [R, H] -> (log-probabilities [R, k] float32, target ids [R, k] int64),
    best first: topk_logprobs(the head's logits) over the int8 lm_head. Race as there. tiles: (block_v,
    block_h, warps, stages), to compare variants (None: by R, as measured)."""
    out = out if out.stride(-1) == 1 else out.contiguous()
    r, hidden = out.shape
    block_v, block_h, warps, stages = tiles or (TILES_ONE_BLOCK if r <= BLOCK_R else TILES_MORE)
    vocab = head.scale.shape[0]
    chunks = triton.cdiv(vocab, block_v)
    assert PAD % block_v == 0
    dev = out.device
    stats = torch.empty(r * chunks * 2, dtype=torch.float32, device=dev)
    cands = torch.empty(r * chunks, dtype=torch.int64, device=dev)
    logits = torch.empty(r * chunks * block_v, dtype=torch.float32, device=dev)
    out_v = torch.empty(r, k, dtype=torch.float32, device=dev)
    out_i = torch.empty(r, k, dtype=torch.int64, device=dev)
    if not r:
        return out_v, out_i
    if race is None:
        flags, args = False, (cands, cands, cands, stats, 1, 0)  # unread
    else:
        assert keys is not None
        flags, args = True, (race.greedy, race.seeds, keys, race.temperature, r // race.seeds.shape[0], rng.TARGET)
    d2t = head.d2t if head.d2t is not None else cands
    _head_topk_kernel[(triton.cdiv(r, BLOCK_R), chunks)](
        out, out.stride(0), r, head.norm if head.norm is not None else stats, head.eps, head.weight, head.scale, d2t,
        vocab, stats, cands, logits, *args, H=hidden, BLOCK_R=BLOCK_R, BLOCK_V=block_v, BLOCK_H=block_h, STAGES=stages,
        NORM=head.norm is not None, D2T=head.d2t is not None, RACE=flags,
        ONE_REQUEST=race is not None and race.seeds.shape[0] == 1, EXACT=not out.is_cuda, num_warps=warps)
    _merge_blocks_kernel[(r,)](stats, cands, logits, d2t, out_v, out_i, chunks, vocab, K=k, KP=triton.next_power_of_2(k),
                               CHUNKS=triton.next_power_of_2(chunks), BLOCK_V=block_v, D2T=head.d2t is not None,
                               num_warps=4)
    return out_v, out_i

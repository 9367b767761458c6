"""A queued verify's layout in one launch: ids, positions, KV slots and context lengths from the
previous verify's results, on the device (worker/lookahead.py, model/graphs.py).

`restart` is model/device_layout.py's `restart` (its torch path is the reference), with the same
arguments; tests/kernels/test_model_kernels.py `test_restart_kernel_equals_the_torch_layout` compares them.

In torch this is ~25 small ops (gather the bonus token, concatenate the drafts, add the accepted
count, positions, the block-table lookup, four slice copies), ~0.5 ms of host time a step: more than
a queued step hides at batch 1 on a small model. One program per sequence here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from streamsd.model.device_layout import DeviceStarts


# Every plain argument varies with the batch bucket, the width and the buffer a call packs into (an
# int divisible by 16 or not, a view's pointer 16-byte aligned or not), and Triton would compile a
# variant per combination: on an H200 the first queued verify at a new width stalled ~80 ms. One
# variant per constexpr combination, compiled at start-up (kernels/warmup.py).
@triton.jit(do_not_specialize=["t_all", "table_stride", "tok_stride", "draft_stride", "width", "block_size"],
            do_not_specialize_on_alignment=["packed", "starts", "prev_starts", "accepted", "tokens", "drafts", "base",
                                            "table"])
def _restart(packed, starts, prev_starts, accepted, tokens, drafts, base, table, t_all, table_stride, tok_stride,
             draft_stride, width, block_size, FROM_PREV: tl.constexpr, HAS_IDS: tl.constexpr, HAS_BASE: tl.constexpr,
             BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if FROM_PREV:  # start = previous start + 1 + accepted: the bonus token's position
        acc = tl.load(accepted + i)
        s = tl.load(prev_starts + i) + 1 + acc
        tl.store(starts + i, s)
    else:
        s = tl.load(starts + i)
    j = tl.arange(0, BLOCK)
    m = j < width
    pos = s + j
    blk = tl.load(table + i * table_stride + pos // block_size, mask=m, other=0).to(tl.int64)
    tl.store(packed + t_all + i * width + j, pos, mask=m)
    tl.store(packed + 2 * t_all + i * width + j, blk * block_size + pos % block_size, mask=m)
    tl.store(packed + 3 * t_all + i, s + width)
    if HAS_IDS:  # the bonus token, then the drafts
        bonus = tl.load(tokens + i * tok_stride + tl.load(accepted + i))
        d = tl.load(drafts + i * draft_stride + j - 1, mask=m & (j > 0), other=0)
        tl.store(packed + i * width + j, tl.where(j == 0, bonus, d), mask=m)
    if HAS_BASE:
        tl.store(base + i, s + 1)


def restart(packed: torch.Tensor, t_all: int, src: DeviceStarts, width: int, block_table: torch.Tensor,
            block_size: int, base: torch.Tensor | None = None) -> None:
    """model/device_layout.restart in one launch. With the previous starts and accepted counts the
    starts [S] are computed (prev + 1 + accepted) and written to `src.starts`; with its tokens [S, K+1]
    and drafts [S, width-1] the ids too (each row's bonus token, then its drafts); `base` [S] gets
    start + 1."""
    starts, prev_starts, accepted, tokens, drafts = src.starts, src.prev, src.accepted, src.tokens, src.drafts
    n = starts.shape[0]
    from_prev = prev_starts is not None
    has_ids = tokens is not None
    assert not has_ids or from_prev, "ids come with the previous verify's accepted counts"
    tokens_stride = drafts_stride = 0
    if has_ids:
        assert tokens is not None and drafts is not None
        tokens, drafts = tokens.contiguous(), drafts.contiguous()
        tokens_stride, drafts_stride = tokens.stride(0), drafts.stride(0)
    _restart[(n,)](
        packed, starts, prev_starts if from_prev else starts, accepted if from_prev else starts,
        tokens if has_ids else packed, drafts if has_ids else packed, base if base is not None else packed,
        block_table, t_all, block_table.stride(0), tokens_stride,
        drafts_stride, width, block_size, FROM_PREV=from_prev, HAS_IDS=has_ids,
        HAS_BASE=base is not None, BLOCK=triton.next_power_of_2(width))

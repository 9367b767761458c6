"""One step of paged online-softmax attention, shared by the decode/verify and prompt kernels.

Both kernels hold a [BLOCK_M, D] tile of queries (tokens x the GROUP heads of one kv head) and
walk the keys through the block table a tile at a time; they differ only in how they pick the
query rows and which key tiles they visit. Keys past `end` or after a row's own position are masked;
with TREE, a row in the draft-tree window of its sequence (which starts at `win` >= 0) sees every key
before the window and the window keys its `bits` set (bit c: position win + c), see spec_decode/tree.py;
rows before the window attend causally.

No public op: both kernels' tests (kernels/attention/paged.py, prefill.py) cover it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, qpos, m, l_sum, acc, kpos, end, bt_row_ptr, k_ptr, v_ptr, kvh,
                sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, d, scale_log2, PAGE: tl.constexpr, IEEE: tl.constexpr,
                bits, win, TREE: tl.constexpr):
    """q [BLOCK_M, D], qpos [BLOCK_M], running (m, l_sum [BLOCK_M], acc [BLOCK_M, D]) over the keys at
    kpos [N] (< end are live) -> the updated (m, l_sum, acc), in log2 units."""
    kv_ok = kpos < end
    # int64: a small model's cache on a large GPU has millions of blocks, and block x block stride
    # passes 2**31 elements (int32 offsets wrap to another block's keys or an illegal address).
    page = tl.load(bt_row_ptr + kpos // PAGE, mask=kv_ok, other=0).to(tl.int64)  # [N]
    slot = kpos % PAGE
    k = tl.load(k_ptr + page[:, None] * sk_b + slot[:, None] * sk_s + kvh * sk_h + d[None, :],
                mask=kv_ok[:, None], other=0.0).to(q.dtype)  # [N, D]
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2  # [BLOCK_M, N]
    seen = kpos[None, :] <= qpos[:, None]  # [BLOCK_M, N]
    if TREE:
        rel = kpos[None, :] - win  # [1, N]
        shift = tl.where(rel > 0, rel, 0).to(tl.int64)
        in_tree = ((bits[:, None] >> shift) & 1) != 0  # [BLOCK_M, N]
        seen = tl.where((win >= 0) & (qpos[:, None] >= win), (rel < 0) | in_tree, seen)
    s = tl.where(seen & kv_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + page[:, None] * sv_b + slot[:, None] * sv_s + kvh * sv_h + d[None, :],
                mask=kv_ok[:, None], other=0.0).to(q.dtype)  # [N, D]
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_sum, acc * alpha[:, None] + pv

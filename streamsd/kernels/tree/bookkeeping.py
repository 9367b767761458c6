"""A draft tree's bookkeeping in three Triton launches (spec_decode/tree.py's torch functions are the oracles).

Inside a tree step's CUDA graph (worker/tree_graphs.py) the walk, the moves of the accepted nodes' KV and
the next step's window were ~100 small torch kernels, a few microseconds each on an H200:
- `walk`: one program per request follows the target's tokens down its tree (D scalar steps), and
  in a tree graph lays out the head's catch-up over the accepted path too;
- `move_path`: one program per (request, cache plane, chunk of a slot's elements) reads every
  accepted node's slot, then writes them to their positions (all read first: a move may read a slot
  another one writes); the KV cache and the head's streams in one launch;
- `next_step`: one program per request lays out the next verify from the new tree: each row's
  depth and mask (parents settle in D rounds through the output itself), ids, positions and slots,
  its root and tree, and this step's result for the host (five torch launches more, folded in).

`walk` is spec_decode/tree.py's `walk` (with its `catch_up` laid out), `move_kv` sample/tree_verify.py's
`move_kv` (the same arguments; `move_path` moves one store and a second beside it), `next_step` the
window spec_decode/tree.py builds (`window_bits`, `positions_to_slots`); tests/kernels/test_tree_kernels.py
`test_tree_bookkeeping_kernels_equal_the_torch_oracles` and `test_tree_kv_moves_equal_the_torch_move_kv`
compare them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.stream_store import StreamStore


@triton.jit
def _catch_up_row(b, root, taken, emitted_ptr, bt_ptr, s_bt, ids_ptr, pos_ptr, slot_ptr, ctx_ptr, pending_ptr,
                  C: tl.constexpr, CP: tl.constexpr, PAGE: tl.constexpr):
    """Request b's catch-up after its walk (spec_decode/tree.catch_up): the head over its root and the D slots
    after it, ids the emitted tokens (padding as 0); its context, and its pending position."""
    j = tl.arange(0, CP)
    live = j < C
    pos = root + j
    block = tl.load(bt_ptr + b * s_bt + pos // PAGE, mask=live, other=0).to(tl.int64)
    tl.store(ids_ptr + b * C + j, tl.maximum(tl.load(emitted_ptr + b * C + j, mask=live, other=0), 0), mask=live)
    tl.store(pos_ptr + b * C + j, pos, mask=live)
    tl.store(slot_ptr + b * C + j, block * PAGE + pos % PAGE, mask=live)
    tl.store(ctx_ptr + b, (root + C).to(tl.int32))
    tl.store(pending_ptr + b, root + taken + 1)


@triton.jit(do_not_specialize=["n", "s_bt"])
def _walk_kernel(target_ptr, tokens_ptr, parents_ptr, emitted_ptr, accepted_ptr, path_ptr, n,
                 roots_ptr, bt_ptr, s_bt, ids_ptr, pos_ptr, slot_ptr, ctx_ptr, pending_ptr,
                 W: tl.constexpr, D: tl.constexpr, NP: tl.constexpr, CATCH: tl.constexpr, CP: tl.constexpr,
                 PAGE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NP)
    live = idx < n
    tok = tl.load(tokens_ptr + b * n + idx, mask=live, other=-1)
    par = tl.load(parents_ptr + b * n + idx, mask=live, other=-2)
    cur = -1  # the node the walk is at (-1: the root), and its window row
    row = 0
    taken = 0
    going = 1
    for d in tl.static_range(D):
        t = tl.load(target_ptr + b * W + row)
        hit = (par == cur) & (tok == t) & live
        found = (tl.max(hit.to(tl.int32), 0) > 0) & (going > 0)
        j = tl.argmax(hit.to(tl.int32), 0)
        tl.store(path_ptr + b * D + d, tl.where(found, j, -1).to(tl.int64))
        tl.store(emitted_ptr + b * (D + 1) + d, tl.where(found, t, -1))
        cur = tl.where(found, j, cur)
        row = tl.where(found, j + 1, row)
        taken += found.to(tl.int32)
        going = found.to(tl.int32)
    tl.debug_barrier()
    tl.store(emitted_ptr + b * (D + 1) + D, -1)
    tl.debug_barrier()
    tl.store(emitted_ptr + b * (D + 1) + taken, tl.load(target_ptr + b * W + row))
    tl.store(accepted_ptr + b, tl.cast(taken, tl.int64))
    if CATCH:
        tl.debug_barrier()  # the emitted row, written above, is read back
        _catch_up_row(b, tl.load(roots_ptr + b), taken, emitted_ptr, bt_ptr, s_bt, ids_ptr, pos_ptr, slot_ptr,
                      ctx_ptr, pending_ptr, D + 1, CP, PAGE)


Catch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def walk(target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int,
         roots: torch.Tensor | None = None, block_table: torch.Tensor | None = None, block_size: int = 0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Catch | None]:
    """spec_decode/tree.walk in one launch: (emitted [B, D + 1], accepted [B], path [B, D], catch). With the
    windows' roots [B] and block_table, the same launch lays out the head's catch-up after it
    (spec_decode/tree.catch_up: ids, positions, slots [B * (D + 1)], context [B] int32, pending [B]); else
    catch is None."""
    b, n = tokens.shape
    dev = tokens.device
    emitted = torch.empty(b, max_depth + 1, dtype=torch.int64, device=dev)
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    path = torch.empty(b, max_depth, dtype=torch.int64, device=dev)
    c = max_depth + 1
    catch: Catch | None = None
    extra: tuple[torch.Tensor | int, ...]  # the kernel's arguments after n
    if roots is not None:
        assert block_table is not None
        ids, positions, slots = (torch.empty(b * c, dtype=torch.int64, device=dev) for _ in range(3))
        catch = (ids, positions, slots, torch.empty(b, dtype=torch.int32, device=dev), torch.empty_like(roots))
        extra = (roots, block_table, block_table.stride(0), *catch)
    else:
        extra = (accepted, accepted, 0, *([accepted] * 5))  # unread
    _walk_kernel[(b,)](target.contiguous(), tokens.contiguous(), parents.contiguous(), emitted, accepted, path, n,
                       *extra, W=target.shape[1], D=max_depth, NP=triton.next_power_of_2(n), CATCH=catch is not None,
                       CP=triton.next_power_of_2(c), PAGE=max(block_size, 1), num_warps=1)
    return emitted, accepted, path, catch


@triton.jit
def _move_plane(base, src, dst, moving, e, elems):
    ok = moving[:, None] & (e < elems)[None, :]
    vals = tl.load(base + src[:, None] * elems + e[None, :], mask=ok)  # [DP, BLOCK]: every source first
    tl.store(base + dst[:, None] * elems + e[None, :], vals, mask=ok)


@triton.jit(do_not_specialize=["plane_stride", "s_bt", "elems", "planes", "more_stride", "more_elems"])
def _move_kernel(data_ptr, plane_stride, elems, planes, more_ptr, more_stride, more_elems, roots_ptr, path_ptr,
                 bt_ptr, s_bt, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, DP)
    p = tl.load(path_ptr + b * D + d, mask=d < D, other=-1)  # [DP]
    moving = p >= 0
    root = tl.load(roots_ptr + b)
    src_pos = tl.where(moving, root + 1 + p, root)
    dst_pos = tl.where(moving, root + 1 + d, root)
    src = tl.load(bt_ptr + b * s_bt + src_pos // PAGE).to(tl.int64) * PAGE + src_pos % PAGE
    dst = tl.load(bt_ptr + b * s_bt + dst_pos // PAGE).to(tl.int64) * PAGE + dst_pos % PAGE
    if plane < planes:
        _move_plane(data_ptr + plane * plane_stride, src, dst, moving, e, elems)
    else:  # the second store's planes
        _move_plane(more_ptr + (plane - planes) * more_stride, src, dst, moving, e, more_elems)


def move_kv(cache: PagedKVCache, store: StreamStore | None, starts: torch.Tensor, path: torch.Tensor,
            block_table: torch.Tensor, block_size: int) -> None:
    """sample/tree_verify.move_kv in one launch: the accepted nodes' K/V of every layer, and the head's
    streams in `store`, from their window rows to their positions (`move_path`)."""
    d = cache.data  # [L, 2, NB, BS, KVH, D]: a plane per layer and K or V, a slot's elements contiguous
    move_path(d.view(d.shape[0] * 2, -1, d.shape[-2] * d.shape[-1]), starts, path, block_table, block_size,
              store.data.unsqueeze(0) if store is not None else None)


def move_path(data: torch.Tensor, roots: torch.Tensor, path: torch.Tensor, block_table: torch.Tensor,
              block_size: int, more: torch.Tensor | None = None) -> None:
    """tree_verify.move_kv's moves on one store, data [planes, slots, elems] (contiguous per slot):
    the node accepted at depth d + 1 from position root + 1 + path[d] to root + 1 + d; more: a second
    store laid out the same way (the streams beside the KV cache), moved in the same launch."""
    planes, _, elems = data.shape
    more_planes, more_elems = (more.shape[0], more.shape[2]) if more is not None else (0, 0)
    b, dmax = path.shape
    block = min(1024, triton.next_power_of_2(max(elems, more_elems)))
    _move_kernel[(b, planes + more_planes, triton.cdiv(max(elems, more_elems), block))](
        data, data.stride(0), elems, planes, more if more is not None else data,
        more.stride(0) if more is not None else 0, more_elems, roots, path.contiguous(), block_table,
        block_table.stride(0), D=dmax, DP=triton.next_power_of_2(dmax), BLOCK=block, PAGE=block_size, num_warps=4)


@triton.jit(do_not_specialize=["s_bt", "t_all", "n"])
def _next_step_kernel(parents_ptr, tokens_ptr, emitted_ptr, accepted_ptr, pending_ptr, bt_ptr, s_bt, packed_ptr,
                      t_all, bits_ptr, roots_ptr, tree_ptr, result_ptr, depth_ptr, n, W: tl.constexpr,
                      D: tl.constexpr, NP: tl.constexpr, PAGE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, NP)
    live = idx < n
    par = tl.load(parents_ptr + b * n + idx, mask=live, other=-2)
    tok = tl.load(tokens_ptr + b * n + idx, mask=live, other=0)
    # This step's result row: emitted (D + 1) | accepted | the new tree's tokens | parents; the next
    # step's tree the same tokens | parents.
    taken = tl.load(accepted_ptr + b)
    e = tl.arange(0, 2 * NP)
    res = result_ptr + b * (D + 2 + 2 * n)
    tl.store(res + e, tl.load(emitted_ptr + b * (D + 1) + e, mask=e <= D), mask=e <= D)
    tl.store(res + D + 1, taken)
    tl.store(res + D + 2 + idx, tok, mask=live)
    tl.store(res + D + 2 + n + idx, par, mask=live)
    tl.store(tree_ptr + b * 2 * n + idx, tok, mask=live)
    tl.store(tree_ptr + b * 2 * n + n + idx, par, mask=live)
    up = tl.where(par >= 0, par, 0)
    own = tl.full([NP], 1, tl.int64) << (idx + 1).to(tl.int64)
    depth = tl.full([NP], 1, tl.int64)
    bits = tl.where(par == -2, own, own | 1)  # a node sees itself and the root (padding: itself)
    scratch = depth_ptr + b * 2 * NP
    for _ in tl.static_range(D - 1):  # parents precede children: D - 1 rounds settle every path
        tl.store(scratch + idx, depth)
        tl.store(scratch + NP + idx, bits)
        tl.debug_barrier()
        pd = tl.load(scratch + up)
        pb = tl.load(scratch + NP + up)
        tl.debug_barrier()
        depth = tl.where(par >= 0, pd + 1, 1)
        bits = tl.where(par >= 0, own | pb, bits)
    pending = tl.load(pending_ptr + b)
    tl.store(roots_ptr + b, pending)
    row0 = b * W
    # the root row (the bonus token: the one emitted last), then node i at row 1 + i
    tl.store(packed_ptr + row0, tl.load(emitted_ptr + b * (D + 1) + taken))
    tl.store(packed_ptr + t_all + row0, pending)
    tl.store(bits_ptr + row0, 1)
    tl.store(packed_ptr + row0 + 1 + idx, tok, mask=live)
    tl.store(packed_ptr + t_all + row0 + 1 + idx, pending + depth, mask=live)
    tl.store(bits_ptr + row0 + 1 + idx, bits, mask=live)
    w = tl.arange(0, 2 * NP)
    pos = pending + w
    slot = tl.load(bt_ptr + b * s_bt + pos // PAGE, mask=w < W, other=0).to(tl.int64) * PAGE + pos % PAGE
    tl.store(packed_ptr + 2 * t_all + row0 + w, slot, mask=w < W)
    tl.store(packed_ptr + 3 * t_all + b, pending + W)  # the context length


def next_step(emitted: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
              pending: torch.Tensor, block_table: torch.Tensor, block_size: int, packed: torch.Tensor,
              bits: torch.Tensor, roots: torch.Tensor, tree: torch.Tensor, max_depth: int) -> torch.Tensor:
    """After a tree step whose walk gave emitted [B, D + 1] and accepted [B], and whose growth gave the
    new tree (tokens, parents [B, N]): writes the next verify into a tree graph's inputs and returns
    this step's result [B, D + 2 + 2N] (emitted | accepted | tokens | parents).
    - packed (ids | positions | slots for the B x W rows, then context lengths) and bits: row 0 the
      bonus token (emitted[accepted]) at `pending`, row 1 + i node i at pending + its depth; slots
      pending + row;
    - roots [B] = pending; tree [B, 2N] = tokens | parents."""
    b, n = parents.shape
    w = n + 1
    np_ = max(triton.next_power_of_2(n), triton.next_power_of_2(max_depth + 1))
    dev = parents.device
    scratch = torch.empty(b * 2 * np_, dtype=torch.int64, device=dev)
    result = torch.empty(b, max_depth + 2 + 2 * n, dtype=torch.int64, device=dev)
    _next_step_kernel[(b,)](parents.contiguous(), tokens.contiguous(), emitted.contiguous(), accepted, pending,
                            block_table, block_table.stride(0), packed, b * w, bits, roots, tree, result, scratch,
                            n, W=w, D=max_depth, NP=np_, PAGE=block_size, num_warps=1)
    return result

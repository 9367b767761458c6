"""Compile every Triton kernel variant a server can reach before the first request.

Triton compiles a kernel per variant the first time one is launched: per value of each constexpr
(the rejection sampler's K, the attention kernel's query width and split count) and per
"specialisation" of the plain arguments (an int equal to 1 or divisible by 16, a pointer aligned
to 16 bytes). A compile takes a few hundred milliseconds, so a step that hits a new variant
stalls for as long as 50 decode steps. On an H200 that happened mid-benchmark whenever a batch
first drafted a new maximum k, or its eager step had a new query width — inside the very steps the
adaptive policy times, and one stalled step made it price a speculative shape at 4× its cost and
avoid it for good.

Two halves: arguments that vary from step to step for no reason of performance (a block table's
width, a pointer into a packed buffer) are declared unspecialised at the kernels, and the
constexpr variants are all compiled here, once (Triton keeps them on disk, so a restart loads
rather than compiles them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from streamsd.kernels.attention.paged import (
    KERNEL_MAX_QUERY,
    TREE_MAX_QUERY,
    _merge_splits_kernel,
    _paged_attn_kernel,
    decode_attention,
)
from streamsd.kernels.attention.prefill import (
    _merge_tiles_kernel,
    _prefill_attn_kernel,
    prefill_attention,
    prefill_tiles,
    tiles_tensor,
    tokens_per_tile,
)
from streamsd.kernels.exact.attention import _exact_attn_kernel, exact_paged_attention
from streamsd.kernels.model.device_layout import _restart, restart
from streamsd.kernels.precompile import Compiling, device_name, mark_compiled, marker, start
from streamsd.kernels.sample import warp, warp_chunked
from streamsd.kernels.sample.rejection import _rejection_kernel, rejection_sample
from streamsd.kernels.sample.rng import _exponentials_kernel, _uniforms_kernel, exponentials, uniforms
from streamsd.kernels.sample.topk import _chunk_topk_kernel, _merge_topk_kernel
from streamsd.kernels.sample.warp import _sample_kernel, _warp_kernel
from streamsd.kernels.sample.warp_chunked import (
    _argmax_chunk_kernel,
    _chunk_kept_kernel,
    _chunk_stats_kernel,
    _merge_best_kernel,
    _warp_out_kernel,
)
from streamsd.kernels.tree.bookkeeping import _move_kernel, _next_step_kernel, _walk_kernel
from streamsd.kernels.tree.head_topk import _head_topk_kernel, _merge_blocks_kernel
from streamsd.model.device_layout import DeviceStarts
from streamsd.sample.rejection import VerifyInput

_SPLITS = (1, 2, 4, 8, 16)  # every value pick_splits can return


def compiled_variants() -> int:
    """Kernel binaries compiled in this process so far (a step that raises it stalled on a compile)."""
    return sum(compiled_by_kernel().values())


def compiled_by_kernel() -> dict[str, int]:
    """compiled_variants by kernel name (which one compiled inside a step)."""
    counts = {}
    for fn in (_rejection_kernel, _paged_attn_kernel, _merge_splits_kernel, _prefill_attn_kernel, _merge_tiles_kernel,
               _exact_attn_kernel,
               _exponentials_kernel, _uniforms_kernel, _restart, _warp_kernel, _sample_kernel,
               _chunk_stats_kernel, _chunk_kept_kernel, _warp_out_kernel, _merge_best_kernel, _argmax_chunk_kernel,
               _walk_kernel, _move_kernel, _next_step_kernel, _chunk_topk_kernel, _merge_topk_kernel,
               _head_topk_kernel, _merge_blocks_kernel):
        counts[fn.__name__] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts


def begin_warm_up(models: list[Any], cache_dtype: torch.dtype, block_size: int, vocab: int, max_k: int,
                  device: torch.device, trees: bool = False, exact: Any | None = None) -> WarmUp:
    """The warm-up of the attention kernel of each model (head layout; with `trees` its draft-tree
    variants too), the exact attention of the `exact` model (its tree variant with `trees`), the
    rejection sampler for every k ≤ ``max_k`` and the sampling noise. On a first start child
    processes begin compiling them now (kernels/precompile.py); `WarmUp.finish` completes the warm-up
    once they are needed, and whatever runs in between (the CUDA-graph capture) overlaps them."""
    layouts = sorted({(m.args.num_heads, m.args.num_kv_heads, m.args.head_dim) for m in models})
    exact_layout = (exact.args.num_heads, exact.args.num_kv_heads, exact.args.head_dim) if exact is not None else None
    every = variant_tasks(layouts, cache_dtype, block_size, vocab, max_k, device, trees, exact_layout)
    done = marker(every, device_name(device))  # read once: it hashes the kernels' source
    return WarmUp(every, device, done, start(every, device, done))


def variant_tasks(layouts: list[tuple[int, int, int]], cache_dtype: torch.dtype, block_size: int, vocab: int,
                  max_k: int, device: torch.device, trees: bool = False,
                  exact_layout: tuple[int, int, int] | None = None) -> list[partial[None]]:
    """One task per kernel variant a step can reach, each once: the sampling noise and warps, the decode
    and verify attention of every head layout (split-merge included; tree variants with `trees`), its
    prefill attention, the exact attention of `exact_layout`, the rejection sampler and the queued-ahead
    restart for every k <= `max_k`."""
    exact_trees = (False, True) if trees else (False,)
    return [
        partial(_sampling_variants, vocab, cache_dtype, device),
        *_paged_tasks(layouts, cache_dtype, block_size, device, trees),
        *[partial(_prefill_variant, layout, cache_dtype, block_size, device) for layout in layouts],
        *([partial(_exact_variant, exact_layout, cache_dtype, block_size, device, tree) for tree in exact_trees]
          if exact_layout is not None else []),
        *[partial(_rejection_variant, k, has_p, has_q, vocab, device) for k in range(1, max_k + 1)
          for has_p, has_q in ((False, False), (True, False), (True, True))],
        *[partial(_restart_variant, k, device) for k in range(1, max_k + 1)],
    ]


@dataclass(frozen=True)
class WarmUp:
    """A warm-up begun (`begin_warm_up`): its tasks, and the children compiling them on a first start."""

    tasks: list[partial[None]]
    device: torch.device
    done: Path | None  # the marker of the whole set (kernels/precompile.py)
    compiling: Compiling | None

    def finish(self) -> tuple[int, float]:
        """Waits for the children, then runs every task here, where each loads its variant from disk
        or (a child failed, or none ran) compiles it; returns (variants compiled here, seconds).

        One task after another, on this thread: a variant's first launch loads its launcher, a small
        extension module Triton builds per kernel signature, and every one of them has the same
        module name. Loaded from several threads at once, a launch can go through another kernel's
        launcher (Python raises "function takes exactly 46 arguments (26 given)") and the start fails.
        Compiling in parallel is the children's work (kernels/precompile.py); what is left here is
        loading from disk, ~100 variants in well under a second."""
        t0, before = time.perf_counter(), compiled_variants()
        if self.compiling is not None:
            self.compiling.wait()
        with torch.cuda.device(self.device):
            for task in self.tasks:
                task()
        torch.cuda.synchronize(self.device)
        mark_compiled(self.done)
        return compiled_variants() - before, time.perf_counter() - t0

    def cancel(self) -> None:
        """Ends the children of a warm-up that will not be finished (the start failed before)."""
        if self.compiling is not None:
            self.compiling.stop()


def _rejection_variant(k: int, has_p: bool, has_q: bool, vocab: int, device: torch.device) -> None:
    vi = _verify_input(k, vocab, has_p, has_q, device)
    # A step's sampler hashes its own uniforms and noise (Verifier.launch): those variants.
    rejection_sample(replace(vi, uniforms=None, noise=None) if has_p else vi)


def _sampling_variants(vocab: int, cache_dtype: torch.dtype, device: torch.device) -> None:
    seeds, positions = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, 1, dtype=torch.int64, device=device)
    exponentials(seeds, positions, 1, vocab)  # the sampling noise (one BLOCK per vocabulary size)
    uniforms(seeds, positions, 1)
    for dtype in (torch.float32, cache_dtype):  # the target's logits, a draft model's or head's
        logits = torch.zeros(1, vocab, dtype=dtype, device=device)
        one = torch.ones(1, device=device)
        warp.warp(logits, one, one * 0)
        warp.sample_keyed(logits, torch.zeros(3, dtype=torch.int64, device=device), one, one * 0,
                          torch.zeros(1, dtype=torch.int64, device=device), one, 1)
        warp_chunked.warp(logits, one, one * 0)  # inside graphs (an EAGLE head's sampled chain)
        warp_chunked.row_argmax(logits)


def _paged_tasks(layouts: list[tuple[int, int, int]], dtype: torch.dtype, page: int, device: torch.device,
                 trees: bool) -> list[partial[None]]:
    """One task per decode/verify attention variant: head layout, query width, split count, tree or not."""
    tasks = []
    for layout in layouts:
        qmax = 1
        while qmax <= (TREE_MAX_QUERY if trees else KERNEL_MAX_QUERY):
            for splits in _SPLITS:
                tasks += [partial(_paged_variant, layout, dtype, page, device, qmax, splits, tree)
                          for tree in (False, True) if (tree and trees) or (not tree and qmax <= KERNEL_MAX_QUERY)]
            qmax *= 2
    return tasks


def _paged_variant(layout: tuple[int, int, int], dtype: torch.dtype, page: int, device: torch.device, qmax: int,
                   splits: int, tree: bool) -> None:
    heads, kv_heads, dim = layout
    cache = torch.zeros(4, page, kv_heads, dim, dtype=dtype, device=device)  # [NB, BS, KVH, D]
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)  # [S, max_blocks]
    q = torch.zeros(qmax, heads, dim, dtype=dtype, device=device)  # [T, H, D]
    ctx = torch.tensor([qmax], dtype=torch.int32, device=device)  # [S]
    starts = torch.tensor([0, qmax], dtype=torch.int32, device=device)  # [S + 1]
    if not tree:
        decode_attention(q, cache, cache, table, ctx, starts, 1.0, qmax, splits=splits)
        return
    bits = torch.ones(qmax, dtype=torch.int64, device=device)  # [T]
    root = torch.zeros(1, dtype=torch.int64, device=device)  # [S]
    decode_attention(q, cache, cache, table, ctx, starts, 1.0, qmax, splits=splits, tree_bits=bits, tree_start=root)


def _exact_variant(layout: tuple[int, int, int], dtype: torch.dtype, page: int, device: torch.device,
                   tree: bool) -> None:
    """The exact attention of a head layout, or its draft-tree variant."""
    heads, kv_heads, dim = layout
    cache = torch.zeros(4, page, kv_heads, dim, dtype=dtype, device=device)  # [NB, BS, KVH, D]
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)  # [S, max_blocks]
    q = torch.zeros(2, heads, dim, dtype=dtype, device=device)  # [T, H, D]
    ctx = torch.tensor([2], dtype=torch.int32, device=device)  # [S]
    starts = torch.tensor([0, 2], dtype=torch.int32, device=device)  # [S + 1]
    bits = torch.tensor([1, 3], dtype=torch.int64, device=device) if tree else None  # [T] a root and its child
    root = torch.zeros(1, dtype=torch.int64, device=device) if tree else None  # [S]
    exact_paged_attention(q, cache, cache, table, ctx, starts, 1.0, 2, tree_bits=bits, tree_start=root)


def _prefill_variant(layout: tuple[int, int, int], dtype: torch.dtype, page: int, device: torch.device) -> None:
    heads, kv_heads, dim = layout
    cache = torch.zeros(4, page, kv_heads, dim, dtype=dtype, device=device)  # [NB, BS, KVH, D]
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)  # [S, max_blocks]
    chunk = KERNEL_MAX_QUERY + 1
    q = torch.zeros(chunk, heads, dim, dtype=dtype, device=device)  # [T, H, D]
    tiles = prefill_tiles([0], [chunk], [chunk], KERNEL_MAX_QUERY, tokens_per_tile(heads, kv_heads))
    prefill_attention(q, cache, cache, table, tiles, 1.0, torch.empty_like(q))  # an eager step's, no split
    split = [(*tiles[0][:4], s, 2) for s in range(2)]  # a prompt graph's tiles: split or not, merged on the device
    prefill_attention(q, cache, cache, table, tiles_tensor(split, device), 1.0, torch.empty_like(q))


def _verify_input(k: int, vocab: int, has_p: bool, has_q: bool, device: torch.device) -> VerifyInput:
    probs = torch.full((1, k + 1, vocab), 1.0 / vocab, device=device) if has_p else None  # [1, K+1, V]
    return VerifyInput(
        target_probs=probs,
        target_argmax=torch.zeros(1, k + 1, dtype=torch.int64, device=device),  # [1, K+1]
        draft_ids=torch.zeros(1, k, dtype=torch.int64, device=device),  # [1, K]
        draft_probs=torch.full((1, k, vocab), 1.0 / vocab, device=device) if has_q else None,  # [1, K, V]
        dense_q=torch.ones(1, dtype=torch.bool, device=device),
        num_drafts=torch.full((1,), k, dtype=torch.int64, device=device),
        greedy=torch.tensor([not has_p], device=device),
        uniforms=torch.full((1, k), 0.5, device=device),  # [1, K]
        noise=torch.ones(1, k + 1, vocab, device=device) if has_p else None,  # [1, K+1, V]
        seeds=torch.zeros(1, dtype=torch.int64, device=device),
        positions=torch.zeros(1, k + 1, dtype=torch.int64, device=device),  # [1, K+1]
    )


def _restart_variant(k: int, device: torch.device) -> None:
    """A verify queued ahead (target: starts and ids from the verify before; EAGLE head: given starts
    and its base) at width 1 + k, which a uniform step can have for every k."""
    z = torch.zeros(1, dtype=torch.int64, device=device)
    packed = torch.zeros(64, dtype=torch.int64, device=device)
    table = torch.zeros(1, 4, dtype=torch.int32, device=device)
    tokens, drafts = torch.zeros(1, k + 1, dtype=torch.int64, device=device), torch.zeros(1, k, dtype=torch.int64,
                                                                                         device=device)
    restart(packed, 16, DeviceStarts(z.clone(), z, z, tokens, drafts), k + 1, table, 16)
    restart(packed, 16, DeviceStarts(z.clone()), k + 1, table, 16, base=z.clone())

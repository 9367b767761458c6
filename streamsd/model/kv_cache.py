"""Paged KV storage: fixed-size blocks, written at slot indices and read through block tables.

This layer only stores and reads; which request owns which block is the scheduler's business.
Rolling back rejected tokens is a change of the context length the next step passes in: stale
entries past it are never read and are overwritten when the positions are written again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from streamsd.model.arch import ModelArgs


def h2d(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a stream synchronisation.

    `torch.tensor(values, device="cuda")` copies with `non_blocking=False`, which waits for the
    stream, i.e. for all GPU work queued before it. A non-blocking copy from pageable memory is a
    plain cudaMemcpyAsync: the driver stages the bytes before it returns (so the source may die
    at once) and the device copy is queued in order. (Temporary pinned buffers would also work,
    kept safe by the caching host allocator's events; pageable is simpler and just as async.)
    """
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device=device, dtype=dtype)
    return t.to(dtype).to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where each token of a flat batch goes, and what each sequence attends to.

    Host lists drive the CPU reference path; the tensors feed the GPU kernel.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset
    query_starts: list[int]  # per sequence, into the T tokens
    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache after this step's writes
    block_tables: list[list[int]]
    block_table: torch.Tensor  # [S, max_blocks] int32, padded with 0
    context_lens_t: torch.Tensor  # [S] int32
    query_starts_t: torch.Tensor  # [S + 1] int32, prefix sums of query_lens
    # Draft trees (spec_decode/tree.py): token t in the window of a sequence whose window starts at position
    # tree_start[s] >= 0 sees the keys before the window and the window keys whose bits tree_bits[t]
    # sets (bit c: position tree_start + c); other tokens and sequences (tree_start -1) attend causally.
    tree_bits: torch.Tensor | None = None  # [T] int64
    tree_start: torch.Tensor | None = None  # [S] int64
    # A prompt graph's tiles (model/graphs.py): every query is one prompt chunk, cut into these tiles
    # of kernels/attention/prefill.py, [n_tiles * TILE_INTS] int32 on the device, rewritten before each replay.
    prompt_tiles: torch.Tensor | None = None
    # What an attention backend derives from the step once and every layer reuses (e.g. the CUDA
    # backend's routing and prompt tiles), keyed by the backend.
    derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(
        starts: list[int], counts: list[int], block_tables: list[list[int]], block_size: int, device: torch.device,
        trees: list[tuple[list[int], list[int]] | None] | None = None,
    ) -> BatchLayout:
        """starts[i]: first position this step computes for sequence i; counts[i]: how many.
        trees[i]: (depth, bits) of its last len(depth) tokens, its draft tree's window, when sequence
        i verifies one: window row j goes to KV slot w + j, sits at position w + depth[j] and sees
        the keys before w and the window keys bits[j] sets (w: the window's first position)."""
        # Vectorised: a step's rows cover whole prompt chunks and a block table per sequence as long as
        # its context, so a per-token Python loop here cost the host time of a long prompt every step.
        n_seq = len(counts)
        cnt = np.asarray(counts, dtype=np.int64)
        first = np.cumsum(cnt) - cnt  # [S] first flat row of each sequence
        seq = np.repeat(np.arange(n_seq), cnt)  # [T] each row's sequence
        pos = np.asarray(starts, dtype=np.int64)[seq] + np.arange(int(cnt.sum())) - first[seq]  # [T]
        width = max((len(t) for t in block_tables), default=1) or 1
        table = np.zeros((n_seq, width), dtype=np.int64)  # [S, W], padded with 0
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t
        slots = table[seq, pos // block_size] * block_size + pos % block_size  # [T]: a row's KV slot follows its order
        positions, bits, tree_start = pos, None, None
        if trees is not None:
            # A tree window's row j sits at the window's first position plus its depth, not at w + j.
            positions, bits = pos.copy(), np.zeros_like(pos)
            tree_start = np.full(n_seq, -1, dtype=np.int64)
            for i, tree in enumerate(trees):
                if tree is None:
                    continue
                depth, mask = tree
                w = starts[i] + counts[i] - len(depth)
                end = int(first[i]) + counts[i]
                positions[end - len(depth) : end] = w + np.asarray(depth, dtype=np.int64)
                bits[end - len(depth) : end] = np.asarray(mask, dtype=np.int64)
                tree_start[i] = w
        q_starts = first.tolist()
        ctx = [s + c for s, c in zip(starts, counts, strict=True)]
        return BatchLayout(
            positions=h2d(torch.from_numpy(positions), torch.int64, device),
            slot_mapping=h2d(torch.from_numpy(slots), torch.int64, device),
            query_starts=q_starts,
            query_lens=list(counts),
            context_lens=ctx,
            block_tables=block_tables,
            block_table=h2d(torch.from_numpy(table), torch.int32, device),
            context_lens_t=h2d(ctx, torch.int32, device),
            query_starts_t=h2d(q_starts + [len(pos)], torch.int32, device),
            tree_bits=h2d(torch.from_numpy(bits), torch.int64, device) if bits is not None else None,
            tree_start=h2d(torch.from_numpy(tree_start), torch.int64, device) if tree_start is not None else None,
        )

    @staticmethod
    def uniform(q: int, positions: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                context_lens: torch.Tensor, tree_bits: torch.Tensor | None = None,
                tree_start: torch.Tensor | None = None, query_starts: torch.Tensor | None = None) -> BatchLayout:
        """q tokens for each sequence of block_table [S, W], from device tensors alone (a step a CUDA
        graph captures, whose values the host never sees): its host lists are placeholders that only
        steer the kernels' dispatch (`for_host` makes real ones for the torch attention).
        `query_starts` [S + 1] int32 (0, q, 2q, ...): given where many layouts share it (a tree's levels)."""
        s = block_table.shape[0]
        if query_starts is None:
            query_starts = uniform_starts(s, q, block_table.device)
        return BatchLayout(positions, slot_mapping, [i * q for i in range(s)], [q] * s, [q] * s, [[0]] * s, block_table,
                           context_lens.to(torch.int32), query_starts, tree_bits, tree_start)

    def for_host(self, block_size: int) -> BatchLayout:
        """This layout with its host lists read from its tensors where the torch attention runs (a CPU);
        unchanged on CUDA, whose kernels read the tensors only."""
        if self.positions.is_cuda:
            return self
        qs, ctx = self.query_starts_t.tolist(), self.context_lens_t.tolist()
        tables = [row[: -(-c // block_size)] if c > 0 else [] for row, c in zip(self.block_table.tolist(), ctx,
                                                                                strict=True)]
        return replace(self, query_starts=qs[:-1], query_lens=[b - a for a, b in zip(qs, qs[1:], strict=False)],
                       context_lens=ctx, block_tables=tables, derived={})

    @property
    def has_trees(self) -> bool:
        return self.tree_bits is not None


def uniform_starts(s: int, q: int, device: torch.device) -> torch.Tensor:
    """Query starts [S + 1] int32 of S sequences of q tokens each."""
    return (torch.arange(s + 1, device=device) * q).to(torch.int32)


class PagedKVCache:
    """K and V for every layer: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]  # each [NB, BS, KVH, D]

    @staticmethod
    def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, KVH, D] into the flat slots [T]."""
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_cache.dtype))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V at flat slots src [M] copied to dst [M] (all read before any is
        written): a verified tree's accepted nodes to their positions (spec_decode/tree.py)."""
        flat = self.data.view(*self.data.shape[:2], -1, *self.data.shape[-2:])  # [L, 2, slots, KVH, D]
        flat[:, :, dst] = flat[:, :, src]

    @staticmethod
    def bytes_for(args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
        return num_blocks * block_size * args.kv_bytes_per_token(dtype)

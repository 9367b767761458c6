"""Paged KV storage: fixed-size blocks, written at slot indices and read through block tables.

This layer only stores and reads; which request owns which block is the scheduler's business.
Rolling back rejected tokens is a change of the context length the next step passes in: stale
entries past it are never read and are overwritten when the positions are written again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    # What an attention backend derives from the step once and every layer reuses (e.g. the CUDA
    # backend's routing and prompt tiles), keyed by the backend.
    derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(
        starts: list[int], counts: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
    ) -> BatchLayout:
        """starts[i]: first position this step computes for sequence i; counts[i]: how many."""
        positions: list[int] = []
        slots: list[int] = []
        q_starts: list[int] = []
        for start, count, table in zip(starts, counts, block_tables, strict=True):
            q_starts.append(len(positions))
            for pos in range(start, start + count):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        ctx = [s + c for s, c in zip(starts, counts, strict=True)]
        return BatchLayout(
            positions=h2d(positions, torch.int64, device),
            slot_mapping=h2d(slots, torch.int64, device),
            query_starts=q_starts,
            query_lens=list(counts),
            context_lens=ctx,
            block_tables=block_tables,
            block_table=h2d(padded, torch.int32, device),
            context_lens_t=h2d(ctx, torch.int32, device),
            query_starts_t=h2d(q_starts + [len(positions)], torch.int32, device),
        )


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

    @staticmethod
    def bytes_for(args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
        return num_blocks * block_size * args.kv_bytes_per_token(dtype)

"""The target's residual streams kept per KV slot, for an EAGLE head that catches up later.

An EAGLE head reads the target's streams at the layers it fuses (spec/eagle.py). A step's streams
exist only while that step runs, so without a place to keep them the head had to follow every step,
plain ones included: an EAGLE engine could not take the genuine plain step (the target alone,
queued ahead, lookahead.py) when the adaptive policy chose k = 0 for the whole batch. Every target
forward of such an engine therefore also writes each token's streams here, at the same flat slot as
its K/V (in a CUDA graph, inside the graph). The head catches up from here when a request speculates
again, the way a draft model replays its missed KV as a prefill chunk, and the planner prices that
replay (CostTable.catchup). A slot's streams are valid exactly when its K/V is: the same forwards
write both, at the same slots, so a rejected draft's slot is rewritten before anything reads it.
"""

from __future__ import annotations

import numpy as np
import torch

from streamsd.model.kv_cache import h2d


class StreamStore:
    """[num_blocks * block_size, len(layers) * hidden] streams, one row per KV slot."""

    def __init__(self, layers: tuple[int, ...], hidden: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.layers = layers  # the target layers whose input streams are kept, ascending
        self.block_size = block_size
        self.data = torch.zeros(num_blocks * block_size, len(layers) * hidden, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(layers: tuple[int, ...], hidden: int, dtype: torch.dtype) -> int:
        return len(layers) * hidden * torch.empty(0, dtype=dtype).element_size()

    def write(self, streams: torch.Tensor, slots: torch.Tensor) -> None:
        """streams [T, layers * hidden] at the flat KV slots [T]."""
        self.data.index_copy_(0, slots, streams.to(self.data.dtype))

    def read(self, tables: list[list[int]], starts: list[int], counts: list[int]) -> torch.Tensor:
        """The streams of positions starts[i] .. starts[i] + counts[i] - 1 of each sequence (its block
        table tables[i]), packed in that order: [sum(counts), layers * hidden]."""
        slots = torch.from_numpy(self.slots(tables, starts, counts))
        return self.data.index_select(0, h2d(slots, torch.int64, self.data.device))

    def slots(self, tables: list[list[int]], starts: list[int], counts: list[int]) -> np.ndarray:
        bs = self.block_size
        out = []
        for table, start, n in zip(tables, starts, counts, strict=True):
            pos = np.arange(start, start + n)
            out.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

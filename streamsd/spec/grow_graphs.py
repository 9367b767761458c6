"""A draft tree's growth (spec/eagle_tree.py) as one CUDA graph per (batch bucket, draw).

A tree step's graph (tree_graphs.py) grows the next tree inside its own replay. The growths left to
the proposer are the first tree of a request (after its prompt, its head caught up on it) and the
tree after any eager step; eager, one is ~75 launches from Python (4-6 ms of a request's first
step on the H200, scripts/step_timeline.py). Here it is one replay: the head's output at each
request's last caught-up slot, its pending position, its blocks and its draw go into static
buffers, the growth runs captured, and the host reads tokens | parents. Padding rows grow a tree at
position 0 through a table of the scratch block: they write only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamsd.config import TreeShape
from streamsd.model.kv_cache import h2d
from streamsd.request import Request
from streamsd.spec.eagle_head import EagleHead
from streamsd.spec.eagle_tree import GrowConsts, HeadLayer, Race, grow

BUCKETS = (1, 2, 4, 8, 16)


@dataclass(slots=True)
class _Grow:
    graph: torch.cuda.CUDAGraph | None  # None off CUDA: the same buffers, run eagerly
    h0: torch.Tensor  # [B, H] the head's output at each request's last caught-up slot
    pending: torch.Tensor  # [B] int64 the pending token's position
    table: torch.Tensor  # [B, max_blocks] int32
    draws: torch.Tensor  # [2, B] int64 greedy flags | seeds
    temperature: torch.Tensor  # [B] float32
    consts: GrowConsts
    out: torch.Tensor | None = None  # [B, 2N] tokens | parents, written by each replay


class GrowGraphs:
    def __init__(self, head: EagleHead, layer: HeadLayer, shape: TreeShape, block_size: int, max_blocks: int,
                 scratch: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 buckets: tuple[int, ...] = BUCKETS):
        self.head, self.layer, self.shape = head, layer, shape
        self.block_size, self.max_blocks, self.scratch = block_size, max_blocks, scratch
        self.hidden, self.dtype, self.device = hidden, dtype, device
        self.buckets = buckets
        self.graphs: dict[tuple[int, bool], _Grow] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.replays = 0

    def key_for(self, reqs: list[Request], tables: list[list[int]]) -> tuple[int, bool] | None:
        """(bucket, sampled) of the graph that grows these requests' trees, or None (eagerly)."""
        bucket = next((b for b in self.buckets if b >= len(reqs)), None)
        if bucket is None or max(len(t) for t in tables) > self.max_blocks:
            return None
        return bucket, not all(r.params.greedy for r in reqs)

    def run(self, key: tuple[int, bool], h0: torch.Tensor, pending: list[int], tables: list[list[int]],
            reqs: list[Request]) -> torch.Tensor:
        """h0 [n, H] -> tokens | parents [n, 2N] (a view, valid until this graph replays again)."""
        g = self.graphs.get(key) or self._capture(*key)
        n, b = len(reqs), key[0]
        table = [[*t, *[self.scratch] * (self.max_blocks - len(t))] for t in tables]
        table += [[self.scratch] * self.max_blocks] * (b - n)
        g.table.copy_(h2d(table, torch.int32, self.device))
        g.pending.copy_(h2d([*pending, *[0] * (b - n)], torch.int64, self.device))
        g.h0[:n].copy_(h0)
        if key[1]:
            g.draws.copy_(h2d([[int(r.params.greedy) for r in reqs] + [1] * (b - n),
                               [r.seed for r in reqs] + [0] * (b - n)], torch.int64, self.device))
            g.temperature.copy_(h2d([r.params.temperature or 1.0 for r in reqs] + [0.0] * (b - n), torch.float32,
                                    self.device))
        if g.graph is None:
            self._grow(g, key[1])
        else:
            g.graph.replay()
        self.replays += 1
        assert g.out is not None
        return g.out[:n]

    def capture_up_to(self, batch: int) -> None:
        for bucket in [b for b in self.buckets if b < batch] + [b for b in self.buckets if b >= batch][:1]:
            for sampled in (False, True):
                if (bucket, sampled) not in self.graphs:
                    self._capture(bucket, sampled)

    def _grow(self, g: _Grow, sampled: bool) -> None:
        race = Race(g.draws[0], g.draws[1], g.temperature) if sampled else None
        tokens, parents = grow(self.head, self.layer, g.h0, g.pending, g.table, self.block_size, self.shape, race,
                               g.consts)  # [B, N] each
        g.out = torch.cat([tokens, parents], dim=1)

    def _capture(self, bucket: int, sampled: bool) -> _Grow:
        dev = self.device
        g = _Grow(torch.cuda.CUDAGraph() if dev.type == "cuda" else None,
                  torch.zeros(bucket, self.hidden, dtype=self.dtype, device=dev),
                  torch.zeros(bucket, dtype=torch.int64, device=dev),
                  torch.full((bucket, self.max_blocks), self.scratch, dtype=torch.int32, device=dev),
                  torch.stack([torch.ones(bucket, dtype=torch.int64, device=dev),
                               torch.zeros(bucket, dtype=torch.int64, device=dev)]),
                  torch.zeros(bucket, dtype=torch.float32, device=dev), GrowConsts.build(bucket, self.shape, dev))
        self.graphs[(bucket, sampled)] = g
        if g.graph is None:
            return g
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
            self._grow(g, sampled)
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            self._grow(g, sampled)
        return g

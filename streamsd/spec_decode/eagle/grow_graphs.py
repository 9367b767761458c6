"""A draft tree's growth (spec_decode/eagle/tree.py) as CUDA graphs: per (batch bucket, draw), and for a lone
request per catch-up width too, its catch-up and growth in one replay.

A tree step's graph (worker/tree_graphs.py) grows the next tree inside its own replay. The growths left to
the proposer are a request's first tree (its head caught up on the prompt first) and the tree after
any eager step. Eager, a growth is ~75 launches from Python, and a catch-up over a prompt ~20 more
that cuBLAS and Triton first meet at each new prompt length: 4-12 ms of a request's first step on
an H200. Here it is one replay. A growth graph takes the head's output
at each request's last caught-up slot, its pending position, its blocks and its draw in static
buffers; a catch-up graph (bucket 1) takes the catch-up's slots packed as a prompt graph packs a
prompt chunk (model/graphs.py: padded to its width, its attention tiles and the row to grow from
rewritten per replay) and grows from that row. Padding rows grow a tree at position 0 through a
table of the scratch block, and pad a catch-up into that block: they write only there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from streamsd.config import TreeShape
from streamsd.model.capture import capture
from streamsd.model.graph_layout import (
    TILE_INTS,
    pack_step,
    packed_size,
    prompt_tile_count,
    static_layout,
    with_prompt_tail,
)
from streamsd.model.graphs import buckets_up_to
from streamsd.model.kv_cache import h2d
from streamsd.model.stream_store import StreamStore
from streamsd.model.tree_layout import Race
from streamsd.request import Request
from streamsd.spec_decode.eagle.head import EagleHead
from streamsd.spec_decode.eagle.tree import GrowConsts, HeadLayer, grow

BUCKETS = (1, 2, 4, 8, 16)


@dataclass(slots=True)
class _Grow:
    graph: torch.cuda.CUDAGraph | None  # None off CUDA: the same buffers, run eagerly
    h0: torch.Tensor  # [B, H] the head's output at each request's last caught-up slot (growth graphs)
    pending: torch.Tensor  # [B] int64 the pending token's position
    table: torch.Tensor  # [B, max_blocks] int32
    draws: torch.Tensor  # [2, B] int64 greedy flags | seeds
    temperature: torch.Tensor  # [B] float32
    consts: GrowConsts
    # A catch-up graph's W slots: ids | positions | slots | context | query starts | the row to grow
    # from | its tiles (model/graphs.py's prompt graph layout)
    packed: torch.Tensor | None = None
    tiles: torch.Tensor | None = None  # [n_tiles * TILE_INTS] int32, copied from `packed` inside the graph
    out: torch.Tensor | None = None  # [B, 2N] tokens | parents, written by each replay


class GrowGraphs:
    def __init__(self, head: EagleHead, layer: HeadLayer, shape: TreeShape, block_size: int, max_blocks: int,
                 scratch: int, dtype: torch.dtype, device: torch.device, store: StreamStore | None = None,
                 widths: tuple[int, ...] = (), buckets: tuple[int, ...] = BUCKETS):
        self.head, self.layer, self.shape, self.store = head, layer, shape, store
        self.block_size, self.max_blocks, self.scratch = block_size, max_blocks, scratch
        self.hidden, self.dtype, self.device = head.spec.args.hidden_size, dtype, device
        self.buckets, self.widths = buckets, widths if store is not None else ()
        self.graphs: dict[tuple[int, bool, int], _Grow] = {}  # (bucket, sampled, catch-up width or 0)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.replays = 0

    def key_for(self, reqs: list[Request], tables: list[list[int]]) -> tuple[int, bool, int] | None:
        """The growth graph for these requests' trees, or None (eagerly)."""
        bucket = next((b for b in self.buckets if b >= len(reqs)), None)
        if bucket is None or max(len(t) for t in tables) > self.max_blocks:
            return None
        return bucket, not all(r.params.greedy for r in reqs), 0

    def catch_up_key(self, req: Request, count: int, table: list[int]) -> tuple[int, bool, int] | None:
        """The catch-up graph for one request's catch-up over `count` slots and its growth, or None."""
        width = next((w for w in self.widths if w >= count), None)
        if width is None or len(table) > self.max_blocks:
            return None
        return 1, not req.params.greedy, width

    def run(self, key: tuple[int, bool, int], h0: torch.Tensor, pending: list[int], tables: list[list[int]],
            reqs: list[Request]) -> torch.Tensor:
        """h0 [n, H] -> tokens | parents [n, 2N] (a view, valid until this graph replays again)."""
        g = self.graphs.get(key) or self._capture(*key)
        g.h0[: len(reqs)].copy_(h0)
        return self._replay(g, key, pending, tables, reqs)

    def run_catch_up(self, key: tuple[int, bool, int], ids: list[int], start: int, count: int, table: list[int],
                     req: Request) -> torch.Tensor:
        """The head caught up on `count` slots from `start` (ids: the token after each), then its tree
        grown from the last: tokens | parents [1, 2N] (a view, valid until this graph replays again)."""
        g = self.graphs.get(key) or self._capture(*key)
        assert g.packed is not None and g.tiles is not None
        host, _ = pack_step(ids, [start], [count], [table], 1, key[2], self.scratch, self.block_size)
        host = with_prompt_tail(host, start, count, key[2], g.tiles.numel() // TILE_INTS, count - 1)
        g.packed.copy_(torch.from_numpy(host), non_blocking=True)
        return self._replay(g, key, [start + count], [table], [req])

    def _replay(self, g: _Grow, key: tuple[int, bool, int], pending: list[int], tables: list[list[int]],
                reqs: list[Request]) -> torch.Tensor:
        n, b = len(reqs), key[0]
        table = [[*t, *[self.scratch] * (self.max_blocks - len(t))] for t in tables]
        table += [[self.scratch] * self.max_blocks] * (b - n)
        g.table.copy_(h2d(table, torch.int32, self.device))
        g.pending.copy_(h2d([*pending, *[0] * (b - n)], torch.int64, self.device))
        if key[1]:
            g.draws.copy_(h2d([[int(r.params.greedy) for r in reqs] + [1] * (b - n),
                               [r.seed for r in reqs] + [0] * (b - n)], torch.int64, self.device))
            g.temperature.copy_(h2d([r.params.temperature or 1.0 for r in reqs] + [0.0] * (b - n), torch.float32,
                                    self.device))
        if g.graph is None:
            self._grow(g, key)
        else:
            g.graph.replay()
        self.replays += 1
        assert g.out is not None
        return g.out[:n]

    def capture_up_to(self, batch: int) -> None:
        keys = [(b, s, 0) for b in buckets_up_to(self.buckets, batch) for s in (False, True)] \
            + [(1, s, w) for w in self.widths for s in (False, True)]
        for key in keys:
            if key not in self.graphs:
                self._capture(*key)

    def _grow(self, g: _Grow, key: tuple[int, bool, int]) -> None:
        h0 = g.h0
        if g.packed is not None and g.tiles is not None:  # the catch-up first: its last row is h0
            assert self.store is not None
            width = key[2]
            g.tiles.copy_(g.packed[-g.tiles.numel() :])  # the host writes them as int64
            ids, layout = static_layout(g.packed, g.table, 1, width, self.scratch)
            layout = replace(layout, prompt_tiles=g.tiles).for_host(self.block_size)  # a CPU's attention reads lists
            feats = self.head.features(self.store.gather(layout.slot_mapping))  # [W, H]
            tail = packed_size(1, width)
            last = g.packed[tail : tail + 1]  # [1] the row to grow from
            h0 = self.layer(ids, feats, layout).index_select(0, last)  # [1, H]
        race = Race(g.draws[0], g.draws[1], g.temperature) if key[1] else None
        tokens, parents = grow(self.head, self.layer, h0, g.pending, g.table, self.block_size, self.shape, race,
                               g.consts)  # [B, N] each
        g.out = torch.cat([tokens, parents], dim=1)

    def _capture(self, bucket: int, sampled: bool, width: int) -> _Grow:
        dev = self.device
        g = _Grow(torch.cuda.CUDAGraph() if dev.type == "cuda" else None,
                  torch.zeros(bucket, self.hidden, dtype=self.dtype, device=dev),
                  torch.zeros(bucket, dtype=torch.int64, device=dev),
                  torch.full((bucket, self.max_blocks), self.scratch, dtype=torch.int32, device=dev),
                  torch.stack([torch.ones(bucket, dtype=torch.int64, device=dev),
                               torch.zeros(bucket, dtype=torch.int64, device=dev)]),
                  torch.zeros(bucket, dtype=torch.float32, device=dev), GrowConsts.build(bucket, self.shape, dev))
        if width:
            a = self.head.spec.args
            n_tiles = prompt_tile_count(width, a.num_heads, a.num_kv_heads)
            empty = pack_step([], [], [], [], 1, width, self.scratch, self.block_size)[0]  # all padding
            g.packed = torch.from_numpy(np.concatenate([empty, np.zeros(1 + TILE_INTS * n_tiles, dtype=np.int64)])).to(dev)
            g.tiles = torch.zeros(TILE_INTS * n_tiles, dtype=torch.int32, device=dev)
        key = (bucket, sampled, width)
        self.graphs[key] = g
        if g.graph is None:
            return g
        assert self.pool is not None
        capture(g.graph, self.pool, dev, lambda: self._grow(g, key))
        return g

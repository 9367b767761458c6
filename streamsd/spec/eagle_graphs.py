"""One CUDA graph per EAGLE propose call: the head's catch-up and its whole draft chain.

Eagerly, a propose call of a one-layer head is about 60 kernel launches per head forward, five
forwards per step, plus a host-built layout per draft: on a small target that costs ten times the
verify itself. Here a call is one replay. Its inputs live in static buffers refreshed by queued
host-to-device copies, as the target's graphs do (model/graphs.py); every int64 input shares one
buffer, so a call costs one copy of them (plus the block table and, when sampling, the warp floats):

- the catch-up tokens of every request packed `width` (= K + 1, the most a verify can accept) per
  row: ids, positions, KV slots, context lengths; the target's streams for them; the row of each
  request's last caught-up token, whose output gives draft 0;
- per chain step j (draft j fed back to predict draft j + 1): positions, slots and context lengths
  of width 1. A request that wants fewer drafts than the graph makes (k_i < steps) still runs
  every step, but its surplus steps write to the scratch block and their drafts are dropped.

Captured per (batch bucket, steps, mode). GREEDY: argmax drafts (one-hot q). SAMPLED (SORTED when
some row uses top-k or top-p): each row is warped at its own parameters, drafts race with noise keyed
by (seed, position, DRAFT) and every sampled row's q goes to its q-pool slot, all as the eager
DraftPicker does; greedy rows in such a batch take the argmax and, like padding rows, write their q
to the pool's spare last row. Prefill chunks (more than `width` catch-up tokens) run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from streamsd.model.graphs import BUCKETS, buckets_up_to, pack_step, static_layout
from streamsd.model.kv_cache import BatchLayout
from streamsd.sampling.warp import WarpParams
from streamsd.spec.drafting import draw_drafts
from streamsd.spec.eagle_head import EagleHead, HeadAttention

GREEDY, SAMPLED, SORTED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class DraftRow:
    """How one request draws its drafts (SAMPLED / SORTED graphs)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    greedy: bool  # a greedy draft (one-hot q) beside sampled ones
    seed: int
    q_slot: int  # its q-pool slot (the pool's spare row when greedy)


@dataclass(slots=True)
class _ChainGraph:
    graph: torch.cuda.CUDAGraph
    bucket: int
    steps: int
    mode: int
    # Every int64 input in one buffer, refreshed by one copy: catch-up layout | last rows | chain
    # layouts | draws. The fields below are views of it.
    inputs: torch.Tensor
    packed: torch.Tensor  # [3T + 2B + 1] the catch-up layout (graphs.pack_step)
    last_rows: torch.Tensor  # [B] the catch-up row whose output gives draft 0
    chain: torch.Tensor  # [max(steps - 1, 1), 3B + 2B + 1] one width-1 layout per chain step
    draw_i: torch.Tensor  # [B, 4]: greedy, seed, draft 0's position, q slot (sampling modes)
    block_table: torch.Tensor  # [B, max_blocks] int32
    streams: torch.Tensor  # [T, n * Ht] the target's streams at the catch-up tokens
    warp_f: torch.Tensor  # [B, 4] float32: temperature, top-k, top-p, min-p (sampling modes)
    drafts: torch.Tensor | None = None  # [B, steps] int64, written by each replay


class EagleGraphs:
    def __init__(self, head: EagleHead, attend_for: Callable[[BatchLayout], HeadAttention], block_size: int,
                 scratch: int, max_blocks: int, width: int, stream_dtype: torch.dtype, device: torch.device,
                 q_pool: torch.Tensor | None = None, buckets: tuple[int, ...] = BUCKETS):
        self.head = head
        self.q_pool = q_pool  # [slots + 1, K, V]: the last row takes the q nobody reads
        self.attend_for = attend_for  # layout -> the head layer's attention over its paged KV (the proposer's)
        self.block_size = block_size
        self.scratch = scratch
        self.max_blocks = max_blocks
        self.width = width
        self.stream_dtype = stream_dtype
        self.device = device
        self.buckets = buckets
        self.graphs: dict[tuple[int, int, int], _ChainGraph] = {}
        self.pool: tuple[int, int] | None = None  # made at the first capture
        self.replays = 0

    @property
    def spare_q_slot(self) -> int:
        return self.q_pool.shape[0] - 1 if self.q_pool is not None else 0

    def key_for(self, counts: list[int], tables: list[list[int]], steps: int,
                rows: list[DraftRow] | None = None) -> tuple[int, int, int] | None:
        """(bucket, steps, mode) of the graph that runs this call, or None to run it eagerly. `rows`:
        the drafting requests' draws when some of them sample (None: all greedy)."""
        bucket = next((b for b in self.buckets if b >= len(counts)), None)
        if bucket is None or not counts or max(counts) > self.width or min(counts) < 1:
            return None
        if max(len(t) for t in tables) > self.max_blocks:
            return None
        if rows is None or all(r.greedy for r in rows):
            return bucket, steps, GREEDY
        if self.q_pool is None:
            return None
        sort = any(r.top_k > 0 or r.top_p < 1.0 for r in rows if not r.greedy)
        return bucket, steps, SORTED if sort else SAMPLED

    def capture_up_to(self, batch: int, mode: int = GREEDY) -> None:
        """Every (bucket, steps) graph of `mode` a call over at most `batch` requests replays."""
        for bucket in buckets_up_to(self.buckets, batch):
            for steps in range(self.width):
                if (bucket, steps, mode) not in self.graphs:
                    self._capture(bucket, steps, mode)

    def run(self, key: tuple[int, int, int], ids: list[int], streams: torch.Tensor, starts: list[int],
            counts: list[int], tables: list[list[int]], ks: list[int], draft_starts: list[int],
            rows: list[DraftRow] | None = None) -> torch.Tensor:
        """Drafts [len(counts), steps] (a view valid until the next replay). Request i caught up on
        counts[i] slots from starts[i]; it wants ks[i] drafts, the first at position draft_starts[i],
        drawn as rows[i] says (sampling modes)."""
        g = self.graphs.get(key) or self._capture(*key)
        n, bucket = len(counts), g.bucket
        host = np.empty(g.inputs.shape[0], dtype=np.int64)
        packed, table = pack_step(ids, starts, counts, tables, bucket, self.width, self.scratch, self.block_size)
        end = packed.shape[0]
        host[:end] = packed
        last = host[end : end + bucket]
        last[:n] = np.cumsum(counts) - 1
        last[n:] = 0
        end += bucket
        chain = self._chain_layouts(table, ks, draft_starts, bucket, g.chain.shape[0])
        host[end : end + chain.size] = chain.reshape(-1)
        end += chain.size
        draws = host[end:].reshape(bucket, 4)
        draws[:] = (1, 0, 0, self.spare_q_slot)  # greedy, q to the spare slot (and all padding rows)
        if rows is not None and g.mode != GREEDY:
            # Whole arrays from Python lists: per-row numpy assignments cost ~5 us a request.
            wf = np.zeros((bucket, 4), dtype=np.float32)
            wf[:n] = [(r.temperature, r.top_k, r.top_p, r.min_p) for r in rows]
            draws[:n] = [(r.greedy, r.seed, d, self.spare_q_slot if r.greedy else r.q_slot)
                         for r, d in zip(rows, draft_starts, strict=True)]
            g.warp_f.copy_(torch.from_numpy(wf), non_blocking=True)
        g.inputs.copy_(torch.from_numpy(host), non_blocking=True)
        g.block_table[: table.shape[0], : table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
        g.streams[: streams.shape[0]].copy_(streams)
        g.graph.replay()
        self.replays += 1
        assert g.drafts is not None
        return g.drafts[:n]

    def _chain_layouts(self, table: np.ndarray, ks: list[int], draft_starts: list[int], bucket: int,
                       steps: int) -> np.ndarray:
        """[steps, 5B + 1]: chain step j's width-1 layout (graphs.pack_step's) in row j. Draft j goes
        into the head's slot one before its position. Rows that need no step j (ks[i] <= j + 1)
        attend to their first slot and write to the scratch block, as do the bucket's padding rows.
        `table` [n, w]: the requests' block tables."""
        bs, n, b = self.block_size, len(ks), bucket
        out = np.zeros((steps, 5 * b + 1), dtype=np.int64)
        j = np.arange(steps)[:, None]  # [J, 1]
        live = np.asarray(ks, dtype=np.int64)[None, :] > j + 1  # [J, n]
        pos = np.where(live, np.asarray(draft_starts, dtype=np.int64)[None, :] - 1 + j, 0)  # [J, n]
        block = table[np.arange(n)[None, :], pos // bs].astype(np.int64)  # [J, n]
        scratch = self.scratch * bs + np.arange(b) % bs  # [B]
        out[:, b : b + n] = pos
        out[:, 2 * b : 2 * b + n] = np.where(live, block * bs + pos % bs, scratch[:n])
        out[:, 2 * b + n : 3 * b] = scratch[: b - n]
        out[:, 3 * b : 3 * b + n] = pos + 1
        out[:, 4 * b : 4 * b + n] = np.arange(n)
        out[:, 4 * b + n :] = n
        return out

    def _forward(self, g: _ChainGraph) -> torch.Tensor:
        """The captured work: catch-up, then `steps` greedy drafts -> [B, steps]."""
        head, bucket = self.head, g.bucket
        ids, layout = static_layout(g.packed, g.block_table, bucket, self.width, self.scratch)
        out = head.run_layer(ids, head.features(g.streams), layout.positions, self.attend_for(layout))  # [T, H]
        h = out.index_select(0, g.last_rows)  # [B, H]
        drafts = []
        for j in range(g.steps):
            tok = head.greedy_draft(h) if g.mode == GREEDY else self._sample(g, h, j)  # [B]
            drafts.append(tok)
            if j + 1 < g.steps:
                _, lay = static_layout(g.chain[j], g.block_table, bucket, 1, self.scratch)
                h = head.run_layer(tok, h, lay.positions, self.attend_for(lay))  # [B, H]
        if not drafts:  # a catch-up-only call (every k = 0)
            return h.new_zeros(bucket, 0, dtype=torch.int64)
        return torch.stack(drafts, dim=1)  # [B, steps]

    def _sample(self, g: _ChainGraph, h: torch.Tensor, j: int) -> torch.Tensor:
        """Draft j of every row as spec/drafting.py's DraftPicker draws it; q into the pool. h [B, H] -> [B]."""
        assert self.q_pool is not None
        wf, wi = g.warp_f, g.draw_i
        wp = WarpParams(wf[:, 0], wf[:, 1].long(), wf[:, 2], wf[:, 3], g.mode == SORTED)
        tokens, q = draw_drafts(self.head.target_logits(h), wp, wi[:, 0].bool(), wi[:, 1], wi[:, 2] + j)  # [B], [B, V]
        self.q_pool[wi[:, 3], j] = q
        return tokens

    def _capture(self, bucket: int, steps: int, mode: int = GREEDY) -> _ChainGraph:
        dev, bs, t_all = self.device, self.block_size, bucket * self.width
        empty = pack_step([], [], [], [], bucket, self.width, self.scratch, bs)[0]  # all padding: safe to run
        chain0 = pack_step([], [], [], [], bucket, 1, self.scratch, bs)[0]
        n_chain = max(steps - 1, 1)
        host = np.concatenate([empty, np.zeros(bucket, dtype=np.int64), np.tile(chain0, n_chain),
                               np.tile(np.array([1, 0, 0, self.spare_q_slot], dtype=np.int64), bucket)])
        inputs = torch.from_numpy(host).to(dev)
        p, c = empty.shape[0], chain0.shape[0]
        n_in = len(self.head.input_layers) * self.head.spec.target_hidden_size
        g = _ChainGraph(
            torch.cuda.CUDAGraph(), bucket, steps, mode, inputs, inputs[:p], inputs[p : p + bucket],
            inputs[p + bucket : p + bucket + n_chain * c].view(n_chain, c), inputs[p + bucket + n_chain * c :].view(bucket, 4),
            torch.full((bucket, self.max_blocks), self.scratch, dtype=torch.int32, device=dev),
            torch.zeros(t_all, n_in, dtype=self.stream_dtype, device=dev),
            torch.zeros(bucket, 4, dtype=torch.float32, device=dev))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
            self._forward(g)
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.drafts = self._forward(g)
        self.graphs[(bucket, steps, mode)] = g
        return g

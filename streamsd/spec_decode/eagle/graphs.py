"""One CUDA graph per EAGLE propose call: the head's catch-up and its whole draft chain.

Eagerly, a propose call of a one-layer head is dozens of kernel launches per head forward, one
forward per draft, plus a host-built layout per draft: on a small target that costs several times
the verify itself. Here a call is one replay. Its inputs live in static buffers refreshed by queued
host-to-device copies, as the target's graphs do (model/graphs.py); every int64 input shares one
buffer, so a call costs one copy of them (plus the block table and, when sampling, the warp floats):

- the catch-up tokens of every request packed from the front (graphs.pack_step, at most `width` =
  K + 1 each): ids, positions, KV slots, context lengths; the target's streams for them;
- per request: the catch-up row that gives draft 0 (`first_row + accepted`), the position of draft 0
  (`base + accepted`), the drafts it wants, and its draws. Chain step j (draft j fed back to predict
  draft j + 1) writes the head's slot one before draft j + 1; its layout is worked out inside the
  graph from those, so it may depend on a count the host has not read yet. A request that wants
  fewer drafts than the graph makes still runs every step, but its surplus steps write to the
  scratch block and their drafts are dropped.

Two ways in. `run`: the host knows every token (after it read the verify's result; accepted = 0).
`run_chained`: straight after the rejection sampler, before any host read: the catch-up covers
all 1 + k_i verified rows of each request with the sampler's output tokens (rows past the accepted prefix write head
slots that the chain, or the next call's catch-up, overwrites before anything reads them) and the
accepted counts stay on the device. The verify's tokens and the drafts then come back in one read.

Captured per (batch bucket, steps, mode). GREEDY: argmax drafts (one-hot q). SAMPLED (SORTED when
some row uses top-k or top-p): each row is warped at its own parameters, drafts race with noise keyed
by (seed, position, DRAFT) and every sampled row's q goes to its q-pool slot, all as the eager
DraftPicker does; greedy rows in such a batch take the argmax and, like padding rows, write their q
to the pool's spare last row. Prefill chunks (more than `width` catch-up tokens) run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from streamsd.model.capture import capture
from streamsd.model.device_layout import DeviceStarts, restart
from streamsd.model.graph_layout import pack_step, static_layout
from streamsd.model.graphs import BUCKETS, buckets_up_to
from streamsd.model.kv_cache import BatchLayout, h2d
from streamsd.model.stream_store import StreamStore
from streamsd.sample.warp import WarpParams
from streamsd.spec_decode.drafting import draw_drafts
from streamsd.spec_decode.eagle.head import EagleHead
from streamsd.spec_decode.eagle.tree import HeadLayer  # the proposer's

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
    graph: torch.cuda.CUDAGraph | None
    bucket: int
    steps: int
    mode: int
    # Every int64 input in one buffer, refreshed by one copy: catch-up layout | per-request rows.
    # The fields below are views of it.
    inputs: torch.Tensor
    packed: torch.Tensor  # [3T + 2B + 1] the catch-up layout (graphs.pack_step)
    first_row: torch.Tensor  # [B] the catch-up row that gives draft 0 when nothing more is accepted
    base: torch.Tensor  # [B] draft 0's position when nothing more is accepted
    accepted: torch.Tensor  # [B] added to both (run_chained overwrites it on the device)
    wants: torch.Tensor  # [B] drafts each request wants (0 for padding)
    draws: torch.Tensor  # [B, 3]: greedy, seed, q slot (sampling modes)
    block_table: torch.Tensor  # [B, max_blocks] int32
    streams: torch.Tensor  # [T, n * Ht] the target's streams at the catch-up tokens
    warp_f: torch.Tensor  # [B, 4] float32: temperature, top-k, top-p, min-p (sampling modes)
    query_starts: torch.Tensor  # [B + 1] arange: every chain step is one token per row
    drafts: torch.Tensor | None = None  # [B, steps] int64, written by each replay


class EagleGraphs:
    def __init__(self, head: EagleHead, run_layer: HeadLayer, block_size: int, scratch: int, max_blocks: int,
                 width: int, stream_dtype: torch.dtype, device: torch.device, q_pool: torch.Tensor | None = None,
                 buckets: tuple[int, ...] = BUCKETS):
        self.head = head
        self.q_pool = q_pool  # [slots + 1, K, V]: the last row takes the q nobody reads
        self.run_layer = run_layer
        self.block_size = block_size
        self.scratch = scratch
        self.max_blocks = max_blocks
        self.width = width
        self.stream_dtype = stream_dtype
        self.device = device
        self.buckets = buckets
        self.graphs: dict[tuple[int, int, int], _ChainGraph] = {}
        # Made at the first capture; torch names the handle's type only privately (a NewType of tuple[int, int]).
        self.pool: torch.cuda._POOL_HANDLE | None = None
        self.replays = 0
        self.chained = 0  # replays queued straight after a verify (run_chained)

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

    def run(self, key: tuple[int, int, int], ids: list[int], store: StreamStore, starts: list[int],
            counts: list[int], tables: list[list[int]], ks: list[int], draft_starts: list[int],
            rows: list[DraftRow] | None = None) -> torch.Tensor:
        """Drafts [len(counts), steps] (a view valid until the next replay). Request i caught up on
        counts[i] slots from starts[i], from the target's streams the store holds there; it wants ks[i]
        drafts, the first at position draft_starts[i], drawn as rows[i] says (sampling modes)."""
        last = np.cumsum(counts) - 1
        g = self._load(key, ids, starts, counts, tables, last, draft_starts, ks, rows)
        n, t_all = sum(counts), g.bucket * self.width
        store.gather(g.packed[2 * t_all : 2 * t_all + n], out=g.streams[:n])  # at the KV slots just loaded
        return self._replay(g, len(counts))

    def run_chained(self, key: tuple[int, int, int], tokens: torch.Tensor, accepted: torch.Tensor,
                    streams: torch.Tensor, starts: list[int], counts: list[int], tables: list[list[int]],
                    ks: list[int], rows: list[DraftRow] | None = None,
                    device_starts: torch.Tensor | None = None) -> torch.Tensor:
        """Drafts [B, steps] right after a verify whose sampler left `tokens` [B, K + 1] (-1 past the
        emitted ones) and `accepted` [B] on the device: request i verified counts[i] tokens from
        starts[i] (its last token and its drafts), and `streams` [sum(counts), n * Ht] are the target's
        at them, packed from the front. `device_starts` [B]: the real starts, on the device (a verify
        queued ahead, equal counts). Nothing is read back here."""
        b, k1 = tokens.shape
        first = np.cumsum(counts) - np.asarray(counts)
        # Accepting a tokens puts draft 0 at start + a + 2 (the last token, a drafts, the bonus).
        g = self._load(key, None, starts, counts, tables, first, [s + 2 for s in starts], ks, rows)
        if device_starts is not None:
            restart(g.packed, g.bucket * self.width, DeviceStarts(device_starts), counts[0], g.block_table,
                    self.block_size, base=g.base)
        g.accepted[:b].copy_(accepted)
        n, flat = sum(counts), tokens.view(-1)
        if n < b * k1:  # fewer drafts than K in some rows: their emitted tokens, packed like the streams
            index = np.repeat(np.arange(b) * k1 - first, counts) + np.arange(n)  # row i, column j -> i * k1 + j
            flat = flat.index_select(0, h2d(torch.from_numpy(index), torch.int64, tokens.device))
        torch.clamp(flat, min=0, out=g.packed[:n])  # -1 past the emitted tokens: any id will do
        g.streams[: streams.shape[0]].copy_(streams)
        self.chained += 1
        return self._replay(g, b)

    def _load(self, key: tuple[int, int, int], ids: list[int] | None, starts: list[int], counts: list[int],
              tables: list[list[int]], first_row: np.ndarray, draft_starts: list[int], ks: list[int],
              rows: list[DraftRow] | None) -> _ChainGraph:
        """The graph for `key` with its host inputs queued (accepted = 0)."""
        g = self.graphs.get(key) or self._capture(*key)
        n, bucket = len(counts), g.bucket
        host = np.zeros(g.inputs.shape[0], dtype=np.int64)
        packed, table = pack_step(ids, starts, counts, tables, bucket, self.width, self.scratch, self.block_size)
        end = packed.shape[0]
        host[:end] = packed
        per_row = host[end : end + 4 * bucket].reshape(4, bucket)  # first row, base, accepted, wants
        per_row[0, :n] = first_row
        per_row[1, :n] = np.asarray(draft_starts, dtype=np.int64) - 1  # the head slot before draft 0
        per_row[3, :n] = ks
        draws = host[end + 4 * bucket :].reshape(bucket, 3)
        draws[:] = (1, 0, self.spare_q_slot)  # greedy, q to the spare slot (and all padding rows)
        if rows is not None and g.mode != GREEDY:
            # Whole arrays from Python lists: per-row numpy assignments cost ~5 us a request.
            wf = np.zeros((bucket, 4), dtype=np.float32)
            wf[:n] = [(r.temperature, r.top_k, r.top_p, r.min_p) for r in rows]
            draws[:n] = [(r.greedy, r.seed, self.spare_q_slot if r.greedy else r.q_slot) for r in rows]
            g.warp_f.copy_(torch.from_numpy(wf), non_blocking=True)
        g.inputs.copy_(torch.from_numpy(host), non_blocking=True)
        g.block_table[: table.shape[0], : table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
        return g

    def _replay(self, g: _ChainGraph, n: int) -> torch.Tensor:
        if g.graph is None:  # no CUDA: the same work, eagerly (tests of the layouts on the CPU)
            g.drafts = self._forward(g)
        else:
            g.graph.replay()
        self.replays += 1
        assert g.drafts is not None
        return g.drafts[:n]

    def chain_layouts(self, g: _ChainGraph) -> torch.Tensor:
        """[J, 3, B] positions, KV slots and context lengths of chain steps j = 0..J-1, on the device.
        Step j feeds draft j at its head slot, one before its position; rows that want no more than
        j + 1 drafts attend to their first slot and write to the scratch block (their KV past their
        reservation is not their own), as do the bucket's padding rows."""
        bs, b, steps = self.block_size, g.bucket, max(g.steps - 1, 1)
        j = torch.arange(steps, device=g.inputs.device).unsqueeze(1)  # [J, 1]
        live = g.wants.unsqueeze(0) > j + 1  # [J, B]
        pos = torch.where(live, (g.base + g.accepted).unsqueeze(0) + j, 0)  # [J, B]
        block = g.block_table.gather(1, (pos // bs).T).T.long()  # [J, B]
        scratch = self.scratch * bs + torch.arange(b, device=pos.device) % bs  # [B]
        slots = torch.where(live, block * bs + pos % bs, scratch)  # [J, B]
        return torch.stack([pos, slots, pos + 1], dim=1)  # [J, 3, B]

    def _forward(self, g: _ChainGraph) -> torch.Tensor:
        """The captured work: catch-up, then `steps` drafts -> [B, steps]."""
        head, bucket = self.head, g.bucket
        ids, layout = static_layout(g.packed, g.block_table, bucket, self.width, self.scratch)
        out = self.run_layer(ids, head.features(g.streams), layout)  # [T, H]
        h = out.index_select(0, g.first_row + g.accepted)  # [B, H]
        chain = self.chain_layouts(g) if g.steps > 1 else None  # [J, 3, B]
        drafts = []
        for j in range(g.steps):
            tok = head.greedy_draft(h) if g.mode == GREEDY else self._sample(g, h, j)  # [B]
            drafts.append(tok)
            if chain is not None and j + 1 < g.steps:
                h = self.run_layer(tok, h, self._step_layout(g, chain[j]))  # [B, H]
        if not drafts:  # a catch-up-only call (every k = 0)
            return h.new_zeros(bucket, 0, dtype=torch.int64)
        return torch.stack(drafts, dim=1)  # [B, steps]

    def _step_layout(self, g: _ChainGraph, step: torch.Tensor) -> BatchLayout:
        """step [3, B] -> the width-1 layout of one chain step (the host lists only steer the kernel
        dispatch: every query is one token)."""
        b = g.bucket
        return BatchLayout(positions=step[0], slot_mapping=step[1], query_starts=list(range(b)), query_lens=[1] * b,
                           context_lens=[1] * b, block_tables=[[self.scratch]] * b, block_table=g.block_table,
                           context_lens_t=step[2], query_starts_t=g.query_starts)

    def _sample(self, g: _ChainGraph, h: torch.Tensor, j: int) -> torch.Tensor:
        """Draft j of every row as spec_decode/drafting.py's DraftPicker draws it; q into the pool. h [B, H] -> [B]."""
        assert self.q_pool is not None
        wf, wi = g.warp_f, g.draws
        wp = WarpParams(wf[:, 0], wf[:, 1].long(), wf[:, 2], wf[:, 3], g.mode == SORTED)
        position = g.base + g.accepted + 1 + j  # [B] draft j's
        tokens, q = draw_drafts(self.head.target_logits(h), wp, wi[:, 0].bool(), wi[:, 1], position)  # [B], [B, V]
        self.q_pool[wi[:, 2], j] = q
        return tokens

    def _capture(self, bucket: int, steps: int, mode: int = GREEDY) -> _ChainGraph:
        dev, t_all = self.device, bucket * self.width
        empty = pack_step([], [], [], [], bucket, self.width, self.scratch, self.block_size)[0]  # all padding
        draws = np.tile(np.array([1, 0, self.spare_q_slot], dtype=np.int64), bucket)
        inputs = torch.from_numpy(np.concatenate([empty, np.zeros(4 * bucket, dtype=np.int64), draws])).to(dev)
        p = empty.shape[0]
        rows = inputs[p : p + 4 * bucket].view(4, bucket)
        n_in = len(self.head.input_layers) * self.head.spec.target_hidden_size
        g = _ChainGraph(
            torch.cuda.CUDAGraph() if dev.type == "cuda" else None, bucket, steps, mode, inputs, inputs[:p],
            rows[0], rows[1], rows[2], rows[3], inputs[p + 4 * bucket :].view(bucket, 3),
            torch.full((bucket, self.max_blocks), self.scratch, dtype=torch.int32, device=dev),
            torch.zeros(t_all, n_in, dtype=self.stream_dtype, device=dev),
            torch.zeros(bucket, 4, dtype=torch.float32, device=dev),
            torch.arange(bucket + 1, device=dev))
        self.graphs[(bucket, steps, mode)] = g
        if g.graph is None:
            return g
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g.drafts = capture(g.graph, self.pool, dev, lambda: self._forward(g))
        return g

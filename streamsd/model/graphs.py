"""CUDA graphs for decode / verify forwards, one per (batch-size bucket, query width).

A step where every sequence brings at most Q query tokens (Q = 1 for plain decode and draft
steps, Q = 1 + k for verification and the draft's catch-up) replays a graph captured for the
smallest bucket >= its batch size. Its tokens are packed flat from the front (query_starts gives
each sequence's real length, so shorter queries such as n-gram steps with fewer drafts fit the
same graph); the tail of the T = bucket * Q token slots and the unused sequence rows are padding:
padding tokens write their K/V into a reserved scratch block no request owns, padding sequences
have context 0 and attend to nothing. Every value that changes per step lives in static device
buffers refreshed by two queued host-to-device copies, so a step never waits for the GPU.
A prompt step (some sequence brings more tokens than any Q: prompt chunks, with the one-token
rows of the requests decoding beside them) replays a prompt graph: at most `prompt_seqs`
sequences, their tokens packed from the front and padded to the smallest of `prompt_widths` that
holds them all. Its attention tiles (kernels/attention/prefill.py) and the rows whose logits it
returns are static buffers the host rewrites too, so prompts of any lengths and starts run the
same graph. Eager, such a step launches ~10 kernels a layer from Python: 10-22 ms on an H200 for a
135M model whose graph replays in 1-3, and with cached prefixes (a shared system prompt, a chat's
earlier turns) nearly every prompt step is that short. Longer prompt steps, and those of more
sequences, still run eagerly (they are bound by the GPU, not the host).

Graphs of one runner share a memory pool: they never run concurrently, and each graph's output
(its logits) stays allocated because the runner holds it.

A runner made with `hidden_layers` (the streams an EAGLE head reads) captures them too: each
graph's static output then also holds the residual streams entering those layers at every token
slot, [T, layers * hidden], concatenated inside the graph exactly as the eager worker does, and
writes them into the engine's stream store at the tokens' KV slots (model/stream_store.py). Such a
runner also keeps graphs without them, for the plain steps of a batch whose plan wants no streams
(StepPlan.wants_streams): each graph is held by (bucket, Q) in the dict of its variant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from streamsd.model.capture import capture
from streamsd.model.device_layout import DeviceStarts, restart
from streamsd.model.graph_layout import (
    TILE_INTS,
    pack_step,
    packed_prompt_tail,
    packed_prompt_tiles,
    packed_size,
    static_layout,
)
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore, keep_streams
from streamsd.sample.greedy import greedy_verify

log = logging.getLogger("streamsd")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class GraphConfig:
    max_blocks: int  # static width of the block table: ceil(max_model_len / block_size) + 1
    query_widths: tuple[int, ...] = (1,)  # Q values captured, e.g. (1, k + 1)
    buckets: tuple[int, ...] = BUCKETS
    prompt_widths: tuple[int, ...] = ()  # token slots of the prompt graphs, each wider than any Q
    prompt_seqs: int = 1  # sequences a prompt graph holds at most (fewer where its width is smaller)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    bucket: int
    width: int
    packed: torch.Tensor  # [3T + 2B + 1] int64: ids | positions | slots | context lens | query starts
    block_table: torch.Tensor  # [B, max_blocks] int32
    rows: torch.Tensor  # [T] the logits rows, arange; the graph reads it, so it must outlive the capture
    logits: torch.Tensor  # [T, V] float32, written by each replay
    hidden: torch.Tensor | None = None  # [T, layers * hidden] the captured streams, when the runner has layers
    # The step's greedy verification, computed in the graph (sample/greedy.py), when Q > 1:
    greedy: tuple[torch.Tensor, torch.Tensor] | None = None  # tokens [B, Q], accepted [B]
    # A prompt graph's attention tiles [n_tiles * TILE_INTS] int32 (its logits are then those of the B rows
    # the host wrote after the packed values)
    tiles: torch.Tensor | None = None


class GraphRunner:
    def __init__(self, model: Transformer, cache: PagedKVCache, scratch_block: int, cfg: GraphConfig,
                 device: torch.device, hidden_layers: tuple[int, ...] = (), verifies: bool = True,
                 store: StreamStore | None = None):
        self.model = model
        self.store = store  # where each replay also writes the streams it captured
        self.verifies = verifies  # its Q > 1 graphs verify greedily too (a draft model's catch-ups do not)
        self.hidden_layers = hidden_layers  # streams every graph of this runner captures (ascending)
        self.cache = cache
        self.scratch = scratch_block
        self.cfg = cfg
        self.device = device
        self.graphs: dict[tuple[int, int], _Graph] = {}
        # A runner with hidden_layers: its graphs that capture no streams (plain steps keeping none).
        self.streamless: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        from streamsd.kernels.attention.prefill import tokens_per_tile  # CUDA only, as this class
        from streamsd.kernels.device import sm_count

        self.per_tile = tokens_per_tile(model.args.num_heads, model.args.num_kv_heads)  # a prompt graph's tile rows
        self.kv_heads, self.sms = model.args.num_kv_heads, sm_count(device)  # how its tiles' keys split
        self.replays = 0
        self.last: _Graph | None = None  # the graph replayed last

    def key_for(self, counts: list[int], tables: list[list[int]], logits_rows: int | None = None
                ) -> tuple[int, int] | None:
        """(bucket, Q) of the graph that can run this step, or None to run it eagerly. A caller that
        says how many logits rows it wants (`logits_rows`) may get a prompt graph, (sequences it
        holds, token slots), when the step's sequences and rows fit it."""
        if not counts or min(counts) < 1 or max(len(t) for t in tables) > self.cfg.max_blocks:
            return None
        width = next((q for q in sorted(self.cfg.query_widths) if q >= max(counts)), None)
        bucket = next((b for b in self.cfg.buckets if b >= len(counts)), None)
        if width is None and logits_rows is not None:
            width = next((w for w in sorted(self.cfg.prompt_widths) if w >= sum(counts)), None)
            bucket = self.prompt_bucket(width) if width is not None else None
            if bucket is not None and max(len(counts), logits_rows) > bucket:
                return None
        if width is None or bucket is None:
            return None
        return bucket, width

    def prompt_bucket(self, width: int) -> int:
        """Sequences (and logits rows) the prompt graph of `width` token slots holds."""
        return min(width, self.cfg.prompt_seqs)

    def _is_prompt(self, width: int) -> bool:
        return width > max(self.cfg.query_widths)

    def run(self, key: tuple[int, int], ids: list[int] | torch.Tensor | None, starts: list[int], counts: list[int],
            tables: list[list[int]], rows: list[int], device_starts: DeviceStarts | None = None,
            streams: bool = True) -> torch.Tensor:
        """Logits [len(rows), V] of the rows asked for; a view valid until this graph replays again.
        `device_starts`: as in `run_hidden`; `streams` False: the graph that writes no streams."""
        return self._rows(self._replay(key, ids, starts, counts, tables, device_starts, rows, streams), rows)

    def _variant(self, streams: bool) -> dict[tuple[int, int], _Graph]:
        return self.graphs if streams or not self.hidden_layers else self.streamless

    def run_hidden(self, key: tuple[int, int], ids: list[int] | torch.Tensor | None, starts: list[int], counts: list[int],
                   tables: list[list[int]], rows: list[int], device_starts: DeviceStarts | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [len(rows), V], streams [sum(counts), layers * hidden] of every real token): views
        valid until this graph replays again. `device_starts`: the real starts (and ids), on the
        device (equal counts; `starts` then only has to hold the same blocks), see `restart`."""
        g = self._replay(key, ids, starts, counts, tables, device_starts, rows)
        assert g.hidden is not None, "this runner captures no hidden streams"
        return self._rows(g, rows), g.hidden[: sum(counts)]  # real tokens are packed from the front

    def _replay(self, key: tuple[int, int], ids: list[int] | torch.Tensor | None, starts: list[int], counts: list[int],
                tables: list[list[int]], device_starts: DeviceStarts | None = None,
                rows: list[int] | None = None, streams: bool = True) -> _Graph:
        g = self._variant(streams).get(key) or self._capture(*key, streams=streams)
        slots = g.width if g.tiles is not None else None  # a prompt graph's tokens pack into its width
        host, table = pack_step(ids if not isinstance(ids, torch.Tensor) else None, starts, counts, tables,
                                g.bucket, g.width, self.scratch, self.cache.block_size, slots)
        if g.tiles is not None:  # a prompt graph: its logits rows and its tiles follow the packed values
            assert rows is not None and len(rows) <= g.bucket and device_starts is None
            host = packed_prompt_tail(host, starts, counts, rows, g.bucket, self.per_tile,
                                      g.tiles.numel() // TILE_INTS, self.kv_heads, self.sms)
        # Pageable non-blocking copies: staged by the driver at once, queued in stream order (see h2d).
        g.packed.copy_(torch.from_numpy(host), non_blocking=True)
        # Only the live columns: the kernel never reads past a sequence's context.
        g.block_table[: table.shape[0], : table.shape[1]].copy_(torch.from_numpy(table), non_blocking=True)
        if isinstance(ids, torch.Tensor):
            g.packed[: ids.shape[0]].copy_(ids)  # device ids (draft steps): queued after the host copy
        if device_starts is not None:
            restart(g.packed, g.bucket * g.width, device_starts, counts[0], g.block_table, self.cache.block_size)
        g.graph.replay()
        self.replays += 1
        self.last = g
        return g

    def greedy_result(self, logits: torch.Tensor, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens [S, Q], accepted [S]) of the greedy verification of the step whose `logits` the last
        replay returned (a view of its output), for its first S sequences, when it was a verify graph
        (Q > 1); else None (an eager step's logits are not a graph's). Views valid until that graph
        replays again."""
        g = self.last
        if g is None or g.greedy is None or logits.data_ptr() != g.logits.data_ptr():
            return None
        return g.greedy[0][:num_seqs], g.greedy[1][:num_seqs]

    def _rows(self, g: _Graph, rows: list[int]) -> torch.Tensor:
        if g.tiles is not None or rows == list(range(len(rows))):  # a prompt graph computed its rows alone
            return g.logits[: len(rows)]
        return g.logits.index_select(0, h2d(rows, torch.int64, self.device))

    def capture_up_to(self, batch: int, widths: tuple[int, ...] | None = None) -> None:
        """Every (bucket, width) graph a step over at most `batch` requests replays (of `widths` only,
        when given)."""
        for bucket in buckets_up_to(self.cfg.buckets, batch):
            for width in widths or self.cfg.query_widths:
                if (bucket, width) not in self.graphs:
                    self._capture(bucket, width)
        for width in () if widths else self.cfg.prompt_widths:
            if (self.prompt_bucket(width), width) not in self.graphs:
                self._capture(self.prompt_bucket(width), width)
        if self.hidden_layers and not widths:  # plain steps that keep no streams: one token each, or a prompt step
            for bucket in buckets_up_to(self.cfg.buckets, batch):
                if (bucket, 1) not in self.streamless:
                    self._capture(bucket, 1, streams=False)
            for width in self.cfg.prompt_widths:
                if (self.prompt_bucket(width), width) not in self.streamless:
                    self._capture(self.prompt_bucket(width), width, streams=False)

    def _capture(self, bucket: int, width: int, streams: bool = True) -> _Graph:
        dev = self.device
        prompt = self._is_prompt(width)
        t_all = width if prompt else bucket * width  # a prompt graph packs all its tokens into `width` slots
        slots = t_all if prompt else None
        packed = torch.from_numpy(pack_step([], [], [], [], bucket, width, self.scratch,
                                            self.cache.block_size, slots)[0]).to(dev)  # all padding: safe to run
        block_table = torch.full((bucket, self.cfg.max_blocks), self.scratch, dtype=torch.int32, device=dev)
        tiles = None
        if prompt:  # | the logits rows | the tiles (int32 values, int64 here like the rest of the buffer)
            n_tiles = packed_prompt_tiles(t_all, bucket, self.per_tile)
            packed = torch.cat([packed, torch.zeros(bucket + TILE_INTS * n_tiles, dtype=torch.int64, device=dev)])
        ids, layout = static_layout(packed, block_table, bucket, width, self.scratch, slots)
        rows = hidden_rows = torch.arange(t_all, device=dev)
        if prompt:
            n = packed_size(bucket, width, slots)
            rows, tiles = packed[n : n + bucket], torch.empty(TILE_INTS * n_tiles, dtype=torch.int32, device=dev)
            layout = replace(layout, prompt_tiles=tiles)
        layers = self.hidden_layers if streams else ()
        store = self.store if streams else None
        qs = layout.query_starts_t
        verifies = width > 1 and self.verifies and not prompt

        def forward() -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
            if tiles is not None:
                tiles.copy_(packed[-tiles.numel() :])  # inside the graph: the host writes them as int64
            out = self.model(ids, layout, self.cache, rows, hidden_layers=layers, hidden_rows=hidden_rows)
            # [T, layers * hidden] | None, into the store too (padding tokens: the scratch block's rows)
            hidden = keep_streams(out.hidden, layout.slot_mapping, store)
            return out.logits, hidden, greedy_verify(out.logits, ids, qs, bucket, width) if verifies else None

        graph = torch.cuda.CUDAGraph()
        logits, hidden, greedy = capture(graph, self.pool, dev, forward)  # [T or 1, V], [T, L * H] | None, [B, Q], [B]
        # Every tensor made outside the capture and read by the graph is kept here: once freed, the
        # caching allocator hands its memory to eager work and the next replay reads garbage.
        g = _Graph(graph, bucket, width, packed, block_table, hidden_rows if prompt else rows, logits, hidden, greedy,
                   tiles)
        self._variant(streams)[(bucket, width)] = g
        return g


def buckets_up_to(buckets: tuple[int, ...], batch: int) -> list[int]:
    """The buckets a batch of at most `batch` requests can land in: those below it and the first >= it."""
    return [b for b in buckets if b < batch] + [b for b in buckets if b >= batch][:1]


def forward_logits(model: Transformer, graphs: GraphRunner | None, cache: PagedKVCache,
                   ids: list[int] | torch.Tensor, starts: list[int], counts: list[int], tables: list[list[int]],
                   rows: list[int], device: torch.device, store: StreamStore | None = None) -> torch.Tensor:
    """Logits [len(rows), V] of one forward, through a graph when one fits, else eagerly. `store`:
    the target's stream store (an EAGLE engine), written by this forward too (a graph's does it)."""
    key = graphs.key_for(counts, tables, len(rows)) if graphs is not None else None
    if graphs is not None and key is not None:
        return graphs.run(key, ids, starts, counts, tables, rows, streams=store is not None)
    layout = BatchLayout.build(starts, counts, tables, cache.block_size, device)
    ids_t = ids if isinstance(ids, torch.Tensor) else h2d(ids, torch.int64, device)
    if store is None:
        return model(ids_t, layout, cache, h2d(rows, torch.int64, device)).logits
    out = model(ids_t, layout, cache, h2d(rows, torch.int64, device), hidden_layers=store.layers,
                hidden_rows=torch.arange(ids_t.shape[0], device=device))
    keep_streams(out.hidden, layout.slot_mapping, store)
    return out.logits

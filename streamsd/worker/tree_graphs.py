"""A whole draft-tree step as one CUDA graph per batch bucket (an EAGLE engine with trees).

One replay runs, for B requests each verifying a tree of N nodes from its root (pending token):
the target over the B x (N + 1) window rows (tree-masked attention, its streams into the store),
each row's token (argmax, or the keyed race a plain step would run), the walk, the accepted nodes'
KV and streams moved to their positions, the head's catch-up over the accepted path (D + 1 rows, the
ones past the accepted writing head slots the growth rewrites before anything reads them), its
growth of the next tree from the pending token (a sampled request's children ranked by its target's
race), and last the next replay's own inputs: the new roots, trees, positions, slots and masks,
written into the buffers this replay read. So a step
queued right behind the last (worker/lookahead.py) is one more replay with no host copy, and the host's
only work per step is starting the read of `result` and waiting for it.

Inputs the host writes (a step not queued behind the last): the packed layout (ids | positions |
slots | context lengths | query starts, as model/graphs.py packs them), the window masks and roots,
the trees, the block table, and per request its greedy flag, seed, temperature, min-p, top-k and
top-p (SAMPLED mode: the Triton race of kernels/sample/warp.py, over a row's top-k/top-p cut where it
has one, bit for bit what an eager step draws; a model's generation config gives every request that
leaves them out its own, top-p 0.9 for the default model). A greedy request's top-k/top-p cut nothing
from an argmax: it replays in GREEDY mode. Requests with penalties, log-probabilities or min_tokens,
and batches above the largest bucket, take the eager path (sample/tree_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from streamsd.config import TreeShape
from streamsd.model.capture import capture
from streamsd.model.graph_layout import pack_step, static_layout
from streamsd.model.graphs import buckets_up_to
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, uniform_starts
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore
from streamsd.model.tree_layout import NONE, Race
from streamsd.request import Request, SamplingParams
from streamsd.sample.greedy import row_argmax
from streamsd.sample.sampler import sample_keyed
from streamsd.sample.tree_verify import host_tree, move_kv
from streamsd.sample.warp import WarpParams
from streamsd.spec_decode.eagle.tree import GrowConsts, HeadLayer, grow
from streamsd.spec_decode.tree import catch_up, depths, positions_to_slots, walk, window_bits

GREEDY, SAMPLED = 0, 1  # argmax | the race (over each row's top-k/top-p cut)
MODES = (GREEDY, SAMPLED)
TREE_BUCKETS = (1, 2, 4, 8, 16)  # trees pay at small batches; a graph's logits are B x (N + 1) x V floats


@dataclass(slots=True)
class _TreeGraph:
    graph: torch.cuda.CUDAGraph | None
    bucket: int
    mode: int
    packed: torch.Tensor  # [3T + 2B + 1] int64 (model/graphs.py's layout), T = B * W
    bits: torch.Tensor  # [T] int64 each window row's mask
    roots: torch.Tensor  # [B] int64 each window's first position (its root's)
    tree: torch.Tensor  # [B, 2N] int64 the trees verified: tokens | parents
    block_table: torch.Tensor  # [B, max_blocks] int32
    draws: torch.Tensor  # [2, B] int64 greedy flags | seeds (field-major: each row is what a kernel reads)
    warp_f: torch.Tensor  # [2, B] float32 temperatures | min-p
    # The same per window row, for the target's race: written with the rest (not expanded inside the
    # replay, where the repeats, the stack and the fills were ~10 launches of a sampled step)
    row_ints: torch.Tensor  # [3, T] int64 greedy flags | seeds | the position each row's token decides
    row_warp: torch.Tensor  # [2, T] float32 temperatures | min-p
    # Constants a replay reads (made before the capture: made inside, each replay would remake them)
    grow: GrowConsts
    rows: torch.Tensor  # [B * W] int64 0, 1, ...: every window row's hidden stream is kept
    catch_starts: torch.Tensor  # [B + 1] int32 the catch-up's query starts (D + 1 rows each)
    row_top_k: torch.Tensor  # [T] int64 each row's top-k (0: none)
    row_top_p: torch.Tensor  # [T] float32 each row's top-p (1: none)
    result: torch.Tensor | None = None  # [B, D + 2 + 2N] emitted | accepted | next tokens | next parents
    tables: list[list[int]] | None = None  # what block_table holds (a request gains a block every 16 tokens)


def replayable(p: SamplingParams) -> bool:
    """Whether a request's tree steps can be the graph's: not one with penalties (they count each path's
    drafts, sample/penalties.py)."""
    return not p.penalised


def mode_for(params: list[SamplingParams]) -> int:
    """The graph a batch replays: an argmax when all are greedy (a greedy request's top-k/top-p cut nothing
    from it), else the race."""
    return GREEDY if all(p.greedy for p in params) else SAMPLED


class TreeGraphs:
    def __init__(self, target: Transformer, cache: PagedKVCache, store: StreamStore, head_layer: HeadLayer,
                 head, shape: TreeShape, scratch: int, max_blocks: int, device: torch.device,
                 buckets: tuple[int, ...] = TREE_BUCKETS):
        self.target = target
        self.cache = cache
        self.store = store
        self.head_layer = head_layer
        self.head = head  # EagleHead
        self.shape = shape
        self.width = shape.nodes + 1
        self.scratch = scratch
        self.max_blocks = max_blocks
        self.device = device
        self.buckets = buckets
        self.graphs: dict[tuple[int, int], _TreeGraph] = {}
        # torch names its graph pool handle type only privately (a NewType of tuple[int, int]).
        self.pool: torch.cuda._POOL_HANDLE | None = None
        self.replays = 0

    def key_for(self, reqs: list[Request], tables: list[list[int]]) -> tuple[int, int] | None:
        bucket = next((b for b in self.buckets if b >= len(reqs)), None)
        if bucket is None or max(len(t) for t in tables) > self.max_blocks:
            return None
        if not all(replayable(r.params) for r in reqs):
            return None
        return bucket, mode_for([r.params for r in reqs])

    def run(self, key: tuple[int, int], reqs: list[Request], roots: list[int]) -> torch.Tensor:
        """Replays the step for requests verifying their full trees from their roots (pending tokens'
        positions), inputs from the host. Returns result [B, D + 2 + 2N] (a view, valid until the
        next replay of this graph)."""
        g = self.graphs.get(key) or self._capture(*key)
        n, w, nodes = len(reqs), self.width, self.shape.nodes
        ids, tree, bits, depth = [], [], [], []
        for r, root in zip(reqs, roots, strict=True):
            d, b = host_tree(r.draft_parents[:nodes])
            ids.extend([r.token_at(root), *r.draft_ids[:nodes]])
            tree.append([*r.draft_ids[:nodes], *r.draft_parents[:nodes]])
            bits.extend(b)
            depth.extend(d)
        tables = [r.blocks for r in reqs]
        host, _ = pack_step(ids, roots, [w] * n, tables, g.bucket, w, self.scratch, self.cache.block_size)
        t = g.bucket * w
        host[t : t + n * w] = np.repeat(np.asarray(roots, dtype=np.int64), w) + np.asarray(depth, dtype=np.int64)
        g.packed.copy_(torch.from_numpy(host), non_blocking=True)
        side = np.zeros((g.bucket, 3 + 2 * nodes), dtype=np.int64)  # bits go separately (up to 2**62)
        side[:, 3:] = np.tile(np.r_[np.zeros(nodes, dtype=np.int64), np.full(nodes, NONE)], (g.bucket, 1))
        side[:, 1] = 1  # padding rows greedy: their garbage logits are never raced
        side[:n, 0] = roots
        side[:n, 1] = [r.params.greedy for r in reqs]
        side[:n, 2] = [r.seed for r in reqs]
        side[:n, 3:] = tree
        dev_side = torch.from_numpy(side).to(self.device, non_blocking=True)
        g.roots.copy_(dev_side[:, 0])
        g.draws.copy_(dev_side[:, 1:3].T)
        g.tree.copy_(dev_side[:, 3:])
        all_bits = np.zeros(t, dtype=np.int64)
        all_bits[: n * w] = bits
        g.bits.copy_(torch.from_numpy(all_bits), non_blocking=True)
        if g.mode != GREEDY:
            wf = np.zeros((2, g.bucket), dtype=np.float32)
            wf[0] = 1.0
            wf[:, :n] = [[r.params.temperature for r in reqs], [r.params.min_p for r in reqs]]
            g.warp_f.copy_(torch.from_numpy(wf), non_blocking=True)
            g.row_warp.copy_(torch.from_numpy(np.repeat(wf, w, axis=1)), non_blocking=True)
            rows = np.ascontiguousarray(np.repeat(side[:, 1:3], w, axis=0).T)  # [2, T] greedy | seed
            g.row_ints[:2].copy_(torch.from_numpy(rows), non_blocking=True)
            k, p = np.zeros(g.bucket, dtype=np.int64), np.ones(g.bucket, dtype=np.float32)
            k[:n], p[:n] = [r.params.top_k for r in reqs], [r.params.top_p for r in reqs]
            g.row_top_k.copy_(torch.from_numpy(np.repeat(k, w)), non_blocking=True)
            g.row_top_p.copy_(torch.from_numpy(np.repeat(p, w)), non_blocking=True)
        return self.replay(key, tables)

    def replay(self, key: tuple[int, int], tables: list[list[int]]) -> torch.Tensor:
        """One more step from the inputs the last replay of this graph wrote (a step queued ahead);
        `tables`: the requests' blocks now (the scheduler may have added some since)."""
        g = self.graphs[key]
        if tables != g.tables:
            # Whole: a padding row's next window goes through its row of the table, which must not still
            # hold the blocks of a request that sat there before (it would write into them).
            table = np.full(tuple(g.block_table.shape), self.scratch, dtype=np.int32)
            for i, t in enumerate(tables):
                table[i, : len(t)] = t
            g.block_table.copy_(torch.from_numpy(table), non_blocking=True)
            g.tables = [list(t) for t in tables]
        if g.graph is None:
            self._step(g)
        else:
            g.graph.replay()
        self.replays += 1
        assert g.result is not None
        return g.result

    def replay_padding(self, bucket: int) -> None:
        """One greedy step of `bucket` padding rows, its inputs put back after: what a tree step over
        that many requests costs, for the start-up profile (worker/profile.py). Its writes land in the
        scratch block; no request's state is read or changed."""
        key = (bucket, GREEDY)
        g = self.graphs.get(key) or self._capture(*key)
        saved = [x.clone() for x in (g.packed, g.bits, g.roots, g.tree)]
        g.block_table.fill_(self.scratch)
        g.tables = None  # the next real step writes its own table
        if g.graph is None:
            self._step(g)
        else:
            g.graph.replay()
        for x, y in zip((g.packed, g.bits, g.roots, g.tree), saved, strict=True):
            x.copy_(y)

    def capture_up_to(self, batch: int) -> None:
        for bucket in buckets_up_to(self.buckets, batch):
            for mode in MODES:
                if (bucket, mode) not in self.graphs:
                    self._capture(bucket, mode)

    # -- the captured work ----------------------------------------------------------------------
    def _step(self, g: _TreeGraph) -> None:
        shape, w, b = self.shape, self.width, g.bucket
        n, dmax, bs = shape.nodes, shape.depth, self.cache.block_size
        ids, layout = static_layout(g.packed, g.block_table, b, w, self.scratch)
        layout = replace(layout, tree_bits=g.bits, tree_start=g.roots).for_host(bs)
        rows, t_all = g.rows, b * w
        # Every row's logits, not gathered (bf16 on CUDA: the argmax and the race read them as float32
        # themselves, the same tokens), and every row's streams straight into the store at its slot.
        out = self.target(ids, layout, self.cache, rows, hidden_layers=self.store.layers, every_row=True,
                          float_logits=not ids.is_cuda, streams_into=self.store.data)
        logits = out.logits  # [T, V]
        if g.mode == GREEDY:
            target = row_argmax(logits.view(b, w, -1))  # [B, W]
        else:
            torch.add(layout.positions, 1, out=g.row_ints[2])  # the token each row decides sits one past it
            # kernels/sample/warp.py's race on CUDA (sample/warp.py's sort, cut and race on a CPU)
            wp = WarpParams(g.row_warp[0], g.row_top_k, g.row_top_p, g.row_warp[1], needs_sort=True)
            target = sample_keyed(logits, wp, g.row_ints).view(b, w)
        tokens, parents = g.tree[:, :n], g.tree[:, n:]
        # The walk, then the head's catch-up on the root and the accepted nodes (D + 1 slots from the root)
        if logits.is_cuda:  # one launch for both, not dozens (kernels/tree/bookkeeping.py)
            from streamsd.kernels.tree import bookkeeping as kernels

            emitted, accepted, path, laid = kernels.walk(target, tokens, parents, dmax, g.roots, g.block_table, bs)
            assert laid is not None
        else:
            emitted, accepted, path = walk(target, tokens, parents, dmax)
            laid = catch_up(g.roots, accepted, emitted, g.block_table, bs)
        move_kv(self.cache, self.store, g.roots, path, g.block_table, bs)
        c = dmax + 1
        catch_ids, at, slots, ctx, pending = laid
        catch = BatchLayout.uniform(c, at, slots, g.block_table, ctx, query_starts=g.catch_starts).for_host(bs)
        feats = self.head.features(self.store.gather(slots))  # [B * C, H]
        h = self.head_layer(catch_ids, feats, catch).view(b, c, -1)  # [B, C, H]
        h0 = h.gather(1, accepted.view(b, 1, 1).expand(b, 1, h.shape[-1])).squeeze(1)  # [B, H]
        race = None if g.mode == GREEDY else Race(g.draws[0], g.draws[1], g.warp_f[0])
        next_tokens, next_parents = grow(self.head, self.head_layer, h0, pending, g.block_table, bs, shape, race,
                                         g.grow)
        # The result, and the next replay's inputs: its roots are the pending tokens, its windows the new trees.
        if logits.is_cuda:
            g.result = kernels.next_step(emitted, accepted, next_tokens, next_parents, pending, g.block_table, bs,
                                         g.packed, g.bits, g.roots, g.tree, dmax)  # [B, D + 2 + 2N]
        else:
            g.result = torch.cat([emitted, accepted.unsqueeze(1), next_tokens, next_parents], dim=1)
            bonus = emitted.gather(1, accepted.unsqueeze(1))  # [B, 1]
            depth = torch.cat([torch.zeros_like(pending).unsqueeze(1), depths(next_parents, dmax)], dim=1)  # [B, W]
            window = pending.unsqueeze(1) + torch.arange(w, device=self.device)  # [B, W]
            g.packed[:t_all].copy_(torch.cat([bonus, next_tokens], dim=1).view(-1))
            g.packed[t_all : 2 * t_all].copy_((pending.unsqueeze(1) + depth).view(-1))
            g.packed[2 * t_all : 3 * t_all].copy_(positions_to_slots(window, g.block_table, bs).view(-1))
            g.packed[3 * t_all : 3 * t_all + b].copy_(pending + w)
            g.bits.copy_(window_bits(next_parents, dmax).view(-1))
            g.roots.copy_(pending)
            g.tree.copy_(torch.cat([next_tokens, next_parents], dim=1))

    def _capture(self, bucket: int, mode: int) -> _TreeGraph:
        dev, w, n = self.device, self.width, self.shape.nodes
        empty = pack_step([], [], [], [], bucket, w, self.scratch, self.cache.block_size)[0]
        g = _TreeGraph(
            torch.cuda.CUDAGraph() if dev.type == "cuda" else None, bucket, mode,
            torch.from_numpy(empty).to(dev), torch.zeros(bucket * w, dtype=torch.int64, device=dev),
            torch.zeros(bucket, dtype=torch.int64, device=dev),
            torch.cat([torch.zeros(bucket, n, dtype=torch.int64, device=dev),
                       torch.full((bucket, n), NONE, dtype=torch.int64, device=dev)], dim=1),
            torch.full((bucket, self.max_blocks), self.scratch, dtype=torch.int32, device=dev),
            torch.zeros(2, bucket, dtype=torch.int64, device=dev), torch.ones(2, bucket, dtype=torch.float32, device=dev),
            torch.zeros(3, bucket * w, dtype=torch.int64, device=dev), torch.zeros(2, bucket * w, device=dev),
            GrowConsts.build(bucket, self.shape, dev), torch.arange(bucket * w, device=dev),
            uniform_starts(bucket, self.shape.depth + 1, dev), torch.zeros(bucket * w, dtype=torch.int64, device=dev),
            torch.ones(bucket * w, device=dev))
        g.warp_f[1] = 0.0
        g.row_warp[0] = 1.0
        self.graphs[(bucket, mode)] = g
        if g.graph is None:
            return g
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        snapshot = [x.clone() for x in (g.packed, g.bits, g.roots, g.tree)]

        def reset() -> None:  # a step writes the next step's inputs: back to all padding
            for x, y in zip((g.packed, g.bits, g.roots, g.tree), snapshot, strict=True):
                x.copy_(y)

        capture(g.graph, self.pool, dev, lambda: self._step(g), reset)
        return g


def tree_graphs_for(worker, proposer, scratch: int, max_len: int, max_batch: int = 0) -> TreeGraphs:
    """The tree graphs of an EAGLE engine with trees (`worker.tree`), over its caches and its head;
    `max_batch`: the most requests a tree step holds (SpecConfig.max_batch; 0: no limit)."""
    shape = worker.tree
    bs = worker.cache.block_size
    max_blocks = -(-(max_len + 2 * shape.nodes + 2 * shape.depth + 2) // bs) + 1
    buckets = tuple(buckets_up_to(TREE_BUCKETS, max_batch)) if max_batch else TREE_BUCKETS
    return TreeGraphs(worker.target, worker.cache, proposer.store, proposer._run, proposer.head, shape, scratch,
                      max_blocks, worker.device, buckets)

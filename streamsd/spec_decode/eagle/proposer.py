"""The EAGLE proposer: a one-layer head over the target's hidden states, with its own paged KV.

The head's cache slot t holds its layer's K/V for (target h_t, token t + 1) at position t, in
the request's own blocks (one table for target, draft model or head). Each call first catches the
head up on every slot it lacks: positions `draft_computed` .. `upto - 1`, whose hidden states the
target's forwards left in the stream store (model/stream_store.py). Usually those are the slots the
last verify pass made possible; after plain steps, which ran the target alone, every position they
decoded too. The last slot gives the first draft; drafts 2..k feed the head's own output back as h.
Those draft slots hold the head's guesses, not the target's states, so they are never kept:
`draft_computed` reports only the caught-up slots and the next call recomputes the accepted ones.

Drafts follow the draft policy (spec_decode/drafting.py). On CUDA the layer runs on fused kernels
(spec_decode/eagle/fast.py) and a call is one graph replay, greedy or sampled drafts alike
(spec_decode/eagle/graphs.py); catch-ups longer than a graph takes (prefill chunks, resuming after plain
steps) run eagerly up to their last slot, and the graph does the rest. `chain` queues that replay
straight behind the verify, before the host has read which drafts passed (the worker's fast path).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from streamsd.config import TreeShape
from streamsd.model.attention import paged_attention
from streamsd.model.graph_layout import PROMPT_WIDTHS
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore
from streamsd.model.tree_layout import Race
from streamsd.request import Request
from streamsd.spec_decode.drafting import DraftPicker
from streamsd.spec_decode.eagle.graphs import GREEDY, SAMPLED, SORTED, DraftRow, EagleGraphs
from streamsd.spec_decode.eagle.grow_graphs import GrowGraphs
from streamsd.spec_decode.eagle.head import EagleHead, HeadAttention
from streamsd.spec_decode.eagle.tree import grow
from streamsd.spec_decode.proposer import Proposal, ProposeItem, Proposer, pair_slot

if TYPE_CHECKING:
    from streamsd.model.graphs import GraphConfig
    from streamsd.spec_decode.eagle.fast import FastHead


class EagleProposer(Proposer):
    dense = True
    keeps_cache = True
    kv_next_tokens = 1  # slot t: (target h_t, token t + 1)
    chains_on_device = True
    store: StreamStore  # an EAGLE head always has one (the base class's may be None)

    def __init__(self, head: EagleHead, target: Transformer, cache: PagedKVCache, q_pool: torch.Tensor,
                 store: StreamStore, depth_steps: tuple[tuple[str, tuple[float, ...]], ...] = (),
                 tree: TreeShape | None = None, int8_lm_head: bool = True):
        self.head = head
        #: how conditional acceptance rises with depth, as the head's evaluation measured it, greedy and sampled
        self.depth_steps = depth_steps
        self.store = store  # the target's streams per KV slot, written by its every forward
        self.target = target
        self.cache = cache  # one layer: [1, 2, NB, BS, KVH, D]
        self.q_pool = q_pool  # [slots, K, V]
        self.vocab = target.args.vocab_size
        self.device = q_pool.device
        self.scale = head.spec.args.head_dim ** -0.5
        #: residual streams the worker must return for every computed token row
        self.hidden_layers: tuple[int, ...] = head.input_layers
        self.graphs: EagleGraphs | None = None
        self.fast: FastHead | None = None
        self.tree = tree  # draft trees of this shape instead of chains (spec_decode/eagle/tree.py)
        self.grow_graphs: GrowGraphs | None = None  # a tree's growth as a graph replay (spec_decode/eagle/grow_graphs.py)
        self.int8_lm_head = int8_lm_head  # with the kernels, trees rank drafts over an int8 lm_head (kernels/tree/head_topk.py)

    @property
    def _fits_kernels(self) -> bool:
        """The head can use the target's attention kernel (the target is set up before its proposer)."""
        a = self.head.spec.args
        return self.device.type == "cuda" and a.head_dim == self.target.args.head_dim and self.target.fast is not None

    def enable_cuda(self, graphs: GraphConfig | None, scratch_block: int) -> None:
        self._enable_kernels()
        if graphs is not None:
            self._enable_graphs(scratch_block, graphs.max_blocks, width=max(graphs.query_widths))

    def _enable_kernels(self) -> None:
        """The head's layer on the fused kernels, when it fits them and has the target's dtype."""
        if self._fits_kernels and self.head.fc.weight.dtype == self.target.model.embed_tokens.weight.dtype:
            from streamsd.spec_decode.eagle.fast import fast_head  # Triton: imported only where it runs

            self.fast = fast_head(self.head, self.target.attend, int8_logits=self.int8_lm_head and self.tree is not None)

    def _enable_graphs(self, scratch_block: int, max_blocks: int, width: int) -> None:
        """CUDA graphs for calls whose catch-ups fit `width` tokens (see spec_decode/eagle/graphs.py); with
        trees, for their growths (spec_decode/eagle/grow_graphs.py: a tree step's own graph grows the rest)."""
        if not self._fits_kernels:
            return
        dtype = self.target.model.embed_tokens.weight.dtype
        if self.tree is not None:
            bs = self.cache.block_size
            self.grow_graphs = GrowGraphs(self.head, self._run, self.tree, bs, max_blocks, scratch_block, dtype,
                                          self.device, self.store, tuple(w for w in PROMPT_WIDTHS if w <= max_blocks * bs))
        else:
            self.graphs = EagleGraphs(self.head, self._run, self.cache.block_size, scratch_block, max_blocks,
                                      width, dtype, self.device, self.q_pool)

    def capture_graphs(self, max_batch: int) -> None:
        """Every graph a call over at most `max_batch` requests replays, whatever its depth and draw: an
        adaptive policy changes k step by step, and a capture (tens of ms) should not land inside a step
        the policy times."""
        if self.grow_graphs is not None:
            self.grow_graphs.capture_up_to(max_batch)
        if self.graphs is None:
            return
        for mode in (GREEDY, SAMPLED, SORTED) if self.graphs.q_pool is not None else (GREEDY,):
            self.graphs.capture_up_to(max_batch, mode)

    def _attend(self, layout: BatchLayout) -> HeadAttention:
        kc, vc = self.cache.layer(0)
        # The target's attention (the Triton kernel once CUDA is set up) fits a head of its shape.
        same = self.head.spec.args.head_dim == self.target.args.head_dim
        paged = self.target.attend if same else paged_attention

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            PagedKVCache.write(kc, vc, k, v, layout.slot_mapping)
            return paged(q, kc, vc, layout, self.scale)

        return attend

    def _run(self, ids: torch.Tensor, feats: torch.Tensor, layout: BatchLayout,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        """The head layer over ids [T], token t's hidden input feats[rows[t]] (rows None: feats[t])."""
        if self.fast is not None:
            return self.fast.run_layer(ids, feats, layout, self.cache.layer(0), rows)  # [T, H]
        if rows is not None:
            feats = feats.index_select(0, rows)  # [T, H]
        return self.head.run_layer(ids, feats, layout.positions, self._attend(layout))  # [T, H]

    @torch.inference_mode()
    def chain(self, reqs: list[Request], starts: list[int], counts: list[int], ks: list[int], tokens: torch.Tensor,
              accepted: torch.Tensor, streams: torch.Tensor | None,
              device_starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """Queue the catch-up and the drafts behind a verify whose results are still on the device:
        request i verified counts[i] tokens from starts[i] (tokens [B, K + 1] and accepted [B] from the
        rejection sampler, the target's streams [sum(counts), n * Ht]) and wants ks[i] drafts. Returns
        the drafts [B, max k] (device), or None when no graph fits (the caller then proposes as usual,
        after its read). Its caller reports each request's head as caught up to start + accepted + 1.
        `device_starts` [B]: the real starts, on the device (a verify queued ahead: worker/lookahead.py)."""
        if self.graphs is None or not reqs:
            return None
        tables = [r.blocks for r in reqs]
        sampling = any(k and not r.greedy_draft for r, k in zip(reqs, ks, strict=True))
        rows = [self._draw(r, k, paired=device_starts is not None) for r, k in zip(reqs, ks, strict=True)] \
            if sampling else None
        key = self.graphs.key_for(counts, tables, max(ks), rows)
        if key is None:
            return None
        assert streams is not None  # the worker chains a head only with the streams it asks for (hidden_layers)
        return self.graphs.run_chained(key, tokens, accepted, streams, starts, counts, tables, ks, rows,
                                       device_starts)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        results = [Proposal([], it.draft_computed) for it in items]
        # (item index, item, first slot to compute, slots): what each head lacks of what the target has.
        work = [(i, it, it.draft_computed, it.upto - it.draft_computed) for i, it in enumerate(items)
                if it.upto > it.draft_computed]
        if self.graphs is not None and any(n > self.graphs.width for *_, n in work):
            work = self._catch_up_long(work, results)
        if not work:
            return results
        starts = [s for _, _, s, _ in work]
        counts = [n for *_, n in work]
        tables = [it.request.blocks for _, it, _, _ in work]
        ids = [t for _, it, s, n in work for t in _tokens(it)[s + 1 : s + n + 1]]
        # Draft only from a fully caught-up slot (a prefill chunk may stop short of the prompt's end).
        wants = [it.k if it.k > 0 and s + n == it.upto else 0 for _, it, s, n in work]
        key = rows = None
        if self.graphs is not None and self.tree is None:
            sampling = any(k and not it.request.greedy_draft for (_, it, _, _), k in zip(work, wants, strict=True))
            rows = [self._draw(it.request, k) for (_, it, _, _), k in zip(work, wants, strict=True)] \
                if sampling else None
            key = self.graphs.key_for(counts, tables, max(wants), rows)
        if key is not None:
            assert self.graphs is not None
            out = self.graphs.run(key, ids, self.store, starts, counts, tables, wants,
                                  [len(it.tokens) for _, it, _, _ in work], rows)  # [n, steps]
            # A catch-up-only call (every k = 0: the policy chose a plain step) has nothing to read back.
            drafts = out.tolist() if max(wants) else [[] for _ in work]
            for w, (i, _, s, n) in enumerate(work):
                results[i] = Proposal(drafts[w][: wants[w]], s + n)
            return results
        if self.tree is not None and self.grow_graphs is not None and len(work) == 1 and wants[0]:
            i, it, s, n = work[0]  # a request's first tree at batch 1: its catch-up and growth in one replay
            key = self.grow_graphs.catch_up_key(it.request, n, tables[0])
            if key is not None:
                host = self.grow_graphs.run_catch_up(key, ids, s, n, tables[0], it.request).tolist()[0]  # [2N]
                results[i] = Proposal(host[: it.k], it.upto, host[self.tree.nodes :][: it.k])
                return results
        out = self._run_slots(ids, starts, counts, tables)  # [T, H]
        for i, _, s, n in work:
            results[i] = Proposal([], s + n)
        drafting = [w for w in range(len(work)) if wants[w]]
        if not drafting:
            return results
        ends = list(itertools.accumulate(counts))
        last = h2d([ends[w] - 1 for w in drafting], torch.int64, self.device)  # [Bd] last row of each drafting item
        draft_items = [work[w][1] for w in drafting]
        if self.tree is not None:
            tokens, parents = self._grow(draft_items, out.index_select(0, last))  # [Bd, N] each
            for row, w in enumerate(drafting):
                i, it, _, _ = work[w]
                results[i] = Proposal(tokens[row][: it.k], it.upto, parents[row][: it.k])
            return results
        host = self._draft_loop(draft_items, out.index_select(0, last)).tolist()  # [Bd, K]
        for row, w in enumerate(drafting):
            i, it, _, _ = work[w]
            results[i] = Proposal(host[row][: it.k], it.upto)
        return results

    def _grow(self, items: list[ProposeItem], h0: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """h0 [Bd, H]: the head's output at each item's last caught-up slot -> each one's tree, best
        first (tokens, parents): a graph replay where one fits, else eagerly."""
        assert self.tree is not None
        pending = [it.upto for it in items]
        tables = [it.request.blocks for it in items]
        reqs = [it.request for it in items]
        key = self.grow_graphs.key_for(reqs, tables) if self.grow_graphs is not None else None
        if key is not None:
            assert self.grow_graphs is not None
            host = self.grow_graphs.run(key, h0, pending, tables, reqs).tolist()  # [Bd, 2N]
        else:
            width = max(len(t) for t in tables)
            table = h2d([t + [0] * (width - len(t)) for t in tables], torch.int32, self.device)  # [Bd, W]
            race = None
            if not all(r.params.greedy for r in reqs):
                race = Race(h2d([int(r.params.greedy) for r in reqs], torch.int64, self.device),
                            h2d([r.seed for r in reqs], torch.int64, self.device),
                            h2d([r.params.temperature or 1.0 for r in reqs], torch.float32, self.device))
            tokens, parents = grow(self.head, self._run, h0, h2d(pending, torch.int64, self.device), table,
                                   self.cache.block_size, self.tree, race)  # [Bd, N] each
            host = torch.cat([tokens, parents], dim=1).tolist()
        n = self.tree.nodes
        return [h[:n] for h in host], [h[n:] for h in host]

    def _catch_up_long(self, work: list[tuple[int, ProposeItem, int, int]], results: list[Proposal]
                       ) -> list[tuple[int, ProposeItem, int, int]]:
        """Catch-ups wider than the graphs take, eagerly: all of a non-drafting item's slots, all but
        the last of a drafting one's (the graph then runs that slot and the drafts). Returns the work
        left for the graph."""
        assert self.graphs is not None
        width = self.graphs.width
        eager, left = [], []
        for i, it, s, n in work:
            if n <= width:
                left.append((i, it, s, n))
                continue
            now = n - 1 if it.k > 0 else n
            eager.append((i, it, s, now))
            results[i] = Proposal([], s + now)
            if now < n:
                left.append((i, it, s + now, n - now))
        starts, counts = [s for _, _, s, _ in eager], [n for *_, n in eager]
        tables = [it.request.blocks for _, it, _, _ in eager]
        ids = [t for _, it, s, n in eager for t in _tokens(it)[s + 1 : s + n + 1]]
        self._run_slots(ids, starts, counts, tables)
        return left

    def _run_slots(self, ids: list[int], starts: list[int], counts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """The head's layer, eagerly, over counts[i] slots from starts[i] of each sequence (their K/V
        written), from the target's streams at those slots: ids [T] the tokens after them -> [T, H]."""
        layout = BatchLayout.build(starts, counts, tables, self.cache.block_size, self.device)
        feats = self.store.gather(layout.slot_mapping)  # [T, layers * Ht]
        return self._run(h2d(ids, torch.int64, self.device), self.head.features(feats), layout)

    @torch.inference_mode()
    def catch_up_pass(self, n: int, table: list[int]) -> torch.Tensor:
        """One eager catch-up over n slots of one sequence (its blocks `table`): what resuming after
        n plain positions costs (the planner's catch-up table, worker/profile.py). Writes garbage K/V there."""
        return self._run_slots([0] * n, [0], [n], [table])

    def _draw(self, r: Request, k: int, paired: bool = False) -> DraftRow:
        """`paired`: q into the request's other pool row (a verify queued ahead: spec_decode/proposer.pair_slot)."""
        greedy = r.greedy_draft or r.q_slot is None or k == 0  # greedy rows write no q of their own
        p = r.params
        slot = r.q_slot or 0
        if paired and not greedy:
            slot = pair_slot(slot, self.q_pool.shape[0])
        return DraftRow(p.temperature, p.top_k, p.top_p, p.min_p, greedy, r.seed, slot)

    def _draft_loop(self, items: list[ProposeItem], h: torch.Tensor) -> torch.Tensor:
        """h [Bd, H]: the head's output at each item's last caught-up slot -> drafts [Bd, max k]."""
        dev = self.device
        reqs = [it.request for it in items]
        picker = DraftPicker(items, self.q_pool, self.vocab)
        k_max = max(it.k for it in items)
        drafts = torch.zeros(len(items), k_max, dtype=torch.int64, device=dev)  # [Bd, K]
        active = list(range(len(items)))
        for j in range(k_max):
            idx = slice(None) if len(active) == len(items) else h2d(active, torch.int64, dev)  # [A]
            tok = picker.pick(self.head.target_logits(h), active, idx, j)  # [A]
            drafts[idx, j] = tok
            keep = [a for a, i in enumerate(active) if items[i].k > j + 1]
            if not keep:
                break
            active = [active[a] for a in keep]
            sel = h2d(keep, torch.int64, dev)  # [A']
            # Draft j sits at position len(tokens) + j; the head's slot for it is one before.
            positions = [len(items[i].tokens) - 1 + j for i in active]
            layout = BatchLayout.build(positions, [1] * len(active), [reqs[i].blocks for i in active],
                                       self.cache.block_size, dev)
            h = self._run(tok.index_select(0, sel), h.index_select(0, sel), layout)  # [A, H]
        return drafts


def _tokens(it: ProposeItem) -> list[int]:
    """Every known token of the item's request (a prefill chunk's item carries none of its own)."""
    return it.tokens if it.tokens else it.request.all_ids

"""The EAGLE proposer: a one-layer head over the target's hidden states, with its own paged KV.

The head's cache slot t holds its layer's K/V for (target h_t, token t + 1) at position t, in
the request's own blocks (one table for target, draft model or head). Each call first catches the
head up on the slots the verify pass (or a prefill chunk) made possible: positions up to
`upto - 1`, whose hidden states the worker hands over in `ProposeItem.hidden`. The last of them
gives the first draft; drafts 2..k feed the head's own output back as h. Those draft slots hold
the head's guesses, not the target's states, so they are never kept: `draft_computed` reports
only the caught-up slots and the next call recomputes the accepted ones from the target's states.

Drafts follow the draft policy (spec/drafting.py). On CUDA the layer runs on fused kernels
(spec/eagle_fast.py) and a call is one graph replay, greedy or sampled drafts alike
(spec/eagle_graphs.py); catch-ups over prefill chunks run eagerly. `chain` queues that replay
straight behind the verify, before the host has read which drafts passed (the worker's fast path).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from streamsd.lookahead import pair_slot
from streamsd.model.attention import paged_attention_reference
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.request import Request
from streamsd.spec.base import Proposal, ProposeItem
from streamsd.spec.drafting import DraftPicker
from streamsd.spec.eagle_graphs import DraftRow, EagleGraphs
from streamsd.spec.eagle_head import EagleHead, HeadAttention

if TYPE_CHECKING:
    from streamsd.spec.eagle_fast import FastHead


class EagleProposer:
    dense = True
    keeps_cache = True

    def __init__(self, head: EagleHead, target: Transformer, cache: PagedKVCache, q_pool: torch.Tensor):
        self.head = head
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

    @property
    def _fits_kernels(self) -> bool:
        """The head can use the target's attention kernel (set up by setup_cuda before this is asked)."""
        a = self.head.spec.args
        return self.device.type == "cuda" and a.head_dim == self.target.args.head_dim and self.target.fast is not None

    def enable_kernels(self) -> None:
        """The head's layer on the fused kernels, when it fits them and has the target's dtype."""
        if self._fits_kernels and self.head.fc.weight.dtype == self.target.model.embed_tokens.weight.dtype:
            from streamsd.spec.eagle_fast import fast_head  # Triton: imported only where it runs

            self.fast = fast_head(self.head, self.target.attend)

    def enable_graphs(self, scratch_block: int, max_blocks: int, width: int) -> None:
        """CUDA graphs for calls whose catch-ups fit `width` tokens (see spec/eagle_graphs.py)."""
        if self._fits_kernels:
            dtype = self.target.model.embed_tokens.weight.dtype
            self.graphs = EagleGraphs(self.head, self._run, self.cache.block_size, scratch_block, max_blocks,
                                      width, dtype, self.device, self.q_pool)

    def _attend(self, layout: BatchLayout) -> HeadAttention:
        kc, vc = self.cache.layer(0)
        # The target's attention (the Triton kernel once CUDA is set up) fits a head of its shape.
        same = self.head.spec.args.head_dim == self.target.args.head_dim
        paged = self.target.attend if same else paged_attention_reference

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            PagedKVCache.write(kc, vc, k, v, layout.slot_mapping)
            return paged(q, kc, vc, layout, self.scale)

        return attend

    def _run(self, ids: torch.Tensor, feats: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        if self.fast is not None:
            return self.fast.run_layer(ids, feats, layout, self.cache.layer(0))  # [T, H]
        return self.head.run_layer(ids, feats, layout.positions, self._attend(layout))  # [T, H]

    @torch.inference_mode()
    def chain(self, reqs: list[Request], starts: list[int], counts: list[int], ks: list[int], tokens: torch.Tensor,
              accepted: torch.Tensor, streams: torch.Tensor,
              device_starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """Queue the catch-up and the drafts behind a verify whose results are still on the device:
        request i verified counts[i] tokens from starts[i] (tokens [B, K + 1] and accepted [B] from the
        rejection sampler, the target's streams [sum(counts), n * Ht]) and wants ks[i] drafts. Returns
        the drafts [B, max k] (device), or None when no graph fits (the caller then proposes as usual,
        after its read). Its caller reports each request's head as caught up to start + accepted + 1.
        `device_starts` [B]: the real starts, on the device (a verify queued ahead: lookahead.py)."""
        if self.graphs is None or not reqs:
            return None
        tables = [r.blocks for r in reqs]
        sampling = any(k and not r.greedy_draft for r, k in zip(reqs, ks, strict=True))
        rows = [self._draw(r, k, paired=device_starts is not None) for r, k in zip(reqs, ks, strict=True)] \
            if sampling else None
        key = self.graphs.key_for(counts, tables, max(ks), rows)
        if key is None:
            return None
        return self.graphs.run_chained(key, tokens, accepted, streams, starts, counts, tables, ks, rows,
                                       device_starts)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        results = [Proposal([], it.draft_computed) for it in items]
        work, starts, counts, ids, feats = [], [], [], [], []
        for i, it in enumerate(items):
            if it.hidden is None:
                continue
            # The worker hands over every verified step's states, so a gap before `hidden_start`
            # should not occur; if it did, those slots stay stale: acceptance suffers, never exactness.
            start = max(it.draft_computed, it.hidden_start)
            end = min(it.upto, it.hidden_start + it.hidden.shape[0])
            if end <= start:
                continue
            tokens = it.tokens if it.tokens else it.request.all_ids
            work.append((i, it))
            starts.append(start)
            counts.append(end - start)
            ids.extend(tokens[start + 1 : end + 1])
            feats.append(it.hidden[start - it.hidden_start : end - it.hidden_start])
        if not work:
            return results
        # Draft only from a fully caught-up slot (a prefill chunk may stop short of the prompt's end).
        wants = [it.k if it.k > 0 and s + c == it.upto else 0 for (_, it), s, c in zip(work, starts, counts, strict=True)]
        tables = [it.request.blocks for _, it in work]
        key = rows = None
        if self.graphs is not None:
            sampling = any(k and not it.request.greedy_draft for (_, it), k in zip(work, wants, strict=True))
            rows = [self._draw(it.request, k) for (_, it), k in zip(work, wants, strict=True)] if sampling else None
            key = self.graphs.key_for(counts, tables, max(wants), rows)
        if key is not None:
            assert self.graphs is not None
            out = self.graphs.run(key, ids, torch.cat(feats), starts, counts, tables, wants,
                                  [len(it.tokens) for _, it in work], rows)  # [n, steps]
            # A catch-up-only call (every k = 0: the policy chose a plain step) has nothing to read back.
            drafts = out.tolist() if max(wants) else [[] for _ in work]
            for w, (i, _) in enumerate(work):
                results[i] = Proposal(drafts[w][: wants[w]], starts[w] + counts[w])
            return results
        dev = self.device
        layout = BatchLayout.build(starts, counts, tables, self.cache.block_size, dev)
        out = self._run(h2d(ids, torch.int64, dev), self.head.features(torch.cat(feats)), layout)  # [T, H]
        for w, (i, _) in enumerate(work):
            results[i] = Proposal([], starts[w] + counts[w])
        drafting = [w for w in range(len(work)) if wants[w]]
        if not drafting:
            return results
        ends = list(itertools.accumulate(counts))
        last = h2d([ends[w] - 1 for w in drafting], torch.int64, dev)  # [Bd] last row of each drafting item
        draft_items = [work[w][1] for w in drafting]
        host = self._draft_loop(draft_items, out.index_select(0, last)).tolist()  # [Bd, K]
        for row, w in enumerate(drafting):
            i, it = work[w]
            results[i] = Proposal(host[row][: it.k], it.upto)
        return results

    def _draw(self, r: Request, k: int, paired: bool = False) -> DraftRow:
        """`paired`: q into the request's other pool row (a verify queued ahead: lookahead.pair_slot)."""
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

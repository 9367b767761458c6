"""A small draft model with its own paged KV cache, sharing the target's block tables.

Each call first catches the draft cache up on the tokens it has not seen (the prompt chunks the
target just prefilled, or the tokens accepted at the last verification), then runs k single-token
steps, each draft chosen by the draft policy (spec_decode/drafting.py).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from streamsd.model.graphs import GraphConfig, GraphRunner, forward_logits
from streamsd.model.kv_cache import PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.spec_decode.drafting import DraftPicker
from streamsd.spec_decode.proposer import DraftModel, Proposal, ProposeItem, Proposer


class DraftModelProposer(Proposer):
    dense = True
    keeps_cache = True

    def __init__(self, model: Transformer, cache: PagedKVCache, q_pool: torch.Tensor, target_vocab: int):
        self.model = model
        self.cache = cache
        self.q_pool = q_pool  # [slots, K, V_target]
        self.vocab = target_vocab
        self.device = q_pool.device
        self.graphs: GraphRunner | None = None  # CUDA graphs for catch-up and single-token steps

    def draft_model(self) -> DraftModel:
        return DraftModel(self.model, self.cache, self.graphs)

    def enable_cuda(self, graphs: GraphConfig | None, scratch_block: int) -> None:
        if graphs is not None:  # catch-ups and single-token steps, no prompt graphs
            self.graphs = GraphRunner(self.model, self.cache, scratch_block, replace(graphs, prompt_widths=()),
                                      self.device, verifies=False)

    def capture_graphs(self, max_batch: int) -> None:
        if self.graphs is not None:
            self.graphs.capture_up_to(max_batch, (1,))  # a draft model steps one token at a time

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        results = [Proposal([], it.draft_computed) for it in items]
        # Items with nothing to catch up on and nothing to draft cost no forward.
        work = [(i, it) for i, it in enumerate(items) if it.k > 0 or it.upto > it.draft_computed]
        if not work:
            return results
        starts, counts, tables, ids = [], [], [], []
        for _, it in work:
            # Catch up on what the cache lacks; a drafting item re-feeds at least its last token,
            # whose logits give the first draft.
            end = len(it.tokens) if it.k > 0 else it.upto
            start = min(it.draft_computed, end - 1) if it.k > 0 else it.draft_computed
            starts.append(start)
            counts.append(end - start)
            tables.append(it.request.blocks)
            ids.extend(it.tokens[start:end] if it.k > 0 else it.request.all_ids[start:end])
        ends = [c - 1 for c in itertools.accumulate(counts)]  # last row of each item
        drafting = [w for w, (_, it) in enumerate(work) if it.k > 0]
        logits = forward_logits(self.model, self.graphs, self.cache, ids, starts, counts, tables,
                                [ends[w] for w in drafting], self.device)  # [Bd, Vd]
        for w, (i, _) in enumerate(work):
            results[i] = Proposal([], starts[w] + counts[w])
        if not drafting:
            return results
        draft_items = [work[w][1] for w in drafting]
        host = self._draft_loop(draft_items, logits).tolist()  # [Bd, K]
        for row, w in enumerate(drafting):
            i, it = work[w]
            results[i] = Proposal(host[row][: it.k], len(it.tokens) + it.k - 1)
        return results

    def _draft_loop(self, items: list[ProposeItem], logits: torch.Tensor) -> torch.Tensor:
        """logits [Bd, Vd] at each item's last token -> drafts [Bd, max k]."""
        dev = self.device
        reqs = [it.request for it in items]
        picker = DraftPicker(items, self.q_pool, self.vocab)
        k_max = max(it.k for it in items)
        drafts = torch.zeros(len(items), k_max, dtype=torch.int64, device=dev)  # [Bd, K]
        active = list(range(len(items)))
        for j in range(k_max):
            idx = slice(None) if len(active) == len(items) else h2d(active, torch.int64, dev)  # [A]
            drafts[idx, j] = picker.pick(self._fit_vocab(logits), active, idx, j)  # [A]
            active = [i for i in active if items[i].k > j + 1]
            if not active:
                break
            idx = slice(None) if len(active) == len(items) else h2d(active, torch.int64, dev)
            positions = [len(items[i].tokens) + j for i in active]
            logits = forward_logits(self.model, self.graphs, self.cache, drafts[idx, j], positions,
                                    [1] * len(active), [reqs[i].blocks for i in active],
                                    list(range(len(active))), dev)  # [A, Vd]
        return drafts

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: extra (padding) ids cut, missing ones impossible."""
        v = logits.shape[-1]
        if v >= self.vocab:
            return logits[:, : self.vocab]
        pad = torch.full((logits.shape[0], self.vocab - v), float("-inf"), device=logits.device)
        return torch.cat([logits, pad], dim=-1)


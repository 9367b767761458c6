"""A step of an engine whose drafts are trees (an EAGLE head's, spec_decode/eagle/tree.py).

On CUDA a step where every request verifies its full tree (its pending token and N nodes) and
wants the next one is one replay of its bucket's tree graph (worker/tree_graphs.py), and the replay of
the step after it is queued before this one is read (worker/lookahead.py): the graph wrote that step's
inputs itself. Requests that verify no tree beside such whole trees (a request joining with its
prompt, one decoding plain) take their own step after the graph's, on the path a step of theirs alone
takes. Every other step (a cut tree near max_tokens, log-probabilities, min_tokens, penalties, no
graph) takes the eager path: the tree-masked forward, sample/tree_verify.py, then the proposer's
catch-up and growth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamsd.model.kv_cache import h2d
from streamsd.sample.tree_verify import entry_tree, verify_trees
from streamsd.sample.verify import below_min_tokens
from streamsd.sched.plan import EntryResult, Scheduled

if TYPE_CHECKING:
    from streamsd.worker.steps.full import FullStep
    from streamsd.worker.worker import Worker


class TreeStep:
    def __init__(self, worker: Worker, full: FullStep):
        self.w = worker
        self.full = full  # its forward and its proposing
        self.beside = 0  # steps that ran requests verifying no tree beside the tree graph's (`_beside`)

    def run(self, entries: list[Scheduled], queue_next: bool = True) -> list[EntryResult]:
        w = self.w
        assert w.tree is not None
        beside = self._beside_split(entries)
        if beside is not None:
            return self._beside(entries, *beside)
        launched = self._launch(entries)
        if launched is None:
            return self.eager(entries)
        key, all_rows = launched
        # The graph's own next inputs are row for row those of the step it ran: a step that lost rows
        # (a request stopped) is followed by one with the host's inputs instead.
        queued_rows = self._queue_next(entries, key) if queue_next and all_rows else []
        w.launched.set()
        results = self._results(entries, w.readback.wait())
        w.lookahead.place([entries[i].start + 1 + results[i].num_accepted for i in queued_rows])
        return results

    def _launch(self, entries: list[Scheduled], whole: bool = False) -> tuple[tuple[int, int], bool] | None:
        """Takes the step queued ahead for `entries`, or queues the tree graph's step for them where they
        all verify whole trees (`whole`: known to), and starts reading its result back. Returns the graph's
        key and whether the step holds all the rows the graph computed; None where no graph serves them
        (nothing was queued; a step queued ahead was dropped)."""
        w = self.w
        taken = w.lookahead.take(entries)
        graphs = w.tree_graphs
        if taken is None:
            key = graphs.key_for([e.request for e in entries], [e.request.blocks for e in entries]) \
                if graphs is not None and (whole or self._whole_trees(entries)) else None
            if key is None:
                return None
            assert graphs is not None
            result = graphs.run(key, [e.request for e in entries], [e.start for e in entries])
            all_rows = True
        else:
            queued, picked = taken
            key = queued.key
            assert key is not None  # only a tree step's graph queues one ahead of a tree step (`_queue_next`)
            all_rows = len(picked) == len(queued.requests)
            result = queued.tokens if all_rows else queued.tokens.index_select(0, h2d(picked, torch.int64, w.device))
        w.readback.start(result[: len(entries)])
        return key, all_rows

    def _results(self, entries: list[Scheduled], host: list[list[int]]) -> list[EntryResult]:
        """The graph's rows read back, [B][D + 2 + 2N]: emitted | accepted | next tree's tokens | parents."""
        assert self.w.tree is not None
        d1, n = self.w.tree.depth + 1, self.w.tree.nodes
        results = []
        for e, row in zip(entries, host, strict=True):
            a = row[d1]
            new = row[: a + 1]
            r = e.request
            stops = len(r.output_ids) + len(new) >= r.params.max_tokens or any(r.stops_on(t) for t in new)
            k = 0 if stops else e.k_next
            results.append(EntryResult(new, a, row[d1 + 1 : d1 + 1 + k], e.start + 1 + a, [j < a for j in range(a + 1)],
                                       None, row[d1 + 1 + n : d1 + 1 + n + k]))
        return results

    def _beside_split(self, entries: list[Scheduled]) -> tuple[list[int], list[int]] | None:
        """(entries verifying whole trees, entries verifying none: prompt chunks, requests decoding plain),
        by index, where the step holds both and a graph may take the trees; else None."""
        if self.w.tree_graphs is None:
            return None
        rest = [i for i, e in enumerate(entries) if e.num_drafts == 0]
        if not rest or len(rest) == len(entries):
            return None
        trees = [i for i, e in enumerate(entries) if e.num_drafts]
        return (trees, rest) if self._whole_trees([entries[i] for i in trees]) else None

    def _beside(self, entries: list[Scheduled], trees: list[int], rest: list[int]) -> list[EntryResult]:
        """Requests joining (their prompt chunks), or decoding plain, beside requests verifying whole trees:
        the tree graph's step for the trees, then the others' own step (a prompt graph where one fits),
        instead of one eager tree-masked forward over all. On an H100 host a request joining a batch of
        16 trees made that forward a 29 ms step, where the tree graph takes 2.4 ms and a prompt graph
        a few: in a closed loop of 16 clients those steps took 44 % of the time. Nothing is queued
        behind: the next step holds the joined request too."""
        tree_entries = [entries[i] for i in trees]
        if self._launch(tree_entries, whole=True) is None:
            return self.eager(entries)
        self.beside += 1
        others = self.eager([entries[i] for i in rest])  # its verify says when its work is queued
        by_index = dict(zip(trees, self._results(tree_entries, self.w.readback.wait()), strict=True))
        by_index.update(zip(rest, others, strict=True))
        return [by_index[i] for i in range(len(entries))]

    def eager(self, entries: list[Scheduled]) -> list[EntryResult]:
        """A tree-masked forward over every entry, the walk, then the proposer (catch-up, growth)."""
        w = self.w
        assert w.tree is not None
        w.lookahead.drop()
        trees = [entry_tree(e) for e in entries]
        logits, _, scored = self.full.forward_scored(entries, trees if any(trees) else None)
        verified = verify_trees(w.verifier, [e for e in entries if e.verifies], logits, w.cache, w.store, w.tree.depth)
        return self.full.propose(entries, verified, scored)

    def _whole_trees(self, entries: list[Scheduled]) -> bool:
        """Every entry verifies its pending token and a full tree and wants the next full one (or none:
        its last step, whose grown tree is dropped), its head caught up to the root, with nothing the
        graph leaves to the eager path."""
        w = self.w
        assert w.tree is not None
        n, room = w.tree.nodes, w.target.args.max_position - 2 * (w.tree.nodes + w.tree.depth + 1)
        # A last step still grows a tree (dropped): only where its positions stay inside the model's.
        return bool(entries) and all(
            e.verifies and e.num_tokens == 1 and e.num_drafts == n and (e.k_next == n or (e.k_next == 0 and e.start < room))
            and e.request.draft_computed == e.start and e.request.params.logprobs is None
            and not below_min_tokens(e.request) for e in entries)

    def _queue_next(self, entries: list[Scheduled], key: tuple[int, int]) -> list[int]:
        """Replays the graph once more (its inputs are this step's outputs) when every entry may take
        that step: this one cannot end it by its length, and it holds the blocks that step writes.
        Returns the rows queued (all or none)."""
        w = self.w
        if not w.lookahead.enabled or w.tree_graphs is None:
            return []
        shape, bs = w.tree, w.cache.block_size
        assert shape is not None
        reach = shape.depth + 2 + max(shape.nodes, shape.depth + shape.frontier * (shape.depth - 1))
        # A request this step may finish by its length would leave the queued step unread: none then.
        ok = all(e.k_next == shape.nodes and len(e.request.output_ids) + shape.depth + 1 < e.request.params.max_tokens
                 and len(e.request.blocks) * bs >= e.start + reach for e in entries)
        if not ok:
            return []
        result = w.tree_graphs.replay(key, [e.request.blocks for e in entries])
        w.lookahead.queue_tree(entries, shape.nodes, result, key, reach)
        return list(range(len(entries)))

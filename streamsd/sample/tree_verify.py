"""Verifying draft trees (spec_decode/tree.py): the target's token at every window row, the walk, and the
accepted nodes' KV moved to their positions; one host read.

Each verifying entry brings its pending token (the root) and the first `num_drafts` nodes of its
tree (a prefix of a tree listed best first is a tree); an entry with no drafts is a tree of none,
so plain rows of the step take the same path. Row r of an entry decides the token at its position
start + 1 + depth(r), drawn as a plain step draws it there: greedy rows take the argmax, sampled
ones race the warped probabilities against the noise keyed (seed, position, TARGET). A seeded request
therefore emits exactly what plain decoding emits, whatever its trees were.
"""

from __future__ import annotations

import numpy as np
import torch

from streamsd.model.kv_cache import PagedKVCache, h2d
from streamsd.model.stream_store import StreamStore
from streamsd.model.tree_layout import NONE, ROOT
from streamsd.request import Request
from streamsd.sample.greedy import row_argmax
from streamsd.sample.sampler import sample_keyed, token_logprobs
from streamsd.sample.verify import Verified, Verifier
from streamsd.sched.plan import Scheduled
from streamsd.spec_decode.tree import path_moves, positions_to_slots, walk


def host_tree(parents: list[int]) -> tuple[list[int], list[int]]:
    """A tree's window as BatchLayout.build takes it: each row's depth (the root's 0) and its
    visible window rows as bits (itself and its ancestors, the root under every node)."""
    depth, bits = [0], [1]
    for i, p in enumerate(parents):
        up = 0 if p == ROOT else p + 1  # the parent's window row
        depth.append(depth[up] + 1)
        bits.append(bits[up] | 1 << (i + 1))
    return depth, bits


def entry_tree(e: Scheduled) -> tuple[list[int], list[int]] | None:
    """The window of a verifying entry with tree drafts: its last pending token and its nodes (a
    request recomputed after preemption brings its earlier tokens before them). None for others:
    they attend causally."""
    if not e.verifies or not e.num_drafts or not e.request.draft_parents:
        return None
    return host_tree(e.request.draft_parents[: e.num_drafts])


def verify_trees(v: Verifier, entries: list[Scheduled], logits: torch.Tensor, cache: PagedKVCache,
                 store: StreamStore | None, max_depth: int) -> Verified:
    """entries: the step's verifying ones, each one row of `logits` [rows, V] per window row, in order."""
    if not entries:
        v.launched.set()
        return Verified([], [], [])
    dev = v.device
    reqs = [e.request for e in entries]
    n = max(e.num_drafts for e in entries)
    b = len(entries)
    tokens = np.zeros((b, max(n, 1)), dtype=np.int64)  # [B, N]
    parents = np.full((b, max(n, 1)), NONE, dtype=np.int64)  # [B, N]
    index = np.zeros((b, n + 1), dtype=np.int64)  # [B, N + 1] each window row's logits row
    depth = np.zeros((b, n + 1), dtype=np.int64)  # [B, N + 1]
    bits: list[list[int]] = []  # [B][<= N + 1] each window row's path: a penalised row counts its drafts
    row = 0
    for i, e in enumerate(entries):
        k, r = e.num_drafts, e.request
        bits.append([1])
        if k:
            assert r.draft_parents, "tree verification of drafts without a tree"
            tokens[i, :k] = r.draft_ids[:k]
            parents[i, :k] = r.draft_parents[:k]
            depth[i, : k + 1], bits[i] = host_tree(r.draft_parents[:k])
        index[i] = row + np.minimum(np.arange(n + 1), k)  # padding rows repeat the last: never read
        row += 1 + k
    depth_t = h2d(torch.from_numpy(depth), torch.int64, dev)  # [B, N + 1]
    rows = logits[h2d(torch.from_numpy(index.ravel()), torch.int64, dev)].view(b, n + 1, -1)  # [B, N + 1, V]
    rows = v.adjust_rows(entries, rows, depth=depth, bits=bits)
    target = _target_tokens(v, reqs, rows, depth_t)  # [B, N + 1]
    width = max_depth + 1
    if n == 0:  # no trees (a request's prompt, plain rows): nothing to walk or move, the row's token is all
        v.launched.set()
        out = [[t] for t in target.view(-1).tolist()]
        host = [[*o, *[-1] * max_depth, 0] for o in out]  # as the walk's read: emitted | accepted | no path
        return Verified(out, [0] * b, _logprobs(reqs, rows, host, width, out))
    tok_t, par_t = (h2d(torch.from_numpy(x), torch.int64, dev) for x in (tokens, parents))
    emitted, accepted, path = walk(target, tok_t, par_t, max_depth)
    starts = h2d([e.start + e.num_tokens - 1 for e in entries], torch.int64, dev)  # [B] each root's position
    move_kv(cache, store, starts, path, _block_table(reqs, dev), cache.block_size)
    v.launched.set()
    host = torch.cat([emitted, accepted.unsqueeze(1), path], dim=1).tolist()  # the step's one host read
    acc = [h[width] for h in host]
    out = [h[: a + 1] for h, a in zip(host, acc, strict=True)]
    logprobs = _logprobs(reqs, rows, host, width, out)
    return Verified(out, acc, logprobs)


def move_kv(cache: PagedKVCache, store: StreamStore | None, starts: torch.Tensor, path: torch.Tensor,
            block_table: torch.Tensor, block_size: int) -> None:
    """The accepted nodes' K/V (and streams) moved from their window rows to their positions."""
    if path.is_cuda:  # one launch for both stores (kernels/tree/bookkeeping.py)
        from streamsd.kernels.tree import bookkeeping as kernel

        kernel.move_kv(cache, store, starts, path, block_table, block_size)
        return
    src, dst = path_moves(starts, path)  # [B, D] positions
    src_slots = positions_to_slots(src, block_table, block_size).view(-1)
    dst_slots = positions_to_slots(dst, block_table, block_size).view(-1)
    cache.move(src_slots, dst_slots)
    if store is not None:
        store.data[dst_slots] = store.data[src_slots]


def _block_table(reqs: list[Request], dev: torch.device) -> torch.Tensor:
    width = max(len(r.blocks) for r in reqs)
    return h2d([r.blocks + [0] * (width - len(r.blocks)) for r in reqs], torch.int32, dev)  # [B, W] as graphs hold it


def _target_tokens(v: Verifier, reqs: list[Request], rows: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """The target's token at every window row [B, N + 1], decided at position start + 1 + depth."""
    b, w, vocab = rows.shape
    if all(r.params.greedy for r in reqs):
        return row_argmax(rows)  # [B, W]
    base = h2d([[r.params.greedy, r.seed, r.num_tokens] for r in reqs], torch.int64, v.device)  # [B, 3]
    ints = torch.stack([base[:, 0:1].expand(b, w), base[:, 1:2].expand(b, w), base[:, 2:3] + depth])  # [3, B, W]
    wp = v.warp_params(reqs).repeat(w)
    return sample_keyed(rows.reshape(b * w, vocab), wp, ints.reshape(3, b * w)).view(b, w)


def _logprobs(reqs: list[Request], rows: torch.Tensor, host: list[list[int]], width: int,
              out: list[list[int]]) -> list:
    """Log-probabilities of the emitted tokens, from the rows that decided them (after the read)."""
    result: list = [None] * len(reqs)
    for i, r in enumerate(reqs):
        n = r.params.logprobs
        if n is None:
            continue
        path = host[i][width + 1 :]
        decided = [0] + [1 + p for p in path[: len(out[i]) - 1]]  # the window row of each emitted token
        sel = rows[i, decided]  # [E, V]
        chosen, vals, ids = token_logprobs(sel, torch.tensor(out[i], device=sel.device), n)
        result[i] = [(c, list(zip(ids_j[:n], vals_j[:n], strict=True)))
                     for c, vals_j, ids_j in zip(chosen.tolist(), vals.tolist(), ids.tolist(), strict=True)]
    return result

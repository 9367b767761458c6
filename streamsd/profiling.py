"""Start-up cost profile for the adaptive policy: seconds per target pass over N tokens and per
draft-model step over B requests, at a representative context length.

Runs before any request exists, so every KV block is free scratch space.
"""

from __future__ import annotations

import time

import torch

from streamsd.adaptive import CostTable
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _time_pass(model: Transformer, cache: PagedKVCache, n: int, context: int, repeats: int) -> float:
    """One pass over n new tokens after `context` cached ones: the weight-bound part of a step
    (a verify step's KV reads grow with its requests, not with its tokens)."""
    dev = cache.data.device
    bs = cache.block_size
    table = list(range(min(-(-(context + n) // bs), cache.num_blocks)))
    ctx = max(min(context, len(table) * bs - n), 0)
    layout = BatchLayout.build([ctx], [n], [table], bs, dev)
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    rows = torch.arange(n, device=dev)
    times = []
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        model(ids, layout, cache, rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:  # the first pass warms up
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def profile_costs(target: Transformer, cache: PagedKVCache, draft: Transformer | None,
                  draft_cache: PagedKVCache | None, max_tokens: int, context: int = 256,
                  repeats: int = 3) -> CostTable:
    buckets = [b for b in BUCKETS if b <= max_tokens]
    verify = {n: _time_pass(target, cache, n, context, repeats) for n in buckets}
    drafts = ({n: _time_pass(draft, draft_cache, n, context, repeats) for n in buckets}
              if draft is not None and draft_cache is not None else {})
    return CostTable.from_samples(verify, drafts)

"""One pass of each model before the first request, on a CPU.

On a GPU the start-up already runs every step shape (kernel warm-up, graph capture). On a CPU it may
run none: when the adaptive policy's cost profile is read back from disk, or with a fixed policy, the
first forward the process makes is the first request's, and it pays the one-off costs of a first
call (oneDNN primitive creation, allocator growth, lazy module set-up) in its time to first token:
about twice the TTFT of the requests after it on a 2-core machine with the default model. A prompt
chunk and a decode step of the target, and a step of a draft model, move those costs to start-up.

Every KV block is free before the first request, so the passes write into blocks nobody holds; what
they write is overwritten by the first request that is given those blocks.
"""

from __future__ import annotations

import torch

from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer

PROMPT_TOKENS = 16  # a prompt chunk's shape: a few rows, like any short chat prompt's


def _passes(model: Transformer, cache: PagedKVCache) -> None:
    """A prompt chunk of PROMPT_TOKENS into block 0 onwards, then one decode token after it."""
    dev = cache.data.device
    bs = cache.block_size
    table = list(range(min(-(-(PROMPT_TOKENS + 1) // bs), cache.num_blocks)))
    for start, count in ((0, PROMPT_TOKENS), (PROMPT_TOKENS, 1)):
        layout = BatchLayout.build([start], [count], [table], bs, dev)
        ids = torch.arange(1, count + 1, dtype=torch.int64, device=dev)  # [count] any ids (0 may be padding)
        model(ids, layout, cache, torch.arange(count, device=dev))


@torch.inference_mode()
def first_passes(target: Transformer, cache: PagedKVCache, draft: tuple[Transformer, PagedKVCache] | None) -> None:
    """Run the target's (and the draft model's) first forwards now, before any request exists."""
    _passes(target, cache)
    if draft is not None:
        _passes(*draft)

"""The start-up passes on a CPU leave nothing a request could read."""

from __future__ import annotations

import torch

from streamsd.engine.builder import load_model
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.worker.first_passes import first_passes


def _prompt_logits(model, cache: PagedKVCache, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` prefilled into blocks 0.. of `cache` (as a first request's)."""
    bs = cache.block_size
    table = list(range(-(-len(ids) // bs)))
    layout = BatchLayout.build([0], [len(ids)], [table], bs, torch.device("cpu"))
    rows = torch.arange(len(ids))
    with torch.inference_mode():
        return model(torch.tensor(ids), layout, cache, rows).logits


def test_a_first_request_after_the_start_up_passes_computes_what_it_would_have_without_them(tiny_model_dir):
    model = load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)[0]
    args = model.args
    ids = [5, 17, 42, 99, 3, 250, 7, 8, 11, 64, 128, 200, 31, 77, 5, 6, 9, 12, 300, 1]  # spans two blocks

    fresh = PagedKVCache(args, 8, 16, torch.float32, torch.device("cpu"))
    expected = _prompt_logits(model, fresh, ids)

    warmed = PagedKVCache(args, 8, 16, torch.float32, torch.device("cpu"))
    first_passes(model, warmed, None)
    assert warmed.data.abs().sum() > 0  # the passes did write into the blocks the request is given
    torch.testing.assert_close(_prompt_logits(model, warmed, ids), expected, rtol=0, atol=0)


def test_the_start_up_passes_run_a_draft_model_too(tiny_model_dir, close_draft_dir):
    target = load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)[0]
    draft = load_model(str(close_draft_dir), torch.device("cpu"), torch.float32)[0]
    t_cache = PagedKVCache(target.args, 4, 16, torch.float32, torch.device("cpu"))
    d_cache = PagedKVCache(draft.args, 4, 16, torch.float32, torch.device("cpu"))
    first_passes(target, t_cache, (draft, d_cache))
    assert t_cache.data.abs().sum() > 0 and d_cache.data.abs().sum() > 0

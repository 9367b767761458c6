"""The CUDA set-up of a built worker: Triton attention and fused layers for its models, the kernel
variants it can reach compiled, and CUDA graphs (model/graphs.py) for its target, its draft model
and its proposer, captured before the first request."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from streamsd.model.graph_layout import PROMPT_SEQS, PROMPT_WIDTHS
from streamsd.model.graphs import GraphConfig, GraphRunner

if TYPE_CHECKING:
    from streamsd.kernels.warmup import WarmUp
    from streamsd.worker.tree_graphs import TreeGraphs
    from streamsd.worker.worker import Worker

log = logging.getLogger(__name__)


def capture_all(worker: Worker, max_batch: int) -> int:
    """Every graph a step over at most `max_batch` requests can replay, captured now: the target's
    (bucket, width) cells, a tree engine's whole steps, and its proposer's (a draft model's one-token
    steps, an EAGLE head's chains at every depth and draw, or its growths). Captured on first use
    instead, each would cost a step 5-110 ms, and over a second where the capture compiles attention
    variants for its width. Returns the graphs captured."""
    draft = worker.proposer.draft_model() if worker.proposer is not None else None
    runners: list[GraphRunner | TreeGraphs] = [r for r in (worker.graphs, draft.graphs if draft else None) if r]
    if worker.tree_graphs is not None:
        runners.append(worker.tree_graphs)

    def count() -> int:
        return sum(len(r.graphs) for r in runners)

    before = count()
    if worker.tree_graphs is not None:
        worker.tree_graphs.capture_up_to(max_batch)
    if worker.graphs is not None:
        worker.graphs.capture_up_to(max_batch)
    if worker.proposer is not None:
        worker.proposer.capture_graphs(max_batch)
    return count() - before


def set_up(worker: Worker, *, scratch_block: int, max_len: int, k: int, graphs: bool,
           exact: bool = False) -> tuple[GraphRunner | None, WarmUp]:
    """The Triton attention and fused layers for the target and a draft model, the proposer moved
    onto them; returns the target's graph runner (None: eager steps) and the kernels' warm-up, begun:
    finish it (`WarmUp.finish`) after capturing the graphs, which a first start's compiles in child
    processes then overlap.

    `scratch_block` is a cache block the scheduler never hands out (every cache has one more block
    than the scheduler counts): padding tokens of a graph write there. `exact`: the target runs the
    batch-invariant GEMM and attention (kernels/exact/); a draft model keeps the fast ones.
    """
    from streamsd.kernels.attention.paged import paged_attention
    from streamsd.kernels.exact.attention import exact_cuda_attention
    from streamsd.kernels.warmup import begin_warm_up
    from streamsd.model.exact_forward import enable_exact_reference
    from streamsd.model.fast_forward import enable_fast_forward

    proposer = worker.proposer
    draft = proposer.draft_model() if proposer is not None else None
    kernel_models = []
    for model in (worker.target, draft.model if draft else None):
        if model is None:
            continue
        d = model.args.head_dim
        exact_here = exact and model is worker.target
        if d and d & (d - 1) == 0:  # the kernels tile the head dimension by powers of two
            model.attend = exact_cuda_attention if exact_here else paged_attention
            enable_fast_forward(model, exact=exact_here)
            kernel_models.append(model)
        elif exact_here:
            enable_exact_reference(model)
    trees = worker.tree is not None  # drafts are trees: worker/tree_graphs.py verifies them
    warm = begin_warm_up(kernel_models, worker.cache.data.dtype, worker.cache.block_size, worker.vocab,
                         1 if trees else k, worker.device, trees=trees,
                         exact=worker.target if exact and worker.target in kernel_models else None)
    if not graphs:
        if proposer is not None:
            proposer.enable_cuda(None, scratch_block)
        return None, warm
    bs = worker.cache.block_size
    # Narrow verify widths too: at large batch the planner drafts 1 or 2 tokens, and a step replays
    # the narrowest graph that holds its longest query, so without them k = 1 pays for k = K.
    widths = (1,) if trees else tuple(sorted({1, min(2, k + 1), min(3, k + 1), k + 1}))
    # The exact attention's grid gives every sequence the longest query the host lists say, which a
    # graph fixes at its width: its prompt graphs hold one sequence, or the grid would be 64x wider.
    cfg = GraphConfig(max_blocks=-(-(max_len + k + 2) // bs) + 1, query_widths=widths,
                      prompt_widths=tuple(w for w in PROMPT_WIDTHS if max(widths) < w <= max_len),
                      prompt_seqs=1 if exact else PROMPT_SEQS)
    if proposer is not None:
        proposer.enable_cuda(cfg, scratch_block)
    # An EAGLE head reads the target's streams at every verified token: its graphs return them too.
    return GraphRunner(worker.target, worker.cache, scratch_block, cfg, worker.device,
                       hidden_layers=worker.hidden_layers, store=worker.store), warm

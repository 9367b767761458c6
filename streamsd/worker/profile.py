"""Start-up cost profile for the adaptive policy, timed in the shapes the engine really runs.

Decode/verify steps: B requests × w query tokens each, at a representative context length —
through the worker's CUDA graphs when it has them (each (batch bucket, query width) graph is
captured, if it was not yet, and its replay timed: exactly what a step over that bucket runs), else
eagerly as the worker's CPU path runs them (one attention call per request, so the batch costs on
its own, not only its tokens). Widths: the graphs' (1 and 1 + K); on the CPU 1 and 1 + K at every
batch edge, and every width between where a step holds at most CONCAVE_TOKENS tokens: a GEMM over a
few rows costs far more than its share of a longer one's (SmolLM2 on 2 cores: 31, 49, 58 and 63 ms
for 1, 2, 3 and 5 rows), so a line from width 1 to 1 + K prices a small verify too low and the policy
speculates where plain decoding is faster. Past that the table interpolates. Draft-model steps: B
requests × 1 token the same way. Prefill chunks: one sequence of n tokens (the shape a chunk has).
Draft trees: a whole tree step of the configured shape per batch bucket (``time_tree_steps``), which
the step chooser (policy/chooser.py) weighs against the plain step of the same batch.

Runs before any request exists (or, in the benchmark, between passes), so every KV block is free
scratch space. Bounded in time (graph captures excluded): cells are timed cheapest first, and once
``budget_s`` is spent the rest are extrapolated from the smaller batches (proportionally: pessimistic, so unmeasured
territory never attracts speculation).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from streamsd.model.graphs import GraphRunner, buckets_up_to, forward_logits
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer
from streamsd.model.stream_store import StreamStore
from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.adaptive.shape import ShapeTable
from streamsd.policy.profile_cache import files_fingerprint
from streamsd.spec_decode.eagle.proposer import EagleProposer
from streamsd.spec_decode.proposer import Proposer
from streamsd.worker.cuda import capture_all

if TYPE_CHECKING:
    from streamsd.worker.worker import Worker

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SLOW_PASS_S = 0.05  # a pass this slow is timed once: its noise is small next to it, the budget is not
CONCAVE_TOKENS = 16  # CPU steps up to this many tokens are timed at every width (see above)


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_time(fn: Any, dev: torch.device, repeats: int) -> float:
    """Fastest seconds of ``fn()`` over ``repeats`` calls after a warm-up call (it captures a graph,
    compiles, allocates); a slow pass is called once more and the warm-up counts as a sample.

    The fastest, not the median: another process or a stall only ever adds time, and one skewed cell
    decides whether a batch ever speculates (a speculative shape timed during a stall keeps the
    policy plain there, and plain steps never correct a speculative key). The online correction
    restores the average level."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    warm = time.perf_counter() - t0
    times = [warm] if warm > SLOW_PASS_S else []
    for _ in range(1 if warm > SLOW_PASS_S else repeats):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def _time_pass(model: Transformer, cache: PagedKVCache, n: int, context: int, repeats: int) -> float:
    """One pass over n new tokens of one sequence after `context` cached ones: a prefill chunk."""
    dev = cache.data.device
    bs = cache.block_size
    table = list(range(min(-(-(context + n) // bs), cache.num_blocks)))
    ctx = max(min(context, len(table) * bs - n), 0)
    layout = BatchLayout.build([ctx], [n], [table], bs, dev)
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    rows = torch.arange(n, device=dev)
    return _best_time(lambda: model(ids, layout, cache, rows), dev, repeats)


def time_step(model: Transformer, cache: PagedKVCache, runner: GraphRunner | None, batch: int, width: int,
              context: int, repeats: int, store: StreamStore | None = None) -> float:
    """Seconds of one decode/verify pass over `batch` requests × `width` tokens, each after `context`
    cached tokens, through the graph such a step replays when there is one. Requests get blocks of
    their own while the pool has them, then share (the values written are garbage either way)."""
    bs = cache.block_size
    usable = cache.num_blocks - 1  # the last block is the graphs' scratch block
    if runner is not None:
        context = min(context, (runner.cfg.max_blocks - 1) * bs - width)
    per_request = -(-(context + width) // bs)
    tables = [[(i * per_request + j) % usable for j in range(per_request)] for i in range(batch)]
    starts, counts = [context] * batch, [width] * batch
    ids = [0] * (batch * width)
    rows = list(range(batch * width))
    dev = cache.data.device
    return _best_time(lambda: forward_logits(model, runner, cache, ids, starts, counts, tables, rows, dev, store),
                      dev, repeats)


def profile_costs(target: Transformer, cache: PagedKVCache, draft: Transformer | None,
                  draft_cache: PagedKVCache | None, max_tokens: int, context: int = 256,
                  repeats: int = 3, *, max_batch: int, max_k: int = 0,
                  graphs: GraphRunner | None = None, draft_graphs: GraphRunner | None = None,
                  budget_s: float | None = None, store: StreamStore | None = None) -> CostTable:
    """The cost table: prefill chunks by tokens, decode/verify steps by (batch, width), draft steps by batch."""
    dev = cache.data.device
    if budget_s is None:
        budget_s = 4.0 if dev.type == "cuda" else 15.0
    prefill = {n: _time_pass(target, cache, n, context, repeats) for n in BUCKETS if n <= max_tokens}
    edges = graphs.cfg.buckets if graphs is not None else BUCKETS
    batches = buckets_up_to(edges, max_batch)
    edge_widths = set(graphs.cfg.query_widths if graphs is not None else (1, 1 + max(max_k, 0)))
    widths = sorted(edge_widths if graphs is not None else range(1, 2 + max(max_k, 0)))
    cells = sorted(((b, w) for b in batches for w in widths
                    if graphs is not None or (b * w <= max_tokens and (w in edge_widths or b * w <= CONCAVE_TOKENS))),
                   key=lambda bw: (bw[0] * bw[1], bw[1]))
    # Capturing is the graphs' own start-up cost, paid once whether or not they are profiled: done
    # first, outside the budget, so every cell the engine can run is timed rather than extrapolated.
    for runner, runner_cells in ((graphs, cells), (draft_graphs, [(b, 1) for b in batches])):
        if runner is None:
            continue
        for key in runner_cells:
            if key not in runner.graphs:
                runner._capture(*key)
    t_start = time.perf_counter()
    over = lambda: time.perf_counter() - t_start > budget_s  # noqa: E731
    steps: dict[tuple[int, int], float] = {}
    for b, w in cells:
        if over() and steps:
            break  # the rest are extrapolated by ShapeTable.from_samples
        steps[(b, w)] = time_step(target, cache, graphs, b, w, context, repeats, store)
    drafts: dict[int, float] = {}
    if draft is not None and draft_cache is not None:
        for b in batches:
            if over() and drafts:
                break  # StepTable extrapolates past its last edge
            drafts[b] = time_step(draft, draft_cache, draft_graphs, b, 1, context, repeats)
    return CostTable.from_samples(prefill, drafts, shape=ShapeTable.from_samples(
        steps, padded=graphs is not None, batches=batches, widths=widths))


def profile_worker(worker: Worker, max_batch: int, max_tokens: int, max_k: int, context: int = 256) -> CostTable:
    """The cost table of a built worker: its target, its graphs, and its draft model if it has one
    (an EAGLE head: its catch-up pass, by positions)."""
    proposer = worker.proposer
    draft = proposer.draft_model() if proposer is not None else None
    capture_all(worker, max_batch)  # a start-up cost of the graphs, not the profile's (and done at build)
    table = profile_costs(worker.target, worker.cache, draft.model if draft else None, draft.cache if draft else None,
                          max_tokens, context, max_batch=max_batch, max_k=max_k, graphs=worker.graphs,
                          draft_graphs=draft.graphs if draft else None, store=worker.store)
    if proposer is not None and proposer.store is not None:  # a head that catches up from the store
        table.catchup = StepTable.from_samples(time_catch_up(proposer, worker.cache, max_tokens, repeats=3))
    if worker.tree is not None and isinstance(proposer, EagleProposer):
        table.tree = StepTable.from_samples(time_tree_steps(worker, proposer, max_batch, repeats=3))
    return table


def time_tree_steps(worker: Worker, proposer: EagleProposer, max_batch: int, repeats: int,
                    budget_s: float | None = None) -> dict[int, float]:
    """Seconds of a whole tree step (verify, walk, catch-up, growth) of the worker's tree shape by batch,
    at the tree graphs' buckets: their replays on CUDA, the same work run eagerly on a CPU. Cheapest
    first; past ``budget_s`` the rest are left to StepTable's proportional extrapolation."""
    from streamsd.worker.tree_graphs import tree_graphs_for

    dev = worker.device
    graphs = worker.tree_graphs or tree_graphs_for(worker, proposer, worker.cache.num_blocks - 1,
                                                   worker.target.args.max_position)
    if budget_s is None:
        budget_s = 4.0 if dev.type == "cuda" else 10.0
    t_start = time.perf_counter()
    out: dict[int, float] = {}
    for b in buckets_up_to(graphs.buckets, max_batch):
        if out and time.perf_counter() - t_start > budget_s:
            break
        out[b] = _best_time(lambda b=b: graphs.replay_padding(b), dev, repeats)
    return out


def time_catch_up(proposer: Proposer, cache: PagedKVCache, max_tokens: int, repeats: int) -> dict[int, float]:
    """Seconds of an EAGLE head's eager catch-up over n positions of one sequence, n at the bucket edges."""
    dev = cache.data.device
    bs = cache.block_size
    table = list(range(min(-(-max_tokens // bs), cache.num_blocks - 1)))
    edges = [n for n in BUCKETS if n <= min(max_tokens, len(table) * bs)]
    return {n: _best_time(lambda n=n: proposer.catch_up_pass(n, table), dev, repeats) for n in edges}


def profile_key(worker: Worker, max_batch: int, max_tokens: int, max_k: int, model_dirs: list[Path],
                context: int = 256) -> dict[str, Any]:
    """What profile_worker's table depends on: the models' files, the machine, the dtype, the CPU
    threads, the versions of the code that runs the steps, and profile_worker's own parameters."""
    import streamsd

    dev = worker.device
    proposer = worker.proposer  # as built: what profile_worker times is its draft model, if any
    graphs = worker.graphs
    return {
        "streamsd": streamsd.__version__, "torch": torch.__version__, "device": device_name(dev),
        "dtype": str(worker.cache.data.dtype), "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "models": files_fingerprint([d for d in model_dirs if d.exists()]),
        "proposer": type(proposer).__name__ if proposer is not None else None,
        "graphs": None if graphs is None else [list(graphs.cfg.buckets), list(graphs.cfg.query_widths)],
        "max_batch": max_batch, "max_tokens": max_tokens, "max_k": max_k, "context": context,
        "tree": None if worker.tree is None else str(worker.tree),
    }


def device_name(dev: torch.device) -> str:
    """The accelerator's or the CPU's model name: a profile made on one machine prices nothing on another.
    A CPU's also names the vector instructions torch's kernels use on it: a virtual machine may call
    itself just "AMD EPYC" on hosts with and without AVX-512, whose steps differ ~3x in cost."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
    except OSError:
        names = []
    import platform

    model = names[0] if names else platform.processor() or platform.machine()
    return f"cpu: {model} x {os.cpu_count()}, {torch.backends.cpu.get_cpu_capability()}"

"""A plain step's sampling over a top-k/top-p cut as one CUDA graph replay per batch bucket.

A sampled request that leaves top-p out gets its model's generation config's (0.9 for the default
model), so nearly every sampled plain step cuts: sample/warp.py sorts each row, cuts it, renormalises it
and races it against the keyed noise, ~20 launches from Python after the step's own graph. On a host
whose cores are slow that is more than a small model's whole decode step: plain decoding at T = 1 ran
at half its greedy speed. Here those operations are captured once per batch bucket and replayed from
static buffers: the logits, each row's warp parameters and its greedy | seed | position. Rows past the
batch are greedy padding that nobody reads.

The graph holds `sampler.sample_keyed`'s own operations on the same values, so a row draws what the
eager path draws (tree graphs capture the same operations for their rows: worker/tree_graphs.py).
CUDA only, as the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from streamsd.request import Request
from streamsd.sample.sampler import sample_keyed
from streamsd.sample.warp import WarpParams

MAX_ROWS = 32  # past it the sort's GPU time outweighs the launches, and a bucket's buffers grow with V


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [B, V] float32, the rows to sample
    params: torch.Tensor  # [4, B] float64: temperature | top-k | top-p | min-p (exact for these ints)
    ints: torch.Tensor  # [3, B] int64: greedy | seed | position
    out: torch.Tensor  # [B] int64, written by each replay


class CutSampling:
    def __init__(self, vocab: int, device: torch.device, pool: torch.cuda._POOL_HANDLE | None = None):
        """Graphs captured into `pool` when given (the target's graphs': they never run at once, and
        this one's output is its own). torch names the handle's type only privately."""
        self.vocab = vocab
        self.device = device
        self.pool = pool
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0

    def capture(self, buckets: list[int]) -> int:
        """A graph for each of `buckets` up to MAX_ROWS not captured yet; returns how many were."""
        todo = [b for b in buckets if b <= MAX_ROWS and b not in self.graphs]
        for b in todo:
            self.graphs[b] = self._capture(b)
        return len(todo)

    def serves(self, reqs: list[Request]) -> bool:
        """A batch whose sampled rows cut (the eager path's sort) and that fits a bucket."""
        return len(reqs) <= max(self.graphs, default=0) and any(
            not r.params.greedy and (r.params.top_k > 0 or r.params.top_p < 1.0) for r in reqs)

    def sample(self, reqs: list[Request], logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """[B] tokens from logits [B, V], as `sample_keyed` draws them; `positions` [B] each row's."""
        n = len(reqs)
        bucket = min(b for b in self.graphs if b >= n)
        g = self.graphs[bucket]
        params, ints = _padding(bucket)
        for i, r in enumerate(reqs):
            p = r.params
            params[:, i] = (p.temperature, p.top_k, p.top_p, p.min_p)
            ints[:, i] = (p.greedy, r.seed, positions[i])
        g.params.copy_(torch.from_numpy(params), non_blocking=True)
        g.ints.copy_(torch.from_numpy(ints), non_blocking=True)
        g.logits[:n].copy_(logits)
        g.graph.replay()
        self.replays += 1
        return g.out[:n].clone()  # the next replay rewrites `out`; a step queued ahead holds its tokens

    def _capture(self, bucket: int) -> _Graph:
        params, ints = _padding(bucket)
        logits = torch.zeros(bucket, self.vocab, dtype=torch.float32, device=self.device)
        dev_params = torch.from_numpy(params).to(self.device)
        dev_ints = torch.from_numpy(ints).to(self.device)

        def run() -> torch.Tensor:
            wp = WarpParams(dev_params[0].float(), dev_params[1].long(), dev_params[2].float(), dev_params[3].float(),
                            needs_sort=True)
            return sample_keyed(logits, wp, dev_ints)

        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            run()  # lazy initialisations (kernel loads, the allocator's blocks) stay out of the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return _Graph(graph, logits, dev_params, dev_ints, out)


def _padding(bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Host values of an all-padding bucket: greedy rows at temperature 1, nothing cut."""
    params = np.zeros((4, bucket), dtype=np.float64)
    params[0], params[2] = 1.0, 1.0
    ints = np.zeros((3, bucket), dtype=np.int64)
    ints[0] = 1
    return params, ints

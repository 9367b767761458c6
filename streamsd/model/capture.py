"""Capturing one CUDA graph, as every graph runner here does (the target's steps, the tree steps, an
EAGLE head's chains and growths)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(graph: torch.cuda.CUDAGraph, pool: torch.cuda._POOL_HANDLE, device: torch.device, run: Callable[[], T],
            reset: Callable[[], None] | None = None) -> T:
    """`run` once eagerly on a side stream (Triton compiles, cuBLAS picks its kernels, outside the capture),
    then captured into `graph`, then replayed once: a graph's first launch uploads it to the device, which
    would otherwise cost the first step that replays it about a millisecond (an EAGLE head's catch-up
    graphs, one per prompt width, are first replayed in requests' prompt steps). Returns what the captured `run` returned: the graph's
    output buffers. `run` must be safe to execute on the buffers as they stand (all padding, which writes
    the scratch block only); `reset` puts back the inputs an execution advances, after each one."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    if reset is not None:
        reset()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    graph.replay()
    if reset is not None:
        reset()
    return out

"""Host cost of launching work on the GPU, in isolation: a Triton kernel through JITFunction.run and
through its compiled launcher, and a replay of each CUDA graph a tiny EAGLE engine captured (target
verify graphs, head chain graphs), with the GPU idle and with ~1 ms of work queued ahead.
Usage: python3 scripts/launch_costs.py"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from tiny_eagle import build_tiny_eagle

from streamsd import LLM, SamplingParams
from streamsd.kernels.sample.rng import _uniforms_kernel


def host_us(fn: Callable[[], object], busy: bool = False, n: int = 25) -> float:
    """Median host microseconds of fn(), after a sync (and ~1 ms of queued GPU work when busy)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(2_000_000)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def triton_launch() -> None:
    seeds = torch.arange(4, dtype=torch.int64, device="cuda")
    pos = torch.arange(20, dtype=torch.int64, device="cuda").view(4, 5)
    out = torch.empty(4, 5, device="cuda")
    args = (seeds, pos, out, 5, 20, 1)
    kernel = _uniforms_kernel[(1,)](*args, BLOCK=128, num_warps=4)
    stream = torch.cuda.current_stream().cuda_stream

    def jit() -> None:
        _uniforms_kernel[(1,)](*args, BLOCK=128, num_warps=4)

    def direct() -> None:  # Triton's own launcher, no argument binding (internal API: a probe only)
        kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, 128)

    print(f"Triton launch: JITFunction.run {host_us(jit, n=200):.1f} us, compiled launcher {host_us(direct, n=200):.1f} us")


def graph_replays() -> None:
    target_dir, head_dir = build_tiny_eagle()
    llm = LLM(str(target_dir), speculative_method="eagle", draft_model=str(head_dir), device="cuda",
              dtype="bfloat16", speculation_policy="fixed")
    llm.generate("hello there", SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    llm.generate("hello there", SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=3))
    worker = llm.core.rt.worker
    for key, g in worker.graphs.graphs.items():
        print(f"target graph {key}: idle {host_us(g.graph.replay):6.1f} us, busy {host_us(g.graph.replay, True):6.1f}")
    for key, g in worker.proposer.graphs.graphs.items():
        if g.graph is not None:
            print(f"chain graph {key}: idle {host_us(g.graph.replay):6.1f} us, busy {host_us(g.graph.replay, True):6.1f}")


if __name__ == "__main__":
    triton_launch()
    graph_replays()

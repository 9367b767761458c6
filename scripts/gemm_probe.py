"""Achieved HBM bandwidth of the 8B layer GEMMs (torch F.linear, i.e. cuBLAS) at decode batch
sizes, against the 4.25 TB/s copy ceiling. Usage: python3 scripts/gemm_probe.py"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def time_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s.record()
    for _ in range(iters // 20):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / iters


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    print(f"{'gemm':>8} {'M':>4} {'us':>8} {'TB/s':>6}")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=dt)
        for m in (1, 16, 64, 320):
            x = torch.randn(m, k, device=dev, dtype=dt)
            us = time_us(lambda x=x, w=w: F.linear(x, w))
            print(f"{name:>8} {m:>4} {us:8.1f} {n * k * 2 / us / 1e6:6.2f}")
    # one 8B layer's four GEMMs back to back at M=1, and a tiny elementwise kernel's cost in a graph
    x = torch.randn(1, 4096, device=dev, dtype=dt)
    print("tiny add (graph, per kernel) us:", round(time_us(lambda: x.add_(1.0), 2000), 2))


if __name__ == "__main__":
    main()

"""The 8B decode GEMMs at M = 1 / 16 / 64 through cuBLAS (F.linear, the default), cuBLASLt
(torch.backends.cuda.preferred_blas_library) and the NN layout (x @ W^T stored [K, N]), with three weight
copies rotated so no weight is served from L2 between calls (o_proj's 33.5 MB fits the H200's 50 MB L2).
Prints us and TB/s of weight bytes per GEMM and each layer's total against 4.25 TB/s.
Usage: python3 scripts/gemm_variants.py"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
VARIANTS = ("cublas", "cublaslt", "nn")


def time_us(fns: list[Callable[[], torch.Tensor]], iters: int = 120) -> float:
    for f in fns:
        f()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters // 10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * len(fns))


def calls(variant: str, x: torch.Tensor, ws: list[torch.Tensor], wts: list[torch.Tensor]) -> list[Callable]:
    if variant == "nn":
        return [lambda wt=wt: torch.mm(x, wt) for wt in wts]
    return [lambda w=w: F.linear(x, w) for w in ws]


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"{'gemm':>8} {'M':>4} " + " ".join(f"{v:>14}" for v in VARIANTS))
    totals: dict[tuple[str, int], float] = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(3)]  # [N, K]
        wts = [w.t().contiguous() for w in ws]  # [K, N]
        for m in (1, 16, 64):
            x = torch.randn(m, k, device=dev, dtype=dt)  # [M, K]
            row = []
            for variant in VARIANTS:
                torch.backends.cuda.preferred_blas_library("cublaslt" if variant == "cublaslt" else "cublas")
                us = time_us(calls(variant, x, ws, wts))
                row.append(us)
                totals[(variant, m)] = totals.get((variant, m), 0.0) + us
            print(f"{name:>8} {m:>4} " + " ".join(f"{us:7.1f}us {n * k * 2 / us / 1e6:4.2f}" for us in row))
    torch.backends.cuda.preferred_blas_library("cublas")
    ideal = sum(n * k * 2 for n, k in SHAPES.values()) / 4.25e6
    for m in (1, 16, 64):
        print(f"layer total M={m}: " + ", ".join(f"{v} {totals[(v, m)]:.1f} us" for v in VARIANTS)
              + f"  (ideal at 4.25 TB/s: {ideal:.1f} us)")


if __name__ == "__main__":
    main()

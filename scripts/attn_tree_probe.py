"""How long the paged attention kernel takes at batch 1 on the default model's shape (9 query heads,
3 KV heads, head_dim 64), decode (1 query row) against a draft tree's window (W rows), per split count,
warp count and rows a program takes of the [BLOCK_M, D] tile ("-": all): 30 launches (a forward's
layers) captured in a CUDA graph, replayed, microseconds a launch. Usage: python3 scripts/attn_tree_probe.py [contexts, e.g. 256,512,1024] [rows, e.g. 1,5,6t,25t]
(a row count ending in t is a tree window: its rows masked by tree bits; default 1,25t,32t)"""

from __future__ import annotations

import sys
from functools import partial

import torch

from streamsd.kernels.attention.paged import paged_attention

HEADS, KV_HEADS, DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


def time_us(fn, reps: int = 50) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * LAYERS)


def main() -> None:
    contexts = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "256,512,1024").split(",")]
    shapes = [(int(x.rstrip("t")), x.endswith("t")) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,25t,32t").split(",")]
    dev = torch.device("cuda")
    blocks = 2048 // PAGE + 2
    kc = torch.randn(blocks, PAGE, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(blocks, device=dev, dtype=torch.int64)[: blocks - 1].to(torch.int32).unsqueeze(0)
    print("context  rows  splits  warps  rows/prog   us/launch")
    for ctx in contexts:
        for rows, tree in shapes:
            q = torch.randn(rows, HEADS, DIM, device=dev, dtype=torch.bfloat16)
            lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
            starts = torch.tensor([0, rows], device=dev, dtype=torch.int32)
            bits = torch.full((rows,), (1 << rows) - 1, device=dev, dtype=torch.int64) if tree else None
            win = torch.tensor([ctx - rows], device=dev, dtype=torch.int64) if tree else None
            for splits in (1, 2, 4, 8, 16) if rows == 1 else (2, 4, 8, 16):
                for warps in (4, 8) if rows > 8 else (4,):
                    for per in (None, 16, 32, 64) if rows > 5 else (None,):
                        if per is not None and per >= 3 * rows:
                            continue
                        us = time_us(partial(paged_attention, q, kc, vc, table, lens, starts, DIM**-0.5, rows,
                                             splits=splits, tree_bits=bits, tree_start=win, num_warps=warps,
                                             rows_per_program=per))
                        print(f"{ctx:7d} {rows:4d}{'t' if tree else ' '} {splits:7d} {warps:6d} {per or '-':>10}"
                              f" {us:11.2f}", flush=True)


if __name__ == "__main__":
    main()

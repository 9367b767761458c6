"""A tree level's children on the H200: the head's norm, bf16 lm_head GEMM and chunked top-k (three
launches, kernels/sample/topk.py) against one pass over an int8 lm_head (kernels/tree/head_topk.py) and its merge,
at the default model's shapes (49152 x 576), for the rows a level has at batch 1 and 4. Each variant
runs 30 times inside one CUDA graph, replayed 50 times: us a call. Also how often the two agree on
the best id, and the merge launch alone.

  python3 scripts/head_topk_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
from attn_tree_probe import time_us  # scripts/: 30 calls in a CUDA graph, replayed

from streamsd.kernels.fused import add_rmsnorm
from streamsd.kernels.sample.topk import topk_logprobs
from streamsd.kernels.tree.head_topk import DraftLogits, _merge_blocks_kernel, head_topk


def _native(out: torch.Tensor, norm: torch.Tensor, eps: float, w: torch.Tensor, k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_logprobs(F.linear(add_rmsnorm(out, None, norm, eps)[0], w), k)


def _merge(rows: int, chunks: int, block_v: int, k: int, dev: torch.device) -> Callable[[], None]:
    stats = torch.rand(rows * chunks * 2, device=dev)
    cands = torch.randint(-(2**62), 2**62, (rows * chunks,), device=dev)
    logits = torch.randn(rows * chunks * block_v, device=dev)
    out_v, out_i = torch.empty(rows, k, device=dev), torch.empty(rows, k, dtype=torch.int64, device=dev)

    def run() -> None:
        _merge_blocks_kernel[(rows,)](stats, cands, logits, cands, out_v, out_i, chunks, chunks * block_v, K=k,
                                      KP=triton.next_power_of_2(k), CHUNKS=triton.next_power_of_2(chunks),
                                      BLOCK_V=block_v, D2T=False, num_warps=4)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    vocab, hidden, k, eps = 49152, 576, 6, 1e-5
    w = (torch.randn(vocab, hidden, generator=g, device=dev) * 0.05).to(torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
    int8 = DraftLogits.build(w, norm, eps, None)
    results = []
    for rows in (1, 6, 24):
        out = torch.randn(rows, hidden, generator=g, device=dev).to(torch.bfloat16)
        native = partial(_native, out, norm, eps, w, k)
        row = {"rows": rows, "native_us": time_us(native)}
        for block_v in (128, 256):
            row[f"merge alone v{block_v}"] = time_us(_merge(rows, vocab // block_v, block_v, k, dev))
        best = native()[1][:, 0]
        for block_v in (128, 256):
            for warps, block_h, stages in itertools.product((4, 8), (32, 64), (1, 2, 3, 4)):
                fused = partial(head_topk, out, int8, k, tiles=(block_v, block_h, warps, stages))
                key = f"int8 v{block_v} w{warps} h{block_h} s{stages}"
                row[key] = time_us(fused)
                row[key + " top1"] = float((fused()[1][:, 0] == best).float().mean())
        results.append(row)
        print(f"rows {rows}: native {row['native_us']:.1f} us, merge alone v128 {row['merge alone v128']:.1f} us, "
              f"v256 {row['merge alone v256']:.1f} us")
        for key in sorted((x for x in row if x.startswith("int8") and not x.endswith("top1")), key=row.get)[:10]:
            print(f"   {key:22s} {row[key]:6.1f} us   top-1 agrees {row[key + ' top1']:.2f}")
    if a.out:
        json.dump(results, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()

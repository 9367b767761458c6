"""Each draft-tree shape on CUDA with a real model, one engine at a time: build it (its graphs captured
for every tree bucket up to --max-seqs), then a few greedy and seeded answers beside plain decoding's.
A shape that fails prints its traceback and the others still run, so a capture fault names its shape
(run with CUDA_LAUNCH_BLOCKING=1 to name its kernel). Exits 1 if any shape failed.

  python3 scripts/tree_shapes_cuda.py --model M --head DIR --shapes "5,4,4,16;3,8,8,24"
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--shapes", required=True, help="'D,M,C,N' separated by ';'")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    from streamsd import LLM, SamplingParams

    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why.",
               "What is the capital of France?", "Explain recursion to a child."]
    params = [SamplingParams(temperature=t, max_tokens=a.max_tokens, seed=i, ignore_eos=True)
              for t in (0.0, 1.0) for i in range(len(prompts))]
    plain = LLM(a.model, device="cuda", max_num_seqs=a.max_seqs, kv_cache_tokens=16384)
    want = [r.outputs[0].token_ids for r in plain.generate(prompts * 2, params)]
    del plain
    failed = []
    for shape in [s for s in a.shapes.split(";") if s]:
        print(f"=== {shape}", flush=True)
        try:
            llm = LLM(a.model, speculative_method="eagle", draft_model=a.head, speculative_tree=shape, device="cuda",
                      max_num_seqs=a.max_seqs, kv_cache_tokens=16384)
            graphs = llm.core.rt.worker.tree_graphs
            print(f"built: {len(graphs.graphs) if graphs else 0} tree graphs", flush=True)
            got = [r.outputs[0].token_ids for r in llm.generate(prompts * 2, params)]
            one = [llm.generate([q], [sp])[0].outputs[0].token_ids for q, sp in zip(prompts, params[:4], strict=True)]
            same = sum(x == y for x, y in zip(got, want, strict=True))
            print(f"batch 8: {same}/8 answers equal plain's (4 greedy, 4 seeded T=1; bf16 numerics may differ); "
                  f"batch 1 greedy: {sum(x == y for x, y in zip(one, want[:4], strict=True))}/4", flush=True)
            del llm, graphs
        except Exception:  # noqa: BLE001 - a shape's fault is reported, the next shape still runs
            traceback.print_exc()
            failed.append(shape)
            if "device-side assert" in traceback.format_exc():
                print("a device-side assert poisons the context: stopping here", flush=True)
                break
        gc.collect()
        torch.cuda.empty_cache()
    print(f"failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Draft trees against the adaptive chain and plain decoding as the batch grows: each engine answers B
requests at once (the held-out prompts, repeated with other seeds past 16), at T = 0 and T = 1.
--gate N adds the tree engine that drafts only while at most N requests decode (speculative_max_batch).
Prints output tokens/s per cell and each engine's build time (its CUDA graphs); writes JSON with --out.

  python3 scripts/tree_batch.py --model M --head DIR --tree 4,6,6,24 --gate 4 --batches 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--held-out", required=True, help="a training.json whose 'held_out' lists the prompts")
    p.add_argument("--tree", default="4,6,6,24")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--gate", type=int, default=0, help="also the tree engine gated at this batch (0: not)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from streamsd import LLM, SamplingParams

    batches = [int(b) for b in a.batches.split(",")]
    held = json.load(open(a.held_out))["held_out"]
    kinds = {"plain": {}, "eagle adaptive": dict(speculative_method="eagle", draft_model=a.head,
                                                 speculation_policy="adaptive"),
             f"tree {a.tree}": dict(speculative_method="eagle", draft_model=a.head, speculative_tree=a.tree)}
    if a.gate:
        kinds[f"tree <= {a.gate}"] = dict(speculative_method="eagle", draft_model=a.head, speculative_tree=a.tree,
                                         speculative_max_batch=a.gate)
    engines, built = {}, {}
    for name, kw in kinds.items():
        t0 = time.perf_counter()
        engines[name] = LLM(a.model, device="cuda", max_num_seqs=max(batches), kv_cache_tokens=65536, **kw)
        built[name] = round(time.perf_counter() - t0, 1)
    rows = []
    for temp in (0.0, 1.0):
        for b in batches:
            convs = [[{"role": "user", "content": held[i % len(held)]}] for i in range(b)]
            params = [SamplingParams(temperature=temp, max_tokens=a.max_tokens, seed=i) for i in range(b)]
            base = None
            for name, llm in engines.items():
                llm.chat(convs, params)  # warm: this batch's shapes
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.chat(convs, params)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                tokens = sum(len(r.outputs[0].token_ids) for r in outs)
                steps = sum(r.spec_stats.steps for r in outs)  # every step that emitted, plain ones too
                emitted = sum(r.spec_stats.emitted for r in outs)
                rate = tokens / secs
                base = base or rate
                rows.append({"engine": name, "temperature": temp, "batch": b, "tokens": tokens,
                             "tokens_per_s": round(rate, 1), "vs_plain": round(rate / base, 2),
                             "tau": round(emitted / steps, 3) if steps else None})
                print(f"T={temp:g} B={b:3d} {name:17s} {tokens:6d} tok {rate:9.1f} tok/s {rate / base:5.2f}x "
                      f"tau {rows[-1]['tau']}", flush=True)
    print("build seconds (graphs included):", built)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "tree": a.tree, "gate": a.gate, "max_tokens": a.max_tokens,
                       "built_s": built, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

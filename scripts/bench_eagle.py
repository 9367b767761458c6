"""Batch-1 decode speed on chat prompts: plain vs n-gram vs EAGLE vs HF transformers, T=0 and T=1.

`streamsd bench offline` times fixed-length greedy runs; this times real answers (stopping at EOS)
at several temperatures, which is what the issue's figures ask for. Methods run round-robin per
prompt so a noisy machine slows them alike; every engine first answers one warm-up prompt (CUDA
graphs are captured and Triton kernels compiled there, not in a timing). tokens/s = generated
tokens / wall time of the request (prefill included), summed over the prompts.

`--phases`: afterwards one more answer per engine and temperature with the host time of each phase of a step
timed (scheduling, the target's forward and its graph replay, verification, the host reads that wait
for the GPU, the proposer, the engine's emit), in ms per step: where an EAGLE step's time goes.

Usage (from the repo root, streamsd importable, e.g. PYTHONPATH=.):
  python scripts/bench_eagle.py --model M --head DIR [--held-out training.json] [--prompts N]
         [--max-tokens N] [--temperatures 0,1] [--device cuda] [--out FILE] [--phases] [--adaptive]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the one shipped for --model)")
    p.add_argument("--held-out", default="streamsd/assets/eagle/smollm2-135m-instruct/training.json",
                   help="a training.json whose held-out prompts to use")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="the engines' dtype: float32 shows that greedy answers match "
                   "plain decoding's once bf16 rounding between 1-row and tree-sized passes is out of the way")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--phases", action="store_true", help="then time each phase of a step (ms per step)")
    p.add_argument("--methods", default=None, help="a comma list of the methods to run (default: all)")
    p.add_argument("--adaptive", action="store_true",
                   help="also eagle under the adaptive policy (what `streamsd serve` runs by default)")
    p.add_argument("--trees", default=None,
                   help="draft-tree shapes 'D,M,C,N' separated by ';', each one more engine (method tree-D,M,C,N; "
                        "'D,M,C,N/native': its drafts ranked over the head's lm_head as it is, not an int8 copy)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from streamsd import LLM, SamplingParams

    prompts = json.load(open(a.held_out))["held_out"][: a.prompts]
    # plain-seq: plain decoding with each step read before the next is queued (no worker/lookahead.py)
    trees = [t for t in (a.trees or "").split(";") if t]
    methods = {"plain": None, "plain-seq": None, "ngram": "ngram", "eagle": "eagle",
               **({"eagle-ad": "eagle"} if a.adaptive else {}), **{f"tree-{t}": "eagle" for t in trees}}
    if a.methods:
        methods = {m: s for m, s in methods.items() if m in a.methods.split(",") or m == "plain"
                   or m.startswith("tree-")}
    engines = {m: LLM(a.model, speculative_method=s, draft_model=a.head if s == "eagle" else None,
                      num_speculative_tokens=a.k, device=a.device, dtype=a.dtype, max_num_seqs=4, kv_cache_tokens=8192,
                      pipeline=False if m == "plain-seq" else None,
                      speculation_policy="adaptive" if m.endswith("-ad") else "fixed",
                      speculative_tree=m.removeprefix("tree-").split("/")[0] if m.startswith("tree-") else None,
                      int8_draft_head=not m.endswith("/native"))
               for m, s in methods.items()}
    worker = engines["plain"].core.rt.worker
    dev = worker.device
    hf = None if a.no_hf else _hf(engines["plain"], dev)
    tok = engines["plain"].tokenizer

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    warm = [{"role": "user", "content": "Say hello in three languages."}]
    for llm in engines.values():
        for temp in (0.0, 1.0):
            llm.chat(warm, SamplingParams(temperature=temp, max_tokens=32, seed=0))
    rows: list[dict[str, Any]] = []
    policies: dict[str, Any] = {}
    for temp in (float(x) for x in a.temperatures.split(",")):
        totals = {m: [0, 0.0, 0, 0] for m in (*engines, *(["hf"] if hf is not None else []))}
        queued = {m: _queued(llm) for m, llm in engines.items()}
        compiles = dict.fromkeys(engines, 0)  # Triton kernels compiled inside the timed answers (each a stall)
        same = dict.fromkeys(engines, 0)  # T=0: answers token-identical to plain's (bf16 verify numerics may differ)
        same_seq = 0  # plain-seq's answers identical to plain's (seeded: at every temperature)
        for i, prompt in enumerate(prompts):
            conv = [{"role": "user", "content": prompt}]
            outs = {}
            for m, llm in engines.items():
                sp = SamplingParams(temperature=temp, max_tokens=a.max_tokens, seed=i)
                sync()
                t0 = time.perf_counter()
                before = _compiled(dev)
                r = llm.chat(conv, sp)[0]
                totals[m][1] += time.perf_counter() - t0  # the engine's last step read its tokens: done
                compiles[m] += _compiled(dev) - before
                totals[m][0] += len(r.outputs[0].token_ids)
                totals[m][2] += r.spec_stats.steps
                totals[m][3] += r.spec_stats.emitted
                outs[m] = r.outputs[0].token_ids
            for m in engines:
                same[m] += outs[m] == outs["plain"]
            same_seq += outs.get("plain-seq") == outs["plain"]
            if hf is not None:
                ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True).to(dev)
                kw: dict[str, Any] = (dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0
                                      else dict(do_sample=False))
                sync()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    gen = hf.generate(**ids, max_new_tokens=a.max_tokens, pad_token_id=tok.eos_token_id, **kw)
                sync()
                totals["hf"][1] += time.perf_counter() - t0
                totals["hf"][0] += gen.shape[1] - ids["input_ids"].shape[1]
        # What the adaptive policy decided and learnt so far (counts run on across temperatures).
        for m, llm in engines.items():
            if hasattr(llm.core.rt.policy, "summary"):
                summary = llm.core.rt.policy.summary()
                policies[f"{m} T={temp:g}"] = summary
                print(f"{m} T={temp:g}: plain share {summary['plain_step_share']:.3f}, k {summary['chosen_k']}, "
                      f"errors {summary['prediction_error']}, "
                      f"prior {summary['prior_means']}, learnt {summary['cost_relative']}, "
                      f"global {summary['cost_global_ratio']:.3f}")
        base = totals["plain"][0] / totals["plain"][1]
        for m, (n, s, steps, emitted) in totals.items():
            rows.append({"method": m, "temperature": temp, "tokens": n, "seconds": round(s, 3),
                         "tokens_per_s": round(n / s, 1), "vs_plain": round(n / s / base, 2),
                         "tau": round(emitted / steps, 3) if steps else None,
                         **({"same_as_plain": f"{same[m]}/{len(prompts)}"}
                            if m.startswith(("eagle", "tree")) and temp == 0 else {}),
                         # Steps queued ahead and taken / dropped (worker/lookahead.py): a drop wastes a step.
                         **({"queued_taken_dropped": [a - b for a, b in zip(_queued(engines[m]), queued[m], strict=True)]}
                            if m in engines else {}),
                         **({"kernel_compiles": compiles[m]} if m in engines else {}),
                         **({"same_as_plain": f"{same_seq}/{len(prompts)}"} if m == "plain-seq" else {})})
    doc = {"model": a.model, "head": a.head, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": str(worker.target.model.embed_tokens.weight.dtype).removeprefix("torch."),
           "cuda_graphs": worker.graphs is not None, "k": a.k, "prompts": len(prompts), "max_tokens": a.max_tokens,
           "rows": rows}
    doc["policy"] = policies
    if a.out:  # first without the phases: a failure there keeps the figures
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
    if a.phases:
        doc["phases_ms_per_step"] = {f"T={t:g}": _phases(engines, prompts[0], a.max_tokens, t)
                                     for t in (float(x) for x in a.temperatures.split(","))}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
    print(f"{doc['device']} {doc['dtype']}, graphs {doc['cuda_graphs']}, batch 1, {len(prompts)} held-out prompts, "
          f"up to {a.max_tokens} tokens, k={a.k}")
    print(f"{'method':18} {'T':>4} {'tokens':>7} {'tok/s':>8} {'x plain':>8} {'tau':>6}")
    for r in rows:
        print(f"{r['method']:18} {r['temperature']:>4g} {r['tokens']:>7} {r['tokens_per_s']:>8} {r['vs_plain']:>8} "
              f"{r['tau'] if r['tau'] is not None else '-':>6} {r.get('same_as_plain', '')}")


def _compiled(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 0
    from streamsd.kernels.warmup import compiled_variants

    return compiled_variants()


def _queued(llm: Any) -> tuple[int, int]:
    la = llm.core.rt.worker.lookahead
    return la.taken, la.dropped


def _phases(engines: dict[str, Any], prompt: str, max_tokens: int, temperature: float) -> dict[str, dict[str, float]]:
    """Host seconds per phase of a step, per engine: the methods below are wrapped with a timer for
    one answer at `temperature`. Nested phases are included in their callers' (`Verifier.verify` holds the
    read of its tokens); `Tensor.tolist` is where the host waits for the GPU."""
    import streamsd.sample.verify as verify_module
    import streamsd.worker.pipelined as pipelined
    import streamsd.worker.tree_runner as tree_step
    from streamsd import SamplingParams
    from streamsd.engine.core import EngineCore
    from streamsd.policy.policy import AdaptivePolicy
    from streamsd.sample import rng
    from streamsd.sample.verify import Verifier
    from streamsd.sched.scheduler import Scheduler
    from streamsd.spec_decode.eagle.graphs import EagleGraphs
    from streamsd.spec_decode.eagle.proposer import EagleProposer
    from streamsd.worker.graphs import GraphRunner
    from streamsd.worker.lookahead import Readback
    from streamsd.worker.tree_graphs import TreeGraphs
    from streamsd.worker.worker import Worker

    wrapped = {Worker: ["step", "_forward", "_propose"], Verifier: ["verify", "_sample_plain", "launch"],
               pipelined: ["plain_step", "chained_step", "_queue_plain", "_queue_chained"],
               tree_step: ["tree_step", "eager_tree_step", "_queue_next"], TreeGraphs: ["run", "replay"],
               Scheduler: ["schedule", "update"], Readback: ["wait"],
               EngineCore: ["emit"], GraphRunner: ["_replay"], EagleProposer: ["propose", "chain"],
               EagleGraphs: ["run", "run_chained"], torch.Tensor: ["tolist"], rng: ["exponentials", "uniforms"],
               verify_module: ["warp"], AdaptivePolicy: ["choose", "commit", "observe"]}
    seconds: dict[str, float] = {}
    originals = []

    def timer(cls: type, name: str) -> None:
        fn = getattr(cls, name)
        originals.append((cls, name, cls.__dict__.get(name)))  # None: inherited, restored by deleting
        key = f"{cls.__name__}.{name}"

        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

        setattr(cls, name, run)

    out: dict[str, dict[str, float]] = {}
    conv = [{"role": "user", "content": prompt}]
    for m, llm in engines.items():
        for cls, names in wrapped.items():
            for name in names:
                timer(cls, name)
        seconds.clear()
        try:
            t0 = time.perf_counter()
            r = llm.chat(conv, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0))[0]
            wall = time.perf_counter() - t0
        finally:
            for cls, name, own in reversed(originals):
                if own is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, own)
            originals.clear()
        steps = max(1, r.spec_stats.steps)
        out[m] = {"steps": steps, "wall": round(1e3 * wall / steps, 3),
                  **{k: round(1e3 * v / steps, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}}
    names = sorted({k for row in out.values() for k in row if k not in ("steps", "wall")},
                   key=lambda k: -max(row.get(k, 0.0) for row in out.values()))
    print(f"\nms per step at T={temperature:g} (host time; nested phases are inside their callers')")
    print(f"{'phase':26}" + "".join(f"{m:>10}" for m in out))
    for k in ("wall", *names):
        print(f"{k:26}" + "".join(f"{row.get(k, 0.0):>10.3f}" for row in out.values()))
    return out


def _hf(llm: Any, dev: torch.device) -> Any:
    """transformers' model of the same checkpoint, sharing our weights (as `streamsd bench offline` does)."""
    from streamsd.bench.offline_run import hf_model

    rt = llm.core.rt
    return hf_model(rt.model_dir, rt.worker.target, dev, rt.worker.target.model.embed_tokens.weight.dtype)


if __name__ == "__main__":
    main()

"""Per-step wall times of whole answers at batch 1: where a request's time goes between its start
(template, prompt, first drafts), its steady steps and its end. Each engine step is stamped at the
worker's entry and exit and labelled by the path it took (a queued replay, a graph run from host
inputs, the eager tree step, a pipelined plain step, the worker's full step); the host's wait for the
GPU inside the step is stamped too. A steady step whose wait is near zero means the GPU was idle.

Usage: python3 scripts/step_timeline.py [--model M --head H] [--trees "4,6,6,24"] [--prompts 4] [--max-tokens 256]
       [--temperatures 0,1] [--out F.json]"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from typing import Any

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--held-out", default="streamsd/assets/eagle/smollm2-135m-instruct/training.json")
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the one shipped for --model)")
    p.add_argument("--trees", default="4,6,6,24")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from streamsd import LLM, SamplingParams

    prompts = json.load(open(a.held_out))["held_out"][: a.prompts]
    engines = {"plain": LLM(a.model, device=a.device, max_num_seqs=4, kv_cache_tokens=8192)}
    for t in (x for x in a.trees.split(";") if x):
        engines[f"tree-{t}"] = LLM(a.model, speculative_method="eagle", draft_model=a.head, device=a.device, max_num_seqs=4,
                                   kv_cache_tokens=8192, speculative_tree=t)
    for llm in engines.values():
        for temp in (0.0, 1.0):
            llm.chat([{"role": "user", "content": "Say hello in three languages."}],
                     SamplingParams(temperature=temp, max_tokens=32, seed=0))
    doc: dict[str, Any] = {"model": a.model, "max_tokens": a.max_tokens, "runs": []}
    with Stamps() as stamps:
        for temp in (float(x) for x in a.temperatures.split(",")):
            for i, prompt in enumerate(prompts):
                for m, llm in engines.items():
                    dev = llm.core.rt.worker.device
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    stamps.reset()
                    t0 = time.perf_counter()
                    r = llm.chat([{"role": "user", "content": prompt}],
                                 SamplingParams(temperature=temp, max_tokens=a.max_tokens, seed=i))[0]
                    t1 = time.perf_counter()
                    run = summarize(stamps.steps, t0, t1)
                    run.update(method=m, temperature=temp, prompt=i, tokens=len(r.outputs[0].token_ids))
                    doc["runs"].append(run)
                    print(line(run), flush=True)
    table(doc["runs"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


class Stamps:
    """Wraps the engine's step and the worker's paths with timers while in use."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._kind: str = ""
        self._wait = 0.0
        self._phases: dict[str, float] = {}  # host ms inside a step's timed phases (nested ones in their callers')

    def reset(self) -> None:
        self.steps = []

    def __enter__(self) -> Stamps:
        import streamsd.worker.pipelined as pipelined
        import streamsd.worker.tree_runner as tree_step
        from streamsd.engine.core import EngineCore
        from streamsd.worker.lookahead import Lookahead, Readback
        from streamsd.worker.tree_graphs import TreeGraphs
        from streamsd.worker.worker import Worker

        def wrap(owner: Any, name: str, around: Any) -> None:
            fn = getattr(owner, name)
            self._saved.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else fn))
            setattr(owner, name, around(fn))

        def execute(fn: Any) -> Any:
            def run(core: Any, plan: Any) -> Any:
                self._kind, self._wait, self._phases = "", 0.0, {}
                t0 = time.perf_counter()
                out = fn(core, plan)
                if plan.entries:
                    self.steps.append({"t0": t0, "t1": time.perf_counter(), "kind": self._kind or "full",
                                       "wait": self._wait, "tokens": sum(e.num_tokens for e in plan.entries),
                                       "phases": {k: round(v, 3) for k, v in self._phases.items()}})
                return out
            return run

        def label(kind: str) -> Any:
            def around(fn: Any) -> Any:
                def run(*args: Any, **kwargs: Any) -> Any:
                    self._kind = self._kind or kind
                    return fn(*args, **kwargs)
                return run
            return around

        def take(fn: Any) -> Any:
            def run(la: Any, entries: Any) -> Any:
                got = fn(la, entries)
                if got is not None:
                    self._kind = "queued"
                return got
            return run

        def wait(fn: Any) -> Any:
            def run(rb: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(rb)
                finally:
                    self._wait += time.perf_counter() - t0
            return run

        def phase(name: str) -> Any:
            def around(fn: Any) -> Any:
                def run(*args: Any, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        self._phases[name] = self._phases.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
                return run
            return around

        from streamsd.sample.verify import Verifier
        from streamsd.spec_decode.eagle.proposer import EagleProposer

        wrap(Worker, "_forward", phase("forward"))
        wrap(Verifier, "verify", phase("verify"))
        wrap(tree_step, "verify_trees", phase("verify"))
        wrap(EagleProposer, "propose", phase("propose"))
        wrap(EagleProposer, "_run_slots", phase("catch_up"))
        wrap(EagleProposer, "_grow", phase("grow"))
        wrap(EngineCore, "execute", execute)
        wrap(Lookahead, "take", take)
        wrap(Readback, "wait", wait)
        wrap(TreeGraphs, "run", label("graph"))
        wrap(tree_step, "eager_tree_step", label("eager"))
        wrap(pipelined, "plain_step", label("plain"))
        wrap(Worker, "_step", label("full"))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()


def summarize(steps: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """ms: before the first step, the first two steps (prompt, first drafts), the steady steps (each
    from the end of the one before), the last two steps, after the last."""
    ends = [t0] + [s["t1"] for s in steps]
    periods = [1e3 * (b - a) for a, b in zip(ends[:-1], ends[1:], strict=True)]
    steady = periods[2:-2] if len(periods) > 4 else []
    waits = [1e3 * s["wait"] for s in steps[2:-2]] if len(steps) > 4 else []
    return {"total_ms": round(1e3 * (t1 - t0), 3), "steps": len(steps),
            "before_ms": round(1e3 * (steps[0]["t0"] - t0), 3) if steps else None,
            "first_ms": [round(x, 3) for x in periods[:2]], "last_ms": [round(x, 3) for x in periods[-2:]],
            "after_ms": round(1e3 * (t1 - steps[-1]["t1"]), 3) if steps else None,
            "steady_n": len(steady), "steady_sum_ms": round(sum(steady), 3),
            "steady_median_ms": round(statistics.median(steady), 4) if steady else None,
            "steady_mean_ms": round(statistics.fmean(steady), 4) if steady else None,
            "steady_wait_mean_ms": round(statistics.fmean(waits), 4) if waits else None,
            "kinds": dict(Counter(s["kind"] for s in steps)), "first_kinds": [s["kind"] for s in steps[:3]],
            "first_phases": [s["phases"] for s in steps[:2]],
            "last_kinds": [s["kind"] for s in steps[-3:]],
            "periods_ms": [round(x, 3) for x in periods]}


def line(r: dict[str, Any]) -> str:
    return (f"{r['method']:16} T={r['temperature']:g} p{r['prompt']} {r['tokens']:4d} tok {r['steps']:4d} steps "
            f"total {r['total_ms']:8.2f} ms | before {r['before_ms']:.2f} first {r['first_ms']} "
            f"steady {r['steady_n']} x {r['steady_mean_ms']} (median {r['steady_median_ms']}, "
            f"wait {r['steady_wait_mean_ms']}) last {r['last_ms']} after {r['after_ms']:.2f} | "
            f"{r['first_kinds']} .. {r['last_kinds']} {r['kinds']} | first step ms {r['first_phases'][0]}")


def table(runs: list[dict[str, Any]]) -> None:
    print(f"\n{'method':16} {'T':>3} {'tok/s':>8} {'ms/req':>8} {'before':>7} {'first2':>8} {'steady/step':>12} "
          f"{'wait/step':>10} {'last2':>7} {'after':>6}  (means over prompts; ms)")
    keys = sorted({(r["method"], r["temperature"]) for r in runs}, key=lambda k: (k[1], k[0]))
    for m, t in keys:
        rs = [r for r in runs if r["method"] == m and r["temperature"] == t]
        tok_s = sum(r["tokens"] for r in rs) / sum(r["total_ms"] for r in rs) * 1e3

        def mean(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.fmean(f(r) for r in rs)
        steady = sum(r["steady_sum_ms"] for r in rs) / max(1, sum(r["steady_n"] for r in rs))
        print(f"{m:16} {t:>3g} {tok_s:>8.1f} {mean(lambda r: r['total_ms']):>8.2f} {mean(lambda r: r['before_ms']):>7.2f} "
              f"{mean(lambda r: sum(r['first_ms'])):>8.2f} {steady:>12.4f} "
              f"{mean(lambda r: r['steady_wait_mean_ms'] or 0):>10.4f} {mean(lambda r: sum(r['last_ms'])):>7.2f} "
              f"{mean(lambda r: r['after_ms']):>6.2f}")


if __name__ == "__main__":
    main()

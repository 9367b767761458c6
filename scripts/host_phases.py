"""Exclusive host time per function in steady-state engine steps, on CUDA: where a step's host
milliseconds go once every graph is captured. Each listed function is wrapped by a timer; a
function's time excludes the timed functions it calls, so the column sums to the step.

A small random target and an untrained EAGLE head by default (host costs do not depend on weights);
`--model M --head H` for a real pair. Prints ms per step for plain and eagle, T=0 and T=1.
Usage: python3 scripts/host_phases.py [--model M --head H] [--tokens N] [--out F.json]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def targets() -> list[tuple[Any, str]]:
    import streamsd.sample.verify as verify
    import streamsd.spec_decode.eagle.graphs as eagle_graphs
    import streamsd.worker.graphs as graphs
    import streamsd.worker.pipelined as pipelined
    from streamsd.engine.core import EngineCore
    from streamsd.sample import rng
    from streamsd.sample.warp import WarpParams
    from streamsd.sched.scheduler import Scheduler
    from streamsd.spec_decode.eagle.proposer import EagleProposer
    from streamsd.worker.lookahead import Lookahead, Readback
    from streamsd.worker.worker import Worker

    return [(EngineCore, "step"), (EngineCore, "emit"), (EngineCore, "finish_step"), (Scheduler, "schedule"),
            (Scheduler, "update"), (Worker, "step"), (Worker, "_forward"), (Worker, "_propose"),
            (pipelined, "plain_step"), (pipelined, "chained_step"), (pipelined, "_queue_plain"),
            (pipelined, "_queue_chained"), (pipelined, "_forward_at"), (Lookahead, "take"),
            (Lookahead, "next_chained"), (Lookahead, "next_rows"), (Lookahead, "queue_chained"), (Lookahead, "place"),
            (Readback, "start"), (Readback, "wait"), (verify.Verifier, "launch"), (verify.Verifier, "_rows"),
            (verify.Verifier, "suppress_early_stops"), (verify.Verifier, "sample_plain"), (verify.Verifier, "read"),
            (verify, "warp"), (WarpParams, "build"), (rng, "exponentials"), (rng, "uniforms"),
            (verify, "unpack"), (graphs.GraphRunner, "_replay"), (graphs, "pack_step"), (eagle_graphs, "pack_step"),
            (graphs, "restart"), (eagle_graphs, "restart"), (torch.cuda.CUDAGraph, "replay"),
            (EagleProposer, "chain"), (EagleProposer, "propose"), (eagle_graphs.EagleGraphs, "run_chained"),
            (eagle_graphs.EagleGraphs, "_load"), (graphs, "h2d"), (verify, "h2d"), (pipelined, "h2d"),
            (eagle_graphs, "h2d")]


class Timers:
    """Exclusive seconds per wrapped function (callees' time subtracted)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.stack: list[float] = []  # callee seconds accumulated per open frame
        self.saved: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str) -> None:
        fn = getattr(owner, name)
        self.saved.append((owner, name, owner.__dict__.get(name)))
        label = f"{getattr(owner, '__name__', owner)}.{name}".replace("streamsd.", "")

        def run(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                inner = self.stack.pop()
                self.seconds[label] = self.seconds.get(label, 0.0) + total - inner
                if self.stack:
                    self.stack[-1] += total

        setattr(owner, name, run)

    def restore(self) -> None:
        for owner, name, own in reversed(self.saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self.saved.clear()


def measure(llm: Any, prompt: str, tokens: int, temperature: float) -> dict[str, float]:
    from streamsd import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=1)
    llm.generate(prompt, params)  # every graph this answer needs is captured now
    t = Timers()
    for owner, name in targets():
        t.wrap(owner, name)
    try:
        core = llm.core
        core.add_request("timed", core.encode_prompt(prompt), params)
        steps, t0 = 0, time.perf_counter()
        while core.has_work:
            core.step()
            steps += 1
        wall = time.perf_counter() - t0
    finally:
        t.restore()
    row = {"steps": steps, "wall": 1e3 * wall / steps}
    row.update({k: 1e3 * v / steps for k, v in sorted(t.seconds.items(), key=lambda kv: -kv[1])})
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--head")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out")
    a = p.parse_args()
    from streamsd import LLM

    if a.model is None:
        from tiny_eagle import build_tiny_eagle

        target_dir, head_dir = build_tiny_eagle()
        a.model, a.head = str(target_dir), str(head_dir)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llms = {"plain": LLM(a.model, device=dev),
            "eagle": LLM(a.model, speculative_method="eagle", draft_model=a.head, device=dev,
                         speculation_policy="fixed")}
    prompt = "Explain how speculative decoding keeps the target model's distribution, step by step."
    doc: dict[str, Any] = {}
    for temperature in (0.0, 1.0):
        rows = {m: measure(llm, prompt, a.tokens, temperature) for m, llm in llms.items()}
        doc[f"T={temperature:g}"] = rows
        names = sorted({k for r in rows.values() for k in r if k not in ("steps", "wall")},
                       key=lambda k: -max(r.get(k, 0.0) for r in rows.values()))
        print(f"\nexclusive host ms per step, T={temperature:g} ({dev})")
        print(f"{'function':40}" + "".join(f"{m:>9}" for m in rows))
        for k in ("steps", "wall", *names):
            print(f"{k:40}" + "".join(f"{r.get(k, 0.0):>9.3f}" for r in rows.values()))
        print(f"{'sum of the timed':40}" + "".join(
            f"{sum(v for k, v in r.items() if k not in ('steps', 'wall')):>9.3f}" for r in rows.values()))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

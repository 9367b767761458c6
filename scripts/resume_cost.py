"""What resuming speculation costs an EAGLE engine at batch 1, against what the planner's catch-up
table says. One answer runs a scripted k: K for a while, then n plain steps, then K again, for
several n; the step that resumes (it verifies no drafts and proposes K, its head first catching up
on the n positions the plain steps decoded) is timed beside a steady speculative step, and beside
`EagleProposer.catch_up_pass(n)`, the eager pass the start-up profile times for that table.

The profilers' small random target and an untrained head (scripts/tiny_eagle.py): host and launch
costs do not depend on weights. CUDA with graphs, as the server runs. Also lists every step inside which
a kernel compiled, a graph was captured or device memory was allocated. Prints a table; `--out F.json`.
Usage: python3 scripts/resume_cost.py [--gaps 8,24,40,64,120] [--out F.json]"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_eagle import build_tiny_eagle  # noqa: E402

from streamsd import LLM, SamplingParams  # noqa: E402
from tests.scripted_policy import ScriptedPolicy  # noqa: E402


def _counters(worker) -> dict[str, int]:
    """Triton variants compiled, CUDA graphs captured (target, head), device segments allocated."""
    out = {"target_graphs": len(worker.graphs.graphs) if worker.graphs is not None else 0,
           "head_graphs": len(getattr(getattr(worker.proposer, "graphs", None), "graphs", {}) or {})}
    if torch.cuda.is_available():
        from streamsd.kernels.warmup import compiled_variants

        out["compiles"] = compiled_variants()
        out["device_allocs"] = torch.cuda.memory_stats().get("num_device_alloc", 0)
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps", default="8,24,40,64,120")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    gaps = [int(x) for x in a.gaps.split(",")]
    target, head = build_tiny_eagle()
    llm = LLM(str(target), speculative_method="eagle", draft_model=str(head), num_speculative_tokens=a.k,
              speculation_policy="fixed", device=a.device, dtype="bfloat16")
    core = llm.core
    proposer = core.rt.worker.proposer
    script: list[int] = []
    for gap in [*gaps, *gaps]:  # twice: the first round also meets each shape's first use
        script += [a.k] * 12
        script += [0] * gap
    script += [a.k] * 12
    core.scheduler.policy = ScriptedPolicy(script, plans_ahead=False)
    core.add_request("r", core.encode_prompt("Tell me a long story about a lighthouse."),
                     SamplingParams(temperature=0.0, max_tokens=4 * len(script), ignore_eos=True))
    times, shapes, stalls = [], [], []
    worker = core.rt.worker
    before = _counters(worker)
    for turn in core.run():
        if turn.plan.entries:
            e = turn.plan.entries[0]
            times.append(1e3 * core.last_step_seconds)
            shapes.append((e.num_tokens, e.num_drafts, e.k_next))
            now = _counters(worker)
            if now != before:  # a compile, a graph captured or device memory allocated inside this step
                stalls.append({"step": len(times) - 1, "ms": round(times[-1], 3), "shape": shapes[-1],
                               "added": {k: now[k] - before[k] for k in now if now[k] != before[k]}})
            before = now
    # Steady speculative steps: verifying K drafts and proposing K, not right after a switch.
    steady = [t for i, (t, s) in enumerate(zip(times, shapes, strict=True))
              if s[1:] == (a.k, a.k) and i > 0 and shapes[i - 1][1:] == (a.k, a.k)]
    plain = [t for i, (t, s) in enumerate(zip(times, shapes, strict=True))
             if s[1:] == (0, 0) and i > 0 and shapes[i - 1][1:] == (0, 0)]
    rows = []
    table = list(range(1, 1 + max(gaps) // 16 + 4))
    # The steps that resume: verify nothing, propose K, after a plain one (found by shape: which step a
    # script entry lands on depends on steps queued ahead). The second round's are reported.
    resumes = [i for i in range(1, len(times)) if shapes[i][1:] == (0, a.k) and shapes[i - 1][1:] == (0, 0)]
    for i, gap in zip(resumes[len(gaps):], gaps, strict=False):
        sync(a.device)
        t0 = time.perf_counter()
        proposer.catch_up_pass(gap, table)  # the run is over: its blocks are free to overwrite
        sync(a.device)
        eager = 1e3 * (time.perf_counter() - t0)
        rows.append({"gap": gap, "resume_ms": round(times[i], 3), "next_ms": round(times[i + 1], 3),
                     "shape": shapes[i], "catch_up_pass_ms": round(eager, 3)})
    doc = {"steady_spec_ms": round(statistics.median(steady), 3), "plain_ms": round(statistics.median(plain), 3),
           "resumes": rows, "stalls": stalls, "times": [round(t, 3) for t in times], "shapes": shapes}
    print(f"steady speculative step {doc['steady_spec_ms']} ms, plain {doc['plain_ms']} ms (medians)")
    print("gap  resume ms  next ms  shape (tokens, drafts verified, proposed)  catch_up_pass ms")
    for r in rows:
        print(f"{r['gap']:4d}  {r['resume_ms']:9.3f}  {r['next_ms']:7.3f}  {r['shape']!s:40s}  {r['catch_up_pass_ms']:.3f}")
    for st in stalls:
        print("inside step", st)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

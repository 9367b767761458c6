"""The engine's adaptive policy at batch 1 with an EAGLE head's costs as measured on the H200, torch-free:
requests served one after another, each with its own acceptance (position 0 uniform in 0.35-0.75,
deeper positions rising by the shipped head's depth steps). Prints tokens/s of plain, fixed k = 4 and
adaptive per seed, and the share of steps that speculated.

The costs (issue 9, session 14, `heldout16.json`): a plain step 1.0 ms; a speculative one 1.1 + 0.15 k ms;
a switch of k 0.3 ms more (nothing queued behind it); a head resuming after more than 8 plain steps
catches up eagerly, 0.8 ms. The start-up table is the profile's batch-1 row (1.05-1.2 ms by width).
An idle batch re-plans every REPLAN_EVERY steps (on the H200 at batch 1, about every 15).
Usage: python3 scripts/batch1_policy.py [--seeds N] [--requests N] [--json FILE]"""

from __future__ import annotations

import argparse
import json
import random

from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.policy import AdaptivePolicy, StepShape
from streamsd.request import Request, SamplingParams

DEPTH_STEPS = (1.050, 1.115, 1.028)  # the shipped head's eval_report.json (spec/eagle_ckpt.measured_depth_steps)


def step_seconds(k: int, prev_k: int, lag: int) -> float:
    t = 1.0e-3 if k == 0 else 1.1e-3 + 0.15e-3 * k
    return t + (0.8e-3 if k and lag > 8 else 0.0) + (0.3e-3 if k and k != prev_k else 0.0)


def run(kind: str, seed: int, requests: int, tokens: int = 256) -> tuple[float, float]:
    """(tokens/s, share of steps speculating) of `kind`: plain, fixed or adaptive."""
    rng = random.Random(seed)
    cost = CostTable.from_samples({1: 1.05e-3, 2: 1.098e-3, 3: 1.10e-3, 5: 1.16e-3, 8: 1.2e-3})
    cost.catchup = StepTable.from_samples({1: 0.82e-3, 512: 0.82e-3})
    policy = AdaptivePolicy(4, cost, draft_has_cache=True, settled_lag=1, queues_ahead=True, depth_steps=(("greedy", DEPTH_STEPS),),
                            plan_budget=0.0)  # plans every REPLAN_EVERY idle steps: not this host's speed
    seconds = emitted = 0.0
    spec = steps = 0
    for n in range(requests):
        a0, curve = rng.uniform(0.35, 0.75), [1.0]
        for s in DEPTH_STEPS:
            curve.append(curve[-1] * s)
        curve = [min(0.95, a0 * c) for c in curve]
        r = Request(f"r{n}", list(range(100)), SamplingParams(max_tokens=tokens, temperature=0.0), seed=n, arrival=0.0, spec_k=4)
        r.output_ids.append(5)
        r.computed, prev_k = r.num_tokens - 1, 0
        while r.remaining_tokens > 0:
            decision = policy.choose([r], 0, False) if kind == "adaptive" else None
            k = 0 if kind == "plain" else 4 if decision is None else decision.ks.get(r.request_id, policy.default_k(r))
            k = min(k, r.remaining_tokens - 1)
            accepted = 0
            while accepted < k and rng.random() < curve[accepted]:
                accepted += 1
            t = step_seconds(k, prev_k, r.num_tokens - 1 - r.draft_computed)
            if decision is not None:
                policy.commit_shape(decision, StepShape(1, 1 + k, k, int(k > 0), 0, 1 + k), [k])
                policy.observe(decision, [(r, k, accepted)], t)
            got = min(accepted + 1, r.remaining_tokens)
            r.output_ids.extend([5] * got)
            r.computed = r.num_tokens - 1
            r.draft_computed = r.num_tokens - 1 if k else r.draft_computed
            seconds, emitted, steps, spec, prev_k = seconds + t, emitted + got, steps + 1, spec + (k > 0), k
    return emitted / seconds, spec / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = {kind: [run(kind, s, a.requests) for s in range(a.seeds)] for kind in ("plain", "fixed", "adaptive")}
    print(f"{'policy':<10}" + "".join(f"{'seed ' + str(s):>16}" for s in range(a.seeds)) + f"{'mean tok/s':>12}")
    for kind, got in rows.items():
        cells = "".join(f"{rate:>9.0f} ({share:4.0%})" for rate, share in got)
        print(f"{kind:<10}{cells}{sum(r for r, _ in got) / len(got):>12.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: [{"tokens_per_s": r, "spec_share": s} for r, s in v] for k, v in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()

"""How well a cost-table key's online correction prices step times with a tail (policy/adaptive/cost.py).

Feeds one speculative key of a graph table sequences of measured step times and prints, per kind of
sequence, the mean over 200 seeds of Σ predicted / Σ measured over steps 10-40 (1.00: the key is
priced at its mean step time; below: too cheap, the failure that makes speculation slower than plain),
then what a lone 4x stall and a lasting 1.5x change do to the price.
Usage: python3 scripts/correction_study.py"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.shape import ShapeTable

B, TOKENS, K = 16, 80, 4


def table() -> CostTable:
    samples = {(b, w): 4e-3 + 2e-5 * b * w for b in (1, 4, 16, 64) for w in (1, 5)}
    return CostTable.from_samples({1: 4e-3, 256: 9e-3}, shape=ShapeTable.from_samples(samples, padded=True))


def priced(times: list[float]) -> list[float]:
    """The price of the key before each step, the step's measured time then fed back."""
    cost, out = table(), []
    raw = cost.predict_raw(B, TOKENS, K)
    for t in times:
        out.append(cost.predict(B, TOKENS, K))
        cost.observe(raw, t, verify_tokens=TOKENS, draft_steps_k=K, batch_size=B)
    return out


def ratio(make: Callable[[random.Random], float], seeds: int = 200, steps: int = 40) -> tuple[float, float]:
    ratios = []
    for seed in range(seeds):
        rng = random.Random(seed)
        times = [make(rng) for _ in range(steps)]
        p = priced(times)
        ratios.append(sum(p[10:]) / sum(times[10:]))
    return statistics.mean(ratios), max(abs(r - 1.0) for r in ratios)


def main() -> None:
    base = table().predict_raw(B, TOKENS, K) * 1.1
    cases = {
        "1 step in 10 at 2x": lambda r: base * (2.0 if r.random() < 0.1 else 1.0) * (1 + r.gauss(0, 0.01)),
        "1 step in 4 at 2x": lambda r: base * (2.0 if r.random() < 0.23 else 1.0) * (1 + r.gauss(0, 0.01)),
        "lognormal jitter, sigma 0.3": lambda r: base * r.lognormvariate(0.0, 0.3),
        "steady, 1 % noise": lambda r: base * (1 + r.gauss(0, 0.01)),
    }
    print(f"{'sequence':30s} {'sum pred / sum meas':>20s} {'worst seed':>11s}")
    for name, make in cases.items():
        mean, worst = ratio(make)
        print(f"{name:30s} {mean:20.3f} {worst:10.1%}")
    p = priced([base] * 20 + [4 * base] + [base] * 10)
    print(f"a lone 4x stall after 20 steady steps: price {p[21] / base:.4f}x the steady step after it")
    p = priced([base] * 20 + [1.5 * base] * 20)
    print("a lasting 1.5x change: price after 2, 4, 8, 12 steps:",
          ", ".join(f"{p[20 + i] / base:.3f}x" for i in (2, 4, 8, 12)))


if __name__ == "__main__":
    main()

"""``python -m streamsd.policy.adaptive [out.json]``: the simulator's batch-size sweep as a table (+ JSON).

Closed loop at each batch size, α drifting sinusoidally (0.55 ± 0.3, 4 s period), for the three
proposer kinds; tokens/s of plain decoding, the best fixed k, the adaptive policy, and the oracle
(the planner fed the true α, for reference).
"""

from __future__ import annotations

import json
import sys

from streamsd.policy.adaptive.simulator import SimConfig, simulate
from streamsd.policy.adaptive.workload import AlphaDrift, ProposerSpec

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sweep(kind: str, alpha: AlphaDrift, max_k: int = 6) -> list[dict[str, object]]:
    spec = ProposerSpec.draft_model(alpha) if kind == "draft" else ProposerSpec(kind, alpha)
    rows: list[dict[str, object]] = []
    for batch in SIZES:
        cfg = SimConfig(spec, max_k=max_k, concurrency=batch, duration_s=4.0 if batch <= 8 else 2.0)
        rates = {p: simulate(cfg, p).tokens_per_s for p in ("plain", "adaptive", "oracle")}
        fixed = {k: simulate(cfg, f"fixed:{k}").tokens_per_s for k in range(1, max_k + 1)}
        best_k = max(fixed, key=fixed.__getitem__)
        rows.append({"proposer": kind, "batch": batch, **rates, "best_fixed_k": best_k, "best_fixed": fixed[best_k]})
    return rows


def main(argv: list[str]) -> None:
    alpha = AlphaDrift(base=0.55, amplitude=0.3, period_s=4.0)
    rows = [row for kind in ("draft", "ngram", "synthetic") for row in sweep(kind, alpha)]
    print(f"{'proposer':>9} {'B':>4} {'plain tok/s':>12} {'adaptive':>9} {'best fixed (k)':>15} {'oracle':>7}")
    for r in rows:
        plain = float(r["plain"])  # type: ignore[arg-type]
        print(f"{r['proposer']:>9} {r['batch']:>4} {plain:>12.0f} {float(r['adaptive']) / plain:>9.3f} "  # type: ignore[arg-type]
              f"{float(r['best_fixed']) / plain:>10.3f} ({r['best_fixed_k']}) {float(r['oracle']) / plain:>7.3f}")  # type: ignore[arg-type]
    if argv:
        with open(argv[0], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

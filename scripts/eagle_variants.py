"""Helpers of `scripts/gpu_eagle.sh ablate|final`: heads that differ in one setting, trained on the same answers.

  prompts SRC HELD_SRC PROMPTS_OUT HELD_OUT  the self-written prompts of SRC (a training.json) as JSONL, and
                                             the held-out prompts of HELD_SRC
  names                                      the variants, in training order
  flags NAME                                 a variant's train-draft flags
  table DIR OUT                              each DIR/NAME/training.json's validation: a table and JSON
  best FILE                                  the variant whose validation promises the longest accepted runs

A variant is ranked by tau estimated from its validation: 1 + m0 + m0*m1 + ..., with m_j the top-1
match at unrolled step j on answers never trained on (the greedy acceptance at depth j given depth j-1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from streamsd.policy.adaptive import expected_tokens

VARIANTS = {
    "base": ["--lr", "2e-3", "--norm-before-residual", "off"],  # the session 3 head's settings
    "norm_first": ["--lr", "2e-3", "--norm-before-residual", "on"],
    "norm_first_mlp2x": ["--lr", "2e-3", "--norm-before-residual", "on", "--head-intermediate-size", "3072"],
}


def tau_estimate(validation: dict[str, float]) -> float:
    matches = [validation[f"match_{j}"] for j in range(len(validation)) if f"match_{j}" in validation]
    return expected_tokens(matches, len(matches))


def main(argv: list[str]) -> None:
    cmd = argv[0]
    if cmd == "prompts":
        src, held_src, out, held_out = argv[1:5]
        written = json.loads(Path(src).read_text())["self_written_prompts"]
        held = json.loads(Path(held_src).read_text())["held_out"]
        Path(out).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in written if p not in set(held)))
        Path(held_out).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held))
        print(f"{len(written)} training prompts, {len(held)} held out")
    elif cmd == "names":
        print(" ".join(VARIANTS))
    elif cmd == "flags":
        print(" ".join(VARIANTS[argv[1]]))
    elif cmd == "table":
        rows = {}
        for name in VARIANTS:
            meta_file = Path(argv[1]) / name / "training.json"
            if not meta_file.is_file():
                continue
            meta = json.loads(meta_file.read_text())
            val = meta["validation"]
            rows[name] = {"flags": VARIANTS[name], "tau_estimate": tau_estimate(val), "validation": val,
                          "steps": meta["train"]["steps"], "seconds": meta["seconds"], "data": meta["data"]}
        Path(argv[2]).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"{'variant':<18} {'steps':>6} {'match per step':<28} {'loss_0':>7} {'tau est':>7}")
        for name, r in rows.items():
            v = r["validation"]
            m = " / ".join(f"{v[k]:.3f}" for k in sorted(v) if k.startswith("match_"))
            print(f"{name:<18} {r['steps']:>6} {m:<28} {v['loss_0']:>7.3f} {r['tau_estimate']:>7.3f}")
    elif cmd == "best":
        rows = json.loads(Path(argv[1]).read_text())
        print(max(rows, key=lambda n: rows[n]["tau_estimate"]) if rows else "base")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Host time per engine step, by phase: what a speculative step adds on the host to a plain one.

Everything here runs serially with the GPU (a speculative step's drafts need the previous step's
accepted tokens), so on the H200 it is added to the graph replay as is: at B = 64 a width-5 verify
replays in 8.9 ms and the step measured 12.1. A tiny random target on the CPU makes the forward
cheap and the host work visible. Synthetic acceptance α (no draft model), adaptive policy.
Usage: python3 scripts/profile_host.py [BATCH] [ALPHA]"""

from __future__ import annotations

import collections
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from streamsd.bench import offline_run as R  # noqa: E402
from streamsd.config import EngineConfig, SpecConfig  # noqa: E402
from streamsd.engine.builder import build_runtime  # noqa: E402
from streamsd.engine.core import EngineCore  # noqa: E402
from streamsd.policy.policy import AdaptivePolicy  # noqa: E402
from streamsd.sample.verify import Verifier  # noqa: E402
from streamsd.sched.scheduler import Scheduler  # noqa: E402
from streamsd.spec_decode.synthetic import SyntheticProposer  # noqa: E402
from streamsd.worker.worker import Worker  # noqa: E402
from tests.tiny import build_model, build_tokenizer  # noqa: E402

PHASES = {Worker: ["_forward", "_propose"], Verifier: ["verify", "_sample_plain"], Scheduler: ["schedule", "update"],
          EngineCore: ["emit", "finish_step"], AdaptivePolicy: ["choose", "observe"],
          SyntheticProposer: ["propose"]}


def timed(seconds: collections.Counter, cls: type, name: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[f"{cls.__name__}.{name}"] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    alpha = float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
    torch.set_num_threads(1)
    seconds: collections.Counter = collections.Counter()
    for cls, names in PHASES.items():
        for name in names:
            timed(seconds, cls, name)
    model = build_model(Path(tempfile.mkdtemp()), seed=0, tokenizer=build_tokenizer(), weight_scale=4.0, max_pos=4096)
    cfg = EngineConfig(model=str(model), spec=SpecConfig(method="ngram", num_tokens=4, policy="adaptive"),
                       device="cpu", max_num_seqs=batch, max_num_batched_tokens=8192)
    rt = build_runtime(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(60)] for _ in range(batch)]
    plain_spec = dataclasses.replace(cfg.spec, method=None)
    plain = R.engine_pass(rt, plain_spec, prompts, 64, batch, speculative=False)
    rt.worker.proposer = SyntheticProposer({tuple(p): o for p, o in zip(prompts, plain.outputs, strict=True)},
                                           alpha, rt.args.vocab_size)
    for mode in ("plain", "speculative"):
        R.engine_pass(rt, plain_spec if mode == "plain" else cfg.spec, prompts, 16, batch, speculative=mode != "plain")
        seconds.clear()
        res = R.engine_pass(rt, plain_spec if mode == "plain" else cfg.spec, prompts, 64, batch,
                            speculative=mode != "plain")
        print(f"{mode}: B={batch}, {res.steps} steps, tau {res.tau:.2f}, ms per step:")
        for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            print(f"  {name:28s} {1e3 * s / res.steps:7.3f}")


if __name__ == "__main__":
    main()

"""How well a head drafts for its target: tau and per-depth acceptance on chat prompts, greedy and sampled.

`streamsd train-draft` writes this as `eval_report.json` for the held-out prompts; it runs the engine
itself (the head loaded from its directory, as a server would), so it measures what serving gets.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamsd.config import SpecMethod


def evaluate(model: str, head_dir: Path, prompts: list[str], max_new_tokens: int, k: int, device: str | None,
             seed: int, temperatures: tuple[float, ...] = (0.0, 0.7), method: SpecMethod = "eagle",
             cuda_graphs: bool = True) -> dict[str, Any]:
    """tau and per-depth acceptance of a proposer on chat prompts, greedy and sampled."""
    from streamsd import LLM, SamplingParams

    llm = LLM(model, speculative_method=method, draft_model=str(head_dir) if method == "eagle" else None,
              num_speculative_tokens=k, device=device, max_num_seqs=64,
              kv_cache_tokens=len(prompts) * (max_new_tokens + 640), cuda_graphs=cuda_graphs)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    results = {}
    for temp in temperatures:
        params = [SamplingParams(temperature=temp, max_tokens=max_new_tokens, seed=seed + i) for i in range(len(prompts))]
        res = llm.chat(convs, params)
        steps = sum(r.spec_stats.steps for r in res)
        emitted = sum(r.spec_stats.emitted for r in res)
        drafted = sum(r.spec_stats.drafted for r in res)
        accepted = sum(r.spec_stats.accepted for r in res)
        depth = [0] * k
        for r in res:
            for d, n in enumerate(r.spec_stats.accepted_per_pos[:k]):
                depth[d] += n
        draft_steps = max(1, steps - len(res))  # each answer's first token comes from a step with no drafts
        results[f"T={temp:g}"] = {
            "tau": emitted / max(1, steps), "acceptance_rate": accepted / max(1, drafted),
            "accept_rate_at_depth": [n / draft_steps for n in depth],
            "conditional_acceptance": [depth[d] / max(1, depth[d - 1] if d else draft_steps) for d in range(k)],
            "steps": steps, "emitted": emitted, "drafted": drafted, "accepted": accepted,
        }
    return {"method": method, "head": str(head_dir), "k": k, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "draft_policy": "greedy (one-hot q) below T=0.75, sampled above",
            "results": results}

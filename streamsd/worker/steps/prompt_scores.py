"""Prompt logprobs (SamplingParams.prompt_logprobs): the rows of a step's forward that score a
prompt, and their logprobs.

The logits at position p are the target's distribution of token p + 1: an entry scoring its prompt
adds a row for every position it computes below the prompt's last (whose logits are the first
sampled token's, the verified row). Scores are the raw model's, before penalties, bias and warping,
as vLLM reports prompt logprobs. Only the full step (and the tree step's eager path) computes them:
every other runner takes entries of one pending token, which score nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamsd.model.kv_cache import h2d
from streamsd.sample.sampler import token_logprobs
from streamsd.sched.plan import Scheduled

#: Per scored prompt token: its logprob and the top alternatives, (token id, logprob) best first.
Scored = list[tuple[float, list[tuple[int, float]]]]


@dataclass(slots=True)
class PromptRows:
    rows: list[int] = field(default_factory=list)  # token rows of the step, in the forward's numbering
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # entry, first row, end, top n

    def add(self, index: int, e: Scheduled, first_row: int) -> None:
        """Entry `index`, whose tokens start at row `first_row`: its rows, if it scores its prompt."""
        r = e.request
        if not r.scores_prompt:
            return
        stop = min(e.start + e.num_tokens, len(r.prompt_ids) - 1)
        if stop <= e.start:
            return
        lo = len(self.rows)
        self.rows.extend(range(first_row, first_row + stop - e.start))
        self.targets.extend(r.prompt_ids[e.start + 1 : stop + 1])
        self.spans.append((index, lo, len(self.rows), r.params.prompt_logprobs or 0))

    def score(self, logits: torch.Tensor, entries: int) -> list[Scored | None]:
        """logits [rows, V] at `rows` -> per entry its scored tokens (None for those scoring nothing)."""
        top = max(n for _, _, _, n in self.spans)
        chosen, vals, ids = token_logprobs(logits, h2d(self.targets, torch.int64, logits.device), top)
        chosen_l, vals_l, ids_l = chosen.tolist(), vals.tolist(), ids.tolist()
        out: list[Scored | None] = [None] * entries
        for index, lo, hi, n in self.spans:
            out[index] = [(chosen_l[j], list(zip(ids_l[j][:n], vals_l[j][:n], strict=True))) for j in range(lo, hi)]
        return out

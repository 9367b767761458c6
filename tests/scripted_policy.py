"""A speculation policy that plays a script: every decoding request drafts the same k, the script's
entry for this `choose` call (the last one repeats). Switches of every kind, on cue, for the lookahead
tests."""

from __future__ import annotations

from streamsd.policy.policy import Decision, cap_k


class ScriptedPolicy:
    def __init__(self, script: list[int], plans_ahead: bool = True):
        self.script, self.calls, self.k = script, 0, 0
        self.plans_ahead = plans_ahead
        self.built: list[tuple[int, int]] = []  # (widest verify, drafts proposed) of each decode step

    def choose(self, decoding, prefill_tokens, backlog):
        self.k = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        return Decision({r.request_id: min(self.k, cap_k(r)) for r in decoding})

    def default_k(self, r):
        return min(self.k, cap_k(r))

    def joining_k(self, r, batch):
        return self.default_k(r)

    def commit(self, decision, plan):
        shape, _ = plan.shape()
        if shape.batch and not shape.prefill_tokens:
            self.built.append((shape.verify_width - 1, shape.draft_steps))

    def observe(self, decision, verified, seconds):
        pass

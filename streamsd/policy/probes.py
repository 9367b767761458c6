"""Probes in flight: requests the planner granted k >= 1 in a plain batch, until their drafts are verified.

A probe takes two steps, one proposing its drafts and one verifying them, and a step that takes a plain
step queued ahead (worker/lookahead.py) proposes nothing. The planner grants a probe for one plan only, and the
next plan of a plain batch keeps k = 0, so a grant is carried here by request id: its k is forced until
the drafts are proposed, then their verification, whatever the plans in between say. On an H200 at
batch 1, ~30 probes in 3000 steps were granted and none was verified before this existed: the running
prior never moved and adaptive EAGLE stayed plain.

Torch-free; the adaptive policy owns one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

PROBE_STEPS = 4  # steps a grant may take to be proposed and verified before it is given up


@dataclass(slots=True)
class Probes:
    # request id -> (k, proposed, steps since the grant)
    inflight: dict[str, tuple[int, bool, int]] = field(default_factory=dict)
    granted: int = 0  # plans that granted probes
    extra_steps: float = 0.0  # Σ the time the steps carrying a probe took beyond a plain step, in plain steps

    @property
    def mean_extra(self) -> float:
        """What one grant was measured to cost, in plain steps (the planner spaces probes by it)."""
        return self.extra_steps / max(self.granted, 1)

    def __bool__(self) -> bool:
        return bool(self.inflight)

    def grant(self, request_ids: Iterable[object], ks: dict[str, int]) -> None:
        """The plan's grants (`ks`: its k by request id): proposed in the step it plans."""
        rids = list(map(str, request_ids))
        for rid in rids:
            self.inflight[rid] = (ks[rid], False, 0)
        self.granted += bool(rids)

    def charge(self, seconds: float, plain_s: float) -> None:
        """A step that carried a probe in a plain batch took `seconds` where a plain step takes `plain_s`."""
        self.extra_steps += max(seconds / plain_s - 1.0, 0.0)

    def age(self, decoding: set[str]) -> None:
        """Once per step: drops the grants whose request left the batch or that got nowhere in a few
        steps (drafts dropped with a step queued ahead, a preemption)."""
        self.inflight = {rid: (k, proposed, age + 1) for rid, (k, proposed, age) in self.inflight.items()
                         if rid in decoding and age < PROBE_STEPS}

    def apply(self, ks: dict[str, int], verify: dict[str, int]) -> bool:
        """Writes the grants into a step's `ks` (to propose) and `verify` (drafts proposed in the step
        before); returns whether `ks` changed, and with it the step's shape."""
        changed = False
        for rid, (k, proposed, _) in self.inflight.items():
            if proposed:
                verify[rid] = k
            elif ks.get(rid, 0) < k:
                ks[rid] = k
                changed = True
        return changed

    def proposed(self, request_id: str) -> None:
        """The step as built proposes this request's drafts: they are verified in the next one."""
        state = self.inflight.get(request_id)
        if state is not None:
            self.inflight[request_id] = (state[0], True, state[2])

    def verified(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)

"""What one engine step is: the scheduler's plan (an entry per request) and the worker's results.

Torch-free; shared by the scheduler, which builds plans, the worker, which executes them, and the
engine core, which applies the results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from streamsd.policy.policy import Decision, StepShape
from streamsd.request import Request


@dataclass(slots=True)
class Scheduled:
    request: Request
    start: int  # first position the target computes
    num_tokens: int  # real tokens computed (a chunk, or all pending)
    num_drafts: int  # cached drafts verified after them (0 when this is a mid-prompt chunk)
    k_next: int  # drafts to propose after this step

    @property
    def verifies(self) -> bool:
        """Reaches the end of the known tokens, so this step samples new ones."""
        return self.start + self.num_tokens == self.request.num_tokens


STEP_KINDS = ("prompt", "verify", "decode")  # StepPlan.kind: what a step's time is reported under


@dataclass(slots=True)
class StepPlan:
    entries: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    decision: Decision | None = None  # the policy's, committed to the step as built

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens + e.num_drafts for e in self.entries)

    @property
    def kind(self) -> str:
        """`prompt` where an entry computes a prompt chunk, else `verify` where one verifies drafts,
        else `decode`."""
        if any(e.num_tokens > 1 for e in self.entries):
            return "prompt"
        return "verify" if any(e.num_drafts for e in self.entries) else "decode"

    @property
    def wants_streams(self) -> bool:
        """Whether this step's forwards write an EAGLE head's streams: as the policy decided, and
        always where a request verifies drafts or proposes some (its head reads them at once) or
        computes a prompt chunk (a head that drafts later catches up on the prompt from the store,
        with no second target pass over it; the prefix cache records which cached blocks have them)."""
        if self.decision is None or self.decision.streams:
            return True
        return any(e.num_drafts or e.k_next or e.num_tokens != 1 or not e.verifies for e in self.entries)

    def shape(self) -> tuple[StepShape, list[int]]:
        """The step as the cost table prices it, and the k each decoding request (one pending token;
        prompt chunks are the rest) got. One pass: it runs between two steps."""
        ks: list[int] = []
        widest = decode_tokens = verify = 0
        for e in self.entries:
            verify += e.num_tokens + e.num_drafts
            if e.num_tokens == 1 and e.verifies:
                ks.append(e.k_next)
                widest = max(widest, e.num_drafts)
                decode_tokens += 1 + e.num_drafts
        shape = StepShape(len(ks), verify, max(ks, default=0), len(ks) - ks.count(0), verify - decode_tokens,
                          1 + widest)
        return shape, ks


#: A request's drafts this step where its k does not decide them: (drafts to verify, drafts to propose).
Pin = tuple[int, int]
#: Given the k each running request gets this step, the requests (by id) whose drafts are pinned instead:
#: what `Scheduler.schedule` asks its caller once per step, after aborts and before any entry is planned.
Pinning = Callable[[Callable[[Request], int]], dict[int, Pin]]


@dataclass(slots=True)
class EntryResult:
    """What the worker reports for one scheduled entry."""

    new_tokens: list[int]  # emitted this step (accepted drafts then one target token); [] for chunks
    num_accepted: int
    draft_ids: list[int]  # proposed for the next step
    draft_computed: int
    draft_flags: list[bool] = field(default_factory=list)  # per new token: was it an accepted draft
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    draft_parents: list[int] = field(default_factory=list)  # the proposed drafts' tree (empty: a chain)
    # With prompt logprobs asked for: those of the prompt tokens at start + 1 .. this step computed.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


"""Simulated workload for ``simulator.py``: requests, proposers and acceptance drifting over time.

Three proposer kinds:
  * ``draft``     — a draft model: every draft step costs a forward of the draft roofline, and a
                    request resuming speculation first replays the tokens its draft KV missed.
  * ``ngram``     — prompt lookup: free to run, bursty acceptance.  Each request alternates
                    between copy spans (α = the drift value, up to max_k matched tokens) and
                    free text (a short match, or none, with α = ``ngram_lo``).
  * ``synthetic`` — free to run, acceptance is a coin with the request's α.

Per-request α = the drift value at the current time plus a fixed per-request offset, or one of
``alpha_choices`` (mixed batches).  Acceptance is drawn from each request's own RNG, so policies
compared under the same seed see the same requests (common random numbers).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from streamsd.policy.adaptive.acceptance import RequestAcceptance
from streamsd.policy.adaptive.roofline import RooflineModel


@dataclass(frozen=True, slots=True)
class AlphaDrift:
    """α over simulated time: a sinusoid around ``base``, or piecewise-constant ``pieces``."""

    base: float = 0.7
    amplitude: float = 0.0
    period_s: float = 4.0
    pieces: tuple[tuple[float, float], ...] = ()  # (from time, α), ascending

    def at(self, t: float) -> float:
        value = self.base
        for start, alpha in self.pieces:
            if t >= start:
                value = alpha
        if self.amplitude:
            value += self.amplitude * math.sin(2.0 * math.pi * t / self.period_s)
        return value


@dataclass(frozen=True, slots=True)
class ProposerSpec:
    kind: str = "draft"  # draft | ngram | synthetic
    alpha: AlphaDrift = field(default_factory=AlphaDrift)
    alpha_spread: float = 0.05  # sd of the per-request α offset
    alpha_choices: tuple[float, ...] = ()  # if set, each request's fixed α is drawn from these
    draft: RooflineModel | None = None
    burst_flip: float = 0.03  # ngram: per-step chance of entering / leaving a copy span
    ngram_lo: float = 0.1

    @classmethod
    def draft_model(cls, alpha: AlphaDrift | None = None, **kw: object) -> ProposerSpec:
        return cls("draft", alpha or AlphaDrift(), draft=RooflineModel.llama32_1b_h200(), **kw)  # type: ignore[arg-type]


@dataclass(slots=True)
class SimRequest:
    rid: int
    prompt: int
    prompt_left: int
    context: int
    remaining: int
    alpha_offset: float
    fixed_alpha: float | None
    rng: random.Random
    copying: bool = False
    match_len: int = 0
    behind: int = 0  # tokens the draft model's KV has not seen
    generated: int = 0
    first_token_s: float = -1.0
    acceptance: RequestAcceptance | None = None

    def alpha(self, spec: ProposerSpec, t: float) -> float:
        if spec.kind == "ngram" and not self.copying:
            a = spec.ngram_lo
        elif self.fixed_alpha is not None:
            a = self.fixed_alpha
        else:
            a = spec.alpha.at(t) + self.alpha_offset
        return min(max(a, 0.0), 0.99)

    def advance_proposer(self, spec: ProposerSpec, max_k: int) -> None:
        """Per step: n-gram requests may enter or leave a copy span; sets the match length."""
        if spec.kind != "ngram":
            self.match_len = max_k
            return
        if self.rng.random() < spec.burst_flip:
            self.copying = not self.copying
        self.match_len = max_k if self.copying else self.rng.choice((0, 0, 1, 2))

    def draw_accepted(self, k: int, alpha: float) -> int:
        """Accepted prefix length of k drafts, each accepted with α given the previous ones."""
        if k <= 0 or alpha <= 0.0:
            return 0
        u = 1.0 - self.rng.random()  # (0, 1]
        return min(k, int(math.log(u) / math.log(alpha)))


def make_request(rid: int, seed: int, spec: ProposerSpec, prompt_len: tuple[int, int],
                 output_len: tuple[int, int]) -> SimRequest:
    """Request ``rid`` of workload ``seed``: identical under every policy."""
    rng = random.Random(seed * 1_000_003 + rid)
    fixed = rng.choice(spec.alpha_choices) if spec.alpha_choices else None
    prompt = rng.randint(*prompt_len)
    return SimRequest(rid, prompt, prompt, 0, rng.randint(*output_len), rng.gauss(0.0, spec.alpha_spread), fixed,
                      rng, copying=rng.random() < 0.5)


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    rng = random.Random(seed ^ 0x5EED)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return times
        times.append(t)


def default_buckets() -> tuple[int, ...]:
    """CUDA-graph capture sizes in the style of vLLM: fine at small sizes, coarser above."""
    return (1, 2, 4, 8, *range(16, 257, 16), *range(288, 1025, 32), *range(1088, 2049, 64))


def pad(n: int, buckets: tuple[int, ...]) -> int:
    for edge in buckets:
        if edge >= n:
            return edge
    return n

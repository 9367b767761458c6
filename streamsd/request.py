"""Sampling parameters and per-request state. Imports no torch: the scheduler lives on these."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it


@dataclass(frozen=True, slots=True)
class Constraint:
    """Structured output (sample/grammar.py): `kind` "json" (`source` a JSON schema; JSON mode is the
    schema of any object) or "regex"; `param` names the request field it came from, for errors."""

    kind: str
    source: str
    param: str = "response_format"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to sample and when to stop; shaped like vLLM's so users know it.

    `speculative` (None = the engine's default) switches speculation for this request, and
    `num_speculative_tokens` caps its k below the engine's maximum.

    `prompt_logprobs` (top alternatives per position, as `logprobs`) asks for the logprob of every
    prompt token after the first under the target's raw distribution, scored during its prefill;
    such a request takes no prefix-cache hits until its prompt is scored (a cached block's logits are
    not kept).

    `logit_bias` (token id -> value added to its logit), `repetition_penalty`, `frequency_penalty`
    and `presence_penalty` change the target's logits before warping (sample/penalties.py says how
    speculation stays exact with them); `constraint`, a grammar, masks them (sample/grammar.py).
    `penalised` says whether any of these is in effect: the target's p then depends on the tokens
    before each position, so no step is prepared before the host knows them.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    speculative: bool | None = None
    num_speculative_tokens: int | None = None
    draft_greedy_threshold: float | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constraint: Constraint | None = None
    # Read for every request of every step: computed once, not per read.
    penalised: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0,
               "temperature", "must be in [0, 100]")
        _check(math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 = off)")
        _check(math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        # 0: the prompt is computed and nothing generated (scored with prompt_logprobs, or cached for later)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_tokens", "must be an integer >= 0")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", "must be an integer in [0, max_tokens]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               "seed", "must be an integer in [0, 2**63)")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
               "logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.prompt_logprobs is None
               or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
               "prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.num_speculative_tokens is None
               or (isinstance(self.num_speculative_tokens, int) and 0 <= self.num_speculative_tokens <= 16),
               "num_speculative_tokens", "must be an integer in [0, 16]")
        _check(self.draft_greedy_threshold is None or 0.0 <= self.draft_greedy_threshold <= 100.0,
               "draft_greedy_threshold", "must be in [0, 100]")
        for s in self.stop_strings:
            _check(isinstance(s, str) and 0 < len(s) <= 256, "stop", "each stop string must be 1 to 256 characters")
        _check(len(self.stop_strings) <= 16, "stop", "at most 16 stop strings")
        for t in self.stop_token_ids or []:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_number(v) and -2.0 <= v <= 2.0, name, "must be in [-2, 2]")
        _check(_number(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty",
               "must be > 0 (1 = off)")
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias",
               "must map token ids to numbers")
        for t, v in (self.logit_bias or {}).items():
            _check(isinstance(t, int) and not isinstance(t, bool) and t >= 0, "logit_bias",
                   f"keys must be token ids (integers >= 0), not {t!r}")
            _check(_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS, "logit_bias",
                   f"values must be in [-100, 100] (token {t}: {v!r})")
        if self.constraint is not None:
            # The grammar alone decides when the answer may end.
            _check(self.min_tokens == 0, "min_tokens", f"cannot be combined with {self.constraint.param}")
            _check(not self.ignore_eos, "ignore_eos", f"cannot be combined with {self.constraint.param}")
        object.__setattr__(self, "penalised", self.penalties or self.constraint is not None)

    @property
    def penalties(self) -> bool:
        """A logit bias or a penalty is in effect (sample/penalties.py)."""
        return (bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ParamError(ValueError):
    """An out-of-range request field; `param` names it for the OpenAI-shaped error."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


def check_token_ids(prompt_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """Every token id a request names (its prompt, stop tokens, logit bias) is one of the model's."""
    # min/max run in C: on the event loop, a generator over a long prompt cost it twice as long.
    if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size):
        raise ParamError("prompt", f"token ids must be in [0, {vocab_size})")
    if any(t >= vocab_size for t in params.stop_token_ids or ()):
        raise ParamError("stop_token_ids", f"must be token ids in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ParamError("logit_bias", f"token ids must be in [0, {vocab_size})")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "cancelled"
    ERROR = "error"


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True)
class SpecStats:
    """Speculation counters of one request (or of the whole engine)."""

    steps: int = 0  # verify steps that emitted tokens
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)  # steps that drafted a token at each position

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
            self.drafted_per_pos.extend([0] * (drafted - len(self.drafted_per_pos)))
        for pos in range(drafted):
            self.drafted_per_pos[pos] += 1
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step, bonus included (the usual τ)."""
        return self.emitted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_pos),
            "drafted_per_position": list(self.drafted_per_pos),
        }


@dataclass(slots=True)
class Request:
    """Everything the scheduler and worker know of one request.

    `computed` counts tokens whose KV the target cache holds; `draft_computed` the same for the
    draft model's cache. `draft_ids` are the drafts proposed after the last verification (their
    q sits in the worker's q pool at `q_slot`, or they are one-hot); the next step that schedules
    this request verifies them, however much later that is.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    eos_ids: frozenset[int] = frozenset()
    spec_k: int = 0  # this request's maximum k (0 = no speculation)
    greedy_draft: bool = True  # one-hot q (greedy draft) vs dense sampled q
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    computed: int = 0
    draft_computed: int = 0
    # The first position whose target streams a forward left out of an EAGLE head's stream store (a
    # plain stretch that kept none: StepPlan.wants_streams); None while none is missing. The head's
    # next catch-up recomputes them first (worker/stream_catchup.py).
    streams_missing_from: int | None = None
    blocks: list[int] = field(default_factory=list)
    # The prefix cache (sched/prefix_cache.py): leading blocks already registered (or taken from it) and the
    # cache entry of the last of them; of those, the leading blocks known to hold the drafter's KV too;
    # prompt tokens found cached at admission (OpenAI's cached_tokens).
    prefix_blocks: int = 0
    prefix_parent: int = 0
    prefix_ready: int = 0
    cached_tokens: int = 0
    draft_ids: list[int] = field(default_factory=list)
    # A draft tree's shape (spec_decode/tree.py): each draft's parent index, ROOT (-1) under the pending
    # token; empty for a chain.
    draft_parents: list[int] = field(default_factory=list)
    q_slot: int | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    first_scheduled: float | None = None
    acceptance: Any = None  # the adaptive policy's per-request estimator state
    # With params.prompt_logprobs: prompt token i + 1's (logprob, top alternatives), i from 0, as scored.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    matcher: Any = None  # a constrained request's grammar state (sample/grammar.py's Matcher)
    draft_state: Any = None  # the proposer's per-request state (an n-gram proposer's index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all scored yet: every prompt token is computed."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def stops_on(self, token: int) -> bool:
        """Whether `token` ends this request once it has min_tokens: an EOS (unless ignored) or a stop id."""
        p = self.params
        return (token in self.eos_ids and not p.ignore_eos) or token in (p.stop_token_ids or ())

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

"""Read a server's Prometheus `/metrics`: gauges for the soak, speculation counter deltas for serve.

Names are looked up under `streamsd:` first and `vllm:` second, so the same benchmark reads a
vLLM server's speculation counters when the two are compared side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from streamsd.sched.plan import STEP_KINDS

PREFIXES = ("streamsd:", "vllm:")

LabelKey = tuple[tuple[str, str], ...]

#: The request histograms whose means split a server's TTFT (named as streamsd and vLLM export them).
REQUEST_STAGES = (("tokenize", "request_tokenize_time_seconds"), ("queue", "request_queue_time_seconds"),
                  ("prefill", "request_prefill_time_seconds"), ("ttft", "time_to_first_token_seconds"))


@dataclass(frozen=True)
class Snapshot:
    """Every sample of one scrape, keyed by sample name (with `_total` etc.) and sorted labels."""

    samples: dict[tuple[str, LabelKey], float]

    def get(self, name: str, **labels: str) -> float | None:
        """Value of `name` (without prefix) under the first prefix present; None if absent."""
        key = tuple(sorted(labels.items()))
        for prefix in PREFIXES:
            value = self.samples.get((prefix + name, key))
            if value is not None:
                return value
        return None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """All samples of `name` keyed by one label's value (e.g. `position`)."""
        for prefix in PREFIXES:
            found = {
                dict(labels)[label]: value
                for (sample, labels), value in self.samples.items()
                if sample == prefix + name and label in dict(labels)
            }
            if found:
                return found
        return {}


@dataclass(frozen=True)
class SpecCounters:
    """Speculation counter deltas between two scrapes, and the figures derived from them."""

    num_drafts: float
    draft_tokens: float
    accepted_tokens: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_acceptance: tuple[float, ...]
    # Mean step time (ms) by kind (`prompt`, `verify`, `decode`) over the interval, where the server
    # reports `step_duration_seconds{kind}`: what a speculative step costs in service beside a plain one.
    step_ms: dict[str, float] = field(default_factory=dict)
    # Mean per-request server time (ms) by stage over the interval, from the server's request histograms:
    # `tokenize` (request to token ids), `queue` (to first scheduled), `prefill` (to first token) and
    # `ttft`; a client's TTFT beyond the server's is HTTP and the client itself.
    request_ms: dict[str, float] = field(default_factory=dict)


def parse_metrics(text: str) -> Snapshot:
    samples: dict[tuple[str, LabelKey], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return Snapshot(samples)


async def scrape(client: aiohttp.ClientSession, base_url: str,
                 headers: dict[str, str] | None = None) -> Snapshot | None:
    """One scrape; None when the server has no usable /metrics (the benchmark still runs)."""
    try:
        async with client.get(base_url.rstrip("/") + "/metrics", headers=headers) as resp:
            text = await resp.text(errors="replace")
    except (aiohttp.ClientError, TimeoutError):
        return None
    if resp.status != 200:
        return None
    try:
        return parse_metrics(text)
    except ValueError:
        return None


def spec_delta(before: Snapshot | None, after: Snapshot | None) -> SpecCounters | None:
    """Speculation counters accrued between two scrapes; None when the server exposes none.

    Mean acceptance length follows vLLM: 1 + accepted / drafts (the bonus or correction token
    every verify step emits). Per-position rates are accepted-at-position / drafts.
    """
    if before is None or after is None:
        return None

    def diff(name: str, **labels: str) -> float | None:
        a, b = after.get(name, **labels), before.get(name, **labels)
        return None if a is None else a - (b or 0.0)

    drafts = diff("spec_decode_num_drafts_total")
    draft_tokens = diff("spec_decode_num_draft_tokens_total")
    accepted = diff("spec_decode_num_accepted_tokens_total")
    if draft_tokens is None or accepted is None:
        return None
    drafts = drafts or 0.0
    per_pos_after = after.by_label("spec_decode_num_accepted_tokens_per_pos_total", "position")
    per_pos_before = before.by_label("spec_decode_num_accepted_tokens_per_pos_total", "position")
    # Index by position number; a position no draft ever reached reads as 0.
    top = max((int(p) for p in per_pos_after), default=-1) if drafts else -1
    per_pos = tuple(
        (per_pos_after.get(str(p), 0.0) - per_pos_before.get(str(p), 0.0)) / drafts if drafts else 0.0
        for p in range(top + 1)
    )
    def mean_ms(histogram: str, **labels: str) -> float | None:
        """A histogram's mean observation over the interval, in ms (None: none observed)."""
        seconds, count = diff(f"{histogram}_sum", **labels), diff(f"{histogram}_count", **labels)
        return 1e3 * seconds / count if seconds is not None and count else None

    step_ms = {kind: ms for kind in STEP_KINDS if (ms := mean_ms("step_duration_seconds", kind=kind)) is not None}
    request_ms = {stage: ms for stage, name in REQUEST_STAGES if (ms := mean_ms(name)) is not None}
    return SpecCounters(
        num_drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
        per_position_acceptance=per_pos,
        step_ms=step_ms,
        request_ms=request_ms,
    )

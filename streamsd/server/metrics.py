"""Prometheus metrics under `streamsd:` with vLLM-like names, one registry per app."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from streamsd.engine.core import RequestOutput
from streamsd.policy.policy import AdaptivePolicy
from streamsd.server.state import ServerState

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, state: ServerState):
        self.state = state
        self.registry = r = CollectorRegistry()
        Gauge("streamsd:num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: len(state.engine.core.scheduler.running) if state.engine else 0)
        Gauge("streamsd:num_requests_waiting", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: len(state.engine.core.scheduler.waiting) if state.engine else 0)
        Gauge("streamsd:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", registry=r).set_function(
            lambda: state.engine.core.scheduler.kv_usage if state.engine else 0.0)
        # Steps queued one ahead (worker/lookahead.py): served as queued, or dropped because the plan changed.
        Gauge("streamsd:pipelined_steps_taken", "Steps served by the step queued ahead of them",
              registry=r).set_function(lambda: state.engine.core.rt.worker.lookahead.taken if state.engine else 0)
        Gauge("streamsd:pipelined_steps_dropped", "Steps queued ahead and dropped (the plan changed)",
              registry=r).set_function(lambda: state.engine.core.rt.worker.lookahead.dropped if state.engine else 0)
        self.drafts = Counter("streamsd:spec_decode_num_drafts", "Verify steps with drafts", registry=r)
        self.draft_tokens = Counter("streamsd:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("streamsd:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_pos = Counter("streamsd:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens by draft position", ["position"], registry=r)
        self.prompt_tokens = Counter("streamsd:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("streamsd:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("streamsd:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("streamsd:inter_token_latency_seconds", "Time between streamed tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("streamsd:e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue = Histogram("streamsd:request_queue_time_seconds", "Time waiting before first scheduled",
                               registry=r, buckets=LATENCY_BUCKETS)
        self._last: dict[str, float] = {}
        r.register(_AdaptiveCollector(state))
        r.register(_PrefixCacheCollector(state))

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.step_drafted:
            self.drafts.inc()
            self.draft_tokens.inc(out.step_drafted)
            self.accepted.inc(out.step_accepted)
            for pos in range(out.step_accepted):
                self.accepted_pos.labels(position=str(pos)).inc()
        if out.queue_seconds is not None:
            self.queue.observe(out.queue_seconds)
        if out.token_ids:
            self.generation_tokens.inc(len(out.token_ids))
            last = self._last.get(out.request_id)
            if last is None:
                self.ttft.observe(now - out.arrival)
            else:
                # Tokens of one step arrive together; spread the gap over them.
                gap = (now - last) / len(out.token_ids)
                for _ in out.token_ids:
                    self.itl.observe(gap)
            self._last[out.request_id] = now
        if out.finished:
            self._last.pop(out.request_id, None)
            self.prompt_tokens.inc(out.prompt_tokens)
            self.e2e.observe(now - out.arrival)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _PrefixCacheCollector:
    """The prefix cache's lookups, in prompt tokens, as the scheduler counts them (at each request's
    first admission): hits / queries is the share of prompt tokens whose prefill was skipped."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        pool = engine.core.scheduler.blocks if engine else None
        yield CounterMetricFamily("streamsd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=pool.queries if pool else 0)
        yield CounterMetricFamily("streamsd:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=pool.hits if pool else 0)


class _AdaptiveCollector:
    """The adaptive policy's decisions, read from it at scrape time (on the event loop, the thread
    that plans; a scrape only reads, the policy learns at its next choice): the k it chose per request
    and step, its share of plain steps, and how well it predicted step times. Absent under a fixed k."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        policy = engine.core.scheduler.policy if engine else None
        if not isinstance(policy, AdaptivePolicy):
            return
        rec = policy.record
        chosen = rec.chosen_k
        buckets, running = [], 0
        for k in range(policy.max_k + 1):
            running += chosen.get(k, 0)
            buckets.append((str(k), running))
        buckets.append(("+Inf", running))
        yield HistogramMetricFamily("streamsd:spec_decode_chosen_k", "Drafts chosen per request and step",
                                    buckets=buckets, sum_value=sum(k * n for k, n in chosen.items()))
        yield GaugeMetricFamily("streamsd:spec_decode_plain_step_share", "Share of steps in which nobody drafted",
                                value=rec.plain_step_share)
        yield GaugeMetricFamily("streamsd:spec_decode_step_predicted_seconds", "The last observed step's predicted time",
                                value=rec.last_predicted)
        yield GaugeMetricFamily("streamsd:spec_decode_step_measured_seconds", "The last observed step's measured time",
                                value=rec.last_measured)
        err = rec.mean_abs_prediction_error
        yield GaugeMetricFamily("streamsd:spec_decode_step_prediction_error",
                                "Mean |predicted / measured - 1| of the step times observed",
                                value=err if err is not None else 0.0)

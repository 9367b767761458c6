"""Prometheus metrics under `streamsd:` with vLLM-like names, one registry per app."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from streamsd.engine.core import RequestMetrics, RequestOutput
from streamsd.engine.info import EngineInfo, EngineLoad, StepReport
from streamsd.sched.plan import STEP_KINDS
from streamsd.server.state import ServerState, finish_reason

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (*LATENCY_BUCKETS, 160.0, 320.0, 640.0, 1280.0, 2560.0)
# 1, 2, 5, 10, ... 1e6: token counts, as vLLM buckets them.
COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5)
STEP_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


class Metrics:
    def __init__(self, state: ServerState):
        self.state = state
        self.registry = r = CollectorRegistry()
        Gauge("streamsd:num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: state.engine.load().running if state.engine else 0)
        Gauge("streamsd:num_requests_waiting", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: state.engine.load().waiting if state.engine else 0)
        Gauge("streamsd:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", registry=r).set_function(
            lambda: state.engine.load().kv_usage if state.engine else 0.0)
        # Steps queued one ahead (worker/lookahead.py): served as queued, or dropped because the plan changed.
        Gauge("streamsd:pipelined_steps_taken", "Steps served by the step queued ahead of them",
              registry=r).set_function(lambda: state.engine.load().pipelined_taken if state.engine else 0)
        Gauge("streamsd:pipelined_steps_dropped", "Steps queued ahead and dropped (the plan changed)",
              registry=r).set_function(lambda: state.engine.load().pipelined_dropped if state.engine else 0)
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
        # Before the engine sees a request: its prompt rendered and tokenised (server/prompts.py), waits included.
        self.tokenize = Histogram("streamsd:request_tokenize_time_seconds", "From a prompt's request to its token ids",
                                  registry=r, buckets=LATENCY_BUCKETS)
        self.queue = Histogram("streamsd:request_queue_time_seconds", "Time waiting before first scheduled",
                               registry=r, buckets=LATENCY_BUCKETS)
        # Per finished request, from the engine's own timestamps (RequestMetrics).
        self.success = Counter("streamsd:request_success", "Finished requests by finish reason", ["finished_reason"],
                               registry=r)
        for reason in ("stop", "length", "abort"):
            self.success.labels(finished_reason=reason)  # exported from the start, at 0
        self.tpot = Histogram("streamsd:time_per_output_token_seconds",
                              "A request's decode time per output token after its first", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.prefill = Histogram("streamsd:request_prefill_time_seconds",
                                 "From first scheduled to first token", registry=r, buckets=REQUEST_BUCKETS)
        self.decode = Histogram("streamsd:request_decode_time_seconds", "From first token to last", registry=r,
                                buckets=REQUEST_BUCKETS)
        self.req_prompt = Histogram("streamsd:request_prompt_tokens", "Prompt tokens per request", registry=r,
                                    buckets=COUNT_BUCKETS)
        self.req_generation = Histogram("streamsd:request_generation_tokens", "Generated tokens per request",
                                        registry=r, buckets=COUNT_BUCKETS)
        self.req_max_tokens = Histogram("streamsd:request_params_max_tokens", "max_tokens per request", registry=r,
                                        buckets=COUNT_BUCKETS)
        # Per step, as the engine reports each executed one (EngineClient.step_observers).
        self.preemptions = Counter("streamsd:num_preemptions", "Requests preempted (their KV recomputed later)",
                                   registry=r)
        self.step_tokens = Histogram("streamsd:iteration_tokens_total",
                                     "Tokens the target computed per step (prompt, pending and draft tokens)",
                                     registry=r, buckets=STEP_TOKEN_BUCKETS)
        # A step's time from the end of the one before (EngineCore.execute): steps that carry a prompt chunk,
        # those that verify drafts (what a speculative step costs in service, against the start-up profile's
        # price) and those that only decode; what joins cost the requests already running.
        self.step_time = Histogram("streamsd:step_duration_seconds", "Engine step time, by whether it computes "
                                   "a prompt chunk, verifies drafts or only decodes", ["kind"], registry=r,
                                   buckets=STEP_BUCKETS)
        for kind in STEP_KINDS:
            self.step_time.labels(kind=kind)
        self.cache_config = Info("streamsd:cache_config", "The KV cache's configuration", registry=r)
        # Requests by the API key that authenticated them, named (key-1, or NAME from NAME:KEY), never the key.
        self.key_requests = Counter("streamsd:api_key_requests", "Authenticated API requests (HTTP requests under "
                                    "/v1/ and WebSocket generations) by API key name", ["key"], registry=r)
        for name in state.api_keys.names if state.api_keys else []:
            self.key_requests.labels(key=name)  # every key exported from the start, at 0
        self._last: dict[str, float] = {}
        r.register(_AdaptiveCollector(state))
        r.register(_PrefixCacheCollector(state))

    def engine_loaded(self, info: EngineInfo) -> None:
        self.cache_config.info({"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_blocks),
                                "cache_dtype": info.cache_dtype, "device": info.device_type,
                                "max_model_len": str(info.max_model_len)})
        for pos in range(info.spec.num_tokens if info.spec.enabled else 0):
            self.accepted_pos.labels(position=str(pos))  # every position exported from the start, at 0

    def observe_step(self, step: StepReport) -> None:
        if step.kind:
            self.step_tokens.observe(step.num_tokens)
            self.step_time.labels(kind=step.kind).observe(step.seconds)
        if step.preempted:
            self.preemptions.inc(step.preempted)

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
            self.success.labels(finished_reason=finish_reason(out)).inc()
            self.req_prompt.observe(out.prompt_tokens)
            self.req_generation.observe(out.completion_tokens)
            if out.metrics is not None:
                self._observe_request(out.metrics, out.completion_tokens)

    def _observe_request(self, m: RequestMetrics, completion_tokens: int) -> None:
        self.req_max_tokens.observe(m.max_tokens)
        if m.first_scheduled_time is None or m.first_token_time is None or m.last_token_time is None:
            return  # it never ran, or made no token
        self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        decode = m.last_token_time - m.first_token_time
        self.decode.observe(decode)
        if completion_tokens > 1:
            self.tpot.observe(decode / (completion_tokens - 1))

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _PrefixCacheCollector:
    """The prefix cache's lookups, in prompt tokens, as the scheduler counts them (at each request's
    first admission): hits / queries is the share of prompt tokens whose prefill was skipped."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        load = self.state.engine.load() if self.state.engine else EngineLoad()
        yield CounterMetricFamily("streamsd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=load.prefix_queries)
        yield CounterMetricFamily("streamsd:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=load.prefix_hits)


class _AdaptiveCollector:
    """The speculation policy's decisions, as the engine's load last reported them: the k it chose per
    request and step, its share of plain steps, and how well it predicted step times. Absent under a
    fixed k; a tree chooser reports its share of plain steps only."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self) -> Iterator[Metric]:
        stats = self.state.engine.load().policy if self.state.engine else None
        if stats is None:
            return
        yield GaugeMetricFamily("streamsd:spec_decode_plain_step_share", "Share of steps in which nobody drafted",
                                value=stats.plain_step_share)
        if stats.max_k is None or stats.chosen_k is None:
            return
        chosen = dict(stats.chosen_k)
        buckets, running = [], 0
        for k in range(stats.max_k + 1):
            running += chosen.get(k, 0)
            buckets.append((str(k), running))
        buckets.append(("+Inf", running))
        yield HistogramMetricFamily("streamsd:spec_decode_chosen_k", "Drafts chosen per request and step",
                                    buckets=buckets, sum_value=sum(k * n for k, n in chosen.items()))
        yield GaugeMetricFamily("streamsd:spec_decode_step_predicted_seconds", "The last observed step's predicted time",
                                value=stats.last_predicted or 0.0)
        yield GaugeMetricFamily("streamsd:spec_decode_step_measured_seconds", "The last observed step's measured time",
                                value=stats.last_measured or 0.0)
        err = stats.prediction_error
        yield GaugeMetricFamily("streamsd:spec_decode_step_prediction_error",
                                "Mean |predicted / measured - 1| of the step times observed",
                                value=err if err is not None else 0.0)

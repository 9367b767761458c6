"""The synchronous engine core: requests in, per-step output deltas out.

`step()` is schedule -> execute -> postprocess. The async engine runs the same three parts with
`execute` on the worker thread; the offline `LLM` calls `step()` directly.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from streamsd.config import EngineConfig, SpecConfig
from streamsd.engine.builder import Runtime, build_runtime
from streamsd.engine.detokenizer import Detokenizer, TokenInfo
from streamsd.engine.text import ChatText
from streamsd.model.parallel import RankLost
from streamsd.request import (
    FinishReason,
    ParamError,
    Request,
    SamplingParams,
    SpecStats,
    Status,
    check_token_ids,
)
from streamsd.sched.plan import EntryResult, StepPlan
from streamsd.sched.scheduler import Scheduler

log = logging.getLogger("streamsd")

IDLE_GAP_S = 0.05  # a longer gap between two steps (a host stall) is not part of the next step's cost


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """When a finished request reached each stage (time.monotonic()), for the server's metrics.
    The token times are those its outputs were made at; None for a request that made none."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an engine refused a request it was sent: a check only the engine could make (an engine in
    another process: its KV pool's size, its queue at that moment)."""

    message: str
    param: str | None  # the request field at fault; None: the engine is overloaded, worth a retry


@dataclass(slots=True)
class RequestOutput:
    """One step's worth of a request: new tokens and text, and at the end why it stopped."""

    request_id: str
    token_ids: list[int]
    text: str
    tokens: list[TokenInfo]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    refusal: Refusal | None = None  # with `error`: the request was refused, never ran
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those whose KV came from the prefix cache
    completion_tokens: int = 0
    step_drafted: int = 0
    step_accepted: int = 0
    stats: SpecStats | None = None
    queue_seconds: float | None = None  # on a request's first output only
    arrival: float = 0.0  # time.monotonic() at submission, for latency metrics
    metrics: RequestMetrics | None = None  # on the last output
    # With prompt_logprobs asked for, on the first output: prompt token i + 1's (logprob, top alternatives).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @classmethod
    def ended(cls, request_id: str, reason: FinishReason, error: str | None = None,
              refusal: Refusal | None = None) -> RequestOutput:
        """A request's last output with nothing in it: it was aborted before it ran, refused, or failed."""
        return cls(request_id, [], "", [], finished=True, finish_reason=str(reason), error=error, refusal=refusal)


def joined(outs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: the tokens and text of all, the per-step counts summed,
    what is said once (queueing time, prompt logprobs) from the delta that says it, the rest (the state
    at the end) from the last."""
    if len(outs) == 1:
        return outs[0]
    return replace(
        outs[-1], token_ids=[i for o in outs for i in o.token_ids], text="".join(o.text for o in outs),
        tokens=[t for o in outs for t in o.tokens], step_drafted=sum(o.step_drafted for o in outs),
        step_accepted=sum(o.step_accepted for o in outs),
        queue_seconds=next((o.queue_seconds for o in outs if o.queue_seconds is not None), None),
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
    )


@dataclass(slots=True)
class _Tracker:
    request: Request
    detok: Detokenizer
    released_tokens: int = 0
    timeline: list[float] = field(default_factory=list)
    prompt_scored: bool = False  # its prompt logprobs went out (with its first output)


@dataclass(slots=True)
class Turn:
    """One step of EngineCore.run: the outputs it released (the previous step's text, and stops)
    and the plan it executed, with where its time went."""

    outputs: list[RequestOutput]
    plan: StepPlan
    execute_s: float  # the step's execution; the previous step's text work ran meanwhile
    serial_s: float  # planning and applying results: host work the GPU waits for


@dataclass(slots=True)
class Emission:
    """A step whose tokens are applied and whose text is still to be made."""

    outputs: list[RequestOutput] = field(default_factory=list)  # aborted and failed requests' finals
    pending: list[tuple[Request, EntryResult, list[int], int, int]] = field(default_factory=list)


class EngineCore:
    def __init__(self, runtime: Runtime, spec: SpecConfig):
        self.rt = runtime
        self.spec = spec
        self.tokenizer = runtime.tokenizer
        self.text = ChatText(runtime.tokenizer, runtime.chat_template)
        self.scheduler = Scheduler(runtime.scheduler_config, dense_q_slots=runtime.q_slots, policy=runtime.policy)
        self.last_step_seconds = 0.0
        self.last_step_end = -1.0  # perf_counter at the end of the last step
        self.trackers: dict[str, _Tracker] = {}
        self.totals = SpecStats()
        # Seeded from the OS once, not read from it per request: each read releases the interpreter lock,
        # and taking it back on the event loop waits out a busy worker thread's switch interval.
        self._rand = random.Random(runtime.seed)
        self._stopped: list[tuple[Request, RequestOutput]] = []  # stop strings found under a running step

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.trackers:
            raise ParamError("id", f"request id {request_id!r} is already running")
        check_token_ids(prompt_ids, params, self.rt.args.vocab_size)
        r = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=params.seed if params.seed is not None else self._rand.getrandbits(63),
            arrival=time.monotonic(),
            eos_ids=self.rt.eos_ids,
            spec_k=self._spec_k(params),
            greedy_draft=self._greedy_draft(params),
        )
        if params.constraint is not None:
            r.matcher = self.rt.grammars.matcher(params.constraint, self.rt.eos_ids)  # compiles on first use
        self.scheduler.add(r)
        self.trackers[request_id] = _Tracker(r, Detokenizer.for_prompt(self.tokenizer, r.prompt_ids,
                                                                        params.stop_strings))
        return r

    def _greedy_draft(self, p: SamplingParams) -> bool:
        """Whether the proposer drafts its argmax (one-hot q) rather than a sample of its q. In the exact
        mode a draft passes when it is plain sampling's token, with probability p(draft): the argmax of q
        passes with p(argmax q), a sample of q with sum(q * p) on average, which is lower wherever q is
        close to p; so there every request drafts argmaxes unless it asks otherwise."""
        if self.rt.exact and p.draft_greedy_threshold is None:
            return True
        threshold = p.draft_greedy_threshold if p.draft_greedy_threshold is not None else self.spec.draft_greedy_threshold
        return p.temperature < threshold

    def _spec_k(self, p: SamplingParams) -> int:
        if not self.spec.enabled or p.speculative is False or p.max_tokens == 0:
            return 0
        if p.constraint is not None and self.spec.tree is not None:
            return 0  # a tree's rows would each need its own path's grammar state: plain steps instead
        k = self.spec.num_tokens
        return min(k, p.num_speculative_tokens) if p.num_speculative_tokens is not None else k

    def abort(self, request_id: str) -> None:
        log.debug("abort %s", request_id)
        if request_id in self.trackers:
            self.scheduler.abort(request_id)

    def close(self) -> None:
        """Releases what outlives the engine object: the follower ranks under tensor parallelism."""
        self.rt.close()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def waited(self) -> None:
        """The engine ran out of work and waited for more: the next step's time starts at its own start.
        Counted from the end of the step before, it read the wait for a burst of requests to arrive
        as its own cost (a wave's prompt step read tens of ms of it), and the policy learns step costs
        from these times."""
        self.last_step_end = -1.0

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan, aborted = self._schedule()
        results = self.execute(plan)
        return self.postprocess(plan, results, aborted)

    def execute(self, plan: StepPlan) -> list[EntryResult] | BaseException:
        """Runs on the worker thread. A failure is returned, not raised, so only its requests fail."""
        if not plan.entries:
            return []
        try:
            t0 = time.perf_counter()
            results = self.rt.worker.step(plan)
            end = time.perf_counter()  # the step ends with a host read: complete
            # What a step costs is the time from the end of the step before to its own: with steps
            # queued ahead (worker/lookahead.py) the GPU runs one while the host finishes the one before,
            # and its own wall time read 2 ms or 7 ms for the same 6 ms step on an H200 (the
            # policy's table swung with it). A long gap is the engine waiting for work: not counted.
            since = self.last_step_end if t0 - self.last_step_end < IDLE_GAP_S else t0
            self.last_step_seconds, self.last_step_end = end - since, end
            return results
        except RankLost:  # a tensor-parallel rank is gone: no step can run again
            raise
        except Exception as exc:  # the engine must outlive any one step
            log.exception("step failed; failing its %d requests", len(plan.entries))
            return exc
        finally:
            self.rt.worker.launched.set()

    def postprocess(self, plan: StepPlan, results: list[EntryResult] | BaseException,
                    aborted: list[Request]) -> list[RequestOutput]:
        return self.emit(self.finish_step(plan, results, aborted), defer_stops=False)

    def finish_step(self, plan: StepPlan, results: list[EntryResult] | BaseException,
                    aborted: list[Request]) -> Emission | None:
        """Applies a step's tokens to its requests (cheap); the text work is `emit`'s."""
        em = Emission(outputs=[self._final(r, FinishReason.ABORT) for r in aborted if r.request_id in self.trackers])
        if isinstance(results, BaseException):
            for e in plan.entries:
                if e.request.finished:
                    continue  # as in `update`: finished meanwhile (a stop `settle` applied), it has its end
                self.scheduler.finish(e.request, FinishReason.ERROR)
                em.outputs.append(self._final(e.request, FinishReason.ERROR, error=f"internal error: {results}"))
            return em
        verified = []
        for entry, res, kept, drafted in self.scheduler.update(plan, results):
            accepted = min(res.num_accepted, len(kept), drafted)
            self.totals.record(drafted, accepted, len(kept))
            # Drafts verified past max_tokens are still the target's verdict on the drafter: the policy
            # learns from every one.
            verified.append((entry.request, entry.num_drafts, res.num_accepted))
            em.pending.append((entry.request, res, kept, drafted, accepted))
        self.rt.worker.lookahead.forget_finished()
        if plan.decision is not None:
            self.scheduler.policy.observe(plan.decision, verified, self.last_step_seconds)
        return em if em.outputs or em.pending else None

    def emit(self, em: Emission | None, *, defer_stops: bool) -> list[RequestOutput]:
        """Detokenises a finished step. With `defer_stops` the next step is already running and may
        hold a request that just hit a stop string: it is finished by `settle` once that step is
        back, never under it, and its last output waits until then."""
        if em is None:
            return []
        outputs = list(em.outputs)
        for r, res, kept, drafted, accepted in em.pending:
            out = self._emit(r, res, kept, drafted, accepted, defer_stops)
            if out is not None:
                outputs.append(out)
        return outputs

    def settle(self) -> list[RequestOutput]:
        """Finishes the requests whose stop strings `emit` found while a step was running."""
        outputs = []
        for r, out in self._stopped:
            if not r.finished:
                self.scheduler.finish(r, FinishReason.STOP)
            self._stop(r)
            self._close(r, out)
            outputs.append(out)
        self._stopped.clear()
        return outputs

    def run(self) -> Iterator[Turn]:
        """Steps until idle, each step's text work (and the next step's plan, when the policy plans
        ahead) overlapping its execution (the offline counterpart of AsyncEngine's loop); yields one
        Turn per step."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamsd-worker") as pool:
            em: Emission | None = None
            while em is not None or self.has_work:
                t0 = time.perf_counter()
                plan, aborted = self.begin()
                t1 = time.perf_counter()
                running = pool.submit(self.execute, plan) if plan.entries else None
                if running is not None:
                    self.wait_launched()
                outputs = self.emit(em, defer_stops=running is not None)
                if running is not None:
                    self.scheduler.plan_ahead(plan)
                results = running.result() if running is not None else []
                t2 = time.perf_counter()
                outputs += self.settle()
                em = self.finish_step(plan, results, aborted)
                yield Turn(outputs, plan, execute_s=t2 - t1, serial_s=(t1 - t0) + (time.perf_counter() - t2))

    def begin(self) -> tuple[StepPlan, list[Request]]:
        """The next step's plan (empty when only emissions are left), before it is submitted."""
        self.rt.worker.launched.clear()
        return self._schedule() if self.has_work else (StepPlan(), [])

    def _schedule(self) -> tuple[StepPlan, list[Request]]:
        # Steps the worker queued ahead pin the plan where they can serve it (the worker is idle now).
        plan, aborted = self.scheduler.schedule(self.rt.worker.lookahead.follow)
        # A request's queue time ends when a step first takes it, before that step runs: its prefill is
        # the time from here to its first token, not part of the wait.
        now = time.monotonic()
        for e in plan.entries:
            if e.request.first_scheduled is None:
                e.request.first_scheduled = now
        return plan, aborted

    def wait_launched(self) -> None:
        """Until the running step has queued its GPU work: its launches need the GIL that `emit`
        would otherwise hold. On the CPU the forward itself is the work, and torch releases the GIL
        inside it: nothing to wait for."""
        if self.rt.worker.device.type == "cuda":
            self.rt.worker.launched.wait(0.005)

    def _emit(self, r: Request, res: EntryResult, kept: list[int], drafted: int, accepted: int,
              defer_stops: bool) -> RequestOutput | None:
        t = self.trackers[r.request_id]
        for i, tok in enumerate(kept):
            lp = res.logprobs[i] if res.logprobs else None
            t.detok.add(TokenInfo(tok, "", res.draft_flags[i] if i < len(res.draft_flags) else False,
                                  lp[0] if lp else None, lp[1] if lp else None))
        text, tokens = t.detok.release(final=r.finished)
        t.released_tokens += len(tokens)
        out = RequestOutput(r.request_id, [x.id for x in tokens], text, tokens,
                            step_drafted=drafted, step_accepted=accepted, arrival=r.arrival)
        if r.first_scheduled is not None and not t.timeline:
            out.queue_seconds = r.first_scheduled - r.arrival
        if r.params.prompt_logprobs is not None and not t.prompt_scored:
            out.prompt_logprobs, t.prompt_scored = list(r.prompt_logprobs), True
        t.timeline.append(time.monotonic())
        if t.detok.stopped and not r.finished and defer_stops:
            self._stopped.append((r, out))
            return None
        if t.detok.stopped and not r.finished:
            self.scheduler.finish(r, FinishReason.STOP)
        if t.detok.stopped:
            self._stop(r)
        if r.finished:
            self._close(r, out)
        return out

    def _stop(self, r: Request) -> None:
        """Tokens past a stop string were never released: they are not part of the output."""
        del r.output_ids[self.trackers[r.request_id].released_tokens :]
        r.finish_reason = FinishReason.STOP

    def _final(self, r: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        t = self.trackers.get(r.request_id)
        text, tokens = t.detok.release(final=True) if t and reason is not FinishReason.ERROR else ("", [])
        out = RequestOutput(r.request_id, [x.id for x in tokens], text, tokens, error=error, arrival=r.arrival)
        r.finish_reason = reason
        self._close(r, out)
        return out

    def _close(self, r: Request, out: RequestOutput) -> None:
        out.finished = True
        out.finish_reason = str(r.finish_reason or FinishReason.STOP)
        out.prompt_tokens = len(r.prompt_ids)
        out.cached_tokens = r.cached_tokens
        out.completion_tokens = len(r.output_ids)
        out.stats = r.stats
        t = self.trackers.pop(r.request_id, None)
        timeline = t.timeline if t is not None else []
        out.metrics = RequestMetrics(r.arrival, r.first_scheduled, timeline[0] if timeline else None,
                                     timeline[-1] if timeline else None, r.params.max_tokens)
        assert r.status is Status.FINISHED and not r.blocks, "finished requests hold no KV"


EngineFactory = Callable[[], EngineCore]


def build_engine_core(cfg: EngineConfig) -> EngineCore:
    """The engine `cfg` describes (as a factory: `functools.partial(build_engine_core, cfg)`, which pickles)."""
    return EngineCore(build_runtime(cfg), cfg.spec)

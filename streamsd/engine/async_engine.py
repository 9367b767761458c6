"""The asyncio engine: continuous batching on the event loop, model work on one worker thread.

Each step: schedule on the loop, one hop to the worker thread for `execute`; while it runs, the
loop detokenises the previous step and hands every request its delta. One hop per step each way,
never one per token, and the text work hides behind the GPU's.

With a stream interval of N > 1 a request's deltas are handed over once they hold N tokens (its
first at once, its last whatever it holds): each delta a stream receives costs the loop a wake-up,
an event to encode and a socket write, which at high concurrency compete with scheduling the next
step. "auto" sets N by the streams open: one for every STREAMS_PER_STEP of them (1 up to that many),
so the loop hands over about that many deltas a step at any load.

It runs on the server's own event loop, or on the loop of an engine process serving the server over
a pipe (engine/core_process.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamsd.config import STREAMS_PER_STEP, StreamInterval
from streamsd.engine.client import EngineClient, OnLost
from streamsd.engine.core import Emission, EngineCore, EngineFactory, RequestOutput, joined
from streamsd.engine.info import EngineInfo, EngineLoad, PolicyStats, StepReport
from streamsd.request import Constraint, SamplingParams
from streamsd.sched.plan import StepPlan


def worker_thread() -> ThreadPoolExecutor:
    """The one thread an engine's model work runs on. Build the engine on it too (its warm-up included):
    CUDA libraries keep state per thread (a cuBLAS handle and its workspace), which the warm-up then
    creates for the steps instead of leaving it to the first request."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamsd-worker")


class AsyncEngine(EngineClient):
    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor | None = None,
                 stream_interval: StreamInterval = 1):
        """`executor`: the `worker_thread` the core was built on (the engine shuts it down on close).
        `stream_interval`: the tokens a request's deltas gather before they are handed over (its first
        and last go at once), or "auto" (by the streams open)."""
        if stream_interval != "auto" and stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1 or 'auto', not {stream_interval}")
        super().__init__(EngineInfo.of(core), core.text)
        self.core = core
        self.stream_interval = stream_interval
        self._held: dict[str, list[RequestOutput]] = {}  # request id -> its deltas not handed over yet
        self._executor = executor or worker_thread()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()

    @classmethod
    async def launch(cls, factory: EngineFactory, stream_interval: StreamInterval,
                     on_lost: OnLost) -> AsyncEngine:
        """Builds the core on a new worker thread, off the event loop; `on_lost` is told if a tensor-parallel
        rank of the engine is lost."""
        worker = worker_thread()
        try:
            core = await asyncio.get_running_loop().run_in_executor(worker, factory)
        except BaseException:
            worker.shutdown(wait=False)
            raise
        if core.rt.group is not None:
            core.rt.group.on_lost.append(on_lost)
        return cls(core, worker, stream_interval)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="streamsd-engine")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)
        self.core.close()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               queue: asyncio.Queue[RequestOutput] | None = None) -> tuple[str, asyncio.Queue[RequestOutput]]:
        rid = request_id or f"req-{next(self._ids)}"
        self.core.add_request(rid, prompt_ids, params)
        queue = self._open(rid, queue)
        self._wake.set()
        return rid, queue

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._wake.set()

    def load(self) -> EngineLoad:
        return EngineLoad.of(self.core, PolicyStats.of(self.core.scheduler.policy))

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    def compile_grammar(self, constraint: Constraint) -> Any:
        return self.core.rt.grammars.compile(constraint)

    async def _run(self) -> None:
        """One step per turn: the worker thread runs step N+1 while this loop detokenises and
        streams step N (the same pipeline as EngineCore.run)."""
        loop = asyncio.get_running_loop()
        core = self.core
        em: Emission | None = None
        done: tuple[StepPlan, float] | None = None  # the last step executed and its time, not yet observed
        while True:
            if em is None and not core.has_work:
                self._observe_step(done)
                done = None
                self._wake.clear()
                await self._wake.wait()
                core.waited()
                continue
            plan, aborted = core.begin()
            running = loop.run_in_executor(self._executor, core.execute, plan) if plan.entries else None
            if running is not None:
                core.wait_launched()
            for out in core.emit(em, defer_stops=running is not None):
                self._dispatch(out)
            self._observe_step(done)
            if running is not None:
                core.scheduler.plan_ahead(plan)
            results = await running if running is not None else []
            seconds = core.last_step_seconds if running is not None else 0.0
            for out in core.settle():
                self._dispatch(out)
            em = core.finish_step(plan, results, aborted)
            done = (plan, seconds) if plan.entries or plan.preempted else None
            if running is None and em is None:
                await asyncio.sleep(0.001)  # only aborts were processed; let the loop breathe

    def _observe_step(self, done: tuple[StepPlan, float] | None) -> None:
        if done is not None and self.step_observers:
            report = StepReport.of(*done)
            for observe in self.step_observers:
                observe(report)

    def _dispatch(self, out: RequestOutput) -> None:
        for observe in self.observers:
            observe(out)
        if self.stream_interval != 1:
            gathered = self._gather(out, self._interval())
            if gathered is None:
                return
            out = gathered
        self._deliver(out)

    def _interval(self) -> int:
        if self.stream_interval == "auto":
            return max(1, -(-len(self._streams) // STREAMS_PER_STEP))
        return self.stream_interval

    def _gather(self, out: RequestOutput, interval: int) -> RequestOutput | None:
        """`out` joined to the deltas held before it; None while they hold fewer tokens than
        `interval` (and are neither the request's first nor its last)."""
        held = self._held.pop(out.request_id, [])
        held.append(out)
        first = out.queue_seconds is not None  # said by a request's first delta only
        if out.finished or out.error or first or sum(len(o.tokens) for o in held) >= interval:
            return joined(held)
        self._held[out.request_id] = held
        return None

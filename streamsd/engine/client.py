"""What a server talks to: requests in, each request's deltas out on an asyncio queue.

`AsyncEngine` runs the core in this process (its model work on a worker thread); `ProcessEngine`
runs it in a process of its own (engine/process.py). Both hand deltas to the same streams and tell
the same observers; the routes see only this interface.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from streamsd.engine.core import RequestOutput, joined
from streamsd.engine.info import EngineInfo, EngineLoad, StepReport
from streamsd.engine.text import ChatText
from streamsd.request import Constraint, SamplingParams

OutputObserver = Callable[[RequestOutput], None]
StepObserver = Callable[[StepReport], None]
OnLost = Callable[[str], None]  # told why an engine can no longer run


class EngineLost(RuntimeError):
    """Raised by `submit` once the engine can no longer run (its process exited): the message says why."""


def gathered(first: RequestOutput, queue: asyncio.Queue[RequestOutput]) -> list[RequestOutput]:
    """`first` and the deltas already waiting behind it in `queue`, each request's joined into one (in
    the order the requests first appear): a stream that fell behind its engine catches up in one
    chunk per request, not one per step it missed."""
    if queue.empty():
        return [first]
    by_request: dict[str, list[RequestOutput]] = {first.request_id: [first]}
    while not queue.empty():
        out = queue.get_nowait()
        by_request.setdefault(out.request_id, []).append(out)
    return [joined(outs) for outs in by_request.values()]


class EngineClient(ABC):
    def __init__(self, info: EngineInfo, text: ChatText):
        self.info = info
        self.text = text
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self.observers: list[OutputObserver] = []  # told of every delta handed over
        # Told of each executed step while the next one runs.
        self.step_observers: list[StepObserver] = []

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               queue: asyncio.Queue[RequestOutput] | None = None) -> tuple[str, asyncio.Queue[RequestOutput]]:
        """Admit a request (raises ValueError-family errors on bad input); returns its output queue,
        `queue` when given (several requests answered together share one)."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def load(self) -> EngineLoad:
        """The engine's live counts (from its last report, where it runs elsewhere)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled (as last reported, where the engine runs elsewhere); read for
        every request a server admits, so cheaper than `load`."""

    @abstractmethod
    def compile_grammar(self, constraint: Constraint) -> Any:
        """Compiles (and caches) a request's grammar; a ParamError if it cannot. Blocking: call it on a thread."""

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas until the request finishes; leaving the loop early aborts the request."""
        rid, queue = self.submit(prompt_ids, params, request_id)
        async for out in self.stream(rid, queue):
            yield out

    async def stream(self, rid: str, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                for out in gathered(await queue.get(), queue):
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self.abort(rid)

    def abort_all(self) -> None:
        for rid in list(self._streams):
            self.abort(rid)

    def _open(self, rid: str, queue: asyncio.Queue[RequestOutput] | None) -> asyncio.Queue[RequestOutput]:
        queue = queue if queue is not None else asyncio.Queue()
        self._streams[rid] = queue
        return queue

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

"""The engine process: an engine core and its step loop, serving a server over a pipe.

The server's event loop parses HTTP, renders chats and streams chunks; the engine's loop schedules,
detokenises and drives the worker thread. In one process they share one interpreter lock and one
event loop, and under load each waits for the other: a wave of arriving requests delays the next
step, a busy step delays the chunks. Here the engine runs the same `AsyncEngine` as in-process, on
a loop of its own, and the two sides meet once a step: the requests that arrived come in, one
report of the step's deltas goes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from multiprocessing.connection import Connection

from streamsd.config import SWITCH_INTERVAL_S, StreamInterval
from streamsd.engine.async_engine import AsyncEngine
from streamsd.engine.core import EngineFactory, Refusal, RequestOutput
from streamsd.engine.info import EngineLoad, PolicyStats, StepReport
from streamsd.engine.process_messages import Abort, Add, Failed, Ready, Report, watch
from streamsd.request import FinishReason, ParamError
from streamsd.sched.scheduler import QueueFullError

log = logging.getLogger("streamsd")
IDLE_REPORT_S = 0.25  # how stale the server's view of an idle engine's load may get
POLICY_STATS_S = 0.25  # how often the policy's stats are read (they walk its record)


def run_core_process(conn: Connection, factory: EngineFactory, stream_interval: StreamInterval,
                     log_level: int) -> None:
    """The process's entry: builds the core on its worker thread, says Ready (or Failed), then serves
    until the server says Shutdown or its end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    import uvloop

    uvloop.run(_serve(conn, factory, stream_interval))


async def _serve(conn: Connection, factory: EngineFactory, stream_interval: StreamInterval) -> None:
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def lost(message: str) -> None:  # a rank lost, on the group's monitor thread: the server hears it and exits
        loop.call_soon_threadsafe(_fail, conn, message, ended)

    try:
        engine = await AsyncEngine.launch(factory, stream_interval, lost)
    except Exception as exc:
        conn.send(Failed(str(exc)))
        return
    conn.send(Ready(engine.info))
    server = _Server(conn, engine, ended)
    watch(conn, server.read)
    await engine.start()
    tasks = [asyncio.create_task(server.forward()), asyncio.create_task(server.heartbeat())]
    try:
        await ended.wait()
    finally:
        loop.remove_reader(conn.fileno())
        for task in tasks:
            task.cancel()
        await engine.close()


def _fail(conn: Connection, message: str, ended: asyncio.Event) -> None:
    with contextlib.suppress(OSError):
        conn.send(Failed(message))
    ended.set()


class _Server:
    """The engine's side of the pipe. Every request's deltas go to one queue, `sink`; `forward` sends
    what it holds as one report each time it wakes, which is once a step."""

    def __init__(self, conn: Connection, engine: AsyncEngine, ended: asyncio.Event):
        self.conn, self.engine, self.ended = conn, engine, ended
        self.sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.steps: list[StepReport] = []
        engine.step_observers.append(self.steps.append)
        self.compiling: dict[str, bool] = {}  # request id -> aborted while its grammar compiles
        self.sent: EngineLoad | None = None
        self.policy: PolicyStats | None = None
        self.policy_read = 0.0
        self.requests_read = 0

    def read(self) -> None:
        try:
            while self.conn.poll():
                msg = self.conn.recv()
                if isinstance(msg, Add):
                    self.requests_read += 1
                    self.add(msg)
                elif isinstance(msg, Abort):
                    self.abort(msg.request_id)
                else:
                    self.ended.set()
                    return
        except (EOFError, OSError):  # the server is gone
            self.ended.set()

    def add(self, msg: Add) -> None:
        if msg.params.constraint is not None:
            # Compiled off the loop (seconds for a grammar engine's first): the steps go on meanwhile.
            self.compiling[msg.request_id] = False
            asyncio.create_task(self.add_constrained(msg))
            return
        self.submit(msg)

    async def add_constrained(self, msg: Add) -> None:
        assert msg.params.constraint is not None
        try:
            await asyncio.to_thread(self.engine.compile_grammar, msg.params.constraint)
        except ValueError as exc:
            del self.compiling[msg.request_id]
            param = exc.param if isinstance(exc, ParamError) else msg.params.constraint.param
            self.sink.put_nowait(_refused(msg.request_id, Refusal(str(exc), param)))
            return
        if self.compiling.pop(msg.request_id):
            self.sink.put_nowait(RequestOutput.ended(msg.request_id, FinishReason.ABORT))
            return
        self.submit(msg)

    def submit(self, msg: Add) -> None:
        try:
            self.engine.submit(msg.prompt_ids, msg.params, msg.request_id, self.sink)
        except QueueFullError as exc:
            self.sink.put_nowait(_refused(msg.request_id, Refusal(str(exc), None)))
        except ValueError as exc:  # what the server could not check: the KV pool's size
            self.sink.put_nowait(_refused(msg.request_id, Refusal(str(exc), exc.param if isinstance(exc, ParamError)
                                                                  else "prompt")))

    def abort(self, request_id: str) -> None:
        if request_id in self.compiling:
            self.compiling[request_id] = True
            return
        self.engine.abort(request_id)

    async def forward(self) -> None:
        while True:
            outputs = [await self.sink.get()]
            while not self.sink.empty():
                outputs.append(self.sink.get_nowait())
            self.send(outputs)

    async def heartbeat(self) -> None:
        """Reports the load of an engine that made no delta since the last report (a prompt chunk's
        step, an idle engine), when it changed."""
        while True:
            await asyncio.sleep(IDLE_REPORT_S)
            if self.steps or self.load() != self.sent:
                self.send([])

    def load(self) -> EngineLoad:
        now = time.monotonic()
        if now - self.policy_read >= POLICY_STATS_S:
            self.policy, self.policy_read = PolicyStats.of(self.engine.core.scheduler.policy), now
        return EngineLoad.of(self.engine.core, self.policy)

    def send(self, outputs: list[RequestOutput]) -> None:
        self.sent = self.load()
        try:
            self.conn.send(Report(outputs, self.steps[:], self.sent, self.requests_read))
        except OSError:  # the server is gone
            self.ended.set()
        self.steps.clear()


def _refused(request_id: str, refusal: Refusal) -> RequestOutput:
    return RequestOutput.ended(request_id, FinishReason.ERROR, refusal.message, refusal)

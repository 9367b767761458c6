"""The server's side of an engine in its own process (engine/core_process.py).

Requests are checked here against what the engine said of itself when it was ready (`EngineInfo`:
the vocabulary, the context window), so that bad input is refused before anything is sent; the few
things only the engine can know (its KV pool, its queue at that moment) come back as the request's
only output, carrying a `Refusal` the server answers as it answers a refused admission. Each report the engine sends is read once, when the pipe becomes
readable: its deltas go to their streams and observers, its steps to the step observers, its load
replaces the last.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from streamsd.config import StreamInterval
from streamsd.engine.client import EngineClient, EngineLost, OnLost
from streamsd.engine.core import EngineFactory, RequestOutput
from streamsd.engine.core_process import run_core_process
from streamsd.engine.info import EngineInfo, EngineLoad
from streamsd.engine.process_messages import (
    Abort,
    Add,
    Failed,
    FromEngine,
    Ready,
    Report,
    Shutdown,
    ToEngine,
    watch,
)
from streamsd.engine.text import ChatText
from streamsd.request import Constraint, FinishReason, ParamError, SamplingParams, check_token_ids
from streamsd.sample.grammar import Grammars
from streamsd.sched.scheduler import check_fits

log = logging.getLogger("streamsd")
CLOSE_TIMEOUT_S = 10.0


class EngineProcessError(RuntimeError):
    """The engine process could not start its engine."""


class ProcessEngine(EngineClient):
    def __init__(self, process: BaseProcess, conn: Connection, info: EngineInfo, text: ChatText,
                 on_lost: OnLost):
        """`on_lost`: told, with a message, if the engine process fails or exits on its own."""
        super().__init__(info, text)
        self._process = process
        self._conn = conn
        self._grammars = Grammars(text.tokenizer, info.vocab_size)  # to refuse a bad grammar here
        self._load = EngineLoad()
        self._sent = 0  # Add messages sent, and of them read by the engine as of its last report
        self._read_by_engine = 0
        self._ids = itertools.count()
        self._gone: str | None = None
        self._on_lost = on_lost
        # Requests and aborts are sent from a thread of their own: a send blocks while the pipe is full,
        # and the loop blocked in one would stop reading the engine's reports, which the engine may
        # itself be blocked writing (each side waiting for the other to read). None ends the thread.
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="streamsd-engine-pipe", daemon=True)

    @classmethod
    async def launch(cls, factory: EngineFactory, stream_interval: StreamInterval, on_lost: OnLost) -> ProcessEngine:
        """Starts the engine process and returns once its engine is ready; EngineProcessError with the
        engine's message if it cannot load. `factory` must pickle (a module-level function, or a
        functools.partial of one)."""
        ctx = mp.get_context("spawn")  # a fork would copy this process's threads and event loop
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=run_core_process, name="streamsd-engine",
                              args=(theirs, factory, stream_interval, logging.getLogger().level))
        process.start()
        theirs.close()
        try:
            first = await asyncio.to_thread(_first_message, ours, process)
            if isinstance(first, Failed):
                raise EngineProcessError(first.message)
            text = await asyncio.to_thread(ChatText.load, first.info.model_dir, first.info.chat_template)
        except BaseException:
            ours.close()
            process.kill()  # still loading, or failed: nothing to finish
            await asyncio.to_thread(process.join)
            raise
        return cls(process, ours, first.info, text, on_lost)

    async def start(self) -> None:
        self._writer.start()
        watch(self._conn, self._read)

    async def close(self) -> None:
        if self._gone is None:
            self._gone = "the server is closing"
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._outbox.put(Shutdown())
        self._outbox.put(None)
        await asyncio.to_thread(_stop, self._process)
        if self._writer.is_alive():
            await asyncio.to_thread(self._writer.join)
        self._conn.close()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               queue: asyncio.Queue[RequestOutput] | None = None) -> tuple[str, asyncio.Queue[RequestOutput]]:
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ParamError("id", f"request id {rid!r} is already running")
        check_token_ids(prompt_ids, params, self.info.vocab_size)
        check_fits(len(prompt_ids), params.max_tokens, self.info.max_model_len)
        if self._gone is not None:
            raise EngineLost(self._gone)
        self._outbox.put(Add(rid, list(prompt_ids), params))
        self._sent += 1
        return rid, self._open(rid, queue)

    def abort(self, request_id: str) -> None:
        if request_id in self._streams and self._gone is None:
            self._outbox.put(Abort(request_id))

    def load(self) -> EngineLoad:
        return self._load

    @property
    def num_waiting(self) -> int:
        """The engine's waiting requests as last reported, and those sent that it had not read then."""
        return self._load.waiting + self._sent - self._read_by_engine

    def compile_grammar(self, constraint: Constraint) -> Any:
        return self._grammars.compile(constraint)

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except OSError:  # the engine process is gone: `_read` reports it
                return

    def _read(self) -> None:
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                if isinstance(msg, Report):
                    self._report(msg)
                elif isinstance(msg, Failed):
                    self._lose(msg.message)
                    return
        except (EOFError, OSError):
            self._lose(f"the engine process exited{_status(self._process)}")

    def _report(self, report: Report) -> None:
        self._load, self._read_by_engine = report.load, report.requests_read
        for step in report.steps:
            for observe_step in self.step_observers:
                observe_step(step)
        for out in report.outputs:
            for observe in self.observers:
                observe(out)
            self._deliver(out)

    def _lose(self, message: str) -> None:
        """The engine is gone: every open stream ends with its message, and the server is told."""
        if self._gone is not None:
            return
        self._gone = message
        log.error("%s", message)
        asyncio.get_running_loop().remove_reader(self._conn.fileno())
        for rid in list(self._streams):
            self._deliver(RequestOutput.ended(rid, FinishReason.ERROR, message))
        self._on_lost(message)


def _status(process: BaseProcess) -> str:
    """How the process ended, once it is reaped: its exit status or the signal that killed it."""
    code = process.exitcode
    if code is None:
        return ""
    return f" (killed by signal {-code})" if code < 0 else f" (status {code})"


def _first_message(conn: Connection, process: BaseProcess) -> Ready | Failed:
    """The engine's first word: Ready, or Failed (also when the process died before saying either)."""
    try:
        msg: FromEngine = conn.recv()
    except (EOFError, OSError):
        process.join(CLOSE_TIMEOUT_S)
        return Failed(f"the engine process exited while loading{_status(process)}")
    assert isinstance(msg, Ready | Failed), f"an engine's first message is Ready or Failed, not {msg!r}"
    return msg


def _stop(process: BaseProcess) -> None:
    process.join(CLOSE_TIMEOUT_S)
    if process.is_alive():
        log.warning("the engine process did not stop in %.0fs; killing it", CLOSE_TIMEOUT_S)
        process.kill()
        process.join()

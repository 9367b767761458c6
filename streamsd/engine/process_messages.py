"""What a server and its engine process say to each other over their pipe (pickled, one message a
`send`): requests and aborts one way; the engine's readiness, then one report a step, the other."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from streamsd.engine.core import RequestOutput
from streamsd.engine.info import EngineInfo, EngineLoad, StepReport
from streamsd.request import SamplingParams


@dataclass(frozen=True, slots=True)
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine could not be built, or can no longer run (a tensor-parallel rank was lost)."""

    message: str


@dataclass(frozen=True, slots=True)
class Report:
    """The deltas handed over since the last report, the steps executed, and the load after them."""

    outputs: list[RequestOutput]
    steps: list[StepReport]
    load: EngineLoad
    requests_read: int  # Add messages the engine has read in all: the server counts those still in the pipe


ToEngine = Add | Abort | Shutdown
FromEngine = Ready | Failed | Report


def watch(conn: Connection, read: Callable[[], None]) -> None:
    """Calls `read` on the running loop whenever `conn` has data to read.

    uvloop (libuv) makes a descriptor it watches non-blocking, and a non-blocking pipe breaks
    Connection's whole messages: `send` of a report larger than the room left, or `recv` of one only
    partly written yet, fails halfway with BlockingIOError, which reads as a lost peer. Both sides of
    this pipe want each message whole (the server's sends come from a thread of their own; a report
    being read is being written at that moment), so the descriptor is made blocking again."""
    fd = conn.fileno()
    asyncio.get_running_loop().add_reader(fd, read)
    os.set_blocking(fd, True)

"""What a server and its engine process say to each other over their pipe (pickled, one message a
`send`): requests and aborts one way; the engine's readiness, then one report a step, the other."""

from __future__ import annotations

from dataclasses import dataclass

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

"""What every route shares: the engine (once loaded), the served name, the lifecycle flags, and
the translation from wire fields to engine parameters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamsd.config import SpecConfig, StreamInterval
from streamsd.engine.client import EngineClient, EngineLost
from streamsd.engine.core import Refusal, RequestOutput
from streamsd.engine.generation_defaults import GenerationDefaults
from streamsd.request import ParamError, SamplingParams, SpecStats
from streamsd.server.protocol import SamplingFields
from streamsd.server.structured import constraint_of
from streamsd.server.unsupported import unsupported_field

if TYPE_CHECKING:
    from streamsd.server.auth import ApiKeys
    from streamsd.server.prompts import PromptEncoder


# What a 429 asks a client to wait: a step or two frees queue slots, and the openai client honours it.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error the client caused or must know about, rendered OpenAI-style."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                             405: "method_not_allowed", 413: "request_too_large", 429: "queue_full",
                             503: "unavailable"}.get(status, "internal_error")
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def overloaded(cls, message: str) -> ApiError:
        """The whole server's queue is full: not this client's fault, worth a retry shortly."""
        return cls(429, message, type_="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class ServerState:
    served_model_name: str
    api_keys: ApiKeys | None = None
    max_queue: int = 1024
    drain_timeout: float = 30.0
    stream_interval: StreamInterval = 1  # tokens a streamed answer's chunks gather (engine/async_engine.py)
    engine: EngineClient | None = None
    prompts: PromptEncoder | None = None
    load_error: str | None = None
    system_fingerprint: str | None = None  # set with the engine (fingerprint.py)
    draining: bool = False
    started: float = field(default_factory=time.time)

    def fail(self, message: str) -> None:
        """The engine cannot serve (it failed to load, or a rank of its group was lost): /health says
        why, and the server exits."""
        self.load_error = message

    def ready_engine(self) -> EngineClient:
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if self.load_error is not None or self.engine is None:  # an engine lost while serving: the server is exiting
            raise ApiError(503, self.load_error or "the model is still loading")
        return self.engine

    def ready(self) -> tuple[EngineClient, PromptEncoder]:
        engine = self.ready_engine()
        assert self.prompts is not None, "set with the engine"
        return engine, self.prompts

    def check_model(self, name: str | None) -> None:
        """A request may leave the model out; if it names one, it must be the served one."""
        if name and name != self.served_model_name:
            raise self.unknown_model(name)

    def unknown_model(self, name: str) -> ApiError:
        return ApiError(404, f"the model '{name}' does not exist; this server serves '{self.served_model_name}'",
                        param="model", code="model_not_found")

    def check_queue(self, engine: EngineClient) -> None:
        if engine.num_waiting >= self.max_queue:
            raise ApiError.overloaded("too many requests are waiting; retry later")


def sampling_params(f: SamplingFields, defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """The request's fields; a sampling field it leaves out takes the model's default (`defaults`)."""
    refusal = unsupported_field(f)
    if refusal is not None:
        raise ApiError(400, refusal.message, param=refusal.param)
    top_n = None
    if f.logprobs is True or (isinstance(f.logprobs, int) and not isinstance(f.logprobs, bool)):
        top_n = f.top_logprobs or 0 if f.logprobs is True else int(f.logprobs)
    spec = f.speculative
    try:
        return defaults.sampling_params(
            temperature=f.temperature,
            top_p=f.top_p,
            top_k=None if f.top_k is None else max(f.top_k, 0),
            min_p=f.min_p,
            repetition_penalty=f.repetition_penalty,
            presence_penalty=f.presence_penalty or 0.0,
            frequency_penalty=f.frequency_penalty or 0.0,
            logit_bias=f.logit_bias or None,
            max_tokens=next((m for m in (f.max_completion_tokens, f.max_tokens) if m is not None), 256),
            min_tokens=f.min_tokens or 0,
            seed=f.seed,
            stop=f.stop,
            stop_token_ids=f.stop_token_ids,
            ignore_eos=f.ignore_eos,
            logprobs=top_n,
            speculative=None if spec is None else spec.enabled,
            num_speculative_tokens=None if spec is None else spec.num_tokens,
            draft_greedy_threshold=None if spec is None else spec.draft_greedy_threshold,
            constraint=constraint_of(f.response_format, f.guided_regex),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), param=exc.param if isinstance(exc, ParamError) else None) from exc


async def compile_constraint(engine: EngineClient, params: SamplingParams) -> None:
    """Compiles the request's grammar on a thread (the engine's compiler caches it for the worker), so
    that one that cannot be compiled is refused before the request is admitted."""
    if params.constraint is None:
        return
    try:
        await asyncio.to_thread(engine.compile_grammar, params.constraint)
    except ParamError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc


def admit(engine: EngineClient, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
          param: str = "prompt", queue: asyncio.Queue[RequestOutput] | None = None):
    from streamsd.sched.scheduler import QueueFullError

    try:
        return engine.submit(prompt_ids, params, request_id, queue)
    except EngineLost as exc:
        raise ApiError(503, str(exc)) from exc
    except QueueFullError as exc:
        raise refused(Refusal(str(exc), None)) from exc
    except ValueError as exc:
        raise refused(Refusal(str(exc), exc.param if isinstance(exc, ParamError) else param)) from exc


def refused(r: Refusal) -> ApiError:
    """The error a refused request answers with: 429 when the engine is overloaded, else a 400 naming the field."""
    if r.param is None:
        return ApiError.overloaded(r.message)
    return ApiError(400, r.message, param=r.param,
                    code="context_length_exceeded" if "context window" in r.message else None)


def failed(out: RequestOutput) -> ApiError:
    """The error of a request that ended with one (`out.error`): refused, or failed while it ran."""
    return refused(out.refusal) if out.refusal is not None else ApiError(500, out.error or "internal error")


def finish_reason(out: RequestOutput) -> str:
    # An engine abort reaches a client that is still listening only when the server cut the request
    # (the drain on shutdown; a client's own cancel or hang-up never reads its end): "abort", as vLLM
    # says, so that a cut answer never looks complete.
    return "abort" if out.finish_reason == "cancelled" else (out.finish_reason or "stop")


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage; speculation in its predicted-output fields (drafts the target accepted, and
    drafted but rejected) and in detail under `speculative`."""
    stats = out.stats or SpecStats()
    return {
        "prompt_tokens": out.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},  # from the prefix cache
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "completion_tokens_details": {"accepted_prediction_tokens": stats.accepted,
                                      "rejected_prediction_tokens": stats.drafted - stats.accepted},
        "speculative": stats.as_dict(),
    }


def token_entries(out: RequestOutput) -> list[dict[str, Any]]:
    return [{"id": t.id, "text": t.text, "draft": t.draft} for t in out.tokens]


def speculation(spec: SpecConfig, exact: bool) -> dict[str, Any]:
    """How the server speculates, for clients that name the proposer (the web UI's legend) and say
    what speculation guarantees (`exact`: the exact mode, where answers equal plain decoding's)."""
    if not spec.enabled:
        return {"method": "none", "num_tokens": 0, "draft_model": None, "tree": None, "exact": exact}
    draft = None
    if spec.method == "draft" and spec.draft_model:  # named like the served model: a directory by its last part
        draft = Path(spec.draft_model).name or spec.draft_model
    return {"method": spec.method, "num_tokens": spec.num_tokens, "draft_model": draft,
            "tree": str(spec.tree) if spec.tree else None, "exact": exact}

"""What every route shares: the engine (once loaded), the served name, the lifecycle flags, and
the translation from wire fields to engine parameters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from streamsd.core import RequestOutput
from streamsd.engine import AsyncEngine
from streamsd.generation_defaults import GenerationDefaults
from streamsd.request import SamplingParams, SpecStats
from streamsd.server.protocol import ChatMessage, SamplingFields


class ApiError(Exception):
    """An error the client caused or must know about, rendered OpenAI-style."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
                             405: "method_not_allowed", 413: "request_too_large", 429: "queue_full",
                             503: "unavailable"}.get(status, "internal_error")
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class ServerState:
    served_model_name: str
    api_key: str | None = None
    max_queue: int = 1024
    drain_timeout: float = 30.0
    engine: AsyncEngine | None = None
    load_error: str | None = None
    draining: bool = False
    started: float = field(default_factory=time.time)

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        if self.engine is None:
            raise ApiError(503, self.load_error or "the model is still loading")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name and name != self.served_model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.served_model_name}'",
                           param="model", code="model_not_found")

    def check_queue(self, engine: AsyncEngine) -> None:
        if len(engine.core.scheduler.waiting) >= self.max_queue:
            raise ApiError(429, "too many requests are waiting; retry later")


def sampling_params(f: SamplingFields, defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """The request's fields; a sampling field it leaves out takes the model's default (`defaults`)."""
    if f.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if f.repetition_penalty not in (None, 1.0):
        raise ApiError(400, "repetition_penalty is not supported (it would break exact speculation); leave it "
                            "out or set it to 1", param="repetition_penalty")
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
            max_tokens=f.max_completion_tokens or f.max_tokens or 256,
            min_tokens=f.min_tokens or 0,
            seed=f.seed,
            stop=f.stop,
            stop_token_ids=f.stop_token_ids,
            ignore_eos=f.ignore_eos,
            logprobs=top_n,
            speculative=None if spec is None else spec.enabled,
            num_speculative_tokens=None if spec is None else spec.num_tokens,
            draft_greedy_threshold=None if spec is None else spec.draft_greedy_threshold,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from exc


def chat_prompt(engine: AsyncEngine, messages: list[ChatMessage]) -> list[int]:
    try:
        return engine.core.encode_chat([{"role": m.role, "content": m.text()} for m in messages])
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    except Exception as exc:  # chat templates raise their own errors for unsupported role orders
        raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc


def admit(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None):
    from streamsd.scheduler import QueueFullError

    try:
        return engine.submit(prompt_ids, params, request_id)
    except QueueFullError as exc:
        raise ApiError(429, str(exc)) from exc
    except ValueError as exc:
        raise ApiError(400, str(exc), param=getattr(exc, "param", None) or "prompt",
                       code="context_length_exceeded" if "context window" in str(exc) else None) from exc


def usage(out: RequestOutput) -> dict[str, Any]:
    stats = out.stats or SpecStats()
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "speculative": stats.as_dict(),
    }


def token_entries(out: RequestOutput) -> list[dict[str, Any]]:
    return [{"id": t.id, "text": t.text, "draft": t.draft} for t in out.tokens]

"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (SSE or not), /v1/models[/{id}]."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from streamsd.engine.async_engine import AsyncEngine
from streamsd.engine.core import RequestOutput
from streamsd.request import SamplingParams
from streamsd.server.body import read_limited
from streamsd.server.disconnect import unless_disconnected
from streamsd.server.prompts import PromptEncoder
from streamsd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_decoder,
    completion_decoder,
    encoder,
)
from streamsd.server.state import (
    ApiError,
    ServerState,
    admit,
    finish_reason,
    sampling_params,
    speculation,
    token_entries,
    usage,
)


async def read_body(request: Request, decoder: msgspec.json.Decoder) -> Any:
    raw = await read_limited(request)
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        hint = "; this server does not implement it" if "unknown field" in str(exc) else ""
        raise ApiError(400, f"invalid request: {exc}{hint}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON: {exc}") from exc


def _param_of(message: str) -> str | None:
    # msgspec names the field as `$.field` or `$.field[0].x` at the end of its message, and a
    # top-level field it does not know as "unknown field `name`" alone.
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    if "unknown field `" in message:
        return message.split("unknown field `", 1)[1].split("`", 1)[0]
    return None


def _logprob_entry(engine: AsyncEngine, tok: Any) -> dict[str, Any]:
    decode = engine.core.tokenizer.decode
    return {
        "token": tok.text,
        "logprob": tok.logprob,
        "bytes": list(tok.text.encode()),
        "top_logprobs": [{"token": (s := decode([i])), "logprob": lp, "bytes": list(s.encode())}
                         for i, lp in (tok.top_logprobs or [])],
    }


class _Completion:
    """Turns engine deltas into one of the two OpenAI object shapes."""

    def __init__(self, state: ServerState, engine: AsyncEngine, chat: bool, include_usage: bool, logprobs: bool):
        self.state, self.engine, self.chat = state, engine, chat
        self.include_usage, self.logprobs = include_usage, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.served_model_name,
                "system_fingerprint": self.state.system_fingerprint}

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [_logprob_entry(self.engine, t) for t in out.tokens]}
        return {
            "tokens": [t.text for t in out.tokens],
            "token_logprobs": [t.logprob for t in out.tokens],
            "top_logprobs": [{e["token"]: e["logprob"] for e in _logprob_entry(self.engine, t)["top_logprobs"]}
                             for t in out.tokens],
        }

    def chunk(self, out: RequestOutput, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(out),
                                  "finish_reason": finish_reason(out) if out.finished else None,
                                  "streamsd": {"tokens": token_entries(out)}}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": out.text} if first else {"content": out.text}
        else:
            choice["text"] = out.text
        return {**self._base(True), "choices": [choice]}

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        last = outs[-1]
        text = "".join(o.text for o in outs)
        tokens = [t for o in outs for t in o.tokens]
        merged = RequestOutput(last.request_id, [t.id for t in tokens], text, tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(last), "logprobs": self._logprobs(merged),
                                  "streamsd": {"tokens": token_entries(merged)}}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._base(False), "choices": [choice], "usage": usage(last)}

    async def sse(self, head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        first = True
        async for out in _chain(head, rest):
            if out.error:
                yield _event(ApiError(500, out.error).body())
                break
            if out.text or out.finished or out.tokens or first:
                yield _event(self.chunk(out, first))
                first = False
            if out.finished and self.include_usage:
                yield _event({**self._base(True), "choices": [], "usage": usage(out)})
        yield b"data: [DONE]\n\n"


async def _chain(head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield head
    async for out in rest:
        yield out


def _never_ran(out: RequestOutput) -> bool:
    return out.finished and out.finish_reason == "cancelled" and out.completion_tokens == 0


NEVER_RAN = "the server shut down before this request ran; send it again"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + encoder.encode(obj) + b"\n\n"


async def _serve(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.streamsd
    engine, prompts = state.ready()
    body: ChatCompletionRequest | CompletionRequest = await read_body(request, chat_decoder if chat else completion_decoder)
    state.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    params = sampling_params(body, engine.core.rt.generation_defaults)
    return await unless_disconnected(request.receive, _answer(state, engine, prompts, body, params, chat))


async def _answer(state: ServerState, engine: AsyncEngine, prompts: PromptEncoder,
                  body: ChatCompletionRequest | CompletionRequest, params: SamplingParams, chat: bool) -> Response:
    if isinstance(body, ChatCompletionRequest):
        prompt_ids = await prompts.chat(body.messages, params.max_tokens)
    elif isinstance(body.prompt, str):
        prompt_ids = await prompts.text(body.prompt, params.max_tokens)
    elif all(isinstance(x, int) for x in body.prompt):
        prompt_ids = [int(x) for x in body.prompt]
    elif len(body.prompt) == 1:
        prompt_ids = await prompts.text(str(body.prompt[0]), params.max_tokens)
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list with one string", param="prompt")
    state.check_queue(engine)
    rid, queue = admit(engine, prompt_ids, params, param="messages" if chat else "prompt")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    comp = _Completion(state, engine, chat, include_usage, params.logprobs is not None)
    outputs = engine.stream(rid, queue)
    if body.stream:
        # The status goes out with the first output: a request the drain cut before it ran gets a 503.
        head = await anext(outputs)
        if head.error:
            raise ApiError(500, head.error)
        if _never_ran(head):
            raise ApiError(503, NEVER_RAN)
        return StreamingResponse(comp.sse(head, outputs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outs = [out async for out in outputs]
    if outs[-1].error:
        raise ApiError(500, outs[-1].error)
    if _never_ran(outs[-1]):
        raise ApiError(503, NEVER_RAN)
    return Response(encoder.encode(comp.full(outs)), media_type="application/json")


async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    max_len = engine.core.scheduler.cfg.max_model_len if engine else None
    return {"id": state.served_model_name, "object": "model", "created": int(state.started), "owned_by": "streamsd",
            "max_model_len": max_len, "speculation": speculation(engine.core.spec) if engine else None}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.streamsd)]})


async def model(request: Request) -> Response:
    state: ServerState = request.app.state.streamsd
    name = request.path_params["model_id"]
    if name != state.served_model_name:
        raise state.unknown_model(name)
    return JSONResponse(_model_card(state))

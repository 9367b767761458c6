"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (SSE or not), /v1/models[/{id}]."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from streamsd.engine.client import EngineClient
from streamsd.engine.core import RequestOutput, joined
from streamsd.request import SamplingParams
from streamsd.server.best_of import check_best_of, pick_best, ranked_params
from streamsd.server.body import read_limited
from streamsd.server.choices import Fanout, admit_all, check_choices, summed
from streamsd.server.disconnect import unless_disconnected
from streamsd.server.prompt_logprobs import by_text, prompt_logprobs
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
    compile_constraint,
    failed,
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


def _logprob_entry(engine: EngineClient, tok: Any) -> dict[str, Any]:
    decode = engine.text.tokenizer.decode
    return {
        "token": tok.text,
        "logprob": tok.logprob,
        "bytes": list(tok.text.encode()),
        "top_logprobs": [{"token": (s := decode([i])), "logprob": lp, "bytes": list(s.encode())}
                         for i, lp in (tok.top_logprobs or [])],
    }


class _Completion:
    """Turns engine deltas into one of the two OpenAI object shapes, a choice per engine request."""

    def __init__(self, state: ServerState, engine: EngineClient, chat: bool, include_usage: bool, logprobs: bool,
                 fanout: Fanout, echoes: list[str] | None = None, prompt_ids: list[list[int]] | None = None):
        self.state, self.engine, self.chat = state, engine, chat
        self.include_usage, self.logprobs = include_usage, logprobs
        self.fanout, self.index = fanout, fanout.index()
        # Completions with echo: each choice's text starts with its prompt's.
        self.echo = [echoes[i // fanout.n] for i in range(len(fanout.rids))] if echoes is not None else None
        self.offset = [len(self.echo[i]) if self.echo else 0 for i in range(len(fanout.rids))]
        # Echo with logprobs: each choice's logprobs start with its prompt's tokens.
        self.prompt_ids = prompt_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.served_model_name,
                "system_fingerprint": self.state.system_fingerprint}

    def _logprobs(self, out: RequestOutput, index: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [_logprob_entry(self.engine, t) for t in out.tokens]}
        offsets = []
        for t in out.tokens:  # where each token starts in the choice's text, as vLLM counts
            offsets.append(self.offset[index])
            self.offset[index] += len(t.text)
        done: dict[str, list[Any]] = {
            "tokens": [t.text for t in out.tokens],
            "token_logprobs": [t.logprob for t in out.tokens],
            "top_logprobs": [by_text(self.engine.text.tokenizer.decode, t.top_logprobs or []) for t in out.tokens],
            "text_offset": offsets,
        }
        if self.prompt_ids is None or out.prompt_logprobs is None:
            return done
        prompt = prompt_logprobs(self.engine.text.tokenizer.decode, self.prompt_ids[index // self.fanout.n],
                                 out.prompt_logprobs)
        return {key: prompt[key] + done[key] for key in done}

    def _choice(self, out: RequestOutput, index: int, first: bool, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": self._logprobs(out, index), "finish_reason": finish,
                                  "streamsd": {"tokens": token_entries(out)}}
        if not self.chat:  # a chat choice's delta or message is its caller's
            choice["text"] = (self.echo[index] if self.echo and first else "") + out.text
        return choice

    def chunk(self, out: RequestOutput, first: bool) -> dict[str, Any]:
        index = self.index[out.request_id]
        choice = self._choice(out, index, first, finish_reason(out) if out.finished else None)
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": out.text} if first else {"content": out.text}
        return {**self._base(True), "choices": [choice]}

    def full(self, outs: list[RequestOutput], every: list[RequestOutput] | None = None,
             per_prompt: int = 0) -> dict[str, Any]:
        """`every`: all candidates' final outputs, `per_prompt` of each prompt, when the choices
        are the best of more (best_of.py): usage counts them all."""
        by_index: list[list[RequestOutput]] = [[] for _ in self.fanout.rids]
        for o in outs:
            by_index[self.index[o.request_id]].append(o)
        choices, finals = [], []
        for index, mine in enumerate(by_index):
            last, merged = mine[-1], joined(mine)
            choice = self._choice(merged, index, True, finish_reason(last))
            if self.chat:
                choice["message"] = {"role": "assistant", "content": merged.text}
            choices.append(choice)
            finals.append(last)
        billed = summed(every, per_prompt) if every is not None else summed(finals, self.fanout.n)
        return {**self._base(False), "choices": choices, "usage": usage(billed)}

    async def sse(self, head: RequestOutput, rest: AsyncGenerator[RequestOutput]) -> AsyncIterator[bytes]:
        try:
            async for event in self._events(head, rest):
                yield event
        finally:
            await rest.aclose()  # an error or a hang-up ends every answer still running, not only one

    async def _events(self, head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        """The stream's events; the last answer's final chunk, the usage and [DONE] go out as one write
        (each write is a trip through the ASGI server to the socket on the event loop)."""
        started: set[int] = set()
        finals: list[RequestOutput | None] = [None] * len(self.fanout.rids)  # in choice order: summed reads it so
        running = len(finals)
        tail = b""
        async for out in _chain(head, rest):
            if out.error:
                tail = _event(failed(out).body())
                break
            index = self.index[out.request_id]
            first = index not in started
            if out.finished:
                finals[index] = out
                running -= 1
            if out.text or out.finished or out.tokens or first:
                started.add(index)
                event = _event(self.chunk(out, first))
                if not running:
                    tail = event
                else:
                    yield event
        if self.include_usage and not running:
            done = [f for f in finals if f is not None]
            tail += _event({**self._base(True), "choices": [], "usage": usage(summed(done, self.fanout.n))})
        yield tail + b"data: [DONE]\n\n"


async def _chain(head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield head
    async for out in rest:
        yield out


def _never_ran(out: RequestOutput) -> bool:
    return out.finished and out.finish_reason == "cancelled" and out.completion_tokens == 0


NEVER_RAN = "the server shut down before this request ran; send it again"


# Python's str.splitlines, which httpx's `iter_lines` (and requests' with `decode_unicode`) reads a stream
# with, also ends a line at NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR, which JSON leaves raw inside
# strings: a token holding one would cut its event in two there. Escaped, any JSON parser reads the same.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _event(obj: dict[str, Any]) -> bytes:
    data = encoder.encode(obj)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:  # UTF-8 lead bytes: these sequences are those characters and nothing else
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


async def _serve(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.streamsd
    engine, prompts = state.ready()
    body: ChatCompletionRequest | CompletionRequest = await read_body(request, chat_decoder if chat else completion_decoder)
    state.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    params = sampling_params(body, engine.info.generation_defaults)
    await compile_constraint(engine, params)
    return await unless_disconnected(request.receive, _answer(state, engine, prompts, body, params, chat))


def _prompt_list(prompt: str | list[int | str | list[int]]) -> list[str | list[int]]:
    """The completions prompt as its prompts: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    ids = [int(x) for x in prompt if isinstance(x, int)]
    if len(ids) == len(prompt):
        return [ids]
    if ids:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                       param="prompt")
    return [x for x in prompt if not isinstance(x, int)]


async def _answer(state: ServerState, engine: EngineClient, prompts: PromptEncoder,
                  body: ChatCompletionRequest | CompletionRequest, params: SamplingParams, chat: bool) -> Response:
    echoes: list[str] | None = None
    scored: list[list[int]] | None = None
    candidates = body.n
    if isinstance(body, ChatCompletionRequest):
        check_choices(body.n, body.n, 1)
        prompt_ids = [await prompts.chat(body.messages, params.max_tokens)]
    else:
        listed = _prompt_list(body.prompt)
        candidates = check_best_of(body.n, body.best_of, body.stream)
        check_choices(body.n, candidates, len(listed))
        prompt_ids = [await prompts.text(p, params.max_tokens) if isinstance(p, str) else p for p in listed]
        if body.echo:  # a token-id prompt echoes as its decoded text
            echoes = [p if isinstance(p, str) else engine.text.tokenizer.decode(p) for p in listed]
        if params.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 generates nothing: it is only accepted with echo (the prompt, and with "
                                "logprobs its scores)", param="max_tokens")
        if body.echo and params.logprobs is not None:  # the prompt's tokens are scored too
            scored = prompt_ids
            params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    state.check_queue(engine)
    fanout = await admit_all(engine, prompt_ids, ranked_params(params, body.n, candidates), candidates,
                             param="messages" if chat else "prompt")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    outputs = fanout.outputs(engine)
    if body.stream:
        # The status goes out with the first output: a request the drain cut before it ran gets a 503.
        head = await anext(outputs)
        if head.error:
            await outputs.aclose()
            raise failed(head)
        if _never_ran(head):
            await outputs.aclose()
            raise ApiError(503, NEVER_RAN)
        comp = _Completion(state, engine, chat, include_usage, params.logprobs is not None, fanout, echoes, scored)
        return StreamingResponse(comp.sse(head, outputs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outs = [out async for out in outputs]
    finals = [o for o in outs if o.finished]
    for f in finals:
        if f.error:
            raise failed(f)
    if any(_never_ran(f) for f in finals):
        raise ApiError(503, NEVER_RAN)
    every: list[RequestOutput] | None = None
    if candidates > body.n:
        final_of = {f.request_id: f for f in finals}
        every = [final_of[rid] for rid in fanout.rids]
        fanout, outs = pick_best(fanout, outs, body.n)
    comp = _Completion(state, engine, chat, include_usage, params.logprobs is not None, fanout, echoes, scored)
    return Response(encoder.encode(comp.full(outs, every, candidates)), media_type="application/json")


async def chat_completions(request: Request) -> Response:
    return await _serve(request, chat=True)


async def completions(request: Request) -> Response:
    return await _serve(request, chat=False)


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    max_len = engine.info.max_model_len if engine else None
    return {"id": state.served_model_name, "object": "model", "created": int(state.started), "owned_by": "streamsd",
            "max_model_len": max_len, "speculation": speculation(engine.info.spec, engine.info.exact) if engine else None}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.streamsd)]})


async def model(request: Request) -> Response:
    state: ServerState = request.app.state.streamsd
    name = request.path_params["model_id"]
    if name != state.served_model_name:
        raise state.unknown_model(name)
    return JSONResponse(_model_card(state))

"""The WebSocket protocol at /v1/ws: many generations multiplexed on one socket by client id."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from streamsd.server.auth import PROTOCOL, ApiKeys
from streamsd.server.protocol import WsCancel, WsGenerate, encoder, ws_decoder
from streamsd.server.state import (
    ApiError,
    ServerState,
    admit,
    compile_constraint,
    failed,
    finish_reason,
    sampling_params,
    token_entries,
    usage,
)


class Session:
    def __init__(self, ws: WebSocket, state: ServerState, key_name: str | None = None):
        self.ws, self.state, self.key_name = ws, state, key_name
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.send_lock = asyncio.Lock()

    async def send(self, obj: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.ws.send_text(encoder.encode(obj).decode())

    async def error(self, rid: str | None, message: str, code: str = "invalid_request") -> None:
        await self.send({"type": "error", "id": rid, "error": {"message": message, "code": code}})

    async def handle(self, raw: str) -> None:
        try:
            msg = ws_decoder.decode(raw)
        except msgspec.ValidationError as exc:
            await self.error(_id_of(raw), f"invalid message: {exc}")
            return
        except msgspec.DecodeError as exc:
            await self.error(None, f"malformed JSON: {exc}")
            return
        if isinstance(msg, WsCancel):
            task = self.tasks.get(msg.id)
            if task is None:
                await self.error(msg.id, "no running request has this id", "unknown_id")
            else:
                task.cancel()
            return
        await self.start(msg)

    async def start(self, msg: WsGenerate) -> None:
        if msg.id in self.tasks:
            await self.error(msg.id, "a request with this id is already running", "duplicate_id")
            return
        if self.key_name is not None:
            self.ws.app.state.metrics.key_requests.labels(key=self.key_name).inc()
        try:
            engine, prompts = self.state.ready()
            self.state.check_model(msg.model)
            params = sampling_params(msg, engine.info.generation_defaults)
            await compile_constraint(engine, params)
            if (msg.messages is None) == (msg.prompt is None):
                raise ApiError(400, "give exactly one of messages or prompt", param="messages")
            if msg.messages:
                ids = await prompts.chat(msg.messages, params.max_tokens)
            else:
                ids = await prompts.text(msg.prompt or "", params.max_tokens)
            self.state.check_queue(engine)
            rid, queue = admit(engine, ids, params, param="messages" if msg.messages else "prompt")
        except ApiError as exc:
            await self.error(msg.id, exc.message, exc.code)
            return
        self.tasks[msg.id] = asyncio.create_task(self.pump(msg.id, rid, queue, len(ids)))

    async def pump(self, cid: str, rid: str, queue: Any, prompt_tokens: int) -> None:
        engine = self.state.engine
        assert engine is not None
        t0, ttft, steps, emitted = time.monotonic(), None, 0, 0
        try:
            async for out in engine.stream(rid, queue):
                if out.error:
                    await self.error(cid, out.error, failed(out).code)
                    return
                steps += 1
                emitted += len(out.tokens)
                if out.tokens or out.text:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    # `step`: what this verify step drafted and the target accepted (drafted 0: it did
                    # not speculate), so that a client can chart the steps as they come.
                    await self.send({"type": "delta", "id": cid, "text": out.text, "tokens": token_entries(out),
                                     "step": {"drafted": out.step_drafted, "accepted": out.step_accepted}})
                if out.finished:
                    await self.send({"type": "done", "id": cid, "finish_reason": finish_reason(out),
                                     "usage": usage(out),
                                     "timing": {"ttft_s": ttft, "elapsed_s": time.monotonic() - t0, "steps": steps}})
        except asyncio.CancelledError:
            # engine.stream's cleanup aborted the request; tell the client unless it is gone.
            with contextlib.suppress(Exception):
                partial = {"prompt_tokens": prompt_tokens, "completion_tokens": emitted,
                           "total_tokens": prompt_tokens + emitted, "speculative": None}
                await self.send({"type": "done", "id": cid, "finish_reason": "cancelled", "usage": partial,
                                 "timing": {"ttft_s": ttft, "elapsed_s": time.monotonic() - t0, "steps": steps}})
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            self.tasks.pop(cid, None)

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def _id_of(raw: str) -> str | None:
    with contextlib.suppress(Exception):
        obj = msgspec.json.decode(raw)
        if isinstance(obj, dict) and isinstance(obj.get("id"), str):
            return obj["id"]
    return None


def _key_name(ws: WebSocket, keys: ApiKeys) -> str | None:
    """The name of the key the handshake carries: in `Authorization: Bearer`, in a subprotocol
    (browsers can set no header), or in an `api_key` query parameter (redacted from logs, but a
    URL travels further than a header: proxies' logs, histories)."""
    return (keys.bearer(ws.headers.get("authorization")) or keys.subprotocol(ws.scope.get("subprotocols", []))
            or keys.match(ws.query_params.get("api_key")))


async def websocket_endpoint(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.streamsd
    key_name = _key_name(ws, state.api_keys) if state.api_keys else None
    if state.api_keys and key_name is None:
        await ws.close(code=1008, reason="invalid API key")
        return
    await ws.accept(subprotocol=PROTOCOL if PROTOCOL in ws.scope.get("subprotocols", []) else None)
    session = Session(ws, state, key_name)
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            if message.get("text") is not None:
                await session.handle(message["text"])
            else:
                await session.error(None, "binary frames are not supported; send JSON text", "unsupported_frame")
    except WebSocketDisconnect:
        pass
    finally:
        await session.close()

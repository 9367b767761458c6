"""The soak's WebSocket iterations: one valid stream per socket (maybe closed or cancelled
mid-way), and malformed frames, each of which must be answered as docs/PROTOCOL.md says."""

from __future__ import annotations

import asyncio
import json
import random
import time

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from streamsd.bench.client import RequestResult, RequestSpec, sampling_fields, stream_ws, ws_url
from streamsd.bench.soak_inputs import SOAK_PROMPTS, BadFrame, pick_bad_frame, soak_spec
from streamsd.bench.soak_tally import Context, Tally

DUPLICATE_GRACE_S = 5.0  # after the stream's `done`, how long the duplicate's answer may lag


def _connect(ctx: Context) -> connect:
    # proxy=None: a loopback soak must never go through an environment proxy.
    return connect(ws_url(ctx.base_url), additional_headers=ctx.headers, proxy=None,
                   open_timeout=ctx.request_timeout)


async def ws_request(ctx: Context, tally: Tally, spec: RequestSpec, index: int, rid: str,
                     mode: str | None, after: int) -> None:
    """One valid stream; `mode` "close" drops the socket, "cancel" sends a cancel, after `after` deltas."""
    tally.transports["ws"] += 1
    try:
        async with _connect(ctx) as ws:
            result = await stream_ws(ws, spec, rid, timeout=ctx.request_timeout,
                                     disconnect_after=after if mode == "close" else None,
                                     cancel_after=after if mode == "cancel" else None)
    except InvalidStatus as exc:
        tally.unexpected_error(f"ws_handshake_{exc.response.status_code}", repr(exc))
        return
    except (InvalidHandshake, OSError, TimeoutError) as exc:
        result = RequestResult.bare("lost", error_kind="ws_connect", message=repr(exc))
    tally.record(result, ctx.answers[index], spec.speculative)


async def bad_ws(ctx: Context, tally: Tally, rng: random.Random, cid: int) -> None:
    rid = f"c{cid}-{tally.started}"
    index = rng.randrange(len(SOAK_PROMPTS))
    spec = soak_spec(index, ctx.model, ctx.max_tokens)
    bad = pick_bad_frame(rng, rid, json.dumps({"type": "generate", "id": rid, **sampling_fields(spec)}))
    tally.transports["ws"] += 1
    try:
        async with _connect(ctx) as ws:
            if bad.expect == "close_1009":
                await _oversized(ws, ctx, tally, bad)
            elif bad.expect == "duplicate":
                await _duplicate(ws, ctx, tally, bad, rid, ctx.answers[index])
            else:
                await _error_then_stream(ws, ctx, tally, bad, spec, rid, ctx.answers[index])
    except (ConnectionClosed, InvalidHandshake, OSError, TimeoutError) as exc:
        tally.unexpected_error("ws_after_bad_frame", f"{bad.name}: {exc!r}")


async def _error_then_stream(ws: ClientConnection, ctx: Context, tally: Tally, bad: BadFrame,
                             spec: RequestSpec, rid: str, answer: str) -> None:
    """The bad frame must draw an `error` and leave the socket usable: a valid request follows."""
    await ws.send(bad.frame)
    is_error = _is_error(await asyncio.wait_for(ws.recv(), ctx.request_timeout))
    tally.bad_input_answer("ws_error" if is_error else "ws_other", is_error, bad.name)
    tally.record(await stream_ws(ws, spec, rid + "-after", timeout=ctx.request_timeout), answer, None)


async def _oversized(ws: ClientConnection, ctx: Context, tally: Tally, bad: BadFrame) -> None:
    await ws.send(bad.frame)
    try:
        await asyncio.wait_for(ws.recv(), ctx.request_timeout)
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd is not None else None
        tally.bad_input_answer(f"ws_close_{code}", code == 1009, bad.name)
        return
    tally.bad_input_answer("ws_other", False, bad.name)


async def _duplicate(ws: ClientConnection, ctx: Context, tally: Tally, bad: BadFrame, rid: str, answer: str) -> None:
    """The same `generate` twice back to back: the second must be refused while the first streams
    on to its exact answer. (Should the first finish before the second is read, both stream.)"""
    await ws.send(bad.frame)
    await ws.send(bad.frame)
    parts: list[str] = []
    errors = dones = 0
    deadline = time.monotonic() + ctx.request_timeout
    try:
        while dones < 2 and not (dones and errors):
            if dones:
                deadline = min(deadline, time.monotonic() + DUPLICATE_GRACE_S)
            msg = json.loads(await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.monotonic())))
            if msg.get("id") != rid:
                continue
            kind = msg.get("type")
            if kind == "delta":
                parts.append(msg.get("text") or "")
            errors += kind == "error"
            dones += kind == "done"
    except TimeoutError:
        if not dones:
            tally.record(RequestResult.bare("lost", "".join(parts), "timeout", "duplicate id"), answer, None)
            return
    text = "".join(parts)
    if errors:
        tally.bad_input_answer("ws_error", True, bad.name)
    elif dones < 2:
        tally.bad_input_answer("ws_ignored", False, bad.name)
    # Two `done`s means the two ran one after the other, so their texts follow each other.
    tally.record(RequestResult.bare("completed", text), answer * max(dones, 1), None)


def _is_error(reply: str | bytes) -> bool:
    try:
        msg = json.loads(reply)
    except ValueError:
        return False
    return isinstance(msg, dict) and msg.get("type") == "error"

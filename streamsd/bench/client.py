"""Streaming clients shared by `bench serve` and `bench soak`: OpenAI SSE over aiohttp and the
`/v1/ws` WebSocket protocol (docs/PROTOCOL.md). Each request yields one `RequestResult` with its
timings (TTFT, inter-chunk gaps, end-to-end) and the server's usage, including speculation.

aiohttp, not httpx: a load generator's own time per chunk lands in every latency it reports. The
default server on an H100, 32 chats at a time streaming ~12,000 tokens/s, read a median time to first
token of 59 ms through httpx (its pure-Python HTTP parsing kept the client's core busy) and 32-35 ms
through aiohttp, which also read 20 % more tokens/s from it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# Outcomes: completed (final event seen), cancelled (WS cancel acknowledged), error (error status or
# error event), disconnected (we cut it on purpose), lost (it ended without a final event).
OUTCOMES = ("completed", "cancelled", "error", "disconnected", "lost")


class BenchError(RuntimeError):
    """The server could not be used at all (no model list, probe request refused, ...)."""


@dataclass(frozen=True)
class RequestSpec:
    endpoint: str
    model: str
    text: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    speculative: bool | None = None  # None: leave the server's default
    history: tuple[tuple[str, str], ...] = ()  # earlier (user, assistant) turns of the chat
    system: str | None = None  # a system prompt (chat) or text prefix (completions) before it all
    response_format: dict[str, Any] | None = None  # structured output (JSON mode or a JSON schema)


@dataclass(frozen=True)
class RequestResult:
    outcome: str
    error_kind: str | None  # "400", "429", "stream_error", "ws_error", "timeout", "transport", ...
    message: str
    text: str
    finish_reason: str | None
    ttft: float | None
    itl: tuple[float, ...]
    e2e: float
    prompt_tokens: int
    output_tokens: int
    spec: dict | None

    @property
    def ok(self) -> bool:
        return self.outcome == "completed"

    @classmethod
    def bare(cls, outcome: str, text: str = "", error_kind: str | None = None, message: str = "") -> RequestResult:
        """A result without timings, for requests judged outside the streaming helpers."""
        return cls(outcome, error_kind, message, text, None, None, (), 0.0, 0, 0, None)


@dataclass
class _Trace:
    """Mutable builder for one request's timings while its stream is read."""

    start: float
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    chunks: int = 0
    tokens: int = 0
    usage: dict | None = None
    finish_reason: str | None = None
    error: str | None = None

    def on_text(self, text: str, ntokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.parts.append(text)
        self.chunks += 1
        self.tokens += ntokens

    def result(self, outcome: str, error_kind: str | None = None, message: str = "") -> RequestResult:
        usage = self.usage or {}
        return RequestResult(
            outcome=outcome,
            error_kind=error_kind,
            message=message,
            text="".join(self.parts),
            finish_reason=self.finish_reason,
            ttft=None if self.first is None else self.first - self.start,
            itl=tuple(self.gaps),
            e2e=time.perf_counter() - self.start,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or self.tokens),
            spec=usage.get("speculative"),
        )


def session(connections: int, stall_timeout: float) -> aiohttp.ClientSession:
    """The benchmarks' HTTP client: up to `connections` kept open, a request failing when no byte comes for
    `stall_timeout` seconds. Never through an environment's proxy (aiohttp's `trust_env` stays off): the
    server itself is measured."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=stall_timeout))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sampling_fields(spec: RequestSpec) -> dict[str, Any]:
    """The fields HTTP bodies and WS `generate` frames share."""
    fields: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": spec.temperature}
    if spec.endpoint == "chat":
        earlier = [{"role": role, "content": text} for turn in spec.history
                   for role, text in zip(("user", "assistant"), turn, strict=True)]
        system = [{"role": "system", "content": spec.system}] if spec.system is not None else []
        fields["messages"] = [*system, *earlier, {"role": "user", "content": spec.text}]
    else:
        fields["prompt"] = spec.text if spec.system is None else f"{spec.system}\n\n{spec.text}"
    if spec.seed is not None:
        fields["seed"] = spec.seed
    if spec.ignore_eos:
        fields["ignore_eos"] = True
    if spec.speculative is not None:
        fields["speculative"] = {"enabled": spec.speculative}
    if spec.response_format is not None:
        fields["response_format"] = spec.response_format
    return fields


def http_body(spec: RequestSpec, *, stream: bool) -> dict[str, Any]:
    body = {"model": spec.model, "stream": stream, **sampling_fields(spec)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def parse_sse_line(line: str) -> dict | str | None:
    """A `data:` line's JSON object, the string "[DONE]", or None for blanks/comments/other fields."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return payload
    return json.loads(payload) if payload else None


async def sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The lines of an event stream as SSE ends them (LF or CR LF). Not a text-mode line reader: like
    str.splitlines it would also end a line at NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR, which a
    server may send raw inside a chunk's JSON strings, and the chunk would read as two broken ones."""
    rest = b""
    async for data in resp.content.iter_any():
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    if rest:
        yield rest.removesuffix(b"\r").decode("utf-8", "replace")


def chunk_text(chunk: dict) -> tuple[str, int, str | None]:
    """(text, token count, finish_reason) of one chat or completions chunk's first choice."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", 0, None
    choice = choices[0]
    delta = choice.get("delta")
    text = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
    provenance = (choice.get("streamsd") or {}).get("tokens")
    ntokens = len(provenance) if isinstance(provenance, list) else (1 if text else 0)
    return text, ntokens, choice.get("finish_reason")


async def stream_sse(
    client: aiohttp.ClientSession,
    base_url: str,
    spec: RequestSpec,
    *,
    headers: dict[str, str] | None = None,
    disconnect_after: int | None = None,
) -> RequestResult:
    """POST one streaming request; cut the connection after `disconnect_after` text chunks if set."""
    trace = _Trace(time.perf_counter())
    url = base_url.rstrip("/") + ROUTES[spec.endpoint]
    try:
        async with client.post(url, json=http_body(spec, stream=True), headers=headers) as resp:
            if resp.status != 200:
                raw = await resp.read()
                return trace.result("error", str(resp.status), error_message(raw))
            async for line in sse_lines(resp):
                event = parse_sse_line(line)
                if event == "[DONE]":
                    if trace.error is not None:
                        return trace.result("error", "stream_error", trace.error)
                    return trace.result("completed")
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    trace.error = json.dumps(event["error"])
                    continue
                if event.get("usage"):
                    trace.usage = event["usage"]
                text, ntokens, finish = chunk_text(event)
                trace.finish_reason = finish or trace.finish_reason
                if text or ntokens:
                    trace.on_text(text, ntokens)
                if disconnect_after is not None and trace.chunks >= disconnect_after:
                    resp.close()  # hang up: the connection goes, not back to the pool
                    return trace.result("disconnected")
            return trace.result("lost", "no_done", "stream ended without data: [DONE]")
    except TimeoutError as exc:
        return trace.result("lost", "timeout", repr(exc))
    except aiohttp.ClientError as exc:
        return trace.result("lost", "transport", repr(exc))
    except json.JSONDecodeError as exc:
        return trace.result("lost", "bad_sse", repr(exc))


def error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")


async def complete(
    client: aiohttp.ClientSession, base_url: str, spec: RequestSpec, headers: dict[str, str] | None = None
) -> str:
    """One non-streaming request's text; raises BenchError on any failure."""
    url = base_url.rstrip("/") + ROUTES[spec.endpoint]
    async with client.post(url, json=http_body(spec, stream=False), headers=headers) as resp:
        raw = await resp.read()
    if resp.status != 200:
        raise BenchError(f"{url} answered {resp.status}: {error_message(raw)}")
    choice = json.loads(raw)["choices"][0]
    return (choice["message"]["content"] if spec.endpoint == "chat" else choice["text"]) or ""


async def first_model(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str] | None = None) -> str:
    async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        raw = await resp.read()
    if resp.status != 200:
        raise BenchError(f"GET /v1/models answered {resp.status}")
    data = json.loads(raw).get("data") or []
    if not data:
        raise BenchError("GET /v1/models listed no model")
    return str(data[0]["id"])


def ws_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    scheme, rest = base.split("://", 1)
    return ("wss" if scheme == "https" else "ws") + "://" + rest + "/v1/ws"


async def stream_ws(
    ws: ClientConnection,
    spec: RequestSpec,
    rid: str,
    *,
    disconnect_after: int | None = None,
    cancel_after: int | None = None,
    timeout: float = 120.0,
) -> RequestResult:
    """Run one `generate` on an open socket; close it after `disconnect_after` deltas, or send a
    `cancel` after `cancel_after` deltas and keep reading until the final `done`."""
    trace = _Trace(time.perf_counter())
    deadline = trace.start + timeout
    cancelled = False
    try:
        await ws.send(json.dumps({"type": "generate", "id": rid, **sampling_fields(spec)}))
        while True:
            raw = await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.perf_counter()))
            msg = json.loads(raw)
            kind, mid = msg.get("type"), msg.get("id")
            if kind == "error" and mid in (rid, None):
                return trace.result("error", "ws_error", json.dumps(msg.get("error")))
            if mid != rid:
                continue
            if kind == "delta":
                trace.on_text(msg.get("text") or "", len(msg.get("tokens") or []) or 1)
                if disconnect_after is not None and trace.chunks >= disconnect_after:
                    await ws.close()
                    return trace.result("disconnected")
                if cancel_after is not None and not cancelled and trace.chunks >= cancel_after:
                    cancelled = True
                    await ws.send(json.dumps({"type": "cancel", "id": rid}))
            elif kind == "done":
                trace.usage = msg.get("usage")
                trace.finish_reason = msg.get("finish_reason")
                return trace.result("cancelled" if trace.finish_reason == "cancelled" else "completed")
    except TimeoutError as exc:
        return trace.result("lost", "timeout", repr(exc))
    except ConnectionClosed as exc:
        return trace.result("lost", "ws_closed", repr(exc))
    except (json.JSONDecodeError, TypeError, AttributeError) as exc:
        return trace.result("lost", "ws_garbage", repr(exc))

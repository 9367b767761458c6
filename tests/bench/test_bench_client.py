"""`streamsd bench`'s client (bench/client.py): SSE parsing, stream outcomes and request bodies."""

from __future__ import annotations

import asyncio
import itertools
import json

from streamsd.bench.client import (
    RequestResult,
    RequestSpec,
    chunk_text,
    parse_sse_line,
    sampling_fields,
    session,
    stream_sse,
)


def test_sse_line_and_chunk_parsing() -> None:
    assert parse_sse_line("data: [DONE]") == "[DONE]" and parse_sse_line(": keepalive") is None
    assert parse_sse_line("") is None and parse_sse_line('data:{"a":1}') == {"a": 1}
    chat = {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None,
                         "streamsd": {"tokens": [{"id": 1, "text": "H", "draft": True}, {"id": 2, "text": "i"}]}}]}
    assert chunk_text(chat) == ("Hi", 2, None)
    assert chunk_text({"choices": [{"text": "x", "finish_reason": "length"}]}) == ("x", 1, "length")
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ("", 0, None)


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


async def _answer_with(parts: list[bytes], status: int, seen: list[bytes]) -> tuple[asyncio.Server, str]:
    """A server on 127.0.0.1 that reads one HTTP request (into `seen`) and answers it with `status` and a
    body written in `parts`, each its own write a moment apart, then closes the connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        seen.append(await reader.readexactly(length))
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n".encode())
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _run_sse(payload: bytes | list[bytes], status: int = 200, disconnect_after: int | None = None,
             seen: list[bytes] | None = None) -> RequestResult:
    async def go() -> RequestResult:
        server, url = await _answer_with(payload if isinstance(payload, list) else [payload], status,
                                         [] if seen is None else seen)
        async with server, session(4, 10.0) as client:
            return await stream_sse(client, url, RequestSpec("chat", "m", "hello", 8), disconnect_after=disconnect_after)

    return asyncio.run(go())


def _delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                  "speculative": {"drafted": 4, "accepted": 2, "mean_accepted_length": 1.5}}}


def test_stream_sse_keeps_unicode_line_breaks_inside_their_chunk() -> None:
    """A server that sends NEL, LINE SEPARATOR or PARAGRAPH SEPARATOR raw inside a chunk's JSON (valid
    JSON; SSE ends lines at LF and CR LF only), with CR LF line ends, split across network reads."""
    text = "one\u2028two\x85three\u2029four é"
    body = f"data: {json.dumps(_delta(text), ensure_ascii=False)}\r\n\r\ndata: [DONE]\r\n\r\n".encode()
    inside = body.index("\u2028".encode()) + 1  # a read that ends inside a multi-byte character
    cuts = [0, 9, inside, len(body) - 3, len(body)]  # and one between the CR and the LF of a line end

    result = _run_sse([body[a:b] for a, b in itertools.pairwise(cuts)])
    assert result.ok and result.text == text


def test_stream_sse_outcomes() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    seen: list[bytes] = []
    ok = _run_sse(_sse(role, _delta("a"), _delta("b"), _delta("c"), USAGE, "[DONE]"), seen=seen)
    assert json.loads(seen[0])["stream_options"] == {"include_usage": True}
    assert ok.ok and ok.text == "abc" and ok.output_tokens == 3 and ok.prompt_tokens == 4
    assert ok.spec == USAGE["usage"]["speculative"] and len(ok.itl) == 2 and ok.ttft is not None
    lost = _run_sse(_sse(_delta("a"), _delta("b")))
    assert lost.outcome == "lost" and lost.error_kind == "no_done" and lost.text == "ab"
    failed = _run_sse(_sse(_delta("a"), {"error": {"message": "boom"}}, "[DONE]"))
    assert failed.outcome == "error" and failed.error_kind == "stream_error"
    refused = _run_sse(b'{"error": {"message": "bad temperature"}}', status=400)
    assert (refused.outcome, refused.error_kind, refused.message) == ("error", "400", "bad temperature")
    cut = _run_sse(_sse(_delta("a"), _delta("b"), _delta("c"), "[DONE]"), disconnect_after=2)
    assert cut.outcome == "disconnected" and cut.text == "ab"


def test_chat_history_goes_before_the_new_question() -> None:
    spec = RequestSpec("chat", "m", "And Rome?", 8, history=(("Paris?", "A city."),))
    assert sampling_fields(spec)["messages"] == [{"role": "user", "content": "Paris?"},
                                                 {"role": "assistant", "content": "A city."},
                                                 {"role": "user", "content": "And Rome?"}]

"""`streamsd bench`'s client (bench/client.py): SSE parsing, stream outcomes and request bodies."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx

from streamsd.bench.client import (
    RequestResult,
    RequestSpec,
    chunk_text,
    parse_sse_line,
    sampling_fields,
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


def _run_sse(payload: bytes, status: int = 200, disconnect_after: int | None = None) -> RequestResult:
    async def go() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=payload))
        async with httpx.AsyncClient(transport=transport) as client:
            spec = RequestSpec("chat", "m", "hello", 8)
            return await stream_sse(client, "http://test", spec, disconnect_after=disconnect_after)

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

    async def go() -> RequestResult:
        stream = _Chunks([body[a:b] for a, b in itertools.pairwise(cuts)])
        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=stream))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_sse(client, "http://test", RequestSpec("chat", "m", "hello", 8))

    result = asyncio.run(go())
    assert result.ok and result.text == text


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk


def test_stream_sse_outcomes() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    ok = _run_sse(_sse(role, _delta("a"), _delta("b"), _delta("c"), USAGE, "[DONE]"))
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

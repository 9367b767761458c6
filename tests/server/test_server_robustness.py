"""A real `streamsd serve` against clients that misbehave: hang-ups, oversized or truncated bodies,
huge prompts, odd auth headers, a full queue. Raw sockets where the openai client cannot say it."""

from __future__ import annotations

import asyncio
import json
import select
import shutil
import socket
import time

import httpx
import pytest
import websockets

from tests.server_util import metric, start_server, wait_metric

CHAT = [{"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--api-key", "sekret", "--max-queue", "1",
                     "--max-num-seqs", "2")
    yield s
    s.stop()


AUTH = {"authorization": "Bearer sekret"}


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _head(path: str, length: int | None, *, chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             "Authorization: Bearer sekret"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_status(sock: socket.socket, timeout: float) -> tuple[int, str]:
    """The status line and the head of a response (raises TimeoutError when none comes)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    return int(head.split(" ", 2)[1]), head


def test_non_streaming_request_is_aborted_when_its_client_disconnects(server):
    before = metric(server.url, "streamsd:generation_tokens_total")
    body = json.dumps({"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "temperature": 1.0}).encode()
    socks = []
    for running in (1, 2):  # one at a time: a second one sent while the first still queues would get 429
        s = _connect(server.port)
        s.sendall(_head("/v1/completions", len(body)) + body)
        socks.append(s)
        assert wait_metric(server.url, "streamsd:num_requests_running", running, 10) == running
    for s in socks:
        s.close()
    assert wait_metric(server.url, "streamsd:num_requests_running", 0, 3) == 0
    assert metric(server.url, "streamsd:kv_cache_usage_perc") == 0
    generated = metric(server.url, "streamsd:generation_tokens_total") - before
    assert generated < 2 * 4000, "the requests ran to the end after their clients left"


def test_body_over_the_limit_is_refused_on_its_content_length(server):
    s = _connect(server.port)
    s.sendall(_head("/v1/completions", 10_000_000_000) + b"{")
    status, head = _read_status(s, 5)
    s.close()
    assert status == 413 and "connection: close" in head.lower()


def test_chunked_body_is_refused_as_soon_as_it_passes_the_limit(server):
    s = _connect(server.port)
    s.sendall(_head("/v1/completions", None, chunked=True))
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
    sent, status = 0, None
    s.settimeout(0.5)
    while sent < 256 << 20:
        if select.select([s], [], [], 0)[0]:
            status, _ = _read_status(s, 5)
            break
        try:
            s.sendall(chunk)
            sent += 1 << 16
        except TimeoutError:
            continue  # the server stopped reading: its answer is on the way
        except (BrokenPipeError, ConnectionResetError):
            status, _ = _read_status(s, 5)
            break
    s.close()
    assert status == 413
    assert sent < 64 << 20, f"the server read {sent >> 20} MiB before refusing"


def test_client_dropping_mid_upload_is_not_a_server_error(server):
    s = _connect(server.port)
    s.sendall(_head("/v1/completions", 1000) + b'{"prompt": ')
    time.sleep(0.2)
    s.close()
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health").status_code == 200
    log = server.log.read_text()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_bearer_scheme_is_case_insensitive(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"authorization": f"{scheme} sekret"})
        assert r.status_code == 200, (scheme, r.text)
    assert httpx.post(f"{server.url}/v1/completions", json=body,
                      headers={"authorization": "Basic sekret"}).status_code == 401

    async def ws():
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/ws",
                                      additional_headers={"authorization": "bearer sekret"}) as sock:
            await sock.send(json.dumps({"type": "generate", "id": "1", "prompt": "hi", "max_tokens": 2}))
            while json.loads(await sock.recv())["type"] != "done":
                pass

    asyncio.run(ws())


def test_full_queue_answers_429_with_retry_after(server):
    async def flood():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as ac:
            long = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
            return await asyncio.gather(*[ac.post("/v1/completions", json=long) for _ in range(6)])

    answers = asyncio.run(flood())
    refused = [r for r in answers if r.status_code == 429]
    assert refused and any(r.status_code == 200 for r in answers)
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "server_overloaded" and err["code"] == "queue_full"


def test_huge_prompts_are_refused_without_stalling_other_streams(server):
    """A 2 MB prompt cannot fit the context window; it is refused from its length without tokenising
    it all on the event loop, so a running stream and /health keep answering meanwhile."""
    huge = "hello world " * 174762

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as ac:
            arrivals: list[float] = []

            async def stream():
                body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            arrivals.append(time.monotonic())
                            if len(arrivals) > 200:
                                return

            task = asyncio.create_task(stream())
            while len(arrivals) < 5:
                await asyncio.sleep(0.01)
            answers = await asyncio.gather(
                ac.post("/v1/completions", json={"prompt": huge, "max_tokens": 4}),
                ac.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}],
                                                      "max_tokens": 4}),
            )
            t0 = time.monotonic()
            health = (await ac.get("/health")).status_code
            health_s = time.monotonic() - t0
            async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/ws?api_key=sekret") as ws:
                await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "hello world " * 87000,
                                          "max_tokens": 4}))
                ws_answer = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await task
            gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
            return answers, health, health_s, ws_answer, max(gaps)

    answers, health, health_s, ws_answer, worst_gap = asyncio.run(scenario())
    assert worst_gap < 1.0, f"another stream stalled {worst_gap:.2f}s"
    for r, param in zip(answers, ("prompt", "messages"), strict=True):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == param
    assert ws_answer["type"] == "error" and ws_answer["error"]["code"] == "context_length_exceeded"
    assert health == 200 and health_s < 1.0


def test_access_log_has_http_and_websocket_lines_without_api_keys(server):
    httpx.get(f"{server.url}/v1/models?api_key=sekret", headers=AUTH)

    async def ws():
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/ws?api_key=sekret&x=1"):
            pass

    asyncio.run(ws())
    time.sleep(0.2)
    log = server.log.read_text()
    assert '"GET /v1/models?api_key=REDACTED HTTP/1.1" 200' in log, log[-2000:]
    assert '"WebSocket /v1/ws?api_key=REDACTED&x=1" [accepted]' in log
    assert "sekret" not in log


def test_tokenising_a_huge_prompt_does_not_stall_other_streams(tiny_model_dir, tmp_path):
    """With a tokenizer that admits no characters-per-token bound (a normalizer that may delete), a
    2 MB prompt is tokenised in full: on a thread, while another stream and /health carry on."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Strip", "strip_left": True, "strip_right": True}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    s = start_server(model, tmp_path, "--speculative-method", "none")
    huge = "hello world " * 174762
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                arrivals: list[float] = []

                async def stream():
                    body = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
                    async with ac.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                arrivals.append(time.monotonic())
                                if refused.done() and len(arrivals) > 20:
                                    return

                refused: asyncio.Future = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(stream())
                while len(arrivals) < 5:
                    await asyncio.sleep(0.01)
                big = asyncio.create_task(ac.post("/v1/completions", json={"prompt": huge, "max_tokens": 4}))
                health_s = []
                while not big.done():
                    t0 = time.monotonic()
                    assert (await ac.get("/health")).status_code == 200
                    health_s.append(time.monotonic() - t0)
                    await asyncio.sleep(0.05)
                refused.set_result(await big)
                await task
                gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
                return refused.result(), max(health_s), max(gaps), len(health_s)

        answer, worst_health, worst_gap, polls = asyncio.run(scenario())
        assert worst_gap < 1.0, f"another stream stalled {worst_gap:.2f}s"
        assert worst_health < 1.0 and polls >= 3
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
    finally:
        s.stop()


def test_streamed_text_with_unicode_line_breaks_reads_one_event_a_line(server):
    """NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR in streamed text (here the echoed prompt) stay inside
    their event for a client that splits the stream as Python's splitlines does (httpx's iter_lines)."""
    prompt = "one\u2028two\x85three\u2029four"
    body = {"prompt": prompt, "echo": True, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(prompt)

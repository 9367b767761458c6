"""A real `streamsd serve` as a browser and a network see it: which origins may open its WebSocket
and read its API (CORS), several API keys and their metrics, keys kept out of logs, and TLS."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import openai
import pytest
import websockets

from tests.server_util import Server, start_server
from tests.tls import self_signed, trusting

CHAT = [{"role": "user", "content": "Tell me about Paris."}]
LISTED = "http://app.example:3000"
KEYS = {"alice": "k-alice-1", "key-2": "k-second", "key-3": "k-third", "bob": "k-bob"}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _ws_status(url: str, **connect) -> int:
    """101 when the upgrade was accepted (and a generation ran over it), else the refusal's status."""

    async def go() -> int:
        try:
            async with websockets.connect(url, **connect) as ws:
                await ws.send(json.dumps({"type": "generate", "id": "1", "prompt": "hi", "max_tokens": 3}))
                while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] not in ("done", "error"):
                    pass
                assert frame["type"] == "done", frame
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code

    return asyncio.run(go())


def _preflight(server: Server, origin: str) -> httpx.Response:
    return httpx.options(f"{server.url}/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def _key_counts(server: Server) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("streamsd:api_key_requests_total{"):
            label = line.split('key="', 1)[1].split('"', 1)[0]
            counts[label] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tmp_path_factory):
    """No security flags: the defaults."""
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("plain"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    """Two listed origins (one written loosely), four keys: two flags, two from a file."""
    folder = tmp_path_factory.mktemp("guarded")
    key_file = folder / "keys.txt"
    key_file.write_text(f"# one key per line\n\n{KEYS['key-3']}\nbob:{KEYS['bob']}\n")
    s = start_server(tiny_model_dir, folder, "--allowed-origins", f"{LISTED},HTTPS://Other.Example:443/",
                     "--api-key", f"alice:{KEYS['alice']}", "--api-key", KEYS["key-2"],
                     "--api-key-file", str(key_file))
    yield s
    s.stop()


# ------------------------------------------------------------------------------------------
# Origins of WebSocket upgrades.


def test_websocket_from_a_foreign_origin_is_refused_by_default(plain):
    assert _ws_status(plain.ws_url, origin="http://evil.example") == 403
    # Same address, another host name: another origin.
    assert _ws_status(plain.ws_url, origin=f"http://localhost:{plain.port}") == 403
    time.sleep(0.2)
    refusals = [line for line in plain.log.read_text().splitlines() if "refused a WebSocket" in line]
    assert any("http://evil.example" in line for line in refusals), plain.log.read_text()[-2000:]


def test_websocket_from_the_servers_own_origin_or_with_no_origin_is_accepted(plain):
    assert _ws_status(plain.ws_url, origin=f"http://127.0.0.1:{plain.port}") == 101
    assert _ws_status(plain.ws_url) == 101


def test_websocket_from_a_listed_origin_is_accepted(guarded):
    auth = _bearer(KEYS["alice"])
    assert _ws_status(guarded.ws_url, origin=LISTED, additional_headers=auth) == 101
    assert _ws_status(guarded.ws_url, origin="https://other.example", additional_headers=auth) == 101
    assert _ws_status(guarded.ws_url, origin="http://app.example", additional_headers=auth) == 403  # another port
    assert _ws_status(guarded.ws_url, origin="http://evil.example", additional_headers=auth) == 403
    assert _ws_status(guarded.ws_url, additional_headers=auth) == 101


# ------------------------------------------------------------------------------------------
# CORS on the HTTP API.


def test_cors_is_off_by_default(plain):
    r = _preflight(plain, "http://evil.example")
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{plain.url}/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_preflight_from_a_listed_origin_is_answered_and_from_another_is_not(guarded):
    r = _preflight(guarded, LISTED)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == LISTED
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower()
                                                 for h in r.headers["access-control-allow-headers"].split(",")}
    refused = _preflight(guarded, "http://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers

    # The answers themselves carry the header, a 401 included: a page must read it to ask for a key.
    body = {"messages": CHAT, "max_tokens": 3}
    r = httpx.post(f"{guarded.url}/v1/chat/completions", json=body, timeout=60,
                   headers={"Origin": LISTED, **_bearer(KEYS["bob"])})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == LISTED
    r = httpx.get(f"{guarded.url}/v1/models", headers={"Origin": LISTED}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == LISTED
    r = httpx.get(f"{guarded.url}/v1/models", headers={"Origin": "http://evil.example", **_bearer(KEYS["bob"])})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# ------------------------------------------------------------------------------------------
# API keys.


def test_several_api_keys_each_counted_under_its_own_label(guarded):
    before = _key_counts(guarded)
    for name, n in (("alice", 2), ("key-2", 1), ("key-3", 1), ("bob", 3)):
        for _ in range(n):
            assert httpx.get(f"{guarded.url}/v1/models", headers=_bearer(KEYS[name]), timeout=10).status_code == 200
    for wrong in ("k-nobody", "# one key per line", f"bob:{KEYS['bob']}", KEYS["bob"] + "x"):
        assert httpx.get(f"{guarded.url}/v1/models", headers=_bearer(wrong), timeout=10).status_code == 401
    after = _key_counts(guarded)
    assert {name: after[name] - before.get(name, 0) for name in after} == {"alice": 2, "key-2": 1, "key-3": 1,
                                                                            "bob": 3}
    text = httpx.get(f"{guarded.url}/metrics", timeout=5).text
    assert not [key for key in KEYS.values() if key in text]


def test_websocket_takes_the_api_key_in_a_subprotocol(guarded):
    def protocols(key: str) -> list[str]:
        return ["streamsd", "streamsd.bearer." + base64.urlsafe_b64encode(key.encode()).rstrip(b"=").decode()]

    async def chosen() -> str | None:
        async with websockets.connect(guarded.ws_url, subprotocols=protocols(KEYS["bob"])) as ws:
            return ws.subprotocol

    before = _key_counts(guarded)
    assert asyncio.run(chosen()) == "streamsd"  # the key's own protocol is never echoed back
    assert _ws_status(guarded.ws_url, subprotocols=protocols(KEYS["bob"])) == 101
    assert _key_counts(guarded)["bob"] - before["bob"] == 1  # one generation
    assert _ws_status(guarded.ws_url, subprotocols=protocols("k-nobody")) == 403
    assert _ws_status(guarded.ws_url, subprotocols=["streamsd"]) == 403


def test_access_log_never_shows_a_key(guarded):
    httpx.get(f"{guarded.url}/v1/models?q={KEYS['bob']}&n=1", headers=_bearer(KEYS["alice"]), timeout=10)
    assert _ws_status(f"{guarded.ws_url}?x={KEYS['key-3']}", additional_headers=_bearer(KEYS["key-3"])) == 101
    time.sleep(0.2)
    log = guarded.log.read_text()
    assert '"GET /v1/models?q=REDACTED&n=1 HTTP/1.1" 200' in log, log[-2000:]
    assert '"WebSocket /v1/ws?x=REDACTED" [accepted]' in log, log[-2000:]
    assert not [key for key in KEYS.values() if key in log]


# ------------------------------------------------------------------------------------------
# TLS.


@pytest.fixture(scope="module")
def server_cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("certs"), "server")


@pytest.fixture(scope="module")
def tls(tiny_model_dir, tmp_path_factory, server_cert):
    cert, key = server_cert
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("tls"), "--ssl-certfile", str(cert),
                     "--ssl-keyfile", str(key), tls=trusting(cert))
    yield s
    s.stop()


def test_https_chat_completion_and_wss_generation(tls, server_cert):
    trust = trusting(server_cert[0])
    with httpx.Client(verify=trust) as http:
        client = openai.OpenAI(base_url=f"{tls.url}/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=http)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5,
                                               extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].message.content
    # The page's own origin is https here; the same host over http is another origin.
    assert _ws_status(tls.ws_url, ssl=trust, origin=f"https://127.0.0.1:{tls.port}") == 101
    assert _ws_status(tls.ws_url, ssl=trust, origin=f"http://127.0.0.1:{tls.port}") == 403
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
        httpx.get(f"{tls.url}/health", timeout=10)


def test_client_certificates_are_required_with_ssl_ca_certs(tiny_model_dir, tmp_path, server_cert):
    cert, key = server_cert
    client = self_signed(tmp_path, "client", client=True)
    stranger = self_signed(tmp_path, "stranger", client=True)
    s = start_server(tiny_model_dir, tmp_path, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                     "--ssl-ca-certs", str(client[0]), tls=trusting(cert, client))
    try:
        assert httpx.get(f"{s.url}/v1/models", verify=trusting(cert, client), timeout=10).status_code == 200
        for unknown in (None, stranger):
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{s.url}/v1/models", verify=trusting(cert, unknown), timeout=10)
    finally:
        s.stop()

"""logit_bias and the repetition/frequency/presence penalties through a real `streamsd serve` that
speculates with a draft model: honoured over both OpenAI routes and the WebSocket, each invalid
value a 400 naming its field."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from websockets.sync.client import connect

from tests.server_util import metric

PROMPT = "hello"  # its greedy answer repeats a token
CHAT = [{"role": "user", "content": "Tell me about Paris."}]


def _ids(choice) -> list[int]:
    return [t["id"] for t in choice.model_extra["streamsd"]["tokens"]]


def _complete(client, **kw):
    return client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, **kw).choices[0]


def test_logit_bias_bans_and_forces_tokens(client):
    base = _complete(client)
    first = _ids(base)[0]
    banned = _complete(client, logit_bias={str(first): -100})
    assert _ids(banned)[0] != first and first not in _ids(banned)
    forced = 70
    assert forced not in _ids(base)
    assert _ids(_complete(client, logit_bias={str(forced): 100})) == [forced] * 16
    # The chat route too: a banned first token changes the answer's start.
    chat = client.chat.completions.create(model=None, messages=CHAT, max_tokens=8, temperature=0).choices[0]
    chat_first = _ids(chat)[0]
    rebiased = client.chat.completions.create(model=None, messages=CHAT, max_tokens=8, temperature=0,
                                              logit_bias={str(chat_first): -100}).choices[0]
    assert _ids(rebiased)[0] != chat_first


@pytest.mark.parametrize("kw", [
    {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0},
    {"extra_body": {"repetition_penalty": 2.0}},
], ids=["frequency", "presence", "repetition"])
def test_a_penalty_changes_a_repetitive_answer(client, server, kw):
    base = _ids(_complete(client))
    assert max(Counter(base).values()) >= 3  # the prompt's greedy answer repeats itself
    penalised = _ids(_complete(client, **kw))
    assert penalised != base
    assert max(Counter(penalised).values()) < max(Counter(base).values())
    # The same request over the WebSocket, and streamed: the same answer.
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **kw.get("extra_body", kw)}
    with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        ws.send(json.dumps({"type": "generate", "id": "a", **body}))
        ids: list[int] = []
        while (event := json.loads(ws.recv(timeout=60)))["type"] != "done":
            assert event["type"] == "delta", event
            ids += [t["id"] for t in event["tokens"]]
    assert ids == penalised
    stream = client.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0, stream=True, **kw)
    assert [i for chunk in stream for i in _ids(chunk.choices[0])] == penalised


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.2}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_each_invalid_penalty_or_bias_is_a_400_naming_it(client, server, route):
    before = _ids(_complete(client))
    base = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": CHAT}
    for fields, param in BAD:
        r = httpx.post(f"{server.url}{route}", json={**base, "max_tokens": 4, **fields}, timeout=30)
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (fields, err)
    with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        ws.send(json.dumps({"type": "generate", "id": "bad", "prompt": PROMPT, "logit_bias": {"999999": 1}}))
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error" and "logit_bias" in event["error"]["message"], event
    assert _ids(_complete(client)) == before
    assert metric(server.url, "streamsd:num_requests_running") == 0
    assert metric(server.url, "streamsd:kv_cache_usage_perc") == 0

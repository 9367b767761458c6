"""The OpenAI and vLLM surface a client relies on: the model route, tokenisation routes, /version,
system_fingerprint, request validation (every field honoured or refused by name), OpenAI's own usage
fields for speculation, and the vLLM dashboard's metrics."""

from __future__ import annotations

import asyncio
import json
import socket

import h11
import httpx
import openai
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from streamsd import __version__
from tests.server_util import start_server

KEY = "sekret"
AUTH = {"authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, close_draft_dir, tmp_path_factory):
    # A small KV pool (32 blocks of 16 tokens) so that a handful of concurrent requests preempt.
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--draft-model", str(close_draft_dir),
                     "--num-speculative-tokens", "3", "--speculation-policy", "fixed", "--api-key", KEY,
                     "--kv-cache-tokens", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _post(server, path, body, headers=AUTH):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


# -- routes ---------------------------------------------------------------------------------------

def test_model_route_returns_the_served_model_and_a_404_for_another(client, model):
    m = client.models.retrieve(model)
    assert (m.id, m.object, m.owned_by) == (model, "model", "streamsd")
    assert m.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_tokenize_matches_the_prompts_the_completions_routes_run(server, client, model, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = _post(server, "/tokenize", {"model": model, "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Once upon a time", add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    # The same ids the completions route runs: its usage counts them.
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]

    chat = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": True}).json()
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    done = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]
    bare = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]

    strs = _post(server, "/tokenize", {"prompt": "Paris", "add_special_tokens": False, "return_token_strs": True})
    assert strs.json()["token_strs"] == tok.convert_ids_to_tokens(tok.encode("Paris", add_special_tokens=False))


def test_detokenize_inverts_tokenize(server):
    ids = _post(server, "/tokenize", {"prompt": "The capital of France", "add_special_tokens": False}).json()["tokens"]
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "The capital of France"}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1], "skip": True}, "skip"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "model"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
])
def test_tokenisation_routes_refuse_bad_input_by_name(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenisation_routes_need_the_api_key_and_version_does_not(server):
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})]:
        r = _post(server, path, body, headers={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": __version__}


# -- system_fingerprint ---------------------------------------------------------------------------

def test_every_response_and_chunk_carries_one_system_fingerprint(client, model):
    kw = dict(model=model, max_tokens=6)
    seen = [client.chat.completions.create(messages=CHAT, **kw).system_fingerprint,
            client.completions.create(prompt="Once", **kw).system_fingerprint]
    for chunk in client.chat.completions.create(messages=CHAT, stream=True, stream_options={"include_usage": True},
                                                **kw):
        seen.append(chunk.system_fingerprint)
    for chunk in client.completions.create(prompt="Once", stream=True, **kw):
        seen.append(chunk.system_fingerprint)
    assert len(set(seen)) == 1, seen
    assert seen[0].startswith(f"fp_streamsd-{__version__}-") and len(seen[0]) > len(f"fp_streamsd-{__version__}-")


def _http_chunks(server, path: str, body: dict) -> list[bytes]:
    """The response body's HTTP/1.1 chunks as they came (each is one write of the server's), read by h11."""
    conn = h11.Connection(h11.CLIENT)
    raw = json.dumps(body).encode()
    headers = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
               ("Content-Length", str(len(raw))), ("Connection", "close")]
    chunks, part = [], b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=headers)) + conn.send(h11.Data(data=raw))
                     + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                assert dict(event.headers).get(b"transfer-encoding") == b"chunked", event.headers
            elif isinstance(event, h11.Data):
                part += event.data
                if event.chunk_end:
                    chunks.append(part)
                    part = b""
            elif isinstance(event, h11.EndOfMessage):
                return chunks


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_streams_final_chunk_usage_and_done_leave_in_one_write(server, model, include_usage):
    body = {"model": model, "messages": CHAT, "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": include_usage}}
    chunks = _http_chunks(server, "/v1/chat/completions", body)
    *streamed, last = chunks
    assert all(c.count(b"data: ") == 1 and b"[DONE]" not in c for c in streamed), chunks
    events = [e for e in last.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 2 + include_usage, events
    final = json.loads(events[0][len(b"data: "):])
    assert final["choices"][0]["finish_reason"] == "length"
    if include_usage:
        assert json.loads(events[1][len(b"data: "):])["usage"]["completion_tokens"] == 5
    tokens = [t for c in [*streamed, events[0]] for e in c.split(b"\n\n") if e
              for t in json.loads(e[len(b"data: "):])["choices"][0]["streamsd"]["tokens"]]
    assert len(tokens) == 5


# -- validation -----------------------------------------------------------------------------------

# OpenAI fields another part of the server is to implement: an entry goes when its field is honoured.
REFUSED = [
    ("/v1/chat/completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [3, 384]}, "stop_token_ids"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stream_options": {"include_usage": False}}, "stream_options"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/completions", {"suffix": "The end."}, "suffix"),
]


@pytest.mark.parametrize("path,extra,param", REFUSED, ids=[f"{p.rsplit('/', 1)[1]}-{param}" for p, _, param in REFUSED])
def test_fields_not_honoured_are_refused_by_name(server, path, extra, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "Once"}
    r = _post(server, path, {**base, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_neutral_values_of_refused_fields_and_user_are_accepted(client, model):
    neutral = {"tools": [], "tool_choice": "none", "functions": [], "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "repetition_penalty": 1, "n": 1, "response_format": {"type": "text"}}
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, user="alice", extra_body=neutral)
    assert chat.choices[0].finish_reason in ("stop", "length")
    done = client.completions.create(model=model, prompt="Once", max_tokens=3, user="alice", echo=False, best_of=1,
                                     suffix=None, stop=None)
    assert done.choices[0].finish_reason in ("stop", "length")


def test_in_vocabulary_stop_token_ids_are_honoured(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})
    ids = [t["id"] for t in full.choices[0].model_extra["streamsd"]["tokens"]]
    cut = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens <= 4


def test_websocket_frames_refuse_the_same_fields(server):
    async def scenario():
        url = f"ws://127.0.0.1:{server.port}/v1/ws?api_key={KEY}"
        async with websockets.connect(url) as ws:
            replies = []
            for i, extra in enumerate([{"n": 2}, {"frobnicate": 1}, {"stop_token_ids": [10**6]},
                                       {"presence_penalty": 0}]):
                await ws.send(json.dumps({"type": "generate", "id": str(i), "prompt": "Once", "max_tokens": 3,
                                          **extra}))
                while (msg := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "delta":
                    pass
                replies.append(msg)
            return replies

    refused_n, unknown, stop_ids, neutral = asyncio.run(scenario())
    assert refused_n["type"] == "error" and "`n`" in refused_n["error"]["message"]  # one answer a frame
    assert unknown["type"] == "error" and "frobnicate" in unknown["error"]["message"]
    assert stop_ids["type"] == "error" and "stop_token_ids" in stop_ids["error"]["message"]
    details = neutral["usage"]["completion_tokens_details"]
    assert neutral["type"] == "done" and sum(details.values()) == neutral["usage"]["speculative"]["drafted"]


# -- usage ----------------------------------------------------------------------------------------

def _check_details(usage):
    spec = usage.model_extra["speculative"]
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec["accepted"]
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == spec["drafted"]
    assert spec["drafted"] > 0 and details.rejected_prediction_tokens >= 0
    return spec["drafted"]


def test_usage_reports_speculation_in_openai_fields(client, model):
    kw = dict(model=model, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    _check_details(client.chat.completions.create(messages=CHAT, **kw).usage)
    _check_details(client.completions.create(prompt="Once upon a time", **kw).usage)
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    _check_details(chunks[-1].usage)
    parts = list(client.completions.create(prompt="Once upon a time", stream=True,
                                           stream_options={"include_usage": True}, **kw))
    _check_details(parts[-1].usage)


# -- metrics --------------------------------------------------------------------------------------

def _scrape(server) -> dict[str, float]:
    """Every sample by its name and labels, e.g. 'streamsd:request_success_total{finished_reason="length"}'."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


MOVING = [
    "streamsd:time_per_output_token_seconds_count",
    'streamsd:request_success_total{finished_reason="length"}',
    "streamsd:num_preemptions_total",
    "streamsd:iteration_tokens_total_count",
    "streamsd:request_prompt_tokens_count",
    "streamsd:request_generation_tokens_count",
    "streamsd:request_params_max_tokens_count",
    "streamsd:request_prefill_time_seconds_count",
    "streamsd:request_decode_time_seconds_count",
    "streamsd:request_tokenize_time_seconds_count",
    'streamsd:step_duration_seconds_count{kind="prompt"}',
    'streamsd:step_duration_seconds_count{kind="verify"}',
]


def test_vllm_dashboard_metrics_are_exported_and_move(server, model):
    before = _scrape(server)
    for name in MOVING:
        assert name in before, name
    for reason in ("stop", "length", "abort"):
        assert f'streamsd:request_success_total{{finished_reason="{reason}"}}' in before
    info = [k for k in before if k.startswith("streamsd:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'num_gpu_blocks="32"' in info[0], info

    async def crowd():  # more than the KV pool holds at once: the newest are preempted
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as ac:
            body = {"model": model, "prompt": "Story:", "max_tokens": 150, "ignore_eos": True, "temperature": 1.0}
            return await asyncio.gather(*[ac.post("/v1/completions", json={**body, "seed": i}) for i in range(6)])

    assert all(r.status_code == 200 for r in asyncio.run(crowd()))
    after = _scrape(server)
    for name in MOVING:
        assert after[name] > before[name], name
    assert after['streamsd:request_success_total{finished_reason="length"}'] - \
        before['streamsd:request_success_total{finished_reason="length"}'] == 6
    assert after["streamsd:request_params_max_tokens_sum"] - before["streamsd:request_params_max_tokens_sum"] == 900
    assert after["streamsd:request_generation_tokens_sum"] - before["streamsd:request_generation_tokens_sum"] == 900
    steps = after["streamsd:iteration_tokens_total_count"] - before["streamsd:iteration_tokens_total_count"]
    tokens = after["streamsd:iteration_tokens_total_sum"] - before["streamsd:iteration_tokens_total_sum"]
    assert tokens >= 900 and steps <= tokens
    tpot = after["streamsd:time_per_output_token_seconds_sum"] - before["streamsd:time_per_output_token_seconds_sum"]
    assert tpot > 0
    timed = sum(after[f'streamsd:step_duration_seconds_count{{kind="{k}"}}'] for k in ("prompt", "verify", "decode"))
    assert timed == after["streamsd:iteration_tokens_total_count"]  # every step with work is timed, once
    # One tokenising per text prompt, and each one took time.
    assert after["streamsd:request_tokenize_time_seconds_count"] - before["streamsd:request_tokenize_time_seconds_count"] == 6
    assert after["streamsd:request_tokenize_time_seconds_sum"] > before["streamsd:request_tokenize_time_seconds_sum"]


def test_openai_client_sees_the_documented_error_shape_for_a_refused_field(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=3,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert info.value.body["param"] == "tools" and "tools" in json.dumps(info.value.body)

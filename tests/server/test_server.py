"""The server through real clients: the `openai` package and `websockets` against uvicorn."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
import websockets

from streamsd import LLM, SamplingParams
from tests.server_util import metric, start_server

CHAT = [{"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def offline(tiny_model_dir, close_draft_dir):
    return LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3)


def test_health_models_and_loading_state(server, client):
    assert 503 in server.health_seen, "health answered 503 while the model loaded"
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [server.log.name and models.data[0].id]
    assert models.data[0].id == "target" or models.data[0].id.startswith("target")


def test_chat_streaming_equals_non_streaming_equals_offline(client, offline):
    kw = dict(model=client.models.list().data[0].id, messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert full.choices[0].message.content == text == ref.text
    assert full.usage.completion_tokens == 24
    spec = full.usage.model_extra["speculative"]
    assert spec["drafted"] > 0 and 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1


def test_completions_streaming_and_not(client, offline):
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    parts = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    ref = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert full.choices[0].text == text == ref[0].outputs[0].text
    assert parts[-1].usage.prompt_tokens == len(ref[0].prompt_token_ids)


def test_seeded_sampling_and_logprobs_through_http(client):
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=CHAT, max_tokens=12, temperature=1.0, seed=42, logprobs=True, top_logprobs=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    lp = a.choices[0].logprobs.content
    assert len(lp) == a.usage.completion_tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in lp)


def _post(server, path, body, raw=False, headers=None):
    data = body if raw else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=data, headers={"content-type": "application/json", **(headers or {})},
                      timeout=30)


BAD_INPUTS = [
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "speculative": {"num_tokens": 99}}, 400, "speculative"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": "x " * 3000, "max_tokens": 2000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/nothing", {}, 404, None),
]


def test_bad_inputs_get_openai_errors_and_change_nothing(server, client):
    model = client.models.list().data[0].id
    before = client.completions.create(model=model, prompt="The capital", max_tokens=10, temperature=0).choices[0].text
    for path, body, status, param in BAD_INPUTS:
        r = _post(server, path, body, raw=isinstance(body, str))
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        if param:
            assert err["param"] == param, (body, err)
    after = client.completions.create(model=model, prompt="The capital", max_tokens=10, temperature=0).choices[0].text
    assert before == after
    assert metric(server.url, "streamsd:num_requests_running") == 0
    assert metric(server.url, "streamsd:kv_cache_usage_perc") == 0


def test_metrics_have_the_promised_names(server, client):
    # A request of its own: the draft counters must move whichever tests ran on this server before.
    client.completions.create(model=client.models.list().data[0].id, prompt="one two one two", max_tokens=8,
                              temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket"]:
        assert f"streamsd:{name}" in text, name
    assert metric(server.url, "streamsd:spec_decode_num_draft_tokens_total") > 0


def test_adaptive_policy_metrics_count_every_choice(tiny_model_dir, tmp_path):
    """The default policy (adaptive) exports the k it chose per request and step as a histogram, its
    share of plain steps and its predicted vs measured step time."""
    s = start_server(tiny_model_dir, tmp_path, "--speculative-method", "ngram", "--num-speculative-tokens", "3")
    try:
        before = metric(s.url, "streamsd:spec_decode_chosen_k_count")
        body = {"prompt": "one two three one two three one two", "max_tokens": 24, "temperature": 0}
        assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
        chosen = metric(s.url, "streamsd:spec_decode_chosen_k_count")
        # One per request and decode step built: 23 after the prompt's, fewer when drafts were accepted.
        assert before == 0 and 1 <= chosen <= 23
        assert metric(s.url, 'streamsd:spec_decode_chosen_k_bucket{le="3"}') == chosen  # k <= 3 always
        assert metric(s.url, 'streamsd:spec_decode_chosen_k_bucket{le="0"}') <= chosen
        assert 0.0 <= metric(s.url, "streamsd:spec_decode_plain_step_share") <= 1.0
        assert metric(s.url, "streamsd:spec_decode_step_measured_seconds") > 0
        assert metric(s.url, "streamsd:spec_decode_step_predicted_seconds") > 0
        assert metric(s.url, "streamsd:spec_decode_step_prediction_error") >= 0
    finally:
        s.stop()


def test_disconnect_mid_stream_frees_everything(server):
    body = {"messages": CHAT, "max_tokens": 3000, "temperature": 1.0, "ignore_eos": True, "stream": True}
    before = metric(server.url, "streamsd:generation_tokens_total")
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # read by hand: leaving a for-loop early would close the stream already
        for _ in range(6):
            next(lines)
        assert metric(server.url, "streamsd:num_requests_running") == 1
    deadline = time.monotonic() + 10.0  # the wait ends as soon as it is freed; a loaded machine may take a while
    while time.monotonic() < deadline and metric(server.url, "streamsd:num_requests_running") > 0:
        time.sleep(0.02)
    assert metric(server.url, "streamsd:num_requests_running") == 0
    assert metric(server.url, "streamsd:kv_cache_usage_perc") == 0
    assert metric(server.url, "streamsd:generation_tokens_total") - before < 3000, "the request ran to the end"


def test_64_concurrent_streams_equal_their_solo_output(server, client):
    model = client.models.list().data[0].id
    prompts = [f"Story number {i}:" for i in range(64)]
    solo = {}
    for p in prompts[:8]:  # solo reference for a sample; all 64 are checked against the offline engine below
        solo[p] = client.completions.create(model=model, prompt=p, max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text

    async def one(ac, p):
        text = ""
        stream = await ac.completions.create(model=model, prompt=p, max_tokens=20, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def all_streams():
        ac = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)
        return await asyncio.gather(*[one(ac, p) for p in prompts])

    texts = asyncio.run(all_streams())
    for p, t in zip(prompts, texts, strict=True):
        if p in solo:
            assert t == solo[p]
    again = [client.completions.create(model=model, prompt=p, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts[8:16]]
    assert again == texts[8:16]


def test_websocket_interleaves_cancels_and_survives_bad_frames(server):
    async def scenario():
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "messages": CHAT, "max_tokens": 12,
                                      "temperature": 0, "ignore_eos": True}))
            await ws.send(json.dumps({"type": "generate", "id": "b", "prompt": "Once upon", "max_tokens": 12,
                                      "temperature": 0, "ignore_eos": True}))
            await ws.send(json.dumps({"type": "generate", "id": "long", "prompt": "x", "max_tokens": 3000,
                                      "temperature": 1.0, "ignore_eos": True}))
            await ws.send("{broken")
            await ws.send(json.dumps({"type": "teleport", "id": "z"}))
            await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "dup"}))
            await ws.send(b"\x00\x01binary")
            texts: dict[str, str] = {"a": "", "b": "", "long": ""}
            done: dict[str, dict] = {}
            errors = []
            cancelled = False
            order = []
            while len(done) < 3:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if msg["type"] == "delta":
                    texts[msg["id"]] += msg["text"]
                    order.append(msg["id"])
                    assert all({"id", "text", "draft"} <= set(t) for t in msg["tokens"])
                    if msg["id"] == "long" and not cancelled:
                        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
                        cancelled = True
                elif msg["type"] == "done":
                    done[msg["id"]] = msg
                else:
                    errors.append(msg)
            # The socket still works after all that.
            await ws.send(json.dumps({"type": "generate", "id": "c", "prompt": "Once upon", "max_tokens": 12,
                                      "temperature": 0, "ignore_eos": True}))
            text_c = ""
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if msg.get("id") == "c" and msg["type"] == "delta":
                    text_c += msg["text"]
                if msg.get("id") == "c" and msg["type"] == "done":
                    break
            return texts, done, errors, order, text_c

    texts, done, errors, order, text_c = asyncio.run(scenario())
    assert done["long"]["finish_reason"] == "cancelled"
    assert done["a"]["finish_reason"] == "length" and done["a"]["usage"]["completion_tokens"] == 12
    assert "speculative" in done["a"]["usage"]
    assert text_c == texts["b"]
    codes = sorted(e["error"]["code"] for e in errors)
    assert codes == ["duplicate_id", "invalid_request", "invalid_request", "unsupported_frame"], errors
    assert {"a", "b"} <= set(order[: len(order) // 2 + 2]) or order.count("a") > 0  # both streamed, interleaved
    assert metric(server.url, "streamsd:num_requests_running") == 0


def test_websocket_oversized_frame_closes_with_1009(server):
    async def scenario():
        async with websockets.connect(f"ws://127.0.0.1:{server.port}/v1/ws", max_size=None) as ws:
            await ws.send("x" * (2 << 20))
            with pytest.raises(websockets.ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 10)
            return info.value.rcvd.code if info.value.rcvd else None

    assert asyncio.run(scenario()) == 1009


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs2"), "--api-key", "sekret", "--max-queue", "1",
                     "--max-num-seqs", "1", "--drain-timeout", "2", "--max-model-len", "400")
    yield s
    s.stop()


def test_api_key_and_queue_limit(guarded):
    body = {"prompt": "hi", "max_tokens": 4}
    r = _post(guarded, "/v1/completions", body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    auth = {"authorization": "Bearer sekret"}
    assert _post(guarded, "/v1/completions", body, headers=auth).status_code == 200

    async def flood():
        async with httpx.AsyncClient(base_url=guarded.url, headers=auth, timeout=60) as ac:
            long = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
            return await asyncio.gather(*[ac.post("/v1/completions", json=long) for _ in range(6)])

    statuses = sorted(r.status_code for r in asyncio.run(flood()))
    assert 429 in statuses and 200 in statuses, statuses

    async def ws_auth():
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(f"ws://127.0.0.1:{guarded.port}/v1/ws"):
                pass
        async with websockets.connect(f"ws://127.0.0.1:{guarded.port}/v1/ws?api_key=sekret") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "1", "prompt": "hi", "max_tokens": 3}))
            while json.loads(await ws.recv())["type"] != "done":
                pass

    asyncio.run(ws_auth())


def test_max_model_len_is_the_context_window_clients_see(guarded):
    auth = {"authorization": "Bearer sekret"}
    models = httpx.get(f"{guarded.url}/v1/models", headers=auth, timeout=30).json()
    assert models["data"][0]["max_model_len"] == 400
    r = _post(guarded, "/v1/completions", {"prompt": "hi", "max_tokens": 400}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_sigterm_drains_streams_and_exits_zero(tiny_model_dir, tmp_path):
    s = start_server(tiny_model_dir, tmp_path, "--drain-timeout", "1.5")

    async def streams():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
            async def one(i):
                events = []
                body = {"prompt": f"p{i}", "max_tokens": 2000 if i % 2 else 30, "ignore_eos": True, "stream": True}
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                return events

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.sleep(0.8)
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = (await ac.get("/health")).status_code
            late = (await ac.post("/v1/completions", json={"prompt": "late", "max_tokens": 3})).status_code
            return await asyncio.gather(*tasks), health, late

    results, health, late = asyncio.run(streams())
    assert health == 503 and late == 503
    for events in results:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] in ("length", "abort")  # "abort": cut by the drain
    assert s.proc.wait(30) == 0


def test_pipelined_server_streams_equal_the_offline_engine(tiny_model_dir, tmp_path):
    """`--pipeline on` (forced on the CPU): plain decode steps queued one ahead under the server's own
    loop, with 24 concurrent streams joining and ending at different lengths (greedy and seeded T=1),
    one client hanging up mid-stream: every finished answer equals the offline engine's, and the
    cache is empty afterwards."""
    s = start_server(tiny_model_dir, tmp_path, "--speculative-method", "none", "--pipeline", "on")
    try:
        ac_url = f"{s.url}/v1"
        model = httpx.get(f"{ac_url}/models").json()["data"][0]["id"]
        prompts = [f"Story number {i}:" for i in range(24)]
        params = [dict(max_tokens=8 + i, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(24)]

        async def one(ac, p, kw):
            text = ""
            stream = await ac.completions.create(model=model, prompt=p, stream=True, extra_body={"ignore_eos": True},
                                                 **kw)
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
            return text

        async def hang_up():
            body = {"prompt": "Tell me a long story", "max_tokens": 3000, "stream": True, "model": model}
            async with httpx.AsyncClient(timeout=30) as h, h.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                for _ in range(5):
                    await lines.__anext__()

        async def run():
            ac = openai.AsyncOpenAI(base_url=ac_url, api_key="unused", max_retries=0, timeout=120)
            tasks = []
            for i, (p, kw) in enumerate(zip(prompts, params, strict=True)):
                tasks.append(asyncio.create_task(one(ac, p, kw)))
                if i % 6 == 5:
                    await asyncio.sleep(0.05)  # joins while steps are queued ahead
            await hang_up()
            return await asyncio.gather(*tasks)

        texts = asyncio.run(run())
        offline = LLM(str(tiny_model_dir))
        want = offline.generate(prompts, [SamplingParams(ignore_eos=True, **kw) for kw in params])
        assert texts == [r.outputs[0].text for r in want]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and metric(s.url, "streamsd:num_requests_running") > 0:
            time.sleep(0.02)
        assert metric(s.url, "streamsd:kv_cache_usage_perc") == 0
        assert metric(s.url, "streamsd:pipelined_steps_taken") > 20
        assert metric(s.url, "streamsd:pipelined_steps_dropped") >= 1  # joins and the hang-up
    finally:
        assert s.stop() == 0

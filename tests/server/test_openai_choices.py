"""Several answers per request on the OpenAI routes: `n` samples (seeded per index), a list of
prompts on /v1/completions, `echo`, completion logprobs with `text_offset`, and the 400s for values
out of range; against a real server that speculates with a draft model."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets
from transformers import AutoTokenizer

from tests.server_util import metric

CHAT = [{"role": "user", "content": "Tell me about Paris."}]
PROMPTS = ["Once upon a time", "The capital of France", "In a hole in the ground", "It was a dark night"]


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat_stream(client, **kw) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


# -- n ------------------------------------------------------------------------------------------

def test_n_seeded_chat_answers_are_reproducible_distinct_and_each_its_own_seed(client, model):
    kw = dict(model=model, messages=CHAT, max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) == 3, texts
    # Sample j runs with seed + j: the same answer a lone request with that seed gets.
    for j in range(3):
        solo = client.chat.completions.create(n=1, **{**kw, "seed": 7 + j})
        assert solo.choices[0].message.content == texts[j]
    one = client.chat.completions.create(n=1, **kw)
    # The prompt counted once; the completions summed.
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    assert a.usage.completion_tokens == 3 * 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + 36


def test_n_streaming_chat_answers_carry_their_index_and_equal_the_non_streaming_ones(client, model):
    kw = dict(model=model, messages=CHAT, max_tokens=10, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    texts, finish, usage = _chat_stream(client, **kw)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 30 and usage.prompt_tokens == full.usage.prompt_tokens


def test_unseeded_samples_differ(client, model):
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3,
                                     extra_body={"ignore_eos": True})
    assert len({c.text for c in done.choices}) == 3


def test_streaming_n_answers_are_all_aborted_when_the_client_disconnects(server):
    body = {"messages": CHAT, "max_tokens": 3000, "temperature": 1.0, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
        assert metric(server.url, "streamsd:num_requests_running") == 3
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and metric(server.url, "streamsd:num_requests_running") > 0:
        time.sleep(0.02)
    assert metric(server.url, "streamsd:num_requests_running") == 0
    assert metric(server.url, "streamsd:kv_cache_usage_perc") == 0


# -- a list of prompts ----------------------------------------------------------------------------

def test_a_list_of_prompts_gets_one_choice_each_in_order(client, model, tiny_model_dir):
    kw = dict(model=model, max_tokens=8, temperature=0)
    done = client.completions.create(prompt=PROMPTS, **kw)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    solos = [client.completions.create(prompt=p, **kw) for p in PROMPTS]
    assert [c.text for c in done.choices] == [s.choices[0].text for s in solos]
    assert done.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solos)
    assert done.usage.completion_tokens == sum(s.usage.completion_tokens for s in solos)
    # Token-id lists answer as their text does.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = client.completions.create(prompt=[tok.encode(p) for p in PROMPTS], **kw)
    assert [c.text for c in ids.choices] == [c.text for c in done.choices]


def test_a_list_of_prompts_with_n_numbers_prompt_i_sample_j_as_i_times_n_plus_j(client, model):
    kw = dict(model=model, max_tokens=8, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    done = client.completions.create(prompt=PROMPTS, n=2, **kw)
    assert [c.index for c in done.choices] == list(range(8))
    for i, p in enumerate(PROMPTS):
        solo = client.completions.create(prompt=p, n=2, **kw)
        assert [c.text for c in done.choices[2 * i: 2 * i + 2]] == [c.text for c in solo.choices]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(prompt=PROMPTS, n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in done.choices}


# -- echo and logprobs ---------------------------------------------------------------------------

def test_echo_puts_the_prompt_before_the_completion(client, model, tiny_model_dir):
    kw = dict(model=model, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt="Once upon a time", **kw)
    echoed = client.completions.create(prompt="Once upon a time", echo=True, **kw)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(prompt="Once upon a time", echo=True, stream=True, **kw)
                       if c.choices)
    assert streamed == echoed.choices[0].text
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("Once upon a time")
    by_ids = client.completions.create(prompt=ids, echo=True, **kw)
    assert by_ids.choices[0].text == tok.decode(ids) + plain.choices[0].text


def test_logprobs_0_gives_the_sampled_tokens_logprob_and_text_offsets(client, model):
    done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs == [{}] * 8
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_up_to_20_top_logprobs(client, model):
    done = client.completions.create(model=model, prompt="Once", max_tokens=3, logprobs=20)
    five = client.completions.create(model=model, prompt="Once", max_tokens=3, logprobs=5)
    # Keyed by token text: ids that decode alike share an entry.
    assert all(5 < len(d) <= 20 for d in done.choices[0].logprobs.top_logprobs)
    assert all(len(d) <= 5 for d in five.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in chat.choices[0].logprobs.content)


INVALID = [
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 129}, "prompt"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
]


@pytest.mark.parametrize("path,extra,param", INVALID, ids=[f"{p.rsplit('/', 1)[1]}-{x}" for p, x, _ in
                                                           [(p, "-".join(f"{k}={v}" for k, v in e.items() if k != "prompt"), q)
                                                            for p, e, q in INVALID]])
def test_invalid_choice_values_are_refused_by_name(server, path, extra, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "Once"}
    r = httpx.post(f"{server.url}{path}", json={**base, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert metric(server.url, "streamsd:num_requests_running") == 0


def test_a_websocket_generate_frame_with_n_is_refused(server):
    async def go() -> dict:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "Once", "max_tokens": 3, "n": 2}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    msg = asyncio.run(go())
    assert msg["type"] == "error" and msg["id"] == "a" and "n" in msg["error"]["message"], msg


def test_n_samples_prefill_their_prompt_once_and_share_its_blocks(client, model, server):
    prompt = "The samples of one prompt share its blocks: " + " ".join(f"w{i}" for i in range(60))
    before = metric(server.url, "streamsd:prefix_cache_hits_total")
    done = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=1.0, n=3)
    hits = metric(server.url, "streamsd:prefix_cache_hits_total") - before
    full_blocks = (done.usage.prompt_tokens - 1) // 16
    assert full_blocks >= 2
    # Sample 0 computes the prompt; the two others take its full blocks from the prefix cache.
    assert hits >= 2 * full_blocks * 16, (hits, done.usage)

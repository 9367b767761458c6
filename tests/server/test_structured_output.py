"""Structured output against a real server speculating with a tiny draft model: `response_format`
(JSON mode, a JSON schema) and `guided_regex`. The tiny target is random, so only the grammar makes
its answers parse, and only the grammar makes them end."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from websockets.sync.client import connect

from tests.server_util import metric, start_server

CHAT = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
            "required": ["age", "ok"],
        },
    },
    "required": ["name", "kind", "tags", "owner"],
}
PET = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _answers(client, n: int, **kw) -> list[str]:
    return [c.message.content for c in _create(client, n, **kw).choices]


def _create(client, n: int, **kw):
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, n=n, **kw)
    assert all(c.finish_reason == "stop" for c in r.choices), [c.finish_reason for c in r.choices]
    return r


def test_json_schema_answers_sampled_under_speculation_all_validate(client):
    answers = _answers(client, 50, temperature=1.0, max_tokens=200, seed=3, response_format=PET)
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({a for a in answers}) > 1  # sampled, not one answer repeated


def test_json_mode_answers_sampled_under_speculation_are_json_objects(client, tiny_tokenizer):
    # Any JSON may nest and run on: a bias towards closing strings and objects makes a random model's
    # objects end well within max_tokens (and has the bias and the grammar's mask apply together).
    closing = {str(tiny_tokenizer.convert_tokens_to_ids(t)): 6 for t in ('"', "}")}
    answers = _answers(client, 50, temperature=1.0, max_tokens=400, seed=5, logit_bias=closing,
                       response_format={"type": "json_object"})
    assert all(isinstance(json.loads(a), dict) for a in answers)


def test_completions_take_a_json_schema_too(client, model):
    r = client.completions.create(model=model, prompt="A pet:", max_tokens=200, temperature=1.0, seed=1,
                                  extra_body={"response_format": PET})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_greedy_structured_output_is_the_same_with_and_without_speculation(client):
    for fmt in (PET, {"type": "json_object"}):
        spec = _create(client, 1, temperature=0.0, max_tokens=400, response_format=fmt)
        plain = _answers(client, 1, temperature=0.0, max_tokens=400, response_format=fmt,
                         extra_body={"speculative": {"enabled": False}})[0]
        assert spec.choices[0].message.content == plain
        assert spec.usage.completion_tokens_details.accepted_prediction_tokens > 0  # it did speculate
        json.loads(plain)


def test_guided_regex_answers_match_it(client):
    pattern = r"(yes|no), [a-z]{2,5}\."
    answers = _answers(client, 20, temperature=1.0, max_tokens=50, seed=2, extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, a) for a in answers), answers


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
    {"type": "xml"},
    {"type": "json_object", "extra": 1},
])
def test_a_response_format_that_cannot_be_compiled_is_refused_by_name(server, fmt):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": CHAT, "max_tokens": 4, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_constraints_that_cannot_hold_are_refused_by_name(server, extra, param):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": "Once", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_server_keeps_answering_after_refusing_a_schema(client, server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    assert httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "response_format": bad}).status_code == 400
    json.loads(_answers(client, 1, temperature=0.0, max_tokens=200, response_format=PET)[0])


def test_websocket_generate_frames_take_a_response_format(server):
    with connect(f"ws://127.0.0.1:{server.port}/v1/ws") as ws:
        ws.send(json.dumps({"type": "generate", "id": "j", "messages": CHAT, "max_tokens": 200, "temperature": 1.0,
                            "seed": 4, "response_format": PET}))
        text, event = "", {}
        while event.get("type") != "done":
            event = json.loads(ws.recv(timeout=60))
            assert event["type"] in ("delta", "done"), event
            text += event.get("text", "")
        assert event["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        ws.send(json.dumps({"type": "generate", "id": "bad", "prompt": "x", "response_format": {"type": "xml"}}))
        event = json.loads(ws.recv(timeout=60))
        assert event["type"] == "error" and "response_format" in event["error"]["message"], event


def test_refused_and_finished_constrained_requests_leave_nothing_behind(server):
    assert metric(server.url, "streamsd:num_requests_running") == 0
    assert metric(server.url, "streamsd:kv_cache_usage_perc") == 0


def test_ngram_speculation_keeps_structured_answers_exact(tiny_model_dir, tmp_path):
    # fixed k: whether it drafts must not hang on the cost profile that the adaptive policy times at start
    s = start_server(tiny_model_dir, tmp_path, "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                     "--speculation-policy", "fixed")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        spec = _create(client, 1, temperature=0.0, max_tokens=300, response_format=PET)
        plain = _answers(client, 1, temperature=0.0, max_tokens=300, response_format=PET,
                         extra_body={"speculative": {"enabled": False}})[0]
        assert spec.choices[0].message.content == plain
        assert spec.usage.completion_tokens_details.accepted_prediction_tokens > 0  # it did speculate
        for text in _answers(client, 20, temperature=1.0, max_tokens=200, seed=9, response_format=PET):
            jsonschema.validate(json.loads(text), SCHEMA)
    finally:
        s.stop()

